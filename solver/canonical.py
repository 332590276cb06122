"""Residency of a schedule per stage, and its canonical form.

The MILP describes a schedule by which Values are resident entering each backward stage and which
ops are recomputed in it. `residency` replays a Schedule into those sets (no memory accounting:
that is the simulator's job). `canonicalize` removes what can only cost: recomputations whose
outputs nothing reads or keeps, duplicates of a resident output, fetches from host memory that
nothing reads or that duplicate a resident Value, offloads never fetched, and residency that nothing
in the stage uses and that is not carried further (it is freed at the stage start anyway; dropping it
earlier is never worse). By the simulator's rules the result has a peak and a time no higher than
the original. A schedule built by a rule (a baseline, LP rounding) may choose an in-place Impl
whose overwritten Value it still holds or another chosen Impl reads; such a schedule is invalid,
and the op gets Impl 0 instead (`analysis.inplace_clashes`). Every schedule the MILP can describe
is canonical, so a baseline's schedule becomes a MILP warm start through this function.
"""

from __future__ import annotations

import dataclasses

from .analysis import GraphFacts, inplace_clashes
from .graph import OpGraph
from .schedule import Schedule, StageSchedule


@dataclasses.dataclass
class Residency:
    """Sets per stage: `resident[t]` entering stage t (t = 0..T, T is after the last stage),
    `recompute[t]` the ops recomputed in stage t. Only scheduled Values (see GraphFacts)."""

    impl: tuple[int, ...]
    resident: list[set[int]]
    recompute: list[set[int]]
    fetch: list[set[int]] = dataclasses.field(default_factory=list)
    """Per stage, the offloaded Values copied back at its start."""


def residency(graph: OpGraph, schedule: Schedule, facts: GraphFacts) -> Residency:
    sched = facts.scheduled
    ops = graph.ops
    res = [set(v for v in schedule.forward_keep if sched[v])]
    rec, fetch = [], []
    for st in schedule.stages:
        r = set(st.recompute)
        present = res[-1] | set(st.fetch) | {w for j in r for w in ops[j].outputs if sched[w]}
        res.append(present - set(st.drop))
        rec.append(r)
        fetch.append(set(st.fetch))
    return Residency(tuple(schedule.impl), res, rec, fetch)


def canonicalize(graph: OpGraph, schedule: Schedule, facts: GraphFacts) -> Schedule:
    """The same schedule without work or residency that can only cost (see the module doc)."""
    ops, sched = graph.ops, facts.scheduled
    r = residency(graph, schedule, facts)
    held = set(schedule.offload).union(*r.resident[:len(graph.backward_order)])
    clashes = inplace_clashes(graph, r.impl, held)
    if clashes:
        r.impl = tuple(0 if j in clashes else i for j, i in enumerate(r.impl))
    T = len(graph.backward_order)
    r.resident[T] = set()  # nothing scheduled is needed after the last stage
    changed = True
    while changed:
        changed = False
        for t in range(T - 1, -1, -1):
            k = graph.backward_order[t]
            needed = {v for v in ops[k].impls[r.impl[k]].saved if sched[v]}
            after = r.resident[t + 1]
            # Recomputations, latest first, so that dropping one can make an earlier one useless;
            # `read_later`: the inputs of the later ones still kept (grown as they are, not
            # rebuilt per op: quadratic in a stage's recomputations, seconds at 3,000 ops).
            read_later: set[int] = set()
            for j in sorted(r.recompute[t], reverse=True):
                outs = [w for w in ops[j].outputs if sched[w]]
                useful = any(w in after or w in needed or w in read_later for w in outs)
                duplicate = len(ops[j].outputs) == 1 and outs and outs[0] in r.resident[t]
                if not useful or duplicate:
                    r.recompute[t].discard(j)
                    changed = True
                else:
                    read_later.update(ops[j].inputs)
            read = needed | read_later
            idle = r.resident[t] - after - read
            if idle:
                r.resident[t] -= idle
                changed = True
            # A fetch nothing reads or carries, or of a Value already there, only costs.
            made = {w for j in r.recompute[t] for w in ops[j].outputs}
            for v in list(r.fetch[t]):
                if (v not in after and v not in read) or v in r.resident[t] or v in made:
                    r.fetch[t].discard(v)
                    changed = True
    stages = []
    for t, k in enumerate(graph.backward_order):
        present = (r.resident[t] | r.fetch[t]
                   | {w for j in r.recompute[t] for w in ops[j].outputs if sched[w]})
        stages.append(StageSchedule(op=k, recompute=tuple(sorted(r.recompute[t])),
                                    drop=tuple(sorted(present - r.resident[t + 1])),
                                    fetch=tuple(sorted(r.fetch[t]))))
    fetched = set().union(*r.fetch) if r.fetch else set()
    return dataclasses.replace(schedule, impl=tuple(r.impl),
                               forward_keep=tuple(sorted(r.resident[0])),
                               stages=tuple(stages), predicted_peak_bytes=None,
                               predicted_time=None,
                               offload=tuple(sorted(v for v in schedule.offload if v in fetched)))
