"""Replay a Schedule on an OpGraph: the memory at every point, the peak, and the step time.

This is the source of truth for what a schedule costs. The MILP (solver/formulation.py) must claim
exactly the peak and time computed here, and the runtime must measure no more than this peak.
The rules are written out in docs/execution-model.md; each rule below cites its section there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .analysis import inplace_clashes, inplace_freed
from .errors import ScheduleError, ScheduleMismatchError
from .graph import OpGraph
from .release import stage_releases
from .schedule import Schedule, StageSchedule


@dataclass(frozen=True)
class Point:
    """The memory at one point of the step."""

    phase: str
    """'forward', 'recompute', 'backward' or 'end'."""
    stage: int | None
    """Backward stage index (None in the forward pass)."""
    op: int | None
    """The Op running at this point."""
    bytes: int
    """Tensor bytes live at the peak of this point (fixed memory included)."""
    resident: tuple[int, ...]
    """Values resident at this point (graph inputs excluded: they are always resident)."""


@dataclass(frozen=True)
class Timeline:
    points: tuple[Point, ...]
    peak_bytes: int
    total_time: float
    forward_time: float
    recompute_time: float
    backward_time: float
    transfer_time: float = 0.0
    """Copies to and from host memory (offload and fetch), charged in full."""

    @property
    def peak_point(self) -> Point:
        return max(self.points, key=lambda p: p.bytes)


def gradient_bytes_at(graph: OpGraph, point: Point) -> int:
    """The gradient bytes counted at a point: its backward stage's, the end's, none forward."""
    if point.phase == "end":
        return graph.final_grad_bytes
    return graph.stage_grad_bytes[point.stage] if point.stage is not None else 0


def check_fingerprint(graph: OpGraph, schedule: Schedule) -> None:
    if schedule.fingerprint != graph.fingerprint:
        raise ScheduleMismatchError(
            f"schedule was solved for another graph (fingerprint {schedule.fingerprint}, this graph "
            f"is {graph.fingerprint}): {graph.describe_difference(schedule.graph_summary)}; "
            f"solve a schedule for this model, batch and input shape")


def _validated(graph: OpGraph, schedule: Schedule):
    """The schedule's checks that need no replay; returns (each op's chosen Impl, the kept
    Values, the offloaded Values, overwritten Value -> the op whose Impl overwrites it)."""
    check_fingerprint(graph, schedule)
    ops, values = graph.ops, graph.values
    if len(schedule.impl) != len(ops):
        raise ScheduleError(f"schedule.impl: expected {len(ops)} entries (one per op), got "
                            f"{len(schedule.impl)}")
    for j, k in enumerate(schedule.impl):
        if k >= len(ops[j].impls):
            raise ScheduleError(f"schedule.impl[{j}]: op {ops[j].name} has {len(ops[j].impls)} "
                                f"impls, got index {k}")
    if len(schedule.stages) != len(graph.backward_order):
        raise ScheduleError(f"schedule.stages: expected {len(graph.backward_order)} stages, got "
                            f"{len(schedule.stages)}")
    impls = [ops[j].impls[k] for j, k in enumerate(schedule.impl)]
    is_input = [v.producer is None for v in values]
    held_by_caller = set(graph.outputs)
    keep = set(schedule.forward_keep)
    for v in keep:
        if v >= len(values) or is_input[v]:
            raise ScheduleError(f"schedule.forward_keep: {v} is not a Value produced by an op")

    offload = set(schedule.offload)
    if offload:
        if graph.host_bandwidth is None:
            raise ScheduleError("schedule.offload: the schedule offloads values to host memory, "
                                "but the graph has no host_bandwidth (a CPU profile, or none "
                                "configured); re-solve without offload or profile with a host "
                                "link bandwidth")
        if len(offload) != len(schedule.offload):
            raise ScheduleError(f"schedule.offload: repeated values in {list(schedule.offload)}")
    for v in offload:
        if v >= len(values) or is_input[v] or v in held_by_caller:
            raise ScheduleError(f"schedule.offload: {v} is not a Value produced by an op (or it "
                                f"is a model output, which the caller holds)")
        if v in keep:
            raise ScheduleError(f"schedule.offload: value {v} ({values[v].name}) is also in "
                                f"forward_keep; an offloaded Value leaves the device")

    # In-place Impls (execution-model section 1): op j writes its output into the storage of
    # the input x it overwrites, so x is gone once j has run. The graph guarantees that no later
    # op reads x; the schedule must not keep it, offload it, hold it across a stage boundary,
    # or choose an Impl whose backward reads it.
    overwritten = {impls[j].overwrites: j for j in range(len(ops))
                   if impls[j].overwrites is not None}
    chosen_saved = {v: k for k in graph.backward_order for v in impls[k].saved}
    for x, j in overwritten.items():
        what = f"op {j} ({ops[j].name}) runs Impl {impls[j].name!r}, which overwrites value {x}"
        if x in keep or x in offload:
            raise ScheduleError(f"{what}, but the schedule keeps or offloads value {x}")
        if x in chosen_saved:
            k = chosen_saved[x]
            raise ScheduleError(f"{what}, but the backward of op {k} ({ops[k].name}) under Impl "
                                f"{impls[k].name!r} reads value {x}")
    return impls, keep, offload, overwritten


def simulate(graph: OpGraph, schedule: Schedule) -> Timeline:
    """Replay `schedule` on `graph`; raise ScheduleError naming the stage if it is not valid."""
    impls, keep, offload, overwritten = _validated(graph, schedule)
    ops, values = graph.ops, graph.values
    is_input = [v.producer is None for v in values]
    held_by_caller = set(graph.outputs)

    def transfer(v: int) -> float:
        return values[v].bytes / graph.host_bandwidth

    def freed(j: int) -> int:
        return inplace_freed(graph, j, schedule.impl[j])

    fixed = graph.fixed_bytes
    points: list[Point] = []
    resident = _Resident([v.bytes for v in values])
    internals = 0

    def live_bytes() -> int:
        return resident.total

    # -- forward pass (execution-model section 2) -------------------------------------------
    last_use = [v.producer if v.producer is not None else -1 for v in values]
    for op in ops:
        for v in op.inputs:
            last_use[v] = max(last_use[v], op.id)
    forward_time = 0.0
    for op in ops:
        impl = impls[op.id]
        out_bytes = sum(values[v].bytes for v in op.outputs)
        peak = (fixed + live_bytes() + internals + out_bytes - freed(op.id) + impl.internal_bytes
                + impl.fwd_workspace)
        resident.update(op.outputs)
        internals += impl.internal_bytes if op.has_backward else 0
        for v in (*op.inputs, *op.outputs):
            if (not is_input[v] and last_use[v] == op.id and v not in keep
                    and v not in held_by_caller):
                resident.discard(v)
        forward_time += impl.fwd_time
        points.append(Point("forward", None, op.id, peak, tuple(sorted(resident))))
    # An offloaded Value leaves the device at its last forward use, like any Value not kept;
    # its copy to host costs time (no overlap with compute is credited).
    transfer_time = sum(transfer(v) for v in offload)

    # -- backward stages (execution-model section 3) ----------------------------------------
    recompute_time = backward_time = 0.0
    for t, (op_id, stage) in enumerate(zip(graph.backward_order, schedule.stages)):
        where = f"stage {t} (backward of op {op_id} {ops[op_id].name})"
        if stage.op != op_id:
            raise ScheduleError(f"schedule.stages[{t}].op: expected {op_id}, got {stage.op}")
        grad = graph.stage_grad_bytes[t]
        impl = impls[op_id]
        held_over = sorted(x for x in overwritten if x in resident)
        if held_over:
            x = held_over[0]
            raise ScheduleError(f"{where}: value {x} ({values[x].name}) is held entering this "
                                f"stage, but op {overwritten[x]} runs Impl "
                                f"{impls[overwritten[x]].name!r}, which overwrites it")
        needed = {v for v in impl.saved if not is_input[v]}
        drop = set(stage.drop)
        for v in drop:
            if v in held_by_caller:
                raise ScheduleError(f"{where}: drops value {v} ({values[v].name}), a model output "
                                    f"that the caller holds")
        prev = -1
        for j in stage.recompute:
            if j >= len(ops) or j <= prev:
                raise ScheduleError(f"{where}: recompute list must hold op ids in increasing "
                                    f"(topological) order, got {list(stage.recompute)}")
            prev = j
        # When each dropped Value is freed: the one rule shared with the runtime.
        release = stage_releases(graph, schedule, t)
        # Fetched Values come back from host memory at the stage start.
        for v in stage.fetch:
            if v not in offload:
                raise ScheduleError(f"{where}: fetches value {v}, which was not offloaded")
            if v in resident or any(v in ops[j].outputs for j in stage.recompute):
                raise ScheduleError(f"{where}: fetches value {v} ({values[v].name}), which is "
                                    f"already resident or recomputed in this stage")
            resident.add(v)
            transfer_time += transfer(v)
        for v in drop:
            if v >= len(values):
                raise ScheduleError(f"{where}: drops value {v}, which does not exist (the graph "
                                    f"has {len(values)} values)")
            if v not in resident and not any(v in ops[j].outputs for j in stage.recompute):
                raise ScheduleError(f"{where}: drops value {v} ({values[v].name}) which is not "
                                    f"resident and not recomputed in this stage")
        resident.difference_update(release.at_start)
        for pos, j in enumerate(stage.recompute):
            rop = ops[j]
            if rop.recompute_unsafe:
                raise ScheduleError(f"{where}: recomputes op {j} ({rop.name}), which must never be "
                                    f"recomputed: {rop.recompute_unsafe}")
            missing = [v for v in rop.inputs if not is_input[v] and v not in resident]
            if missing:
                raise ScheduleError(f"{where}: recomputing op {j} ({rop.name}) needs values "
                                    f"{missing} ({', '.join(values[v].name for v in missing)}), "
                                    f"which are not resident")
            rimpl = impls[j]
            new = [v for v in rop.outputs if v not in resident]
            dup = sum(values[v].bytes for v in rop.outputs if v in resident)
            # Transient: duplicates of resident outputs and what the forward needs besides its
            # inputs and outputs under no_grad (Impl.recompute_transient: no internals are
            # saved, since nothing is held for a backward); an in-place Impl writes into its
            # overwritten input instead.
            peak = (fixed + grad + live_bytes() + internals + sum(values[v].bytes for v in new)
                    + dup - freed(j) + rimpl.recompute_transient)
            resident.update(new)
            resident.difference_update(release.after_recompute[pos])
            recompute_time += rimpl.rerun_time
            points.append(Point("recompute", t, j, peak, tuple(sorted(resident))))
        missing = sorted(needed - resident)
        if missing:
            raise ScheduleError(f"{where}: its backward needs values {missing} "
                                f"({', '.join(values[v].name for v in missing)}), which are "
                                f"neither resident nor recomputed")
        # Saved Values autograd frees before the peak are not in the workspace; one the
        # schedule holds past the stage is still there at the peak.
        held_past = sum(values[v].bytes for v in impl.early_release
                        if v in resident and v not in release.at_end)
        peak = fixed + grad + live_bytes() + internals + impl.bwd_workspace + held_past
        points.append(Point("backward", t, op_id, peak, tuple(sorted(resident))))
        backward_time += impl.bwd_time
        resident.difference_update(release.at_end)
        internals -= impl.internal_bytes

    held_over = sorted(x for x in overwritten if x in resident)
    if held_over:
        x = held_over[0]
        raise ScheduleError(f"value {x} ({values[x].name}) is held after the last stage, but op "
                            f"{overwritten[x]} overwrites it in place")
    end = fixed + graph.final_grad_bytes + live_bytes() + internals
    points.append(Point("end", None, None, end, tuple(sorted(resident))))
    return Timeline(points=tuple(points), peak_bytes=max(p.bytes for p in points),
                    total_time=forward_time + recompute_time + backward_time + transfer_time,
                    forward_time=forward_time, recompute_time=recompute_time,
                    backward_time=backward_time, transfer_time=transfer_time)


class _Resident(set):
    """A set of Value ids that keeps the sum of their bytes as it changes (summing the set at
    every point made each replay quadratic in the graph's size)."""

    def __init__(self, nbytes: list[int]):
        super().__init__()
        self.nbytes = nbytes
        self.total = 0

    def add(self, v: int) -> None:
        if v not in self:
            super().add(v)
            self.total += self.nbytes[v]

    def discard(self, v: int) -> None:
        if v in self:
            super().discard(v)
            self.total -= self.nbytes[v]

    def update(self, vs) -> None:
        for v in vs:
            self.add(v)

    def difference_update(self, vs) -> None:
        for v in vs:
            self.discard(v)


def store_all_schedule(graph: OpGraph, impl: tuple[int, ...] | None = None) -> Schedule:
    """Plain PyTorch: keep every Value a backward needs; free it after the last stage needing it.
    An in-place Impl in `impl` whose overwritten Value another chosen Impl saves is replaced by
    Impl 0 (it could not run: analysis.inplace_clashes)."""
    impl = tuple(impl) if impl is not None else (0,) * len(graph.ops)
    clashes = inplace_clashes(graph, impl, ())
    if clashes:
        impl = tuple(0 if j in clashes else i for j, i in enumerate(impl))
    is_input = [v.producer is None for v in graph.values]
    last_stage: dict[int, int] = {}
    for t, op_id in enumerate(graph.backward_order):
        for v in graph.ops[op_id].impls[impl[op_id]].saved:
            if not is_input[v]:
                last_stage[v] = t
    outputs = set(graph.outputs)
    drops: list[list[int]] = [[] for _ in graph.backward_order]
    for v, t in last_stage.items():
        if v not in outputs:
            drops[t].append(v)
    stages = tuple(StageSchedule(op=o, recompute=(), drop=tuple(sorted(drops[t])))
                   for t, o in enumerate(graph.backward_order))
    return Schedule(fingerprint=graph.fingerprint, graph_summary=graph.summary(), impl=impl,
                    forward_keep=tuple(sorted(v for v in last_stage if v not in outputs)),
                    stages=stages, mode="store_all", created_by="baseline:store_all",
                    cost_provenance=graph.cost_provenance)


def with_predictions(graph: OpGraph, schedule: Schedule, **changes) -> Schedule:
    """Return `schedule` with the simulator's peak and time filled in (and other field changes)."""
    tl = simulate(graph, schedule)
    return dataclasses.replace(schedule, predicted_peak_bytes=tl.peak_bytes,
                               predicted_time=tl.total_time, **changes)
