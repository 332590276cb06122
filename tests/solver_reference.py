"""An exact optimum by exhaustive dynamic programming, independent of the MILP (tests only).

It shares no code with solver/formulation.py, solver/analysis.py or solver/canonical.py: the
memory rules are re-implemented here from docs/execution-model.md, and the optimal schedule it
returns is checked with solver.simulate by the tests. Exponential: for graphs of a few ops.

State: the set of Values resident entering backward stage t. For every Impl assignment and every
forward keep set, the step time is the forward time plus the cheapest way through the stages;
a stage's choices are every valid recompute set and every next resident set (which fixes the
drop set), each checked against the budget at every point of the stage.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

from solver.graph import OpGraph
from solver.schedule import Schedule, StageSchedule


def exact_optimum(graph: OpGraph, budget: int, *, mode: str = "full"):
    """(min step time, a schedule achieving it) or None if no schedule fits `budget`."""
    ops, vals = graph.ops, graph.values
    held = set(graph.outputs)
    produced = [v.id for v in vals if v.producer is not None]
    free_vals = [v for v in produced if v not in held]  # residency decided by the schedule
    nbytes = {v.id: v.bytes for v in vals}
    T = len(graph.backward_order)
    best = None
    impl_choices = [range(len(op.impls)) if mode == "full" else [0] for op in ops]
    for impl in itertools.product(*impl_choices):
        im = [ops[j].impls[i] for j, i in enumerate(impl)]
        # In-place Impls: x is destroyed where op j runs; no chosen backward may read it and no
        # schedule may keep it or hold it across a stage boundary.
        destroyed = {i.overwrites for i in im if i.overwrites is not None}
        if any(v in destroyed for k in graph.backward_order for v in im[k].saved):
            continue

        def new_bytes(j):
            return 0 if im[j].overwrites is not None else sum(nbytes[w] for w in ops[j].outputs)
        internals_at = []
        for t in range(T):
            internals_at.append(sum(im[k].internal_bytes for k in graph.backward_order[t:]))

        def forward(keep):
            """Peak of the forward pass and the resident set after it."""
            last = {v: vals[v].producer for v in produced}
            for op in ops:
                for v in op.inputs:
                    if vals[v].producer is not None:
                        last[v] = max(last[v], op.id)
            live, internals, peak = set(), 0, 0
            for op in ops:
                out = new_bytes(op.id)
                peak = max(peak, graph.fixed_bytes + sum(nbytes[v] for v in live) + internals
                           + out + im[op.id].internal_bytes + im[op.id].fwd_workspace)
                live |= set(op.outputs)
                if op.has_backward:
                    internals += im[op.id].internal_bytes
                for v in set(op.inputs) | set(op.outputs):
                    if v in last and last[v] == op.id and v not in keep and v not in held:
                        live.discard(v)
            return peak, frozenset(live)

        def stage(t, resident, rec, nxt):
            """Peak of stage t with recompute list `rec` and resident set `nxt` after it, or None
            if invalid. Follows execution-model section 3 step by step."""
            k = graph.backward_order[t]
            saved = [v for v in im[k].saved if vals[v].producer is not None]
            present = set(resident) | {w for j in rec for w in ops[j].outputs}
            if not nxt <= present or nxt & destroyed:
                return None
            drop = (present - nxt) - held
            base = graph.fixed_bytes + graph.stage_grad_bytes[t] + internals_at[t]
            uses = {}  # dropped value -> last position using it (len(rec) = the backward)
            for pos, j in enumerate(rec):
                for v in ops[j].inputs:
                    if v in drop:
                        uses[v] = pos
            for v in saved:
                if v in drop:
                    uses[v] = len(rec)
            live = set(resident)
            for v in drop:
                if v not in uses:
                    live.discard(v)
            peak = 0
            for pos, j in enumerate(rec):
                if any(vals[v].producer is not None and v not in live for v in ops[j].inputs):
                    return None
                i = im[j]
                peak = max(peak, base + sum(nbytes[v] for v in live)
                           + new_bytes(j) + i.recompute_transient)
                live |= set(ops[j].outputs)
                for v in drop:
                    if uses.get(v, -1) == pos:
                        live.discard(v)
                    # produced here and read by nothing later in the stage: freed at once
                    if v in ops[j].outputs and uses.get(v, -1) < pos:
                        live.discard(v)
            if any(v not in live for v in saved):
                return None
            # a saved Value the backward frees early is still there if the stage keeps it
            early_kept = sum(nbytes[v] for v in im[k].early_release if v in nxt)
            peak = max(peak, base + sum(nbytes[v] for v in live) + im[k].bwd_workspace
                       + early_kept)
            return peak

        safe = [op.id for op in ops if op.recompute_unsafe is None]
        fwd_time = sum(i.fwd_time for i in im)
        bwd_time = sum(im[k].bwd_time for k in graph.backward_order)

        @lru_cache(maxsize=None)
        def rest(t, resident):
            """(min time of stages t.., choices) entering stage t with `resident`."""
            if t == T:
                end = (graph.fixed_bytes + graph.final_grad_bytes
                       + sum(nbytes[v] for v in resident))
                return (0.0, ()) if end <= budget else None
            out = None
            for r in range(len(safe) + 1):
                for rec in itertools.combinations(safe, r):
                    present = set(resident) | {w for j in rec for w in ops[j].outputs}
                    optional = sorted(present - held)
                    always = frozenset(present & held)
                    for m in range(len(optional) + 1):
                        for keep_next in itertools.combinations(optional, m):
                            nxt = frozenset(keep_next) | always
                            peak = stage(t, resident, rec, nxt)
                            if peak is None or peak > budget:
                                continue
                            sub = rest(t + 1, nxt)
                            if sub is None:
                                continue
                            cost = sum(im[j].fwd_time for j in rec) + sub[0]
                            if out is None or cost < out[0] - 1e-12:
                                out = (cost, ((rec, present - nxt),) + sub[1])
            return out

        for m in range(len(free_vals) + 1):
            for keep in itertools.combinations(free_vals, m):
                if destroyed & set(keep):
                    continue
                peak, after = forward(set(keep))
                if peak > budget:
                    continue
                sub = rest(0, after)
                if sub is None:
                    continue
                total = fwd_time + bwd_time + sub[0]
                if best is None or total < best[0] - 1e-12:
                    stages = tuple(StageSchedule(op=k, recompute=tuple(rec),
                                                 drop=tuple(sorted(drop)))
                                   for k, (rec, drop) in zip(graph.backward_order, sub[1]))
                    sched = Schedule(fingerprint=graph.fingerprint,
                                     graph_summary=graph.summary(), impl=tuple(impl),
                                     forward_keep=tuple(sorted(keep)), stages=stages,
                                     budget_bytes=budget, mode=mode, created_by="reference")
                    best = (total, sched)
    return best


def exact_min_peak(graph: OpGraph, *, mode: str = "full", hi: int | None = None) -> int:
    """The least budget with a feasible schedule (bisection over exact_optimum)."""
    lo = graph.fixed_bytes
    hi = hi if hi is not None else graph.fixed_bytes + sum(v.bytes for v in graph.values) * 3 + 10 \
        + max(graph.stage_grad_bytes, default=0) + graph.final_grad_bytes + sum(
            i.internal_bytes + i.fwd_workspace + i.bwd_workspace + i.recompute_transient
            for op in graph.ops
            for i in op.impls)
    assert exact_optimum(graph, hi, mode=mode) is not None
    while lo < hi:
        mid = (lo + hi) // 2
        if exact_optimum(graph, mid, mode=mode) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo
