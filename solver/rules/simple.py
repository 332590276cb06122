"""Simple rules that build schedules: a kept set plus a recomputation policy, and the rules
that choose the kept set (Chen's segments, greedy dropping, ranking by recompute cost per byte).

Every schedule is built by `schedule_from_keep`, cleaned by `canonical.canonicalize` and judged
by the simulator; nothing here predicts memory. baselines.py wraps some of them as SolveResults;
warmstart.py offers them all to the MILP as first incumbents.
"""

from __future__ import annotations

import math
import time

from ..analysis import GraphFacts
from ..canonical import canonicalize
from ..graph import OpGraph
from ..schedule import Schedule, StageSchedule
from ..simulate import simulate, store_all_schedule


SAC_SAVE_KINDS = frozenset({"Conv2d", "Linear", "matmul", "bmm", "mm", "addmm", "conv2d",
                            "linear", "scaled_dot_product_attention"})
"""Op kinds whose outputs selective activation checkpointing saves inside a checkpointed block
(the policy PyTorch users write: keep convolutions, matmuls and attention, dear to recompute;
recompute norms, activations and adds, cheap per byte)."""


def kind_in(kind: str, kinds) -> bool:
    """Whether an Op's kind is one of `kinds`, an ATen overload named by its op
    ('linear.default' is 'linear'), as torch.export's graphs name them."""
    return kind in kinds or kind.partition(".")[0] in kinds


def recompute_closure(graph: OpGraph, scheduled, present, targets) -> set[int]:
    """The ops to recompute so that every scheduled Value of `targets` exists: the producer of
    each one missing from `present`, and back through its inputs until Values that are present
    (iteratively: chains of thousands of ops would pass Python's recursion limit)."""
    ops, values = graph.ops, graph.values
    todo: set[int] = set()
    stack = [v for v in targets]
    while stack:
        v = stack.pop()
        if not scheduled[v] or v in present:
            continue
        p = values[v].producer
        if p in todo:
            continue
        todo.add(p)
        stack.extend(ops[p].inputs)
    return todo


def schedule_from_keep(graph: OpGraph, keep, *, impl=None, retain: str = "saved",
                       facts: GraphFacts | None = None, mode: str = "store_all",
                       created_by: str = "") -> Schedule:
    """The schedule that keeps `keep` from the forward pass and recomputes the rest on demand.

    At each backward stage, a Value the stage's backward reads that is not resident is rebuilt by
    recomputing the fewest ops back to resident Values. What a stage recomputed is then held for
    later stages according to `retain`: 'all' (every recomputed Value, Chen's segment policy),
    'saved' (only Values some later backward reads) or 'none' (recompute again when needed).
    Kept Values are held until their last use. Outputs of ops that must never be recomputed are
    always kept when anything later may read them. The result is canonical.
    """
    facts = facts or GraphFacts(graph, "full")
    impl = tuple(impl) if impl is not None else (0,) * len(graph.ops)
    ops, sched = graph.ops, facts.scheduled
    T = len(graph.backward_order)
    keep = {v for v in keep if sched[v]}
    for op in ops:
        if op.recompute_unsafe is not None:
            keep |= {w for w in op.outputs if sched[w] and facts.horizon[w] >= 0}
    needs = [{v for v in ops[k].impls[impl[k]].saved if sched[v]} for k in graph.backward_order]
    later_need = [set() for _ in range(T + 1)]
    for t in range(T - 1, -1, -1):
        later_need[t] = later_need[t + 1] | needs[t]

    ending: list[set[int]] = [set() for _ in range(T)]
    for v, h in enumerate(facts.horizon):
        if 0 <= h < T:
            ending[h].add(v)
    resident = set(keep)
    stages = []
    for t, k in enumerate(graph.backward_order):
        todo = recompute_closure(graph, sched, resident, needs[t])
        unsafe = [j for j in todo if ops[j].recompute_unsafe is not None]
        assert not unsafe, f"op {unsafe[0]}, which must never be recomputed, lost its outputs"
        made = {w for j in todo for w in ops[j].outputs if sched[w]}
        present = resident | made
        if retain == "all":
            carry = set(present)
        elif retain == "saved":
            carry = (present & keep) | (present & later_need[t + 1])
        else:
            carry = present & keep
        # Drop what no stage from t + 1 on reads: of the Values carried into t (each read at t
        # or later), those last read at t; of the rest, any read no later than t.
        carry -= {v for v in (carry if t == 0 else carry - resident | ending[t])
                  if facts.horizon[v] <= t}
        stages.append(StageSchedule(op=k, recompute=tuple(sorted(todo)),
                                    drop=tuple(sorted(present - carry))))
        resident = carry
    s = Schedule(fingerprint=graph.fingerprint, graph_summary=graph.summary(), impl=impl,
                 forward_keep=tuple(sorted(keep)), stages=tuple(stages), mode=mode,
                 created_by=created_by, cost_provenance=graph.cost_provenance)
    return canonicalize(graph, s, facts)


def articulation_values(graph: OpGraph, facts: GraphFacts | None = None) -> list[int]:
    """Values that every path of the forward graph crosses: after their producer runs, they are
    the only scheduled Value that later ops still read. Ordered by producer."""
    facts = facts or GraphFacts(graph, "full")
    sched, last = facts.scheduled, facts.last_use
    n = len(graph.ops)
    crossing = [0] * (n + 1)  # scheduled values live across the boundary after op i
    for v in graph.values:
        if sched[v.id] and last[v.id] > v.producer:
            crossing[v.producer + 1] += 1
            crossing[last[v.id] + 1] -= 1
    live = 0
    count = []
    for i in range(n):
        live += crossing[i + 1]
        count.append(live)
    out = []
    for op in graph.ops:
        if count[op.id] == 1:
            alive = [w for w in op.outputs if sched[w] and last[w] > op.id]
            if len(alive) == 1:
                out.append(alive[0])
    return out


def segment_boundaries(graph: OpGraph, facts: GraphFacts, length: float) -> list[int]:
    """Articulation Values about `length` ops apart (the segment boundaries to keep)."""
    arts = articulation_values(graph, facts)
    chosen, last = [], -1
    for v in arts:
        p = graph.values[v].producer
        if p - last >= length:
            chosen.append(v)
            last = p
    return chosen


def chen_schedule(graph: OpGraph, facts: GraphFacts, length: float, *, impl=None) -> Schedule:
    return schedule_from_keep(graph, segment_boundaries(graph, facts, length), impl=impl, retain="all",
                              facts=facts, mode="checkpoint", created_by="baseline:chen_sqrt_n")


def greedy_schedule(graph: OpGraph, budget: int, facts: GraphFacts, *, impl=None,
                    retain: str = "saved", deadline: float | None = None) -> Schedule:
    """Stop keeping Values, best bytes per recompute second first, until the peak fits; then
    keep again, in reverse order, those whose return still fits and saves time (`keep_more`,
    cut short at `deadline`, a time.perf_counter() value). The shortest prefix of the order to drop
    is found by galloping and bisection (the peak is close to monotone in it; the result is
    checked): a scan one Value at a time took 35-48 s on an 817-op transformer."""
    ops = graph.ops
    impl = tuple(impl) if impl is not None else (0,) * len(ops)
    base = store_all_schedule(graph, impl)
    kept = set(base.forward_keep)

    def cost(v: int) -> float:
        p = graph.values[v].producer
        return ops[p].impls[impl[p]].rerun_time

    order = sorted((v for v in kept if ops[graph.values[v].producer].recompute_unsafe is None),
                   key=lambda v: -graph.values[v].bytes / max(cost(v), 1e-12))

    def build(k):
        return schedule_from_keep(graph, k, impl=impl, retain=retain, facts=facts,
                                  mode="checkpoint", created_by="baseline:greedy")

    built: dict[int, tuple[Schedule, bool]] = {}

    def dropping(k: int) -> tuple[Schedule, bool]:
        """The schedule without the first k Values of the order, and whether it fits."""
        if k not in built:
            s = build(kept - set(order[:k]))
            built[k] = (s, simulate(graph, s).peak_bytes <= budget)
        return built[k]

    n = len(order)
    lo, hi = 0, 1  # invariant once found: dropping(lo) does not fit, dropping(hi) fits
    if dropping(0)[1]:
        hi = 0
    else:
        while hi < n and not dropping(hi)[1]:
            lo, hi = hi, min(n, 2 * hi)
        if not dropping(hi)[1]:
            return dropping(n)[0]  # nothing fits: the rule's least-memory schedule
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if dropping(mid)[1]:
                hi = mid
            else:
                lo = mid
    return keep_more(graph, budget, kept - set(order[:hi]), reversed(order[:hi]), build,
                     deadline, start=dropping(hi)[0])


def chen_sqrt_n_schedule(graph: OpGraph) -> Schedule:
    """The chen_sqrt_n baseline: Chen et al.'s sqrt(n) segments on Impl 0."""
    return chen_schedule(graph, GraphFacts(graph, "checkpoint"), math.sqrt(len(graph.ops)))


def greedy_baseline_schedule(graph: OpGraph, budget: int) -> Schedule:
    """The greedy baseline: kept Values dropped by bytes per recompute second, on Impl 0."""
    return greedy_schedule(graph, budget, GraphFacts(graph, "checkpoint"))


def baseline_schedules(graph: OpGraph, budget: int, *, greedy: bool = True
                       ) -> list[tuple[str, Schedule]]:
    """The simple baselines' schedules (solver/baselines.py): store-all, Chen's sqrt(n), the
    greedy (unless not `greedy`: the caller makes it later). A solve runs them to the end
    whatever its time limit and the machine's load, so its answer is never worse than any of
    them that fits."""
    out = [("store_all", store_all_schedule(graph)), ("chen_sqrt_n", chen_sqrt_n_schedule(graph))]
    if greedy:
        out.append(("greedy", greedy_baseline_schedule(graph, budget)))
    return out


def ranked_values(graph: OpGraph, facts: GraphFacts, values, impl, exclude=frozenset()
                  ) -> list[int]:
    """The Values among `values` a plan may keep (scheduled, read by a later stage, not made by
    an op that must never be recomputed; not in `exclude`), dearest to recompute per byte
    first (ties: the lower id)."""
    ops, vals = graph.ops, graph.values

    def seconds_per_byte(v: int) -> float:
        p = vals[v].producer
        return ops[p].impls[impl[p]].rerun_time / max(vals[v].bytes, 1)

    return sorted((v for v in values
                   if facts.scheduled[v] and facts.horizon[v] >= 0 and v not in exclude
                   and ops[vals[v].producer].recompute_unsafe is None),
                  key=lambda v: (-seconds_per_byte(v), v))


def ranked_schedule(graph: OpGraph, budget: int, facts: GraphFacts, *, impl=None,
                    retain: str = "saved", deadline: float | None = None) -> Schedule | None:
    """Keep the Values whose recomputation costs the most time per byte, as many as fit.

    Candidates are all scheduled Values a later stage could read, including those no backward
    reads (DenseNet's feature maps feed only concatenations: keeping them and recomputing the
    concatenation is the memory-efficient DenseNet trick, which a rule that only drops from
    store-all's keep set cannot find). The longest prefix of the ranking that fits the budget is
    found by bisection (the peak is close to monotone in it, and the result is checked); then
    the rest of the ranking is offered to `keep_more` (until `deadline`): a Value past the
    prefix is often small or live away from the peak. None if even the empty prefix does not
    fit."""
    impl = tuple(impl) if impl is not None else (0,) * len(graph.ops)
    order = ranked_values(graph, facts, range(len(graph.values)), impl)

    def build(keep) -> Schedule:
        return schedule_from_keep(graph, keep, impl=impl, retain=retain, facts=facts,
                                  mode="checkpoint", created_by="baseline:ranked")

    lo, hi, best = 0, len(order), None
    while lo <= hi:
        mid = (lo + hi) // 2
        s = build(order[:mid])
        if simulate(graph, s).peak_bytes <= budget:
            best, lo = s, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return None
    return keep_more(graph, budget, order[:hi], order[hi:], build, deadline, start=best)


FILL_CHUNK = 8
FILL_CHUNK_MAX = 128
"""Candidates `keep_more` offers at once: a chunk that fits is taken whole (one build and one
replay for many Values where the budget has room) and the next one is twice as large, up to
FILL_CHUNK_MAX; one that does not fit is halved, and the next fresh one is half as large, down
to FILL_CHUNK."""


def keep_more(graph: OpGraph, budget: int, keep, candidates, build, deadline: float | None = None,
              *, start: Schedule | None = None) -> Schedule:
    """Add `candidates` to the kept set, in their order, wherever the schedule `build(kept)`
    still fits the budget and gets faster; return the last schedule taken (`start`, if given,
    is `build(keep)`). Stops at `deadline` (a time.perf_counter() value).

    The rules choose what to keep by a ranking and a prefix; Values past the prefix can still
    fit (small ones, or live away from the peak), and each kept one spares a recomputation
    (docs/BENCHMARKS.md, Solver-scale, measures what this adds to the ranked rule)."""
    keep = set(keep)
    s = start if start is not None else build(keep)
    best_time = simulate(graph, s).total_time
    todo = [v for v in candidates if v not in keep][::-1]  # popped from the end: in order
    halves: list[list[int]] = []  # a stack: a failed chunk's first half on top
    size = FILL_CHUNK
    while halves or todo:
        if deadline is not None and time.perf_counter() > deadline:
            break
        fresh = not halves
        chunk = halves.pop() if halves else [todo.pop() for _ in range(min(size, len(todo)))]
        trial = build(keep | set(chunk))
        tl = simulate(graph, trial)
        if tl.peak_bytes <= budget and tl.total_time < best_time - 1e-12 * max(1.0, best_time):
            keep.update(chunk)
            s, best_time = trial, tl.total_time
            if fresh:
                size = min(2 * size, FILL_CHUNK_MAX)
        else:
            if fresh:
                size = max(size // 2, FILL_CHUNK)
            if len(chunk) > 1:
                half = len(chunk) // 2
                halves += [chunk[half:], chunk[:half]]
    return s
