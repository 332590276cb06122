"""Recompute-support cuts: valid inequalities that tighten the MILP's LP relaxation.

Why they are needed. `retention` lets a Value's residency grow only through recomputation of its
producer: S[t+1,v] <= S[t,v] + R[t,p]. In 0/1 terms that is exact, but the LP can recompute p a
little at every stage (R = 0.01 each), so v's residency ramps from 0 up to 1 across many stages
while each of those recomputations needs its inputs only 1% resident (`recompute_inputs`). The
ramp buys a Value that is resident where a backward needs it, for a fraction of one
recomputation and almost none of its inputs' memory; no schedule does that. Measured on the
profiled GoogLeNet (batch 320, analytical A100 costs) at 9 GiB: the LP relaxation is +9.78% over
store-all, +11.77% with these cuts, and the best schedule known +12.79%; the ramps run through
the concatenations whose inputs are BatchNorm+ReLU outputs with the relu_mask Impl (their own
backward reads no output, so nothing else pins those Values).

The cut. For a recomputable op p with scheduled output v, a path u_1, ..., u_k of scheduled
Values (u_1 an input of p, u_{i+1} an input of u_i's producer, each producer recomputable except
perhaps the last one's), q the producer of u_k, and stages t1 < t2:

    S[t2,v] <= S[t1,v] + sum_i S[t1,u_i] + sum_{t1 <= t < t2} (R[t,q] + Fe[t,v] + sum_i Fe[t,u_i])

(Fe terms only with offload; columns that do not exist are 0.) Valid for every 0/1 solution:
if v is resident at t2 but not at t1, `retention` gives a stage t in [t1,t2) where p is
recomputed or v fetched; `recompute_inputs` then needs u_1 at t, resident (so, by `retention`,
resident at t1 or made at a stage in [t1,t)) or recomputed at t (which needs u_2 there, and so
on down the path), or fetched. Every case puts a 1 on the right-hand side. The cuts remove no
schedule, so bounds stay valid and optima unchanged.

There are O(paths x T^2) of them, so they are separated from an LP solution (`separate`) and the
violated ones added as rows (the `recompute_support` block of docs/formulation.md), a few rounds
at the root before branch and bound (search/branch_and_bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_DEPTH = 3
"""Longest path u_1..u_k enumerated. Measured (LP bound over store-all, rounds to no violation):
UNet (batch 11) at 5 GiB 21.08% without cuts, 22.75% at depth 1, 23.35% at 2, 23.60% at 3,
23.61% at 5; GoogLeNet at 5 and 9 GiB gains nothing past depth 1."""

MIN_VIOLATION = 0.01
"""A cut is added when the LP solution breaks it by more than this (in residency units)."""


@dataclass(frozen=True, order=True)
class SupportCut:
    """S[last,value] <= S[first,value] + sum S[first,u] + recomputations of the path's root
    producer (and fetches) in stages first..last-1. See the module docstring."""

    value: int
    path: tuple[int, ...]
    first: int
    last: int


def support_paths(form, depth: int = MAX_DEPTH) -> list[tuple[int, tuple[int, ...]]]:
    """(v, path) for every recomputable op's scheduled output v and every path of scheduled
    Values up its inputs, of length 1..depth, that a cut can use."""
    g = form.graph
    sched = form.facts.scheduled
    out = []

    def walk(v: int, path: list[int]) -> None:
        out.append((v, tuple(path)))
        q = g.values[path[-1]].producer
        if len(path) < depth and q is not None and (0, q) in form.R:
            for w in g.ops[q].inputs:
                if sched[w] and (0, w) in form.S and w not in path and w != v:
                    walk(v, path + [w])

    for op in g.ops:
        if (0, op.id) not in form.R:
            continue
        for v in op.outputs:
            if (1, v) not in form.S:  # never resident past the forward: nothing to ramp
                continue
            for u in dict.fromkeys(op.inputs):
                if sched[u] and (0, u) in form.S:
                    walk(v, [u])
    return out


def support_terms(form, cut: SupportCut) -> list[tuple[int, float]]:
    """The row `lhs <= 0` of a cut, as (column, coefficient) of `form`."""
    g = form.graph
    v, t1, t2 = cut.value, cut.first, cut.last
    q = g.values[cut.path[-1]].producer
    terms = [(form.S[t2, v], 1.0)]
    fetchable = (v,) + cut.path
    for w in fetchable:
        col = form.S.get((t1, w))
        if col is not None:
            terms.append((col, -1.0))
    for t in range(t1, t2):
        col = form.R.get((t, q))
        if col is not None:
            terms.append((col, -1.0))
        for w in fetchable:
            col = form.Fe.get((t, w))
            if col is not None:
                terms.append((col, -1.0))
    return terms


def all_support_cuts(form, depth: int = MAX_DEPTH) -> list[SupportCut]:
    """Every cut (for tests on small graphs: O(paths x T^2) of them)."""
    return [SupportCut(v, path, t1, t2) for v, path in support_paths(form, depth)
            for t2 in range(1, form.T + 1) if (t2, v) in form.S for t1 in range(t2)]


def separate(form, x: np.ndarray, paths=None, *, min_violation: float = MIN_VIOLATION,
             limit: int = 5000) -> list[SupportCut]:
    """The cuts that `x` (a solution of `form`) breaks by more than `min_violation`: for each
    path and each stage t2, the most violated t1. The `limit` most violated, most violated
    first."""
    if paths is None:
        paths = support_paths(form)
    g, n = form.graph, form.T + 1
    series: dict = {}

    def over_stages(cols: dict, key: int) -> np.ndarray:
        """x of columns cols[(t, key)] for t = 0..T (0 where the column does not exist)."""
        if (id(cols), key) not in series:
            s = np.zeros(n)
            for t in range(n):
                col = cols.get((t, key))
                if col is not None:
                    s[t] = x[col]
            series[id(cols), key] = s
        return series[id(cols), key]

    found = []
    for v, path in paths:
        sv = over_stages(form.S, v)
        held = sv + sum(over_stages(form.S, u) for u in path)
        # path Values are scheduled, so produced: q exists (it may have no R column)
        made = over_stages(form.R, g.values[path[-1]].producer)
        if form.Fe:
            made = made + sum(over_stages(form.Fe, w) for w in (v,) + path)
        before = np.concatenate([[0.0], np.cumsum(made)])  # before[t] = sum_{t' < t} made[t']
        # rhs(t1, t2) = slack[t1] + before[t2]; the best t1 < t2 is the prefix argmin of slack
        slack = held - before[:n]
        arg = np.zeros(n, dtype=int)
        for t in range(1, n):
            arg[t] = t if slack[t] < slack[arg[t - 1]] else arg[t - 1]
        for t2 in range(1, n):
            if (t2, v) not in form.S:
                break
            t1 = int(arg[t2 - 1])
            violation = sv[t2] - (slack[t1] + before[t2])
            if violation > min_violation:
                found.append((violation, SupportCut(v, path, t1, t2)))
    found.sort(key=lambda c: -c[0])
    return [c for _, c in found[:limit]]
