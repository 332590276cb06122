"""ReLU families: relu_mask (MONeT's intermediate-activated ReLU) and bn_relu_lean.

relu_mask: the default ReLU backward holds its output (threshold_backward(grad, out, 0)); this one
holds `out > 0` as a bool tensor, 1 byte per element (a quarter of float32; MONeT packs it to one
bit, 1/32, which needs a packing kernel: future work). Its output Value is then free to go after
its last forward use unless another Op saves it.

bn_relu_lean: BatchNorm (training) followed by an in-place ReLU in one Op. The default holds the
BN input, the statistics and the output (for the ReLU); relu_mask holds the input, the statistics
and a mask; this one holds only the BN input and recomputes the pre-activation in its backward
with the same kernel (batch statistics, no running-statistics update), so the mask is bitwise the
same, and the statistics come out of that recomputation. Running statistics are updated once, by
the module's own forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from .registry import ImplSpec, module_of, register


class ReluMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inplace: bool):
        if inplace:
            y = torch.relu_(x)
            ctx.mark_dirty(x)
        else:
            y = torch.relu(x)
        ctx.save_for_backward(y > 0)
        return y

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        # threshold_backward(grad, out, 0) is `out > 0 ? grad : 0`; the same values bit for bit.
        return torch.where(mask, grad, 0), None


class BnReluLean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mod):
        # The module's own forward: batch statistics, running statistics (and
        # num_batches_tracked) updated exactly once; the ReLU in place as the model wrote it.
        y = torch.relu_(mod(x))
        ctx.eps = mod.eps
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
        gz = torch.where(z > 0, grad, 0)
        del z
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            gz, x, w, None, None, mean, invstd, True, ctx.eps,
            [need_x, need_w and w is not None, need_b and b is not None])
        return gx, gw, gb, None


# ----------------------------------------------------------------------------------------------
# Matching
# ----------------------------------------------------------------------------------------------
def relu_call(gm, n) -> "tuple[bool, int] | None":
    """(inplace, index of the input in args) when node `n` is a ReLU, else None."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is nn.ReLU:
            return bool(mod.inplace), 0
        return None
    if n.op == "call_function":
        if n.target in (torch.relu_, F.relu_):
            return True, 0
        if n.target is torch.relu:
            return False, 0
        if n.target is F.relu:
            inplace = n.kwargs.get("inplace", n.args[1] if len(n.args) > 1 else False)
            return (inplace, 0) if isinstance(inplace, bool) else None
        return None
    if n.op == "call_method" and n.target in ("relu", "relu_"):
        return n.target == "relu_", 0
    return None


def _input(args, kwargs):
    return args[0] if args else kwargs["input"]


def _match_relu_mask(gm, nodes):
    subs = {}
    for n in nodes:
        r = relu_call(gm, n)
        if r is None:
            continue
        inplace = r[0]
        subs[n.name] = (lambda interp, node, args, kwargs, inplace=inplace:
                        ReluMask.apply(_input(args, kwargs), inplace))
    return subs or None


def _plain_bn(mod) -> bool:
    return (isinstance(mod, _BatchNorm) and type(mod).__module__ == "torch.nn.modules.batchnorm"
            and type(mod).__name__ != "SyncBatchNorm")


def _match_bn_relu_lean(gm, nodes):
    if len(nodes) != 2:
        return None
    bn, relu = nodes
    if bn.op != "call_module" or len(bn.args) != 1 or bn.kwargs:
        return None
    mod = gm.get_submodule(bn.target)
    if not _plain_bn(mod) or not mod.training:
        return None
    r = relu_call(gm, relu)
    # The ReLU must be in place on the BN output and its only reader, so nothing ever sees the
    # pre-activation that this Impl does not keep.
    if r is None or not r[0] or len(relu.all_input_nodes) != 1 or relu.all_input_nodes[0] is not bn \
            or len(bn.users) != 1:
        return None

    def run_bn(interp, node, args, kwargs):
        m = module_of(interp, node.target)
        return BnReluLean.apply(args[0], m.weight, m.bias, m)

    def run_relu(interp, node, args, kwargs):
        return _input(args, kwargs)  # already activated, in place, by the BN node

    return {bn.name: run_bn, relu.name: run_relu}


register(ImplSpec("relu_mask", _match_relu_mask,
                  "ReLU holding a bool mask (1 byte per element) instead of its output"))
register(ImplSpec("bn_relu_lean", _match_bn_relu_lean,
                  "BatchNorm(train) + in-place ReLU holding only the BN input; the backward "
                  "recomputes the pre-activation"))
