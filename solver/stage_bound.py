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

That greedy bound needs no LP solver and takes milliseconds. It ignores where a recomputation
takes its inputs from, so `stage_extra_costs` strengthens it, stage by stage as time allows, with
the closure LP (`_closure_cost`): an op run again after t needs its inputs then, so each input
that no later stage saves must be resident at t (its bytes count there), run again itself (its
own inputs in turn), or, with offload, fetched back. On a transformer, freeing a GELU's output by
running it again keeps the MLP's first output, as big, unless that one runs again too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import scipy.sparse

from .analysis import GraphFacts

# The closure LP's optimum comes from a floating-point solver (tolerances near 1e-7): it is
# lowered by this fraction, so that rounding cannot lift a bound above a schedule's time.
LP_SLACK = 1e-6


@dataclass(frozen=True)
class Stage:
    """What every schedule holds at the peak of one backward stage, and how it buys bytes back."""

    need: int
    """Bytes held before buying any back."""
    held: frozenset
    """The scheduled Values counted in `need`: saved at this stage or at a later one."""
    rerun: dict
    """Op -> (its cheapest rerun in seconds, the bytes of its outputs in `held` that only a
    later stage saves: not resident at this stage if the op runs again after it)."""
    offload: dict
    """Value -> (seconds of one copy to host, bytes), for those same Values, with offload."""
    other: list
    """(seconds, bytes): Impls with smaller internals or workspace, as hull increments."""

    @property
    def items(self) -> list:
        """Every way of buying bytes back, as independent (seconds, bytes) items."""
        return [*self.offload.values(), *self.rerun.values(), *self.other]


def stages(facts: GraphFacts, offload: bool = False):
    """Each backward stage's `Stage`, in backward order."""
    g = facts.graph
    ops, values = g.ops, g.values
    fastest = facts.fastest_impls
    allowed = facts.impls
    T = len(g.backward_order)

    def op_time(j: int, i: int) -> float:
        return ops[j].impls[i].fwd_time + ops[j].impls[i].bwd_time

    forced_at, forced_later = _forced(facts)
    held_bytes = sum(values[v].bytes for v in facts.held if values[v].producer is not None)
    rerun = rerun_times(facts)

    internal_items = {}
    base_internal = {}
    for op_id in g.backward_order:
        f = fastest[op_id]
        base = ops[op_id].impls[f].internal_bytes
        base_internal[op_id] = base
        internal_items[op_id] = _hull([
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
        # Values a later stage needs that this one does not: made again after t.
        droppable: dict[int, int] = {}
        host: dict[int, tuple[float, int]] = {}
        for v in forced_later[t] - forced_at[t]:
            p = values[v].producer
            if offload and g.host_bandwidth:
                host[v] = (values[v].bytes / g.host_bandwidth, values[v].bytes)
            if rerun[p] is not None:
                droppable[p] = droppable.get(p, 0) + values[v].bytes
        other: list[tuple[float, int]] = []
        # Impls with smaller internals, for ops whose backward is still to come...
        for s in range(t + 1, T):
            other.extend(internal_items[g.backward_order[s]])
        # ...and for the stage's own op, internals and workspace together.
        other.extend(_hull([(op_time(op_id, i) - op_time(op_id, f),
                             own.internal_bytes + own.bwd_workspace
                             - ops[op_id].impls[i].internal_bytes
                             - ops[op_id].impls[i].bwd_workspace) for i in allowed[op_id]]))
        yield Stage(need, frozenset(held_values), {p: (rerun[p], b) for p, b in droppable.items()},
                    host, other)


def _forced(facts: GraphFacts) -> tuple[list[set], list[set]]:
    """Per stage: the scheduled Values its op saves under every allowed Impl, and the union of
    those of the stages after it."""
    g, ops = facts.graph, facts.graph.ops
    forced_at = []
    for op_id in g.backward_order:
        sets = [set(ops[op_id].impls[i].saved) for i in facts.impls[op_id]]
        forced_at.append({v for v in set.intersection(*sets) if facts.scheduled[v]})
    forced_later: list[set[int]] = [set() for _ in forced_at]
    acc: set[int] = set()
    for t in range(len(forced_at) - 1, -1, -1):
        forced_later[t] = set(acc)
        acc |= forced_at[t]
    return forced_at, forced_later


def rerun_times(facts: GraphFacts) -> list:
    """Per op: its cheapest rerun over its allowed Impls (seconds); None for unsafe ops."""
    return [None if op.recompute_unsafe is not None else
            min(op.impls[i].rerun_time for i in facts.impls[op.id]) for op in facts.graph.ops]


def _hull(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
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


def stage_items(facts: GraphFacts, offload: bool = False):
    """Per backward stage, in order: (need, items), `need` the bytes every schedule holds at the
    stage's peak before buying any back, `items` the (seconds, bytes) it can buy them back with
    (each op's Impls as increments along their hull)."""
    for st in stages(facts, offload):
        yield st.need, st.items


def stage_extra_costs(facts: GraphFacts, budget: int, offload: bool = False,
                      deadline: float | None = None, closure: bool = True,
                      enough: float = math.inf) -> list[float]:
    """Per backward stage: a lower bound on the seconds any schedule within `budget` spends
    above the time floor (GraphFacts.time_floor) for that stage's peak to fit; 0.0 where the
    least memory already fits, and math.inf where nothing can make it fit (the budget is
    infeasible).

    Each stage gets the greedy bound, then with `closure`, dearest stage first until `deadline`
    (time.perf_counter(); None: no limit), the closure LP's where it is higher; it stops once
    some stage's cost reaches `enough` (seconds: the bound the caller needs)."""
    all_stages = list(stages(facts, offload))
    costs = [0.0 if st.need <= budget else cheapest_cover(st.items, st.need - budget)
             for st in all_stages]
    rerun = rerun_times(facts)
    order = sorted((t for t, c in enumerate(costs) if 0.0 < c < math.inf),
                   key=lambda t: -costs[t])
    best = max(costs, default=0.0)
    for t in order if closure else ():
        if best >= enough or deadline is not None and time.perf_counter() >= deadline:
            break
        costs[t] = max(costs[t], _closure_cost(facts, all_stages[t], budget, rerun))
        best = max(best, costs[t])
    return costs


def _closure_cost(facts: GraphFacts, st: Stage, budget: int, rerun: list) -> float:
    """The least cost of bringing stage `st` within `budget`, as an LP over:
    r_p in [0, 1] per op p run again after the stage (cost: its cheapest rerun; frees its
    outputs that only a later stage needs), h_u in [0, 1] per Value u that such an op reads and
    no stage from here on saves (u resident at the stage: its bytes count), o_u with offload (u
    copied to host and fetched back for the rerun), and the stage's other items as fractions.
    Rows: h_u + r_q(u) + o_u >= r_p for each such input u of p (q(u) its producer, when it may
    run again), and the bytes freed at least need - budget. The greedy bound is this LP without
    the first rows, so this is never below it (up to LP_SLACK)."""
    g, values = facts.graph, facts.graph.values
    host = facts.graph.host_bandwidth if st.offload else 0
    ops = list(st.rerun)
    index = {p: k for k, p in enumerate(ops)}
    frontier: dict[int, int] = {}
    edges: list[tuple[int, int | None, int]] = []  # (op column, producer column, frontier Value)
    k = 0
    while k < len(ops):  # the ops whose outputs are freed, then the inputs their reruns need
        p = ops[k]
        k += 1
        for u in g.ops[p].inputs:
            if not facts.scheduled[u] or u in st.held:
                continue  # always resident, or counted in `need` unless its producer reruns
            frontier.setdefault(u, len(frontier))
            q = values[u].producer
            if rerun[q] is not None and q not in index:
                index[q] = len(ops)
                ops.append(q)
            edges.append((index[p], index.get(q) if rerun[q] is not None else None, u))
    if not edges:
        return 0.0  # no rerun needs anything the greedy bound did not count
    nr, nh = len(ops), len(frontier)
    no = nh if host else 0
    items = [*st.offload.values(), *st.other]
    n = nr + nh + no + len(items)
    cost = np.zeros(n)
    cost[:nr] = [rerun[p] for p in ops]
    if host:
        cost[nr + nh:nr + nh + no] = [values[u].bytes / host for u in frontier]
    cost[nr + nh + no:] = [max(c, 0.0) for c, _ in items]
    # Row 0, bytes freed >= excess, as -freed <= -excess.
    freed = np.zeros(n)
    freed[:nr] = [st.rerun[p][1] if p in st.rerun else 0 for p in ops]
    freed[nr:nr + nh] = [-values[u].bytes for u in frontier]
    freed[nr + nh + no:] = [b for _, b in items]
    rows, cols, vals = [0] * n, list(range(n)), list(-freed)
    for e, (pc, qc, u) in enumerate(edges, start=1):  # r_p - h_u - r_q - o_u <= 0
        rows += [e, e]
        cols += [pc, nr + frontier[u]]
        vals += [1.0, -1.0]
        if qc is not None:
            rows.append(e)
            cols.append(qc)
            vals.append(-1.0)
        if host:
            rows.append(e)
            cols.append(nr + nh + frontier[u])
            vals.append(-1.0)
    a = scipy.sparse.csr_matrix((vals, (rows, cols)), shape=(len(edges) + 1, n))
    b = np.zeros(len(edges) + 1)
    b[0] = -(st.need - budget)
    res = scipy.optimize.linprog(cost, A_ub=a, b_ub=b, bounds=(0, 1), method="highs")
    if res.status == 2:
        return math.inf  # nothing frees enough
    if res.status != 0:
        return 0.0  # the solver gave up: no claim
    return res.fun * (1 - LP_SLACK)


def stage_least_peak(facts: GraphFacts, offload: bool = False) -> int:
    """A lower bound on the peak of any schedule (bytes): the most any stage still holds after
    buying back every byte it can, whatever the time."""
    return max((need - sum(b for _, b in items) for need, items in stage_items(facts, offload)),
               default=0)


def cheapest_cover(items: list[tuple[float, int]], excess: int) -> float:
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


def stage_bound(facts: GraphFacts, budget: int, offload: bool = False,
                deadline: float | None = None, closure: bool = True,
                enough: float = math.inf) -> float:
    """A lower bound on the step time of any schedule within `budget` (seconds): the time floor
    plus the largest of `stage_extra_costs`; math.inf when some stage cannot fit at all. The
    closure LP stops once the bound reaches `enough` (seconds; on Llama-70B's 3,212 stages
    it takes 0.1 s each, and the first one proves the chain's plan)."""
    extra = stage_extra_costs(facts, budget, offload, deadline, closure,
                              enough - facts.time_floor)
    return facts.time_floor + max(extra, default=0.0)
