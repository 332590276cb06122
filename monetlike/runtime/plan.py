"""The static part of running a Schedule: everything that does not change from step to step.

A `Plan` joins three things that name the same program differently: the OpGraph (Ops and Values by
id), the Schedule (per-stage recompute and drop lists) and the traced fx GraphModule (nodes by
name). It is built once per input signature and then read by every step (`executor.StepState`).

It also decides, per Value, how the runtime treats it (see NOTE [Value handling] below) and
precomputes, per backward stage, when each dropped Value is released: the simulator's own rule,
solver/release.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from solver.errors import ScheduleError
from solver.graph import OpGraph
from solver.release import StageRelease, stage_releases
from solver.schedule import Schedule
from solver.simulate import simulate
from ..core.recompute import norm_kind, rng_free
from ..impls import get, names
from ..impls.registry import stashed_recompute_of
from ..core.modules import module_of

# NOTE [Value handling]
# Every Value is in one of three classes, decided once per plan:
# - scheduled: produced by an Op that some stage recomputes (or offloaded). Its forward copy may be
#   freed and another copy used, so each saved tensor on its storage is packed as a handle and
#   unpacked from `StepState.resident`.
# - pass-through: saved by a backward, never recomputed. Autograd saves it the ordinary way and
#   frees it after its last backward use, no later than the schedule's drop: a store-all schedule
#   costs what plain PyTorch does.
# - neither: never saved; the generated forward frees it at its last forward use.
# The runtime holds a Value in `resident` only where a handle or a recomputation reads it, so it
# never keeps more than the simulator's resident set.
#
# NOTE [Ops no backward reaches]
# An Op whose results do not lead to the loss (`mask = (u * scale) > 0`) still gets autograd nodes
# when its inputs require grad, and they keep `u` alive past where the model frees it. So such an Op
# runs under no_grad, and each result that requires grad gets a grad_fn that saves nothing and
# raises if a backward reaches it (executor._unreached_results). Exceptions: an Op a model output
# derives from runs as profiled; under autocast's weight-cast cache the nodes run with grad (a cast
# made under no_grad would be cached without a gradient) and save nothing.

# Functions whose recomputation would not reproduce the original result or would repeat a side
# effect. The profiler marks such Ops `recompute_unsafe` and the simulator refuses to recompute
# them; this list is a second line of defence at run time (a schedule edited by hand, an older
# profile). Random ops are absent on purpose: the runtime replays the RNG state.
_NEVER_RECOMPUTE_NAMES = frozenset({
    "topk", "nonzero", "nonzero_static", "unique", "unique_consecutive", "argwhere",
    "masked_select", "randperm", "multinomial", "bincount", "histc", "item", "tolist",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier",
    "print",
})


# Impls the runtime knows how to execute: 'default' is the op as the model wrote it; the others
# are the registered operator implementations (monetlike/impls), run in place of the Op's nodes.
def runtime_impls() -> frozenset[str]:

    return frozenset({"default"}) | names()


def target_name(node: fx.Node) -> str:
    """A readable name for what a node calls ('conv2d', 'relu_', 'layer1.0.conv1')."""
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


# What a graph captured by torch.export records for `with torch.autocast(...)` in older IRs
# (newer ones wrap the region into one `wrap_with_autocast` node; fx records nothing).
AUTOCAST_SWITCHES = frozenset({"_enter_autocast", "_exit_autocast"})


@dataclass
class Plan:
    graph: OpGraph
    schedule: Schedule
    gm: fx.GraphModule
    nodes: dict[str, fx.Node]
    """fx node by name."""
    node_op: dict[str, int]
    """fx node name -> Op id, for nodes that belong to an Op."""
    op_nodes: list[list[fx.Node]]
    """Per Op, its fx nodes in execution order."""
    op_last_node: dict[str, int]
    """Name of the last fx node of each Op -> Op id (the Op is complete after it ran)."""
    value_of: dict[tuple[str, int | None], int]
    """(fx node name, tuple index or None) -> Value id, for Values created by Ops."""
    placeholder_index: dict[str, int]
    op_values: list[frozenset[int]]
    """Per Op, its input and output Value ids: the only candidates when identifying a storage."""
    scheduled: frozenset[int]
    """Value ids read through handles (NOTE [Value handling])."""
    held: frozenset[int]
    """Value ids the runtime ever holds in `resident`."""
    keep_from_forward: frozenset[int]
    """held & (forward_keep | outputs): put in `resident` when created in the forward pass."""
    recomputed_ops: frozenset[int]
    rng_ops: frozenset[int]
    """Recomputed Ops whose RNG state is captured and replayed (not known to be RNG-free)."""
    hooked_ops: frozenset[int]
    """Ops whose nodes run under the saved-tensor hooks: those that read or make a scheduled
    Value (NOTE [Where the hooks are] in executor.py), and the unreached ones."""
    unreached_ops: frozenset[int]
    """Ops no backward runs through whose results require grad, so that autograd nodes made by
    them may save tensors all the same (NOTE [Ops no backward reaches])."""
    no_grad_ops: frozenset[int]
    """The unreached Ops no model output derives from: run under no_grad (the same NOTE)."""
    meta_nodes: frozenset[str]
    """fx nodes whose result geometry a recomputation may need to rebuild an argument."""
    stage_of_op: dict[int, int]
    releases: list[StageRelease]
    """Per backward stage, when its dropped Values are released (solver/release.py)."""
    offload: frozenset[int] = frozenset()
    """Values copied to host memory in the forward pass (offload.py)."""
    offload_after: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Op id -> its offloaded outputs, copied once the Op's last node ran (after its in-place
    writes)."""
    impl_saved: list[frozenset[int]] = field(default_factory=list)
    impl_calls: dict = field(default_factory=dict)
    """fx node name -> replacement callable, for the nodes of Ops whose Impl is not 'default'."""
    overwrites: dict = field(default_factory=dict)
    """Op id -> the Value its chosen in-place Impl overwrites (monetlike/impls/inplace.py)."""
    overwritten_args: dict = field(default_factory=dict)
    """fx node name -> the positions (ints) and keywords (strs) of its arguments that are the
    Value its in-place Impl overwrites (NOTE [In place on a view] in executor.py)."""
    storage_values: list = field(default_factory=list)
    """Per Op, the Values a storage it touches may be, each with its rank (outputs first): the
    candidates when a saved
    tensor or a node's result is matched to a Value by storage (NOTE [Storage identity] in
    step_state.py). An in-place Op's output shares its storage with the Value it overwrites, which
    is left out: after the write that storage holds the output."""
    active_stages: frozenset[int] = frozenset()
    """Backward stages that do something at run time (fetch, recompute, or release a Value the
    runtime holds): only their Ops get stage hooks (NOTE [Stage boundaries] in step_state.py)."""
    runtime_nodes: frozenset[str] = frozenset()
    """fx nodes the forward runs through the runtime (NOTE [Generated forward] in executor.py);
    every other node runs as fx's generated code."""
    stashed_recompute: dict = field(default_factory=dict)
    """fx node name -> (run, argument), for the recomputed Ops whose Impl recomputes from what its
    forward stashed (impls.registry.StashedRecompute; dropout_mask applies its held mask)."""
    stats_nodes: dict = field(default_factory=dict)
    """fx node name -> Op id, for the training BatchNorms of recomputed Ops: their forward's
    batch statistics are held until the Op's last recomputation (NOTE [BatchNorm from its
    statistics] in recompute.py)."""
    last_recompute: dict = field(default_factory=dict)
    """Recomputed Op id -> the last backward stage that recomputes it."""
    autocast_switches: bool = True
    """Whether a node of the traced graph enters or leaves an autocast context, so that the
    autocast state may differ between Ops of one forward."""

    @property
    def store_all(self) -> bool:
        """Nothing recomputed or offloaded, and no Op no backward reaches saves a tensor: the
        step is plain autograd."""
        return not self.recomputed_ops and not self.offload and not self.unreached_ops


def build_plan(graph: OpGraph, schedule: Schedule, gm: fx.GraphModule) -> Plan:
    """Join graph, schedule and traced module; raise ScheduleError if they do not fit together.

    Whether offload can run on the model's device is the caller's check (it knows the tensors:
    offload.check_offload_devices), made before this."""
    # The simulator validates the schedule against the graph (fingerprint, residency of every
    # Value a recomputation or a backward reads, unsafe Ops); a schedule it rejects never runs.
    simulate(graph, schedule)

    known = runtime_impls()
    for op, k in zip(graph.ops, schedule.impl):
        if op.impls[k].name not in known:
            raise ScheduleError(
                f"schedule picks Impl {op.impls[k].name!r} for op {op.id} ({op.name}); this "
                f"runtime executes {sorted(known)} only: solve with mode='checkpoint' or "
                f"update monetlike")
    nodes = {n.name: n for n in gm.graph.nodes}
    node_op, op_nodes = _op_nodes(graph, gm, nodes)
    op_last_node = {g[-1].name: j for j, g in enumerate(op_nodes) if g}
    impl_calls = _impl_calls(graph, schedule, gm, op_nodes)

    placeholder_index = {n.name: i for i, n in
                         enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    value_of: dict[tuple[str, int | None], int] = {}
    for v in graph.values:
        if v.producer is not None:
            value_of[(v.name, v.index)] = v.id
    op_values = [frozenset(op.inputs) | frozenset(op.outputs) for op in graph.ops]
    overwrites = {op.id: op.impls[k].overwrites for op, k in zip(graph.ops, schedule.impl)
                  if op.impls[k].overwrites is not None}
    overwritten_args = _overwritten_args(graph, overwrites, op_nodes, impl_calls)
    storage_values = [{v: rank for rank, v in enumerate(tuple(op.outputs) + tuple(
        v for v in op.inputs if v not in op.outputs and v != overwrites.get(op.id)))}
        for op in graph.ops]
    impl_saved = [frozenset(op.impls[k].saved) for op, k in zip(graph.ops, schedule.impl)]

    recomputed_ops = frozenset(j for st in schedule.stages for j in st.recompute)
    is_input = {v.id for v in graph.values if v.producer is None}
    offload = frozenset(schedule.offload)
    # Offloaded Values are read through handles like recomputed ones (NOTE [Value handling]): a
    # tensor saved the ordinary way would keep the device copy alive.
    scheduled = frozenset(v for j in recomputed_ops for v in graph.ops[j].outputs) | offload
    recompute_inputs = frozenset(v for j in recomputed_ops for v in graph.ops[j].inputs
                                 if v not in is_input)
    held = scheduled | recompute_inputs
    offload_after: dict[int, list[int]] = {}
    for v in sorted(offload):
        offload_after.setdefault(graph.values[v].producer, []).append(v)
    # NOTE [Ops no backward reaches]: what their nodes save is let go at once.
    # (An output that requires grad has a grad_fn: the Op has autograd nodes, which may save.)
    unreached_ops = frozenset(
        op.id for op in graph.ops
        if not op.has_backward and any(graph.values[v].requires_grad for v in op.outputs))
    hooked_ops = frozenset(op.id for op in graph.ops
                           if not scheduled.isdisjoint(op_values[op.id])) | unreached_ops
    no_grad_ops = unreached_ops - _feeding_outputs(graph)
    rng_ops = _rng_ops(graph, gm, recomputed_ops, op_nodes)
    keep = set(schedule.forward_keep) | set(graph.outputs)
    keep_from_forward = frozenset(v for v in held if v in keep)
    _check_recomputable(graph, recomputed_ops, op_nodes)
    meta = _recompute_reads(recomputed_ops, op_nodes, node_op)

    stage_of_op = {o: t for t, o in enumerate(graph.backward_order)}
    releases = [stage_releases(graph, schedule, t) for t in range(len(schedule.stages))]
    active_stages = frozenset(
        t for t, (st, rel) in enumerate(zip(schedule.stages, releases))
        if st.fetch or st.recompute
        or not held.isdisjoint((*rel.at_start, *rel.at_end, *(v for vs in rel.after_recompute
                                                                 for v in vs))))
    # NOTE [Generated forward]: the Ops whose nodes need the runtime in the forward pass.
    producers = {graph.values[v].producer for v in held | offload} - {None}
    runtime_ops = (set(hooked_ops) | recomputed_ops | producers | set(offload_after)
                   | {graph.backward_order[t] for t in active_stages})
    runtime_nodes = {n.name for j in runtime_ops for n in op_nodes[j]} | meta | set(impl_calls)


    stashed_recompute = _stashed_recompute(graph, schedule, gm, recomputed_ops, op_nodes)
    stats_nodes = {n.name: j for j in recomputed_ops - unreached_ops for n in op_nodes[j]
                   if (n.op == "call_function" and n.target is F.batch_norm) or (
                       n.op == "call_module"
                       and norm_kind(type(_submodule(gm, n.target))) == "batchnorm")}
    last_recompute = {j: t for t, st in enumerate(schedule.stages) for j in st.recompute}

    return Plan(graph=graph, schedule=schedule, gm=gm, nodes=nodes, node_op=node_op,
                op_nodes=op_nodes, op_last_node=op_last_node, value_of=value_of,
                placeholder_index=placeholder_index, op_values=op_values, scheduled=scheduled,
                held=held, keep_from_forward=keep_from_forward, recomputed_ops=recomputed_ops,
                hooked_ops=hooked_ops, unreached_ops=unreached_ops, no_grad_ops=no_grad_ops,
                rng_ops=rng_ops,
                meta_nodes=frozenset(meta), stage_of_op=stage_of_op, releases=releases,
                impl_saved=impl_saved, impl_calls=impl_calls, overwrites=overwrites,
                overwritten_args=overwritten_args,
                storage_values=storage_values, offload=offload,
                offload_after={j: tuple(vs) for j, vs in offload_after.items()},
                active_stages=active_stages, runtime_nodes=frozenset(runtime_nodes),
                stashed_recompute=stashed_recompute, stats_nodes=stats_nodes,
                last_recompute=last_recompute,
                autocast_switches=any(n.op == "call_function"
                                      and target_name(n) in AUTOCAST_SWITCHES
                                      for n in gm.graph.nodes))


def _op_nodes(graph: OpGraph, gm: fx.GraphModule, nodes: dict):
    """(fx node name -> Op id, each Op's nodes in the trace's order); every node an Op names
    must be in the traced model."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    node_op: dict[str, int] = {}
    op_nodes: list[list[fx.Node]] = []
    for op in graph.ops:
        for name in op.nodes:
            if name not in nodes:
                raise ScheduleError(
                    f"op {op.id} ({op.name}) names fx node {name!r}, which the traced model does "
                    f"not have; the graph was profiled from another model, or from another "
                    f"trace of this one: other leaf_modules, or a forward hook registered on a "
                    f"submodule since it was profiled (a module with forward hooks is traced "
                    f"whole, as one op). Profile this model and solve again (with the hooks in "
                    f"place)")
            node_op[name] = op.id
        op_nodes.append(sorted((nodes[name] for name in op.nodes), key=order.__getitem__))
    return node_op, op_nodes


def _impl_calls(graph: OpGraph, schedule: Schedule, gm: fx.GraphModule, op_nodes) -> dict:
    """Non-default Impls: the replacement of each of their nodes (the forward runs it instead)."""
    impl_calls: dict = {}
    for op, k in zip(graph.ops, schedule.impl):
        if k == 0:
            continue
        subs = get(op.impls[k].name).match(gm, op_nodes[op.id])
        if not subs:
            raise ScheduleError(
                f"schedule picks Impl {op.impls[k].name!r} for op {op.id} ({op.name}), which "
                f"does not apply to its nodes in this trace; re-profile the model and solve again")
        impl_calls.update(subs)
    return impl_calls


def _overwritten_args(graph: OpGraph, overwrites: dict, op_nodes, impl_calls) -> dict:
    """fx node name -> where (argument positions or keywords) its in-place Impl's overwritten
    Value is passed."""
    overwritten_args: dict[str, tuple] = {}
    for j, x in overwrites.items():
        xv = graph.values[x]
        for node in op_nodes[j]:
            if node.name not in impl_calls or xv.index is not None:
                continue
            where = tuple(i for i, a in enumerate(node.args)
                          if isinstance(a, fx.Node) and a.name == xv.name)
            where += tuple(k for k, a in node.kwargs.items()
                           if isinstance(a, fx.Node) and a.name == xv.name)
            if where:
                overwritten_args[node.name] = where
    return overwritten_args


def _feeding_outputs(graph: OpGraph) -> set[int]:
    """Ops a model output derives from through Values that require grad. An unreached one keeps
    its nodes, and what they hold outside the hooks, until the caller drops the output, in the
    profiled step as at run time: it runs as it did there."""
    feeds_output: set[int] = set()
    stack = [graph.values[v].producer for v in graph.outputs if graph.values[v].requires_grad]
    while stack:
        j = stack.pop()
        if j is None or j in feeds_output:
            continue
        feeds_output.add(j)
        stack.extend(graph.values[v].producer for v in graph.ops[j].inputs
                     if graph.values[v].requires_grad)
    return feeds_output


def _rng_ops(graph: OpGraph, gm: fx.GraphModule, recomputed_ops, op_nodes) -> frozenset:
    """The recomputed Ops that draw random numbers (their RNG state is recorded and replayed)."""
    if "random_ops" in graph.meta:  # the profiler saw which Ops drew random numbers
        return frozenset(recomputed_ops) & frozenset(graph.meta["random_ops"])

    def kind(n: fx.Node) -> str:
        if n.op == "call_module":
            return type(module_of(gm, n.target)).__name__
        return target_name(n).split(".")[-1]

    # a graph profiled before it recorded them: judge by the names of their modules
    return frozenset(j for j in recomputed_ops if not rng_free([kind(n) for n in op_nodes[j]]))


def _check_recomputable(graph: OpGraph, recomputed_ops, op_nodes) -> None:
    for j in sorted(recomputed_ops):
        for n in op_nodes[j]:
            if target_name(n).split(".")[-1] in _NEVER_RECOMPUTE_NAMES:
                raise ScheduleError(
                    f"schedule recomputes op {j} ({graph.ops[j].name}), whose node "
                    f"{n.format_node()} is data-dependent, nondeterministic or a collective and "
                    f"must never be recomputed; re-profile the model so the op is marked "
                    f"recompute_unsafe and solve again")


def _recompute_reads(recomputed_ops, op_nodes, node_op: dict) -> set[str]:
    """Nodes a recomputation may read without recomputing them: the arguments of recomputed
    Ops' nodes, and, through nodes that belong to no Op (views, getitem), their arguments."""
    meta: set[str] = set()
    stack = [a for j in recomputed_ops for n in op_nodes[j] for a in n.all_input_nodes
             if node_op.get(a.name) != j]
    while stack:
        a = stack.pop()
        if a.name in meta:
            continue
        meta.add(a.name)
        if a.name not in node_op and a.op not in ("placeholder", "get_attr"):
            stack.extend(a.all_input_nodes)
    return meta


def _stashed_recompute(graph: OpGraph, schedule: Schedule, gm: fx.GraphModule, recomputed_ops,
                       op_nodes) -> dict:
    """fx node name -> (run, argument) for recomputed Ops whose Impl recomputes from a stash."""
    out = {}
    for j in recomputed_ops:
        outputs = [graph.values[v] for v in graph.ops[j].outputs]
        stashed = stashed_recompute_of(graph.ops[j].impls[schedule.impl[j]].name)
        if stashed is not None and all(stashed.applies(v.dtype, v.requires_grad)
                                       for v in outputs):
            argument = stashed.argument(gm, op_nodes[j])
            if argument is not None:
                out[op_nodes[j][0].name] = (stashed.run, argument)
    return out


def _submodule(gm: fx.GraphModule, target: str) -> "torch.nn.Module | None":
    try:
        return module_of(gm, target)
    except AttributeError:
        return None
