"""Facts about an OpGraph that the MILP and the baselines both need, computed once.

Everything here follows the simulator's rules (docs/execution-model.md): which Values are
scheduled at all (graph inputs and model outputs are always resident, so never decided), where
each Value's forward life ends, which backward stage may read which Value under which Impl, and
the "horizon" of each Value: the last backward stage at which holding it can still matter, either
because a backward reads it or because it feeds an op whose recomputation can matter then. Past
its horizon a Value is never worth holding, and an op is worth recomputing at stage t only if
t is within the horizon of one of its outputs. These are the safe variable fixings of
docs/formulation.md section 2: they remove no optimal schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .graph import Impl, OpGraph

MODES = ("full", "checkpoint")


def allowed_impls(graph: OpGraph, mode: str) -> tuple[tuple[int, ...], ...]:
    """Per op, the Impl indices the solver may choose: all of them in full mode, Impl 0 in
    checkpoint mode. An Impl dominated by another (saves a superset, and is no better in any cost
    or workspace) is dropped: choosing the other never costs time or memory."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out = []
    for op in graph.ops:
        if mode == "checkpoint" or len(op.impls) == 1:
            out.append((0,))
            continue
        keep = []
        for i, a in enumerate(op.impls):
            dominated = any(dominates(b, a) and (not dominates(a, b) or k < i)
                            for k, b in enumerate(op.impls) if k != i)
            if not dominated:
                keep.append(i)
        out.append(tuple(keep))
    return tuple(out)


def dominates(b: Impl, a: Impl) -> bool:
    """b is at least as good as a in every respect the schedule can see. An in-place Impl and
    an allocating one never dominate each other: the first is leaner at every point where the Op
    runs, the second leaves its input for others to hold or read (so equal `saved` and costs,
    as for ReLU and its in-place variant, do not make one redundant)."""
    return (b.overwrites == a.overwrites and set(b.saved) <= set(a.saved)
            and b.internal_bytes <= a.internal_bytes
            and b.fwd_time <= a.fwd_time and b.bwd_time <= a.bwd_time
            and b.rerun_time <= a.rerun_time
            and b.fwd_workspace <= a.fwd_workspace and b.bwd_workspace <= a.bwd_workspace
            and set(b.early_release) <= set(a.early_release)
            and b.recompute_transient <= a.recompute_transient)


def inplace_freed(graph: OpGraph, j: int, i: int) -> int:
    """Bytes Impl i of op j does not allocate where the Op runs: its output's, when it writes the
    output into the storage of the input it overwrites (docs/execution-model.md section 1)."""
    if graph.ops[j].impls[i].overwrites is None:
        return 0
    return sum(graph.values[w].bytes for w in graph.ops[j].outputs)


def inplace_clashes(graph: OpGraph, impl, held) -> set[int]:
    """The ops whose chosen in-place Impl cannot run under `impl` when the Values in `held` are
    held across some stage boundary (or offloaded): another op's chosen Impl saves the Value it
    overwrites, or the Value is held. Schedules from rules (baselines, LP rounding) revert
    those ops to Impl 0; MILP solutions never have any (docs/formulation.md, `inplace_*`)."""
    saved = set()
    for k in graph.backward_order:
        saved.update(graph.ops[k].impls[impl[k]].saved)
    held = set(held)
    return {j for j, i in enumerate(impl)
            if (x := graph.ops[j].impls[i].overwrites) is not None and (x in saved or x in held)}


@dataclass(frozen=True)
class GraphFacts:
    """Derived, schedule-independent facts for one graph and one mode."""

    graph: OpGraph
    mode: str

    @cached_property
    def impls(self) -> tuple[tuple[int, ...], ...]:
        return allowed_impls(self.graph, self.mode)

    @cached_property
    def held(self) -> frozenset[int]:
        """Model outputs: the caller holds them for the whole step."""
        return frozenset(self.graph.outputs)

    @cached_property
    def scheduled(self) -> tuple[bool, ...]:
        """Per Value: is its residency decided by the schedule (produced by an op, not held)?"""
        return tuple(v.producer is not None and v.id not in self.held for v in self.graph.values)

    @cached_property
    def last_use(self) -> tuple[int, ...]:
        """Per Value: the last op of the forward pass that touches it (its producer if unread);
        the simulator frees it right after that op unless it is kept."""
        last = [v.producer if v.producer is not None else -1 for v in self.graph.values]
        for op in self.graph.ops:
            for v in op.inputs:
                last[v] = max(last[v], op.id)
        return tuple(last)

    @cached_property
    def out_bytes(self) -> tuple[int, ...]:
        vals = self.graph.values
        return tuple(sum(vals[v].bytes for v in op.outputs) for op in self.graph.ops)

    @cached_property
    def need(self) -> tuple[dict[int, tuple[int, ...]], ...]:
        """Per stage t: scheduled Value -> the allowed Impls of the stage's op that save it."""
        out = []
        for op_id in self.graph.backward_order:
            op = self.graph.ops[op_id]
            d: dict[int, list[int]] = {}
            for i in self.impls[op_id]:
                for v in op.impls[i].saved:
                    if self.scheduled[v]:
                        d.setdefault(v, []).append(i)
            out.append({v: tuple(i) for v, i in d.items()})
        return tuple(out)

    @cached_property
    def horizon(self) -> tuple[int, ...]:
        """Per Value: the last stage at which holding it can matter (-1: never after the forward
        pass). Computed from the back of the graph: a Value matters until the last stage that may
        read it, or until the horizon of any safe op that reads it."""
        g = self.graph
        hz = [-1] * len(g.values)
        for t, d in enumerate(self.need):
            for v in d:
                hz[v] = max(hz[v], t)
        op_hz = [-1] * len(g.ops)
        for op in reversed(g.ops):
            if op.recompute_unsafe is None:
                op_hz[op.id] = max((hz[w] for w in op.outputs if self.scheduled[w]), default=-1)
            for v in op.inputs:
                if self.scheduled[v]:
                    hz[v] = max(hz[v], op_hz[op.id])
        for v in range(len(g.values)):
            if not self.scheduled[v]:
                hz[v] = -1
        return tuple(hz)

    @cached_property
    def op_horizon(self) -> tuple[int, ...]:
        """Per op: the last stage at which recomputing it can matter (-1: never; unsafe ops)."""
        g = self.graph
        return tuple(
            -1 if op.recompute_unsafe is not None else
            max((self.horizon[w] for w in op.outputs if self.scheduled[w]), default=-1)
            for op in g.ops)

    @cached_property
    def candidates(self) -> tuple[tuple[int, ...], ...]:
        """Per stage t: the ops that may be recomputed just before it, in topological order."""
        T = len(self.graph.backward_order)
        cands: list[list[int]] = [[] for _ in range(T)]
        for j, h in enumerate(self.op_horizon):
            for t in range(h + 1):
                cands[t].append(j)
        return tuple(tuple(c) for c in cands)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        return self.graph.users

    @cached_property
    def fastest_impls(self) -> tuple[int, ...]:
        """Each op's allowed Impl with the least forward + backward time (the lowest index on
        a tie)."""
        ops = self.graph.ops
        return tuple(min(self.impls[j], key=lambda i: (ops[j].impls[i].fwd_time
                                                      + ops[j].impls[i].bwd_time, i))
                     for j in range(len(ops)))

    @cached_property
    def time_floor(self) -> float:
        """A lower bound on any schedule's step time: every op forward and backward once on its
        fastest allowed Impl, nothing recomputed or transferred (the simulator's total is that
        plus recomputation and transfers, both never negative)."""
        ops = self.graph.ops
        return sum(ops[j].impls[i].fwd_time + ops[j].impls[i].bwd_time
                   for j, i in enumerate(self.fastest_impls))

    @cached_property
    def overwrites(self) -> dict[tuple[int, int], int]:
        """(op j, allowed Impl i) -> the Value that in-place Impl overwrites."""
        return {(j, i): self.graph.ops[j].impls[i].overwrites
                for j in range(len(self.graph.ops)) for i in self.impls[j]
                if self.graph.ops[j].impls[i].overwrites is not None}
