"""In-place execution as an Impl: relu_inplace, sigmoid_inplace, add_inplace, add_inplace_rhs.

An op the model writes out of place (`torch.relu(x)`, `nn.ReLU()`, `a + b`) allocates its output
while its input is still live. Run in place (`torch.relu_(x)`, `a.add_(b)`), the output takes the
storage of one input Value x instead: the point where the op runs (its forward and each
recomputation) is lower by the output's bytes, and x is gone from then on. That is only right
when nothing reads or holds x afterwards, which the graph and the schedule decide together
(docs/execution-model.md section 1):
- the profiler offers the Impl only where no other op reads x after it, no backward of any Impl
  reads x, x is an Op's own output (not a graph input, parameter, buffer or model output) of the
  output's shape, dtype and bytes, and its creator node returns it whole
  (`monetlike/profile/impl_timing.py`, `inplace_alternatives`);
- the MILP never holds x across a stage boundary when the Impl is chosen, and no chosen Impl
  may save x (docs/formulation.md, `inplace_saved` and `inplace_resident`).

The backward is autograd's own for the in-place kernel, and reads what the out-of-place one
reads: ReLU, sigmoid and tanh their result (same bits: the same kernels write the same values),
add nothing. Gradients are therefore bitwise plain PyTorch's. Left out on purpose: ReLU6 /
hardtanh, whose backward reads its input, so in place autograd saves a clone of it taken before
the write and the point gains nothing (hardtanh.py); LeakyReLU, whose out-of-place backward reads
its input (the Value overwritten) while the in-place one reads its result, so the two Impls
would save different Values (the IR requires an in-place Impl to save what Impl 0 saves, so
that Impl 0 is always a valid fallback).

Recomputation runs the in-place call too (under no_grad), on the copy of x recomputed in that
stage, which then goes (executor.recompute_op).

`ImplSpec.overwrites(gm, node)` names the argument node whose storage the output takes: the
profiler needs it to check the conditions above and to record `Impl.overwrites`.
"""

from __future__ import annotations

import operator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import ImplSpec, register
from .relu import node_input
from ..core.modules import has_forward_hooks


def _creator(nodes):
    """The node that makes the Op's output. The Op's other nodes, if any, write into that output
    in place (`torch.relu_` after `a + b`: torchvision's ResNet `out += identity; relu(out)` traces
    as an out-of-place add followed by an in-place ReLU); they run unchanged, on the output that
    now lives in the overwritten input's storage."""
    return nodes[0] if nodes else None


def _first_arg_node(n):
    a = n.args[0] if n.args else n.kwargs.get("input", n.kwargs.get("self"))
    return a if hasattr(a, "op") else None  # an fx.Node


# -- ReLU-like activations whose backward reads the result ----------------------------------
def _plain_module(mod) -> bool:
    """No forward hooks: the replacement calls the kernel, not the module, so hooks would not
    run (and a hook may read the input this Impl overwrites)."""
    return not has_forward_hooks(mod)


def _relu_like(gm, n):
    """The in-place call for an out-of-place ReLU node, or None."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if not _plain_module(mod):
            return None
        if type(mod) is nn.ReLU and not mod.inplace:
            return lambda x: torch.relu_(x)
        return None
    if n.op == "call_function":
        if n.target is torch.relu:
            return lambda x: torch.relu_(x)
        if n.target is F.relu:
            inplace = n.kwargs.get("inplace", n.args[1] if len(n.args) > 1 else False)
            return (lambda x: torch.relu_(x)) if inplace is False else None
        return None
    if n.op == "call_method" and n.target == "relu" and len(n.args) == 1 and not n.kwargs:
        return lambda x: torch.relu_(x)
    return None


def _sigmoid_like(gm, n):
    """The in-place call for an out-of-place sigmoid / tanh node, or None."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if not _plain_module(mod):
            return None
        if type(mod) is nn.Sigmoid:
            return lambda x: torch.sigmoid_(x)
        if type(mod) is nn.Tanh:
            return lambda x: torch.tanh_(x)
        return None
    if n.op == "call_function" and not n.kwargs and len(n.args) == 1:
        if n.target in (torch.sigmoid, F.sigmoid):
            return lambda x: torch.sigmoid_(x)
        if n.target in (torch.tanh, F.tanh):
            return lambda x: torch.tanh_(x)
        return None
    if n.op == "call_method" and len(n.args) == 1 and not n.kwargs:
        if n.target == "sigmoid":
            return lambda x: torch.sigmoid_(x)
        if n.target == "tanh":
            return lambda x: torch.tanh_(x)
    return None


def unary_matcher(call_of):
    def match(gm, nodes):
        n = _creator(nodes)
        if n is None or _first_arg_node(n) is None:
            return None
        call = call_of(gm, n)
        if call is None:
            return None
        return {n.name: lambda interp, node, args, kwargs: call(node_input(args, kwargs))}
    return match


def unary_overwrites(gm, n):
    return _first_arg_node(n)


# -- residual adds ---------------------------------------------------------------------------
def _plain_add(n) -> bool:
    """`a + b`, `torch.add(a, b)` or `a.add(b)` of two fx nodes, without alpha or out."""
    if n.kwargs or len(n.args) != 2 or not all(hasattr(a, "op") for a in n.args):
        return False
    if n.args[0] is n.args[1]:
        return False  # a + a: the kernel would read what it writes through both operands
    if n.op == "call_function":
        return n.target in (operator.add, torch.add)
    return n.op == "call_method" and n.target == "add"


def add_matcher(into: int):
    """match() for an add written out of place, run as `operand[into].add_(other)` (IEEE
    addition is commutative, so b.add_(a) gives a + b's bits)."""
    def match(gm, nodes):
        n = _creator(nodes)
        if n is None or not _plain_add(n):
            return None

        def run(interp, node, args, kwargs):
            return args[into].add_(args[1 - into])
        return {n.name: run}
    return match


def add_overwrites(into: int):
    def overwrites(gm, n):
        return n.args[into] if _plain_add(n) else None
    return overwrites


register(ImplSpec("relu_inplace", unary_matcher(_relu_like),
                  "an out-of-place ReLU run in place on its input Value",
                  overwrites=unary_overwrites))
register(ImplSpec("sigmoid_inplace", unary_matcher(_sigmoid_like),
                  "an out-of-place sigmoid / tanh run in place on its input Value",
                  overwrites=unary_overwrites))
register(ImplSpec("add_inplace", add_matcher(0),
                  "a + b written out of place, run as a.add_(b)", overwrites=add_overwrites(0)))
register(ImplSpec("add_inplace_rhs", add_matcher(1),
                  "a + b written out of place, run as b.add_(a)", overwrites=add_overwrites(1)))
