"""maxpool_compact: MaxPool2d whose backward holds the in-window argmax in 4 bits (or 8).

The default (max_pool2d_with_indices) holds its input and int64 global indices (8 bytes per output
element). The argmax inside a window of area <= 16 (2x2, 3x3, 4x4: every common CNN) fits in 4
bits, kept two to a byte as MONeT does (half a byte per output element: each sample's positions,
in the output's memory order, take ceil(C * H_out * W_out / 2) bytes); up to area 127 it is kept
as an int8 (1 byte per output element). The global index is rebuilt in the backward from the
output position, stride, padding and dilation, and the input is needed only for its shape.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import ImplSpec, register


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _window_origin(out_hw, stride, padding, device):
    h0 = (torch.arange(out_hw[0], device=device) * stride[0] - padding[0]).view(-1, 1)
    w0 = (torch.arange(out_hw[1], device=device) * stride[1] - padding[1]).view(1, -1)
    return h0, w0


# The batch is pooled (and unpooled) in up to this many slices, each writing its part of the
# result in place: the int64 indices and their conversion exist for one slice at a time, so the
# transient is an eighth of what one call over the batch would hold (on VGG-16 that call set the
# least budget). Samples are independent, so every element is computed as in one call, bit for
# bit.
SLICES = 8
MIN_SLICE = 1 << 20
"""Output elements below which the batch is not sliced further (a slice costs kernel launches;
the transient of a small pooling does not matter; tests lower it to exercise the slicing)."""


def _format(t):
    """The memory format the pooling kernels give their results for input `t`."""
    if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _slices(n: int, per_sample: int):
    step = max(-(-n // SLICES), -(-MIN_SLICE // max(per_sample, 1)))
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


PACK_AREA = 16
"""Kernel areas up to this keep their in-window positions in 4 bits, two to a byte; larger ones
(up to 127) in an int8 each."""


def _rows(t, fmt):
    """`t` (n, C, H, W), laid out in `fmt`, as (n, C * H * W) in memory order (a view)."""
    if fmt is torch.channels_last:
        t = t.permute(0, 2, 3, 1)
    return t.view(t.shape[0], -1)


# Here, not in bitmask.py (flat bool masks): packs a slice's int64 positions in place, per sample.
def _pack4(pos, out):
    """Write `pos` ((n, P) int64 in [0, 16), consumed) into `out` ((n, ceil(P / 2)) uint8):
    position 2j in the low nibble of byte j, position 2j + 1 in its high nibble."""
    h = pos.shape[1] // 2
    pairs = pos[:, :2 * h].unflatten(1, (h, 2))
    out[:, :h].copy_(pairs[..., 1].mul_(16).add_(pairs[..., 0]))
    if pos.shape[1] % 2:
        out[:, h].copy_(pos[:, -1])


def _unpack4(packed, out):
    """The inverse of `_pack4`: the positions of `packed` into `out` ((n, P) int64)."""
    h = out.shape[1] // 2
    pairs = out[:, :2 * h].unflatten(1, (h, 2))
    pairs[..., 0].copy_(packed[:, :h]).bitwise_and_(15)
    pairs[..., 1].copy_(packed[:, :h]).bitwise_right_shift_(4)
    if out.shape[1] % 2:
        out[:, -1].copy_(packed[:, h])


def _compact(idx, W, kernel, stride, padding, dilation, out_hw, device):
    """The in-window position of each global index in `idx` (int64, written in place)."""
    h0, w0 = _window_origin(out_hw, stride, padding, device)
    kw = (idx % W).sub_(w0)
    kh = idx.div_(W, rounding_mode="floor").sub_(h0)
    if dilation[1] != 1:
        kw.div_(dilation[1], rounding_mode="floor")
    if dilation[0] != 1:
        kh.div_(dilation[0], rounding_mode="floor")
    return kh.mul_(kernel[1]).add_(kw)


def _expand(kh, W, kernel, stride, padding, dilation):
    """The global int64 indices of in-window positions `kh` (int64, consumed)."""
    h0, w0 = _window_origin(kh.shape[-2:], stride, padding, kh.device)
    kw = kh % kernel[1]
    kh.div_(kernel[1], rounding_mode="floor").mul_(dilation[0]).add_(h0).mul_(W)
    return kw.mul_(dilation[1]).add_(w0).add_(kh)


class MaxPoolCompact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        args = (kernel, stride, padding, dilation, ceil_mode)
        W = x.shape[-1]
        packed = kernel[0] * kernel[1] <= PACK_AREA
        if x.dim() != 4:  # unbatched: one call
            fmt = torch.contiguous_format
            y, idx = torch.ops.aten.max_pool2d_with_indices(x, *args)
            pos = _compact(idx, W, kernel, stride, padding, dilation, y.shape[-2:], x.device)
            if packed:
                k = torch.empty((1, (pos.numel() + 1) // 2), dtype=torch.uint8, device=x.device)
                _pack4(pos.reshape(1, -1), k)
            else:
                k = pos.to(torch.int8)
            del idx, pos
        else:
            first, idx = torch.ops.aten.max_pool2d_with_indices(x[:1], *args)
            del idx
            fmt = _format(x)
            y = torch.empty((x.shape[0],) + tuple(first.shape[1:]), dtype=x.dtype,
                            device=x.device, memory_format=fmt)
            del first
            per_sample = y[0].numel()
            # Packed: one row of ceil(per_sample / 2) bytes per sample, so that a slice of
            # samples is a slice of rows whatever the parity.
            k = (torch.empty((x.shape[0], (per_sample + 1) // 2), dtype=torch.uint8,
                             device=x.device) if packed else
                 torch.empty(y.shape, dtype=torch.int8, device=x.device, memory_format=fmt))
            for part in _slices(x.shape[0], per_sample):
                yp, ip = y[part], torch.empty(y[part].shape, dtype=torch.long, device=x.device,
                                              memory_format=fmt)
                torch.ops.aten.max_pool2d_with_indices.out(x[part], *args, out=yp, indices=ip)
                pos = _compact(ip, W, kernel, stride, padding, dilation, y.shape[-2:], x.device)
                if packed:
                    _pack4(_rows(pos, fmt), k[part])
                else:
                    k[part] = pos
                del ip, pos
        ctx.geom = (tuple(x.shape), x.dtype, kernel, stride, padding, dilation, ceil_mode, fmt,
                    packed)
        ctx.save_for_backward(k)
        return y

    @staticmethod
    def backward(ctx, grad):
        (k,) = ctx.saved_tensors
        shape, dtype, kernel, stride, padding, dilation, ceil_mode, kfmt, packed = ctx.geom
        args = (kernel, stride, padding, dilation, ceil_mode)
        W = shape[-1]
        geo = (W, kernel, stride, padding, dilation)

        def positions(rows, out_shape):
            """The int64 in-window positions of `rows` of k, shaped (and laid out) as the
            forward's output."""
            if not packed:
                return rows.long()
            pos = torch.empty(out_shape, dtype=torch.long, device=k.device,
                              memory_format=kfmt)
            _unpack4(rows, _rows(pos if len(out_shape) == 4 else pos.unsqueeze(0), kfmt))
            return pos

        # The kernel reads only the input's sizes (and memory format): a zero-stride stand-in.
        if len(shape) != 4:
            like = grad.new_zeros((1,) * len(shape)).expand(shape)
            gx = torch.ops.aten.max_pool2d_with_indices_backward(
                grad, like, *args, _expand(positions(k, grad.shape), *geo))
            return gx, None, None, None, None, None
        fmt = _format(grad)
        gx = torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=fmt)
        for part in _slices(shape[0], grad[0].numel()):
            n = part.stop - part.start
            like = grad.new_zeros((1,) * len(shape)).expand((n,) + shape[1:])
            idx = _expand(positions(k[part], (n,) + tuple(grad.shape[1:])), *geo)
            torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
                grad[part], like, *args, idx, grad_input=gx[part])
            del idx
        return gx, None, None, None, None, None


def _params(kernel, stride, padding, dilation):
    kernel = _pair(kernel)
    stride = _pair(stride) if stride not in (None, [], ()) else kernel
    return kernel, stride, _pair(padding), _pair(dilation)


def _match(gm, nodes):
    if len(nodes) != 1:
        return None
    n = nodes[0]
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is not nn.MaxPool2d or mod.return_indices or n.kwargs or len(n.args) != 1:
            return None
        kernel, stride, padding, dilation = _params(mod.kernel_size, mod.stride, mod.padding,
                                                    mod.dilation)
        ceil = bool(mod.ceil_mode)
    elif n.op == "call_function" and n.target in (F.max_pool2d, torch.max_pool2d):
        names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                 "return_indices")
        a = dict(zip(names, n.args), **n.kwargs)
        if a.get("return_indices", False) or any(isinstance(v, torch.fx.Node)
                                                 for k, v in a.items() if k != "input"):
            return None
        kernel, stride, padding, dilation = _params(a["kernel_size"], a.get("stride"),
                                                    a.get("padding", 0), a.get("dilation", 1))
        ceil = bool(a.get("ceil_mode", False))
    else:
        return None
    if kernel[0] * kernel[1] > 127:  # the int8 form's limit
        return None

    def run(interp, node, args, kwargs):
        x = args[0] if args else kwargs["input"]
        return MaxPoolCompact.apply(x, kernel, stride, padding, dilation, ceil)

    return {n.name: run}


register(ImplSpec("maxpool_compact", _match,
                  "MaxPool2d holding the in-window argmax in 4 bits, two to a byte (kernel area "
                  "<= 16; int8 up to 127) instead of its input and int64 indices"))
