"""maxpool_compact: MaxPool2d whose backward holds the in-window argmax as int8.

The default (max_pool2d_with_indices) holds its input and int64 global indices (8 bytes per output
element). The argmax inside a window of area <= 127 fits in an int8 (1 byte per output element,
MONeT packs it to 4 bits); the global index is rebuilt in the backward from the output position,
stride, padding and dilation, and the input is needed only for its shape.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import ImplSpec, module_of, register


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _window_origin(out_hw, stride, padding, device):
    h0 = (torch.arange(out_hw[0], device=device) * stride[0] - padding[0]).view(-1, 1)
    w0 = (torch.arange(out_hw[1], device=device) * stride[1] - padding[1]).view(1, -1)
    return h0, w0


class MaxPoolCompact(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        y, idx = torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation,
                                                        ceil_mode)
        # In place on the int64 indices, so the transient is the indices plus one more buffer.
        W = x.shape[-1]
        h0, w0 = _window_origin(y.shape[-2:], stride, padding, x.device)
        kw = (idx % W).sub_(w0)
        kh = idx.div_(W, rounding_mode="floor").sub_(h0)
        if dilation[1] != 1:
            kw.div_(dilation[1], rounding_mode="floor")
        if dilation[0] != 1:
            kh.div_(dilation[0], rounding_mode="floor")
        k = kh.mul_(kernel[1]).add_(kw).to(torch.int8)
        del idx, kh, kw
        ctx.geom = (tuple(x.shape), x.dtype, kernel, stride, padding, dilation, ceil_mode)
        ctx.save_for_backward(k)
        return y

    @staticmethod
    def backward(ctx, grad):
        (k,) = ctx.saved_tensors
        shape, dtype, kernel, stride, padding, dilation, ceil_mode = ctx.geom
        W = shape[-1]
        h0, w0 = _window_origin(k.shape[-2:], stride, padding, k.device)
        kh = k.long()
        kw = kh % kernel[1]
        kh.div_(kernel[1], rounding_mode="floor").mul_(dilation[0]).add_(h0).mul_(W)
        idx = kw.mul_(dilation[1]).add_(w0).add_(kh)
        del k, kh, kw
        # The kernel reads only the input's sizes (and memory format): a zero-stride stand-in.
        like = grad.new_zeros((1,) * len(shape)).expand(shape)
        gx = torch.ops.aten.max_pool2d_with_indices_backward(grad, like, kernel, stride, padding,
                                                             dilation, ceil_mode, idx)
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
    if kernel[0] * kernel[1] > 127:
        return None

    def run(interp, node, args, kwargs):
        x = args[0] if args else kwargs["input"]
        return MaxPoolCompact.apply(x, kernel, stride, padding, dilation, ceil)

    return {n.name: run}


register(ImplSpec("maxpool_compact", _match,
                  "MaxPool2d holding the in-window argmax as int8 instead of its input and int64 "
                  "indices"))
