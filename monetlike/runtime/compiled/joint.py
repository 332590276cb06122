"""AOTAutograd's joint graph, described for the compiled model (solver/compiled.py).

Reads each fx node's fake value (`node.meta["val"]`) for its bytes, the op's schema for whether
its output is a view of an input, torch's FLOP formulas for matmuls and convolutions, and the
operator tags for random ops. Where the forward ends is default_partition's rule: at the last
node AOTAutograd tagged as traced in the forward.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from solver.compiled import JointGraph, JointNode

from ...core import torch_private
from ...core.allocator import AllocatorLog

__all__ = ["OpMeasures", "describe", "measure_ops", "tag_saved", "saved_names"]

# Ops that return tensors on their input's storage without saying so in their schema.
_UNDECLARED_VIEWS = {torch.ops.aten._unsafe_view.default, torch.ops.aten.unsafe_split.Tensor,
                     torch.ops.aten.unsafe_split_with_sizes.default,
                     torch.ops.aten.unsafe_chunk.default}


def _nbytes(t) -> int:
    """Bytes of the storage a fresh tensor like `t` occupies (its strides included)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return span * t.element_size()


# Ops whose result is `clone_preserve_strides(self)` written into: a copy of self's whole
# storage (the base of a view, 2,048 B where the view spans 1,600), or of self alone where self
# overlaps itself (an expanded gradient).
_CLONE_SELFS_STORAGE = {torch.ops.aten.copy.default, torch.ops.aten.select_scatter.default,
                        torch.ops.aten.slice_scatter.default,
                        torch.ops.aten.diagonal_scatter.default,
                        torch.ops.aten.as_strided_scatter.default}


def _fresh_nbytes(node: fx.Node, t) -> int:
    """Bytes of the storage `node`'s fresh output `t` allocates."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    self = node.args[0].meta.get("val") if node.target in _CLONE_SELFS_STORAGE else None
    if isinstance(self, torch.Tensor):
        if any(st == 0 and sz > 1 for sz, st in zip(self.shape, self.stride())):
            return self.numel() * self.element_size()
        try:
            return max(_nbytes(t), int(self.untyped_storage().nbytes()))
        except (RuntimeError, TypeError, NotImplementedError):  # a symbolic size: no storage
            pass
    return _nbytes(t)


def _view_of(node: fx.Node) -> fx.Node | None:
    """The input node whose storage `node`'s output lives on, for a view op; else None."""
    target = node.target
    if target in _UNDECLARED_VIEWS:
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    alias = schema.returns[0].alias_info
    for arg, value in zip(schema.arguments, node.args):
        # a list of views (`Tensor(a)[]`, a split's) shows an empty set: its elements' is a
        if arg.alias_info is not None and (arg.alias_info.before_set == alias.before_set
                                           or not alias.before_set):
            return value if isinstance(value, fx.Node) else None
    return None


def _meta(v):
    if isinstance(v, fx.Node):
        val = v.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return val
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


def _flops(node: fx.Node) -> int:
    """torch's FLOP count of one run of `node` (0 for ops torch has no formula for)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in flop_registry:
        return 0
    counter = FlopCounterMode(display=False)
    with counter:
        node.target(*_meta(node.args), **{k: _meta(v) for k, v in node.kwargs.items()})
    return int(counter.get_total_flops())


def _is_rng(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _zeros_for(node: fx.Node):
    """Zeros standing in for `node`'s value, at the trace's strides (a tuple of them for a
    multi-output op; a non-tensor value as it is)."""
    def zeros(val):
        if isinstance(val, torch.Tensor):
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype,
                                       device=val.device).zero_()
        return val
    val = node.meta.get("val")
    return type(val)(zeros(v) for v in val) if isinstance(val, (tuple, list)) else zeros(val)


@dataclass(frozen=True)
class OpMeasures:
    """What running the joint graph's ops once each on this device showed."""

    scratch: dict[str, int]
    """Node name -> bytes its kernel allocates beyond its outputs while it runs."""
    seconds: dict[str, float]
    """Node name -> seconds of one run (the least of `TIMING_RUNS`, wall clock)."""
    failed: tuple[str, ...]
    """Nodes whose op would not run on zero tensors (it needs real indices or sizes)."""


TIMING_RUNS = 3


def _new_bytes(out, args) -> int:
    """Bytes of the storages in `out` that none of `args` holds (what the op allocated)."""
    held = {a.untyped_storage().data_ptr() for a in _tensors(args)}
    seen, total = set(), 0
    for t in _tensors(out):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)


def _run_joint(joint: fx.GraphModule, ops: set[str], log: AllocatorLog | None,
               timed: dict[str, str], seconds: dict[str, float], failed: set[str],
               allocated: dict[str, int]) -> None:
    """Run the joint graph once on zero inputs, each op on the values the ops before it made
    (their real strides, which the trace's do not always match): with `log`, a mark before and
    after each op of `ops`; else each op of `timed` (node -> its key) timed, the least of
    TIMING_RUNS runs, into `seconds` by key. An op that raises is `failed`; zeros stand in."""
    nodes = list(joint.graph.nodes)
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    env: dict[fx.Node, object] = {}
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "get_attr"):
            env[n] = _zeros_for(n)
        elif n.op == "call_function":
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            if log is not None and n.name in ops:
                log.mark(f"{n.name}:a")
            try:
                out = n.target(*args, **kwargs)
            except Exception:  # an op that needs real data (indices, sizes) to run
                failed.add(n.name)
                out = _zeros_for(n)
            if log is not None and n.name in ops:
                log.mark(f"{n.name}:b")
                allocated[n.name] = _new_bytes(out, (args, kwargs))
            if n.name in timed and timed[n.name] not in seconds and n.name not in failed:
                runs = []
                for _ in range(TIMING_RUNS):
                    t = time.perf_counter()
                    n.target(*args, **kwargs)
                    runs.append(time.perf_counter() - t)
                seconds[timed[n.name]] = min(runs)
            env[n] = out
            del args, kwargs, out
        for a in [a for a in n.all_input_nodes if last.get(a) == i]:
            env.pop(a, None)


def measure_ops(joint: fx.GraphModule) -> OpMeasures:
    """Run the joint graph on zero inputs, each op on what the ops before it made: each op's
    scratch in its place by the CPU allocator's own events, then each distinct op's time (same
    target, argument shapes and constants). CPU only: on other devices nothing is measured (the
    model then prices ops by their FLOPs and bytes). The RNG state is restored afterwards."""
    todo = [n for n in joint.graph.nodes if n.op == "call_function" and n.target is not
            operator.getitem and _view_of(n) is None]
    if any(isinstance(v, torch.Tensor) and v.device.type != "cpu"
           for n in todo for v in [n.meta.get("val")]):
        return OpMeasures({}, {}, ())
    ops = {n.name for n in todo}
    first: dict[str, str] = {}  # key -> the first node of it
    for n in todo:
        first.setdefault(_key(n), n.name)
    timed = {name: key for key, name in first.items()}
    failed: set[str] = set()
    seconds: dict[str, float] = {}  # key -> seconds
    allocated: dict[str, int] = {}
    state = torch.get_rng_state()
    try:
        # the partition runs under the compile's fake-tensor mode: set it aside to run for real
        with torch_private.outside_dispatch_modes(), torch.no_grad():
            with AllocatorLog() as log:
                _run_joint(joint, ops, log, {}, seconds, failed, allocated)
            _run_joint(joint, ops, None, timed, seconds, set(), {})
    finally:
        torch.set_rng_state(state)
    scratch, times = {}, {}
    for n in todo:
        if n.name in failed:
            continue
        before = log.level(f"{n.name}:a")
        scratch[n.name] = max(0, log.peak_between(f"{n.name}:a", f"{n.name}:b") - before
                              - allocated[n.name])
        key = _key(n)
        if key in seconds:
            times[n.name] = seconds[key]
    return OpMeasures(scratch, times, tuple(n.name for n in todo if n.name in failed))


def _signature(a):
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            return (tuple(val.shape), tuple(val.stride()), str(val.dtype))
        return repr(val)
    if isinstance(a, (list, tuple)):
        return tuple(_signature(x) for x in a)
    return repr(a)


def _key(n: fx.Node) -> str:
    return f"{n.target}|{[_signature(a) for a in n.args]}|{sorted(n.kwargs.items())!r}"


def describe(joint: fx.GraphModule, num_fwd_outputs: int,
             measures: OpMeasures | None = None, *, pin_rng: bool = False) -> JointGraph:
    """The joint graph as solver.compiled sees it, with `measures` from measure_ops. pin_rng:
    random ops are saved, never recomputed (Inductor: its backward's replay of the RNG state
    drew other seeds than its forward, measured on a dropout; a saved seed redraws the same)."""
    measures = measures or OpMeasures({}, {}, ())
    nodes = list(joint.graph.nodes)
    last_forward = max((i for i, n in enumerate(nodes) if torch_private.joint_forward_tagged(n)
                        or (n.op == "placeholder"
                            and torch_private.joint_placeholder_kind(n) == "primal")),
                       default=-1)
    out, fixed, rng_state = [], 0, 0
    for i, n in enumerate(nodes):
        if n.op == "output":
            continue
        val = n.meta.get("val")
        inputs = tuple(dict.fromkeys(n.all_input_nodes))
        names = tuple(x.name for x in inputs)
        if n.op in ("placeholder", "get_attr"):
            kind = torch_private.joint_placeholder_kind(n) if n.op == "placeholder" else "other"
            if kind == "tangent":
                out.append(JointNode(n.name, "tangent", out_bytes=(_nbytes(val),)))
            else:
                fixed += _nbytes(val)
                out.append(JointNode(n.name, "primal"))
            continue
        phase = "forward" if i <= last_forward else "backward"
        multi = isinstance(val, (tuple, list))
        base = _view_of(n)  # a split's outputs too: views of its input
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and isinstance(
                n.args[0].meta.get("val"), (tuple, list)):
            alias, out_bytes = (n.args[0].name, int(n.args[1])), ()
        elif base is not None:
            alias, out_bytes = (base.name, 0), ()
        elif multi:
            alias, out_bytes = None, tuple(_fresh_nbytes(n, v) for v in val)
        else:
            alias, out_bytes = None, (_fresh_nbytes(n, val),)
        rng = _is_rng(n)
        if rng and phase == "forward":
            rng_state = max(rng_state, torch.get_rng_state().numel())
        out.append(JointNode(
            n.name, phase, inputs=names, out_bytes=out_bytes, alias=alias, flops=_flops(n),
            scratch=measures.scratch.get(n.name, 0),
            seconds=measures.seconds.get(n.name, 0.0 if alias else None),
            candidate=phase == "forward" and isinstance(val, torch.Tensor), rng=rng,
            pinned=rng and pin_rng and phase == "forward" and isinstance(val, torch.Tensor),
            multi=len(val) if multi else 0))
    results = list(nodes[-1].args[0])
    fwd = tuple(r.name for r in results[:num_fwd_outputs] if isinstance(r, fx.Node))
    bwd = tuple(r.name for r in results[num_fwd_outputs:] if isinstance(r, fx.Node))
    return JointGraph(nodes=tuple(out), forward_outputs=fwd, backward_outputs=bwd,
                      fixed_bytes=fixed, rng_state_bytes=rng_state)


def tag_saved(joint: fx.GraphModule, graph: JointGraph, saved: frozenset[str]) -> None:
    """Tag the joint graph so that torch's default partition saves exactly `saved`: every other
    forward value MUST_RECOMPUTE (a multi-output op too when any of its outputs is recomputed, so
    that a random one replays its RNG state), all in one checkpoint region."""
    recomputed_multi = {n.alias[0] for n in graph.nodes
                        if n.candidate and n.alias is not None and n.name not in saved
                        and graph.by_name[n.alias[0]].multi}
    for node in joint.graph.nodes:
        desc = graph.by_name.get(node.name)
        if desc is None or desc.phase != "forward":
            continue
        if desc.candidate:
            keep = node.name in saved
        elif desc.multi:
            keep = node.name not in recomputed_multi
        else:
            continue
        node.meta["recompute"] = (CheckpointPolicy.MUST_SAVE if keep
                                  else CheckpointPolicy.MUST_RECOMPUTE)
        node.meta["ac_graph_id"] = 0  # one region: torch's cleanup saves no region boundary


def saved_names(forward: fx.GraphModule, num_fwd_outputs: int) -> list[str]:
    """Names of the values the partitioned forward hands the backward (after its own outputs)."""
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    return [a.name for a in output.args[0][num_fwd_outputs:] if isinstance(a, fx.Node)]
