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

from .registry import ImplSpec, one_node, register


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


def _out_hw(hw, kernel, stride, padding, dilation, ceil_mode):
    """The pooling's output height and width, by PyTorch's formula (pooling_output_shape): no
    pooling of a sample just to learn them. Invalid arguments are left to the kernel to report
    (a size below 1 made 0)."""
    out = []
    for n, k, s, p, d in zip(hw, kernel, stride, padding, dilation):
        o = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (o - 1) * s >= n + p:  # the last window starts inside the input
            o -= 1
        out.append(max(o, 0))
    return tuple(out)


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


# Here, not in bitmask.py (flat bool masks): packs a slice's uint8 positions, per sample.
def _pack4(pos, out):
    """Write `pos` ((n, P) uint8 in [0, 16)) into `out` ((n, ceil(P / 2)) uint8): position 2j
    in the low nibble of byte j, position 2j + 1 in its high nibble."""
    h = pos.shape[1] // 2
    pairs = pos[:, :2 * h].unflatten(1, (h, 2))
    torch.add(pairs[..., 0], pairs[..., 1], alpha=16, out=out[:, :h])
    if pos.shape[1] % 2:
        out[:, h].copy_(pos[:, -1])


def _unpack4(packed, out):
    """The inverse of `_pack4`: the positions of `packed` into `out` ((n, P), any integer
    dtype: the nibbles are written straight into it, no uint8 copy in between)."""
    h = out.shape[1] // 2
    pairs = out[:, :2 * h].unflatten(1, (h, 2))
    torch.bitwise_and(packed[:, :h], 15, out=pairs[..., 0])
    torch.bitwise_right_shift(packed[:, :h], 4, out=pairs[..., 1])
    if out.shape[1] % 2:
        out[:, -1].copy_(packed[:, h])


def _unrows(flat, shape, fmt):
    """The inverse of `_rows`: `flat` (memory order) as `shape`, laid out in `fmt` (a view)."""
    if fmt is torch.channels_last and len(shape) == 4:
        n, c, h, w = shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(shape)


def _in_bounds(hw, kernel, dilation):
    """Whether every window holds an input element (then PyTorch's argmax lies in its window)
    and a window's offsets kh * dH * W + kw * dW are distinct. A window wider than the input,
    with padding, can hold none: an output of -inf whose index lies outside it."""
    return all((k - 1) * d < s for k, d, s in zip(kernel, dilation, hw))


def _offsets(W, kernel, dilation, device):
    """off[kh * kW + kw] = kh * dH * W + kw * dW: an in-window position's global index less its
    window's base (int64, kernel area long)."""
    kh = torch.arange(kernel[0], device=device) * (dilation[0] * W)
    kw = torch.arange(kernel[1], device=device) * dilation[1]
    return (kh.view(-1, 1) + kw.view(1, -1)).view(-1)


def _base(W, out_hw, stride, padding, device):
    """The global index of each window's origin, h0 * W + w0 ((H_out, W_out) int64; negative
    where padding puts it outside the input)."""
    h0, w0 = _window_origin(out_hw, stride, padding, device)
    return h0 * W + w0


def forward_lookup(hw, out_hw, kernel, stride, padding, dilation, m, device):
    """(table, base) with position = table[index - base] (uint8; base None: table[index]), or
    None where the arithmetic of `_compact` must do. `m`: a slice's least output elements; the
    tables are held with the slice's int64 indices and uint8 positions (9 bytes an element),
    and stay within the arithmetic path's two int64 buffers."""
    if not _in_bounds(hw, kernel, dilation):
        return None
    (H, W), (kH, kW) = hw, kernel
    if all(s >= (k - 1) * d + 1 for k, s, d in zip(kernel, stride, dilation)) and H * W <= 7 * m:
        # Windows that do not overlap: an input element's window, and its place in it, follow
        # from its index alone; one table over the input plane spares the int64 subtraction.
        kh, kw = ((torch.arange(n, device=device) + p).remainder_(s).div_(d, rounding_mode="floor")
                  for n, s, p, d in zip(hw, stride, padding, dilation))
        return (kh.view(-1, 1) * kW + kw.view(1, -1)).view(-1).to(torch.uint8), None
    R = (kH - 1) * dilation[0] * W + (kW - 1) * dilation[1] + 1
    if 8 * out_hw[0] * out_hw[1] + R > 7 * m:
        return None
    inv = torch.zeros(R, dtype=torch.uint8, device=device)
    inv[_offsets(W, kernel, dilation, device)] = torch.arange(kH * kW, device=device).to(
        torch.uint8)
    return inv, _base(W, out_hw, stride, padding, device)


def backward_lookup(hw, out_hw, kernel, stride, padding, dilation, m, device):
    """(table, window) with index = table[window * kernel area + position] (window: (H_out,
    W_out) int32 numbers of the windows), or (off, base) with index = off[position] + base;
    None where `_expand` must do. Held with the slice's int32 positions and int64 indices (12
    bytes an element): the tables must fit in what the arithmetic path's second int64 buffer
    took (4 bytes an element)."""
    if not _in_bounds(hw, kernel, dilation):
        return None
    planes, area = out_hw[0] * out_hw[1], kernel[0] * kernel[1]
    off = _offsets(hw[1], kernel, dilation, device)
    base = _base(hw[1], out_hw, stride, padding, device)
    if 8 * planes * area + 4 * planes <= 4 * m:
        # One table over (window, position): its int32 index costs half the int64 add of base.
        window = torch.arange(0, planes * area, area, dtype=torch.int32, device=device)
        return (base.view(-1, 1) + off.view(1, -1)).view(-1), window.view(out_hw)
    if 8 * (planes + area) <= 4 * m:
        return off, base
    return None


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


def _positions(ip, fmt, lookup, geo):
    """The in-window positions of the global indices `ip` (int64, consumed) as (n, P) uint8 in
    `fmt`'s memory order (n = 1 unbatched)."""
    if ip.dim() == 3:
        ip = ip.unsqueeze(0)
    n = ip.shape[0]
    if lookup is None:
        W, kernel, stride, padding, dilation = geo
        pos = _compact(ip, W, kernel, stride, padding, dilation, ip.shape[-2:], ip.device)
        return _rows(pos, fmt).to(torch.uint8)  # < 128 wherever a window holds input
    table, base = lookup
    r = ip if base is None else ip.sub_(base)
    return torch.index_select(table, 0, _rows(r, fmt).view(-1)).view(n, -1)


class MaxPoolCompact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        args = (kernel, stride, padding, dilation, ceil_mode)
        W = x.shape[-1]
        geo = (W, kernel, stride, padding, dilation)
        packed = kernel[0] * kernel[1] <= PACK_AREA
        if x.dim() != 4:  # unbatched: one call
            fmt = torch.contiguous_format
            y, idx = torch.ops.aten.max_pool2d_with_indices(x, *args)
            lookup = forward_lookup(x.shape[-2:], y.shape[-2:], kernel, stride, padding,
                                     dilation, y.numel(), x.device)
            pos = _positions(idx, fmt, lookup, geo)
            del idx, lookup
            if packed:
                k = torch.empty((1, (pos.numel() + 1) // 2), dtype=torch.uint8, device=x.device)
                _pack4(pos, k)
            else:
                k = pos.view(y.shape).view(torch.int8)
            del pos
        else:
            fmt = _format(x)
            y = torch.empty(x.shape[:2] + _out_hw(x.shape[-2:], *args), dtype=x.dtype,
                            device=x.device, memory_format=fmt)
            per_sample = y[0].numel()
            # Packed: one row of ceil(per_sample / 2) bytes per sample, so that a slice of
            # samples is a slice of rows whatever the parity.
            k = (torch.empty((x.shape[0], (per_sample + 1) // 2), dtype=torch.uint8,
                             device=x.device) if packed else
                 torch.empty(y.shape, dtype=torch.int8, device=x.device, memory_format=fmt))
            parts = _slices(x.shape[0], per_sample)
            m = min((p.stop - p.start for p in parts), default=0) * per_sample
            lookup = forward_lookup(x.shape[-2:], y.shape[-2:], kernel, stride, padding,
                                     dilation, m, x.device)
            for part in parts:
                yp, ip = y[part], torch.empty(y[part].shape, dtype=torch.long, device=x.device,
                                              memory_format=fmt)
                torch.ops.aten.max_pool2d_with_indices.out(x[part], *args, out=yp, indices=ip)
                pos = _positions(ip, fmt, lookup, geo)
                del ip
                if packed:
                    _pack4(pos, k[part])
                else:
                    _rows(k[part], fmt).copy_(pos.view(torch.int8))
                del pos
            del lookup
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
        unbatched = len(shape) != 4
        parts = [slice(0, 1)] if unbatched else _slices(shape[0], grad[0].numel())
        per_sample = grad.numel() if unbatched else grad[0].numel()
        m = min((p.stop - p.start for p in parts), default=0) * per_sample
        lookup = backward_lookup(shape[-2:], grad.shape[-2:], kernel, stride, padding, dilation,
                                  m, grad.device)

        def indices(rows, out_shape):
            """The global int64 indices of `rows` of k (their slice's output shape and layout:
            out_shape, in the forward's format)."""
            n = 1 if unbatched else out_shape[0]
            if lookup is None:  # int64 positions, then arithmetic
                if packed:
                    pos = torch.empty(out_shape, dtype=torch.long, device=k.device,
                                      memory_format=kfmt)
                    _unpack4(rows, _rows(pos if not unbatched else pos.unsqueeze(0), kfmt))
                else:
                    pos = rows.long()
                return _expand(pos, *geo)
            # int32 positions (index_select's narrowest index), then one lookup.
            table, base = lookup
            pos = torch.empty((n, per_sample), dtype=torch.int32, device=k.device)
            if packed:
                _unpack4(rows, pos)
            else:
                pos.copy_(_rows(rows if not unbatched else rows.unsqueeze(0), kfmt))
            if base.dtype == torch.int32:
                _unrows(pos.view(-1), out_shape, kfmt).add_(base)
            idx = _unrows(torch.index_select(table, 0, pos.view(-1)), out_shape, kfmt)
            del pos
            return idx if base.dtype == torch.int32 else idx.add_(base)

        # The kernel reads only the input's sizes (and memory format): a zero-stride stand-in,
        # made from nothing (new_zeros on grad would count as reading it, per slice).
        one = torch.zeros((1,) * len(shape), dtype=grad.dtype, device=grad.device)
        if unbatched:
            like = one.expand(shape)
            gx = torch.ops.aten.max_pool2d_with_indices_backward(
                grad, like, *args, indices(k, grad.shape))
            return gx, None, None, None, None, None
        fmt = _format(grad)
        gx = torch.empty(shape, dtype=grad.dtype, device=grad.device, memory_format=fmt)
        for part in parts:
            n = part.stop - part.start
            like = one.expand((n,) + shape[1:])
            idx = indices(k[part], (n,) + tuple(grad.shape[1:]))
            torch.ops.aten.max_pool2d_with_indices_backward.grad_input(
                grad[part], like, *args, idx, grad_input=gx[part])
            del idx
        return gx, None, None, None, None, None


def pool_params(kernel, stride, padding, dilation):
    """max_pool2d's arguments as pairs, the stride defaulting to the kernel as PyTorch's does."""
    kernel = _pair(kernel)
    stride = _pair(stride) if stride not in (None, [], ()) else kernel
    return kernel, stride, _pair(padding), _pair(dilation)


def _match(gm, nodes):
    n, mod = one_node(gm, nodes)
    if n is None:
        return None
    if mod is not None:
        if type(mod) is not nn.MaxPool2d or mod.return_indices or n.kwargs or len(n.args) != 1:
            return None
        kernel, stride, padding, dilation = pool_params(mod.kernel_size, mod.stride, mod.padding,
                                                    mod.dilation)
        ceil = bool(mod.ceil_mode)
    elif n.op == "call_function" and n.target in (F.max_pool2d, torch.max_pool2d):
        names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                 "return_indices")
        a = dict(zip(names, n.args), **n.kwargs)
        if a.get("return_indices", False) or any(isinstance(v, torch.fx.Node)
                                                 for k, v in a.items() if k != "input"):
            return None
        kernel, stride, padding, dilation = pool_params(a["kernel_size"], a.get("stride"),
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
