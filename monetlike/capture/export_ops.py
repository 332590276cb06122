"""What torch.export alone refuses or gets wrong, captured: custom autograd Functions as one op
each, and Python branches on tensor values specialised to the example's values.

`monetlike.capture.export_graph` uses both; they belong to the capture floor.

NOTE [Custom autograd Functions under export]
Non-strict torch.export runs a custom autograd Function's forward on its tracing tensors and
records the ops inside; the exported graph would differentiate them, not the Function's backward
(on torch 2.14 a gradient reversal's gradient came back with the wrong sign). So while exporting,
each `SomeFunction.apply(...)` is routed (trace.functions_applied) to one op of our own,
`monetlike::autograd_function(Tensor[] tensors, int key)`, which export keeps as one node: its
fake kernel runs the Function's forward on the fake tensors for the output shapes, below the
tracer. After the export each such node is put back as a call of the Function itself
(`FunctionsAsOps.finish`), with the call's non-tensor arguments as constants of the node's target,
as fx applies it (NOTE [Custom autograd Functions] in monetlike/trace.py): one Op, whose saved
tensors are what its forward saves, recomputed by applying it again; the profiler sees whether it
draws random numbers, so a recomputation restores the generator as for any op. The Function that
torch.library makes for a custom op's registered backward (`register_autograd`) is let through:
export then records the custom op itself, which the runtime calls with its autograd kernel.
Python attributes a Function's forward sets (Reformer's layers set the dropout seeds their
reversible backward replays) are set by the op at every step, so they are no state the graph
leaves out; but a recomputation would set them again: such an op is recompute-unsafe.

NOTE [Data-dependent branches]
A forward that branches on a tensor's value (`if y.sum() > 0`, `n = int(mask.sum())`) cannot be
exported on fake tensors. A measured profile has the real example: exported again with the fake
tensors carrying its real values (torch_private.exporting_with_real_values), each such guard takes
the example's value and stays in the graph as a run-time assertion (`aten._assert_scalar`), so
the graph is specialised to the example's branch as it is to its shapes. `name_guards` rewrites
each assertion's message to name the user's line and the way out: a later batch that takes
another branch is refused when it reaches that line, never run down the example's branch. An
analytical profile runs on meta tensors, which hold no values: it keeps export's refusal.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from ..core.torch_private import custom_op_autograd_class, tree_flatten, tree_unflatten
from .trace import TraceError, function_op, user_frame_in

__all__ = ["FunctionsAsOps", "RECOMPUTE_UNSAFE", "ValueReads", "inside_function", "is_data_dependent",
           "name_guards"]

_LIB = torch.library.Library("monetlike", "FRAGMENT")
_LIB.define("autograd_function(Tensor[] tensors, int key) -> Tensor[]")
_OP = torch.ops.monetlike.autograd_function.default
_KEYS = itertools.count()
# node.meta key: reasons the profiler adds to the node's Op's recompute_unsafe.
RECOMPUTE_UNSAFE = "monetlike_recompute_unsafe"
_SITES: dict[int, "_Site"] = {}  # key -> call site, while its export runs


@dataclass
class _Site:
    """One `cls.apply(...)` call met while exporting."""

    cls: type
    spec: Any  # pytree spec of (args, kwargs)
    consts: dict  # leaf position -> non-tensor value
    n_leaves: int
    single: bool = True  # the Function returned one tensor (else a tuple of tensors)
    sets_state: bool = False  # its forward set a Python attribute of the model's modules

    def rebuild(self, tensors) -> tuple[tuple, dict]:
        it = iter(tensors)
        leaves = [self.consts[i] if i in self.consts else next(it) for i in range(self.n_leaves)]
        return tree_unflatten(leaves, self.spec)

    def op(self) -> Callable:
        """The graph's target: applies the Function to the node's tensors and the constants."""
        site, apply = self, function_op(self.cls)

        def op(*tensors):
            args, kwargs = site.rebuild(tensors)
            out = apply(*args, **kwargs)
            return out if site.single else tuple(out)

        op.__name__ = op.__qualname__ = apply.__name__
        return op


def _kinds(out) -> str:
    """`(Tensor, int)` for a Function's output (the types of a tuple's items)."""
    def kind(o) -> str:
        return "Tensor" if isinstance(o, torch.Tensor) else type(o).__name__

    if isinstance(out, (tuple, list)):
        return "(" + ", ".join(map(kind, out)) + ")"
    return kind(out)


def _fake(tensors, key):
    """The Function's forward on the op's (fake, or real) tensors, outside the tracer."""
    site = _SITES[key]
    args, kwargs = site.rebuild(tensors)
    with torch.no_grad(), _inside_fake(site):
        out = site.cls.apply(*args, **kwargs)
    site.single = isinstance(out, torch.Tensor)
    leaves = [out] if site.single else list(out) if isinstance(out, (tuple, list)) else None
    if leaves is None or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise TraceError(
            f"the torch.autograd.Function {site.cls.__module__}.{site.cls.__qualname__} returned "
            f"{_kinds(out)}; monetlike captures a Function that returns a tensor or a tuple of "
            f"tensors only under torch.export. Return the tensors as a tuple (and "
            f"other values from outside the Function), or capture the model with torch.fx "
            f"(capture='fx')")
    # A custom op's outputs may not alias its inputs (a Function may return a view of one):
    # copies of fake tensors cost nothing (of the example's, while exporting with real values,
    # little), and the node is replaced after the export.
    return [t.clone() for t in leaves]


torch.library.register_fake("monetlike::autograd_function", _fake, lib=_LIB)
# On real tensors too: an export with real values (NOTE [Data-dependent branches]) runs each op's
# kernel beside its fake one.
_LIB.impl("autograd_function", _fake, "CompositeExplicitAutograd")

_RUNNING: list[_Site] = []  # the sites whose Function's forward a fake kernel runs


@contextlib.contextmanager
def _inside_fake(site: _Site):
    """While a fake kernel runs a Function's forward, Functions it applies run as they are."""
    _RUNNING.append(site)
    try:
        yield
    finally:
        _RUNNING.pop()


def inside_function() -> bool:
    """Whether a Function's forward is running for its op's output shapes (trace.attributes_set's
    `exempt`): a Python attribute it sets (Reformer's layers set their dropout seeds) its op sets
    again at every step, but a recomputation would set it once more, so the op is marked."""
    for site in _RUNNING:
        site.sets_state = True
    return bool(_RUNNING)


class FunctionsAsOps:
    """NOTE [Custom autograd Functions under export]: `hook` for trace.functions_applied during
    the export; `finish(gm)` after it puts the Functions back into the graph."""

    def __init__(self):
        self.keys: list[int] = []

    def hook(self, cls, args, kwargs):
        if _RUNNING or custom_op_autograd_class(cls):
            return None
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        consts = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
        key = next(_KEYS)
        _SITES[key] = site = _Site(cls, spec, consts, len(leaves))
        self.keys.append(key)
        out = _OP(tensors, key)
        return out[0] if site.single else tuple(out)

    def close(self) -> None:
        for key in self.keys:
            _SITES.pop(key, None)

    def finish(self, gm: fx.GraphModule) -> None:
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not _OP:
                continue
            tensors, key = node.args
            site = _SITES[key]
            with graph.inserting_before(node):
                new = graph.call_function(site.op(), tuple(tensors))
            new.meta = dict(node.meta)
            if site.sets_state:  # NOTE [Custom autograd Functions under export]
                new.meta[RECOMPUTE_UNSAFE] = [
                    f"applies the autograd Function {site.cls.__qualname__}, whose forward sets "
                    f"Python attributes of the model's modules: a recomputation would set them "
                    f"again (a dropout seed its backward replays)"]
            if site.single:  # export indexed the op's list: the Function's tensor itself
                for user in list(node.users):
                    user.replace_all_uses_with(new)
                    graph.erase_node(user)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        gm.recompile()


def is_data_dependent(e: BaseException) -> bool:
    """Whether torch.export failed on a guard on a tensor's value (NOTE [Data-dependent
    branches])."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = f"{type(e).__name__}: {e}".lower()
        if "data-dependent" in text or "data dependent" in text \
                or "guardondatadependent" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


# What reads a tensor's value into Python: each call is one `aten.item` node of the graph.
_VALUE_READS = (torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__int__,
                torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.tolist)


class ValueReads(TorchFunctionMode):
    """The user's line of each read of a tensor's value, in the order the export met them."""

    def __init__(self):
        super().__init__()
        self.lines: list[str | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            self.lines.append(user_frame_in(traceback.extract_stack()))
        return func(*args, **(kwargs or {}))


def _origin(node: fx.Node, items: list[fx.Node], lines: list) -> str | None:
    """The user's line that read the value an assertion checks: the `aten.item` node it depends
    on, matched by its rank to the reads ValueReads recorded (when both counts agree)."""
    if len(items) != len(lines):
        return None
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in items:
            return lines[items.index(n)]
        stack.extend(n.all_input_nodes)
    return None


def name_guards(gm: fx.GraphModule, model_name: str, reads: list) -> list[str]:
    """NOTE [Data-dependent branches]: each run-time assertion's message names the user's line
    (`reads`: ValueReads.lines); returns those lines, each once."""
    found: dict[str, None] = {}
    items = [n for n in gm.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.aten.item.default]
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
            continue
        cond, text = node.args[:2]
        expr = re.search(r"for expression (.*) on node", str(text))
        where = _origin(node, items, reads) or "a line of its forward"
        found[where] = None
        node.args = (cond, (
            f"{model_name} was captured for the branch its example took at {where} (where the "
            f"forward reads a tensor's value: {expr.group(1) if expr else text}), and this "
            f"batch takes another one; the graph, its profile and its schedule hold for the "
            f"example's branch only. Way out: profile and wrap the model on a batch that takes "
            f"this branch (one wrapped model per branch), or write that line without a Python "
            f"branch on a tensor's value (torch.where, masks of fixed shape)"))
    gm.recompile()
    return list(found)
