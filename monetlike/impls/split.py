"""conv_split, linear_split (and their *_mask forms): MONeT's split backward.

The default backward of a convolution or a linear layer is one autograd node that holds the
layer's input and computes the weight, bias and input gradients at once: at its peak the input,
the output gradient and the input gradient are all resident. These Impls compute the same
gradients in two autograd nodes of one stage: the first (the layer's result's grad_fn) holds the
input and computes the weight and bias gradients; autograd releases what it saved as soon as it
has run, so the input can go (when no later stage holds it: `Impl.early_release`, measured by the
profiler like any other release inside a backward); the second holds only the weight and computes
the input gradient from the output gradient, with a zero-stride stand-in for the input (the
kernels read only its sizes: `torch.nn.grad.conv2d_input` does the same). A frozen layer (weight
and bias without grad) holds no input at all.

The two nodes are linked by a zero-stride tensor of the output's shape (one element of storage):
the first node hands the output gradient through it to the second. The forward calls the
layer's own function (F.conv2d, F.linear) on the same arguments: the output is the default's,
bit for bit; the gradients compute the same mathematics with the same kernels, split by their
output mask (on the CPU they come out bitwise equal; tests/test_impls.py asserts
`torch.testing.assert_close`).

*_split_mask: the same for an Op whose in-place ReLU / hardtanh writes the layer's output
(VGG's [conv, relu_]), with the activation holding a 1-bit mask as in relu_mask. An Op has one
Impl, so this pair is one Impl: the mask frees the activation's result for the next layer's split
to release, the split frees the layer's input.

Not offered (the default runs): string padding ('same' may pad asymmetrically), padding modes
other than zeros, modules with hooks (the replacement calls the layer's function, not the
module), and at run time under autocast (the saved input would not be the cast one), an
unbatched input, or an input without grad (nothing to split).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hardtanh import hardtanh_call
from .registry import ImplSpec, announce_release, register
from .relu import mask_matcher, node_input, relu_call
from ..core.modules import has_hooks, module_of

_CONV_MODULES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
# torch.export keeps these aten overloads (same argument names as the functionals), so the
# Hugging Face models that fx cannot trace are split too.
_CONV_FUNCTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3, torch.ops.aten.conv1d.default: 1,
                   torch.ops.aten.conv2d.default: 2, torch.ops.aten.conv3d.default: 3}
_LINEAR_FUNCTIONS = (F.linear, torch.ops.aten.linear.default)


def _tuple(v, dims: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims


class Conv:
    """A convolution's geometry, its forward and its two backward halves."""

    def __init__(self, dims: int, stride, padding, dilation, groups: int):
        self.dims, self.groups = dims, groups
        self.stride, self.padding = _tuple(stride, dims), _tuple(padding, dims)
        self.dilation = _tuple(dilation, dims)
        self.fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]

    def fits(self, x) -> bool:
        return x.dim() == self.dims + 2

    def forward(self, x, w, b):
        return self.fn(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def out_shape(self, x, w) -> tuple:
        spatial = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(
            x.shape[2:], w.shape[2:], self.stride, self.padding, self.dilation))
        return (x.shape[0], w.shape[0]) + spatial

    def _backward(self, g, x, w, bias_sizes, mask):
        return torch.ops.aten.convolution_backward(
            g, x, w, bias_sizes, list(self.stride), list(self.padding), list(self.dilation),
            False, [0] * self.dims, self.groups, mask)

    def grad_weight(self, g, x, w, need_w: bool, need_b: bool):
        _, gw, gb = self._backward(g, x, w, [w.shape[0]] if need_b else None,
                                   (False, need_w, need_b))
        return gw, gb

    def grad_input(self, g, x_shape, w):
        return self._backward(g, g.new_empty(1).expand(x_shape), w, None, (True, False, False))[0]


class Linear:
    """F.linear: y = x W^T + b over the last dimension."""

    def fits(self, x) -> bool:
        return x.dim() >= 1

    def forward(self, x, w, b):
        return F.linear(x, w, b)

    def out_shape(self, x, w) -> tuple:
        return tuple(x.shape[:-1]) + (w.shape[0],)

    def grad_weight(self, g, x, w, need_w: bool, need_b: bool):
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
        gb = g2.sum(0) if need_b else None
        return gw, gb

    def grad_input(self, g, x_shape, w):
        return g.matmul(w)


class _InputHalf(torch.autograd.Function):
    """Runs second in the backward: the input gradient, holding the weight only."""

    @staticmethod
    def forward(ctx, x, w, layer, out_shape, dtype):
        ctx.layer, ctx.x_shape = layer, tuple(x.shape)
        ctx.save_for_backward(w)
        return torch.empty(1, dtype=dtype, device=x.device).expand(out_shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return ctx.layer.grad_input(g, ctx.x_shape, w), None, None, None, None


class _WeightHalf(torch.autograd.Function):
    """Runs first: the layer's forward, and in the backward its weight and bias gradients; it
    holds the input, which autograd lets go when this node has run."""

    @staticmethod
    def forward(ctx, link, x, w, b, layer):
        ctx.layer, ctx.link_shape = layer, link.shape
        need_w, need_b = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        ctx.need = (need_w, need_b)
        ctx.save_for_backward(x if need_w else None, w)
        y = layer.forward(x, w, b)
        # F.linear on a 3-d input returns a view of its 2-d result, and a custom Function's view
        # output may not be written in place (an in-place ReLU on it): return the result itself;
        # split_apply takes the same view of it outside, as the default's autograd graph has.
        if y._base is not None and y._base.numel() == y.numel():
            return y._base
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_w, need_b = ctx.need
        gw, gb = ctx.layer.grad_weight(g, x, w, need_w, need_b) if need_w or need_b \
            else (None, None)
        if x is not None:
            announce_release(x)
        del x
        # The output gradient goes on to _InputHalf through the link (it has the output's shape).
        g = g.reshape(ctx.link_shape) if ctx.needs_input_grad[0] else None
        return g, None, gw, gb, None


def _autocast(device_type: str) -> bool:
    # The meta device (analytical profiles) has no autocast state to ask about.
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def split_apply(layer, x, w, b, default):
    """The layer's result with its backward split; `default()` where a split does not apply."""
    if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad
            and layer.fits(x)) or _autocast(x.device.type):
        return default()
    shape = layer.out_shape(x, w)
    link = _InputHalf.apply(x, w.detach(), layer, shape, x.dtype)
    y = _WeightHalf.apply(link, x.detach(), w, b, layer)
    return y if tuple(y.shape) == shape else y.view(shape)


# ----------------------------------------------------------------------------------------------
# Matching
# ----------------------------------------------------------------------------------------------
def _plain_module(mod) -> bool:
    return not has_hooks(mod)


def _bind(args, kwargs, names: tuple, defaults: tuple) -> list:
    """Positional-or-keyword arguments of a call, in `names` order (defaults for the rest)."""
    out = list(args[:len(names)])
    for i in range(len(out), len(names)):
        out.append(kwargs.get(names[i], defaults[i]))
    return out


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = (None, None, None, 1, 0, 1, 1)


def conv_replacement(gm, n):
    """A replacement running the convolution node `n` split, or None when it is not one."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        dims = _CONV_MODULES.get(type(mod))
        if dims is None or mod.padding_mode != "zeros" or isinstance(mod.padding, str) \
                or not _plain_module(mod):
            return None

        def run_module(interp, node, args, kwargs):
            m = module_of(interp, node.target)
            layer = Conv(dims, m.stride, m.padding, m.dilation, m.groups)
            return split_apply(layer, node_input(args, kwargs), m.weight, m.bias,
                               lambda: m(*args, **kwargs))
        return run_module
    if n.op == "call_function" and n.target in _CONV_FUNCTIONS:
        dims = _CONV_FUNCTIONS[n.target]
        padding = _bind(n.args, n.kwargs, _CONV_ARGS, _CONV_DEFAULTS)[4]
        if isinstance(padding, str):
            return None

        def run_function(interp, node, args, kwargs):
            x, w, b, stride, pad, dil, groups = _bind(args, kwargs, _CONV_ARGS, _CONV_DEFAULTS)
            return split_apply(Conv(dims, stride, pad, dil, groups), x, w, b,
                               lambda: node.target(*args, **kwargs))
        return run_function
    return None


LINEAR = Linear()


def linear_replacement(gm, n):
    """A replacement running the linear node `n` split, or None when it is not one."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is not nn.Linear or not _plain_module(mod):
            return None

        def run_module(interp, node, args, kwargs):
            m = module_of(interp, node.target)
            return split_apply(LINEAR, node_input(args, kwargs), m.weight, m.bias,
                               lambda: m(*args, **kwargs))
        return run_module
    if n.op == "call_function" and n.target in _LINEAR_FUNCTIONS:
        def run_function(interp, node, args, kwargs):
            x, w, b = _bind(args, kwargs, ("input", "weight", "bias"), (None, None, None))
            return split_apply(LINEAR, x, w, b, lambda: node.target(*args, **kwargs))
        return run_function
    return None


def split_matcher(replacement, with_mask: bool):
    """match() for a split family: the Op's creator node is the layer; with_mask: and one of the
    Op's other nodes is a ReLU / hardtanh, run with a mask (the *_mask Impls' code)."""
    masks = (mask_matcher(relu_call), mask_matcher(hardtanh_call))

    def match(gm, nodes):
        fn = replacement(gm, nodes[0])
        if fn is None:
            return None
        subs = {nodes[0].name: fn}
        if with_mask:
            acts = {}
            for m in masks:
                acts.update(m(gm, nodes[1:]) or {})
            if not acts:
                return None
            subs.update(acts)
        return subs
    return match


register(ImplSpec("conv_split", split_matcher(conv_replacement, False),
                  "convolution whose backward computes the weight gradient, lets the input go, "
                  "then computes the input gradient"))
register(ImplSpec("conv_split_mask", split_matcher(conv_replacement, True),
                  "conv_split with the Op's in-place ReLU / hardtanh holding a 1-bit mask"))
register(ImplSpec("linear_split", split_matcher(linear_replacement, False),
                  "linear layer whose backward computes the weight gradient, lets the input go, "
                  "then computes the input gradient"))
register(ImplSpec("linear_split_mask", split_matcher(linear_replacement, True),
                  "linear_split with the Op's in-place ReLU / hardtanh holding a 1-bit mask"))
