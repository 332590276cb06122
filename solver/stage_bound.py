"""A lower bound on the step time from each backward stage's memory alone (docs/formulation.md,
"The stage bound").

At the peak of backward stage t (the simulator's "backward" point), any schedule holds at least:
the fixed memory, the stage's gradients, the model outputs, every Value that op(t) saves under
each of its allowed Impls, the internals of every op whose backward has not run yet, op(t)'s
backward workspace, and every Value that some later stage saves under each of its allowed Impls
(a Value needed later and not resident now must be made again after t: recomputed, or fetched
back from host memory). So a schedule within the budget pays, at every stage, for enough of:
- recomputing, after t, an op whose outputs a later stage needs (at least its cheapest rerun),
- offloading such a Value (at least one copy to host),
- running an op on another Impl with smaller internals or workspace (its extra time),
to bring that least memory down to the budget. Each schedule pays for these things separately
and at least once, so the cheapest fractional way to free the bytes (a multiple-choice knapsack's
LP, solved greedily on each op's convex hull) is a lower bound on what it spends above the time
floor at that stage; the bound is the floor plus the largest over the stages.

It needs no LP solver and runs in milliseconds per stage, so it gives big graphs an honest bound
where the MILP's LP relaxation cannot be solved in time. It ignores everything the MILP knows
about where recomputations take their inputs from, so on graphs the LP can solve the LP is
stronger.
"""

from __future__ import annotations

import math

from .analysis import GraphFacts


def stage_items(facts: GraphFacts, offload: bool = False):
    """Per backward stage, in order: (need, items), `need` the bytes every schedule holds at the
    stage's peak before buying any back, `items` the (seconds, bytes) it can buy them back with
    (each op's Impls as increments along their hull)."""
    g = facts.graph
    ops, values = g.ops, g.values
    fastest = facts.fastest_impls
    allowed = facts.impls
    scheduled = facts.scheduled
    T = len(g.backward_order)

    def op_time(j: int, i: int) -> float:
        return ops[j].impls[i].fwd_time + ops[j].impls[i].bwd_time

    # Values every allowed Impl of a stage's op saves: held at that stage whatever the schedule.
    forced_at = []
    for t, op_id in enumerate(g.backward_order):
        sets = [set(ops[op_id].impls[i].saved) for i in allowed[op_id]]
        forced_at.append({v for v in set.intersection(*sets) if scheduled[v]})
    # forced_later[t]: Values forced at some stage after t (suffix union).
    forced_later: list[set[int]] = [set() for _ in range(T)]
    acc: set[int] = set()
    for t in range(T - 1, -1, -1):
        forced_later[t] = set(acc)
        acc |= forced_at[t]
    held_bytes = sum(values[v].bytes for v in facts.held if values[v].producer is not None)
    rerun = [None if op.recompute_unsafe is not None else
             min(op.impls[i].rerun_time for i in allowed[op.id]) for op in ops]

    # Per op with a backward: the hull of (extra time, bytes saved) over its allowed Impls,
    # internals only (the stage's own op adds its workspace below).
    def hull(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
        """Increments (extra seconds, bytes) along the upper convex hull of (cost, saving) points
        starting at (0, 0), in order of falling bytes per second."""
        pts = sorted({(max(c, 0.0), s) for c, s in points if s > 0})
        chain = [(0.0, 0)]
        for c, s in pts:
            if s <= chain[-1][1]:
                continue  # dearer or as dear as the last point, and saves no more
            if len(chain) >= 2 and c <= chain[-1][0]:
                chain.pop()  # as dear as the last point and saves more
            while len(chain) >= 2:
                (c1, s1), (c2, s2) = chain[-2], chain[-1]
                # chain[-1] on or below the segment chain[-2] -> (c, s): not on the hull
                if (s2 - s1) * (c - c1) <= (s - s1) * (c2 - c1):
                    chain.pop()
                else:
                    break
            chain.append((c, s))
        return [(c2 - c1, s2 - s1) for (c1, s1), (c2, s2) in zip(chain, chain[1:])]

    internal_items = {}
    base_internal = {}
    for op_id in g.backward_order:
        f = fastest[op_id]
        base = ops[op_id].impls[f].internal_bytes
        base_internal[op_id] = base
        internal_items[op_id] = hull([
            (op_time(op_id, i) - op_time(op_id, f), base - ops[op_id].impls[i].internal_bytes)
            for i in allowed[op_id]])

    # internals[t]: the fastest Impls' internals of ops whose stage is t or later.
    internals = [0] * (T + 1)
    for t in range(T - 1, -1, -1):
        internals[t] = internals[t + 1] + base_internal[g.backward_order[t]]

    for t, op_id in enumerate(g.backward_order):
        f = fastest[op_id]
        own = ops[op_id].impls[f]
        held_values = forced_at[t] | forced_later[t]
        need = (g.fixed_bytes + g.stage_grad_bytes[t] + held_bytes
                + sum(values[v].bytes for v in held_values) + internals[t] + own.bwd_workspace)
        items: list[tuple[float, int]] = []
        # Values a later stage needs that this one does not: made again after t.
        droppable: dict[int, int] = {}
        for v in forced_later[t] - forced_at[t]:
            p = values[v].producer
            if offload and g.host_bandwidth:
                items.append((values[v].bytes / g.host_bandwidth, values[v].bytes))
            if rerun[p] is not None:
                droppable[p] = droppable.get(p, 0) + values[v].bytes
        items.extend((rerun[p], b) for p, b in droppable.items())
        # Impls with smaller internals, for ops whose backward is still to come...
        for s in range(t + 1, T):
            items.extend(internal_items[g.backward_order[s]])
        # ...and for the stage's own op, internals and workspace together.
        items.extend(hull([(op_time(op_id, i) - op_time(op_id, f),
                            own.internal_bytes + own.bwd_workspace
                            - ops[op_id].impls[i].internal_bytes
                            - ops[op_id].impls[i].bwd_workspace) for i in allowed[op_id]]))
        yield need, items


def stage_extra_costs(facts: GraphFacts, budget: int, offload: bool = False) -> list[float]:
    """Per backward stage: a lower bound on the seconds any schedule within `budget` spends
    above the time floor (GraphFacts.time_floor) for that stage's peak to fit; 0.0 where the
    least memory already fits, and math.inf where nothing can make it fit (the budget is
    infeasible)."""
    return [0.0 if need <= budget else _cheapest_cover(items, need - budget)
            for need, items in stage_items(facts, offload)]


def stage_least_peak(facts: GraphFacts, offload: bool = False) -> int:
    """A lower bound on the peak of any schedule (bytes): the most any stage still holds after
    buying back every byte it can, whatever the time."""
    return max((need - sum(b for _, b in items) for need, items in stage_items(facts, offload)),
               default=0)


def _cheapest_cover(items: list[tuple[float, int]], excess: int) -> float:
    """The least total cost of fractions of `items` (cost, bytes) freeing `excess` bytes, taken
    in order of bytes per second (each group's hull increments come in that order already, so
    the greedy respects them); math.inf when all of them free less."""
    items = sorted(items, key=lambda it: -math.inf if it[0] <= 0 else -it[1] / it[0])
    cost = 0.0
    for c, b in items:
        if b >= excess:
            return cost + max(c, 0.0) * excess / b
        cost += max(c, 0.0)
        excess -= b
    return math.inf


def stage_bound(facts: GraphFacts, budget: int, offload: bool = False) -> float:
    """A lower bound on the step time of any schedule within `budget` (seconds): the time floor
    plus the largest of `stage_extra_costs`; math.inf when some stage cannot fit at all."""
    extra = stage_extra_costs(facts, budget, offload)
    return facts.time_floor + max(extra, default=0.0)
