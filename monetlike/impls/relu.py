"""ReLU families, and the machinery they share with the other mask-gradient activations.

An activation whose gradient is `grad where mask else 0` (ReLU, hardtanh / ReLU6) gets two Impls,
both built here from one `Activation` description, so every such family runs the same code:

*_mask (relu_mask, hardtanh_mask; MONeT's intermediate-activated ReLU): the default backward
holds the output (ReLU in place: threshold_backward(grad, out, 0)) or the input (hardtanh:
hardtanh_backward(grad, in, lo, hi); in place, autograd clones the input first, see hardtanh.py);
this one holds the mask packed to one bit per element (bitmask.py; a thirty-second of float32, as
MONeT's). The activation's output and input Values are then free to go after their last forward
use unless another Op saves them.

bn_*_lean (bn_relu_lean, bn_hardtanh_lean): BatchNorm (training) followed by the in-place
activation in one Op. The default holds the BN input, the statistics and what the activation
saves; *_mask holds the input, the statistics and a mask; this one holds only the BN input and
recomputes the pre-activation in its backward with the same kernel (batch statistics, no
running-statistics update), so the mask is bitwise the same, and the statistics come out of that
recomputation. Running statistics are updated once, by the module's own forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.torch_private import BatchNormBase, outside_dispatch_modes, sole_owner
from . import bitmask
from .registry import ImplSpec, register
from ..core.modules import module_of


class Activation:
    """An activation whose gradient is `grad` where a mask holds and 0 elsewhere.

    `run(x, inplace)` is the forward (the default's kernel: same bits); `mask(y)` the bool mask
    computed from the output, as the *_mask Impls hold it: where the gradient is zeroed, by the
    default backward's own test, so that a NaN takes the same branch; `grad_from_pre(grad, z)`
    the default's backward given the pre-activation, as the bn_*_lean Impls recompute it."""

    def run(self, x, inplace: bool):
        raise NotImplementedError

    def mask(self, y):
        raise NotImplementedError

    def grad_from_pre(self, grad, z):
        raise NotImplementedError

    def default_backward(self, grad, saved):
        """The default's backward kernel (`saved`: the tensor it saves, of the output's
        layout)."""
        raise NotImplementedError

    def grad_layout(self, grad, saved_stride) -> tuple[int, ...]:
        """The strides of the default backward's input gradient. The *_mask Impls give theirs
        the same: another layout changes what the next layers' backwards copy (a transposed
        Linear's split backward made a contiguous copy of a row-major one: 2,048 B the profile
        did not see). Asked of the default's own kernel on the device, run on tensors of at most
        2 elements per dimension laid out in the same order (the meta kernels decide some
        layouts otherwise than the CPU's: hardtanh_backward's)."""
        g, saved = _small_geometry(grad.shape, grad.stride()), _small_geometry(grad.shape,
                                                                               saved_stride)
        key = (repr(self), g, saved, grad.dtype, grad.device.type)
        if key not in _LAYOUTS:  # a handful of layouts per model: the kernel runs once each
            with outside_dispatch_modes():  # not the step's: the profile must not count it
                g_t, saved_t = (torch.zeros(sum(st) + 1, dtype=grad.dtype, device=grad.device)
                                .as_strided(size, st) for size, st in (g, saved))
                _LAYOUTS[key] = tuple(self.default_backward(g_t, saved_t).stride())
        return _dense_in_order(grad.shape, _LAYOUTS[key])


_LAYOUTS: dict[tuple, tuple[int, ...]] = {}


def _order(stride, shape) -> list[int]:
    """Dimensions from innermost to outermost (row-major among equal strides)."""
    return sorted(range(len(shape)), key=lambda d: (stride[d], -d))


def _small_geometry(shape, stride) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(size, stride) of a tensor of at most 2 elements per dimension with `stride`'s order of
    dimensions (its expanded ones expanded): what a kernel decides a result's layout from."""
    small = [1 if n == 1 else 2 for n in shape]
    out, size = [0] * len(shape), 1
    for d in _order(stride, shape):
        if stride[d] != 0:
            out[d], size = size, size * small[d]
    return tuple(small), tuple(out)


def _dense_in_order(shape, stride) -> tuple[int, ...]:
    """Dense strides for `shape` with the order of dimensions of `stride`."""
    out, size = [0] * len(shape), 1
    for d in _order(stride, shape):
        out[d], size = size, size * shape[d]
    return tuple(out)


class Relu(Activation):
    # threshold_backward(grad, out, 0) is `out <= 0 ? 0 : grad`: a NaN output (relu(NaN) is NaN)
    # passes the gradient. So the mask marks where it is zeroed, `y <= 0`; `y > 0` would zero it
    # at a NaN. Same kernel count and bytes either way.

    def run(self, x, inplace):
        return torch.relu_(x) if inplace else torch.relu(x)

    def mask(self, y):
        if y.device.type != "cpu":
            return y <= 0
        # On the CPU by the cast's nonzero test (y is a ReLU's output: never below 0): its cast
        # to bool is vectorised, its comparisons to bool are not (5x the time). Elsewhere (CUDA,
        # and the meta device of a GPU plan) the comparison moves fewer bytes.
        return y.to(torch.bool).logical_not_()

    def grad_from_pre(self, grad, z):
        # out <= 0 iff z <= 0 (and a NaN z gives a NaN out): the default's test on the output.
        return torch.where(z <= 0, 0, grad)

    def default_backward(self, grad, saved):
        return torch.ops.aten.threshold_backward(grad, saved, 0)


RELU = Relu()


class ActMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act: Activation, inplace: bool):
        y = act.run(x, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(bitmask.pack_of(y, act.mask))
        ctx.act, ctx.out_stride = act, tuple(y.stride())  # the default saves y (or x: alike)
        return y

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        # The default backwards put `grad` where it passes and +0 elsewhere; so does masked_fill_,
        # bit for bit. In place when nothing else references the gradient (the usual case: the
        # next layer's input gradient, made for this node alone): the stage then never holds the
        # output gradient and the input gradient at once, which is what sets the least budget of
        # a plain conv-ReLU stack (VGG).
        stride = ctx.act.grad_layout(grad, ctx.out_stride)
        return bitmask.masked_zero(grad, packed, sole_owner(grad), stride), None, None


class BnActLean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mod, act: Activation):
        # The module's own forward: batch statistics, running statistics (and
        # num_batches_tracked) updated exactly once; the activation in place as the model wrote
        # it (no grad here, so an in-place hardtanh does not clone its input).
        y = act.run(mod(x), True)
        ctx.eps = mod.eps
        ctx.act = act
        ctx.save_for_backward(x, weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w, b = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # Same kernel as recompute.py's BatchNorm recomputation: batch statistics without running
        # statistics gives the forward's pre-activation bitwise, so the mask and the statistics
        # BatchNorm's backward reads are the forward's.
        z, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.0,
                                                           ctx.eps)
        gz = ctx.act.grad_from_pre(grad, z)
        del z
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            gz, x, w, None, None, mean, invstd, True, ctx.eps,
            [need_x, need_w and w is not None, need_b and b is not None])
        return gx, gw, gb, None, None


# ----------------------------------------------------------------------------------------------
# Matching
# ----------------------------------------------------------------------------------------------
def relu_call(gm, n) -> "tuple[bool, Activation] | None":
    """(inplace, RELU) when node `n` is a ReLU, else None."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is nn.ReLU:
            return bool(mod.inplace), RELU
        return None
    if n.op == "call_function":
        if n.target in (torch.relu_, F.relu_):
            return True, RELU
        if n.target is torch.relu:
            return False, RELU
        if n.target is F.relu:
            inplace = n.kwargs.get("inplace", n.args[1] if len(n.args) > 1 else False)
            return (inplace, RELU) if isinstance(inplace, bool) else None
        return None
    if n.op == "call_method" and n.target in ("relu", "relu_"):
        return n.target == "relu_", RELU
    return None


def node_input(args, kwargs):
    """The tensor an activation node acts on (positional, or the `input`/`self` keyword)."""
    if args:
        return args[0]
    for key in ("input", "self"):
        if key in kwargs:
            return kwargs[key]
    raise TypeError(f"activation call without its input tensor (keywords: {sorted(kwargs)})")


def mask_matcher(act_call):
    """match() for an *_mask family: every node of the group `act_call` recognises.

    `act_call(gm, node)` returns (inplace, Activation) or None."""
    def match(gm, nodes):
        subs = {}
        for n in nodes:
            r = act_call(gm, n)
            if r is None:
                continue
            inplace, act = r
            subs[n.name] = (lambda interp, node, args, kwargs, inplace=inplace, act=act:
                            ActMask.apply(node_input(args, kwargs), act, inplace))
        return subs or None
    return match


def _plain_bn(mod) -> bool:
    return (isinstance(mod, BatchNormBase) and type(mod).__module__ == "torch.nn.modules.batchnorm"
            and type(mod).__name__ != "SyncBatchNorm")


def bn_lean_matcher(act_call):
    """match() for a bn_*_lean family: exactly [BatchNorm (train), in-place activation on it]."""
    def match(gm, nodes):
        if len(nodes) != 2:
            return None
        bn, a = nodes
        if bn.op != "call_module" or len(bn.args) != 1 or bn.kwargs:
            return None
        mod = gm.get_submodule(bn.target)
        if not _plain_bn(mod) or not mod.training:
            return None
        r = act_call(gm, a)
        # The activation must be in place on the BN output and its only reader, so nothing ever
        # sees the pre-activation that this Impl does not keep.
        if r is None or not r[0] or len(a.all_input_nodes) != 1 \
                or a.all_input_nodes[0] is not bn or len(bn.users) != 1:
            return None
        act = r[1]

        def run_bn(interp, node, args, kwargs):
            m = module_of(interp, node.target)
            return BnActLean.apply(args[0], m.weight, m.bias, m, act)

        def run_act(interp, node, args, kwargs):
            return node_input(args, kwargs)  # already activated, in place, by the BN node

        return {bn.name: run_bn, a.name: run_act}
    return match


register(ImplSpec("relu_mask", mask_matcher(relu_call),
                  "ReLU holding a mask packed to 1 bit per element instead of its output",
                  warm=bitmask.warm))
register(ImplSpec("bn_relu_lean", bn_lean_matcher(relu_call),
                  "BatchNorm(train) + in-place ReLU holding only the BN input; the backward "
                  "recomputes the pre-activation"))
