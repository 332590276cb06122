"""First incumbents for the MILP: the best of several cheap schedules, each checked by the simulator.

`heuristic_schedules` builds store-all, the greedy baseline with two retention policies, the
ranked rule (keep what is dearest to recompute per byte, as much as fits, then whatever else of
the ranking still fits and saves time; it also keeps Values no backward reads, such as
DenseNet's feature maps), Chen's segments at several lengths, segments at
narrow cuts (segments.py: per-block checkpointing where a mask or position tensor crosses every
block, so no single Value cuts the graph) at lengths 1, 2, 4, ... ops, per-block checkpointing
read off the model's module paths (what a user would write with torch.utils.checkpoint) and on
the repeated blocks found in the graph itself (blocks.py: identical layers), both also with
selective activation checkpointing's policy (rules.SAC_SAVE_KINDS: matmul, convolution and
attention outputs kept inside a block; the plans peers' users write, as starts), the chain
combination on those blocks (chain.py: one plan per block, chosen together by dynamic
programming under the budget), and
"keep nothing" (the least-memory rule), each on Impl 0 and on the memory-lean Impls; `best_fitting`
keeps the fastest that fits the budget. `lp_rounding`
solves the MILP's LP relaxation and rounds its residency columns at several thresholds
(Checkmate's rounding, applied to every stage), recomputing whatever a rounded plan lacks; it
costs one LP solve and often lands far closer to the optimum at tight budgets than the rules do.
"""

from __future__ import annotations

import time

from ..analysis import GraphFacts
from ..canonical import canonicalize
from ..graph import OpGraph
from ..schedule import Schedule, StageSchedule
from ..simulate import simulate, store_all_schedule
from .blocks import find_blocks, repeated_block_checkpoint_schedule
from .chain import chain_schedule
from .segments import block_schedule, cut_lengths, cut_schedule
from .simple import (SAC_SAVE_KINDS, chen_schedule, greedy_schedule, ranked_schedule,
                     recompute_closure, schedule_from_keep)


CHAIN_SHARE = 0.75
"""The chain combination may take this share of the rules' time left when it starts (its replays
grow with the candidates of the segments it cannot carry from a twin), so that the ranked and
greedy rules after it still run. On Llama-3-8B per rank at per-block checkpointing's peak it
needs about 40 s of the 82 s left (loaded machine): at half, it was sometimes left out (26.63%
per-block checkpointing, against its 25.71%)."""
RUNS_SHARE = 0.4
"""The same for its run on links of up to RUNS_LONGEST segments (blocks.merged), which comes
after the closure LP (with the costly rules): two of them (Impl 0, lean) leave the ranked rule
a third of that time."""
RUNS_LONGEST = 2
"""The most segments one link of that run may span."""


def lean_impls(graph: OpGraph, facts: GraphFacts) -> tuple[int, ...] | None:
    """Per op, the allowed Impl holding the fewest bytes for its backward (saved scheduled
    Values plus internals; ties: the faster), or None when that is Impl 0 everywhere. A
    compact-mask Impl lets the backward drop a whole activation for a few percent of time."""
    out = []
    for op in graph.ops:
        def held(i):
            im = op.impls[i]
            saved = sum(graph.values[v].bytes for v in im.saved if facts.scheduled[v])
            return (saved + im.internal_bytes, im.fwd_time + im.bwd_time)
        out.append(min(facts.impls[op.id], key=held))
    return tuple(out) if any(out) else None


def heuristic_schedules(graph: OpGraph, budget: int, facts: GraphFacts,
                        deadline: float | None = None, on_schedule=None,
                        before_costly=None, enough=None, before_chain=None,
                        impls: list[tuple[str, tuple[int, ...]]] | None = None,
                        have_start=None, clock=time.perf_counter
                        ) -> list[tuple[str, Schedule]]:
    """Named candidate schedules, on Impl 0 and (full mode) on the memory-lean Impls; some may
    not fit the budget. With `deadline` (a time.perf_counter() value) the rules run cheapest
    first and the costly ones not started by then are left out (greedy's clean-up pass is cut
    short); the cheap ones (store-all, Chen's, the cuts, the per-block and chain rules) run
    until a schedule fits (`have_start`), then only where they would end by then: on an 817-op
    transformer store-all, Chen's and the cut segments take under a second, the
    ranked and greedy rules seconds each, keep-nothing about 5 s. `on_schedule(name, schedule)`
    is called as each one is made (so that a caller can report the first that fits at once).
    `before_costly()` is called once before the first of the rules that take seconds on large
    graphs (ranked, greedy, keep-nothing: a caller can prove a bound then), and `enough()`
    before each rule after the first: when it returns True the rest are left out (the caller
    has a schedule proven good enough). `before_chain()` is called once before the first chain
    combination (the first rule whose deadline is a share of the time left: what the caller
    runs there is paid from that share, as the greedy baseline is). `impls`: the (name prefix, Impl per op) variants to run
    the rules on instead (the least-memory schedule's Impls, when no rule fits on these).
    `have_start()`: whether a schedule that fits has been made (by the caller's reckoning);
    once it has, a rule with no deadline of its own is left out where it would end past
    `deadline` (`_would_overrun`), the cheap ones too: on Llama-70B's per-rank graph (3,236
    ops) each takes seconds. `clock`: what `deadline` is read against here (tests count steps
    with it); the rules with deadlines of their own read them on time.perf_counter()."""
    variants: list[tuple[str, tuple[int, ...] | None]] = [("", None)]
    if impls is not None:
        variants = list(impls)
    elif facts.mode == "full" and (lean := lean_impls(graph, facts)) is not None:
        variants.append(("lean/", lean))
    n = len(graph.ops)
    found = []

    def chain():
        """The graph's repeated blocks (blocks.py), found once."""
        if not found:
            found.append(find_blocks(graph))
        return found[0]

    def share(fraction: float) -> float | None:
        """A deadline `fraction` of the way from now to `deadline`."""
        if deadline is None:
            return None
        now = clock()
        return now + fraction * max(0.0, deadline - now)

    rules = []  # (name, thunk), cheapest first; the costly ones from `costly` on
    for tag, impl in variants:
        rules.append((f"{tag}store_all", lambda impl=impl: store_all_schedule(graph, impl)))
        for length in sorted({1, 2, 3, max(1, round(n ** 0.5 / 2)), max(1, round(n ** 0.5))}):
            rules.append((f"{tag}chen/{length}",
                          lambda impl=impl, length=length: chen_schedule(graph, facts, length,
                                                                         impl=impl)))
        for length in cut_lengths(graph):
            rules.append((f"{tag}cuts/{length}",
                          lambda impl=impl, length=length: cut_schedule(graph, facts, length,
                                                                        impl=impl)))
        for sac, kinds in (("", frozenset()), ("/sac", SAC_SAVE_KINDS)):
            rules.append((f"{tag}per_block{sac}",
                          lambda impl=impl, kinds=kinds: block_schedule(
                              graph, facts, impl=impl, save_kinds=kinds)))
            rules.append((f"{tag}repeated_blocks{sac}",
                          lambda impl=impl, kinds=kinds: repeated_block_checkpoint_schedule(
                              graph, facts, impl=impl, chain=chain(), save_kinds=kinds)))
        rules.append((f"{tag}chain",
                      lambda impl=impl: chain_schedule(graph, budget, facts, impl=impl,
                                                       chain=chain(),
                                                       deadline=share(CHAIN_SHARE))))
    costly = len(rules)
    first_chain = next(i for i, (name, _) in enumerate(rules) if name.endswith("chain"))
    for tag, impl in variants:
        rules.append((f"{tag}chain/runs",
                      lambda impl=impl: chain_schedule(
                          graph, budget, facts, impl=impl, chain=chain(),
                          deadline=share(RUNS_SHARE), longest=RUNS_LONGEST)))
    for tag, impl in variants:
        for retain in ("saved", "all"):
            rules.append((f"{tag}ranked/{retain}",
                          lambda impl=impl, retain=retain: ranked_schedule(
                              graph, budget, facts, retain=retain, impl=impl,
                              deadline=deadline)))
    for tag, impl in variants:
        for retain in ("saved", "none"):
            rules.append((f"{tag}greedy/{retain}",
                          lambda impl=impl, retain=retain: greedy_schedule(
                              graph, budget, facts, retain=retain, impl=impl,
                              deadline=deadline)))
    for tag, impl in variants:
        rules.append((f"{tag}keep_nothing",
                      lambda impl=impl: schedule_from_keep(graph, (), retain="none", facts=facts,
                                                           impl=impl)))
    # the chain combination, ranked and greedy rules stop at a deadline of their own
    own_clock = {name for name, _ in rules if name.startswith(
        tuple(f"{tag}{rule}" for tag, _ in variants for rule in ("chain", "ranked/", "greedy/")))}
    out: list[tuple[str, Schedule]] = []
    longest = 0.0  # the longest a rule with no deadline of its own took so far
    for i, (name, make) in enumerate(rules):
        # Until a schedule fits, the cheap rules run whatever the clock (milliseconds to a
        # second on 800 ops), so that there is a start; the deadline binds the costly ones.
        if i >= costly and deadline is not None and clock() > deadline:
            break
        if i == costly and before_costly is not None:
            before_costly()
        if i == first_chain and before_chain is not None:
            before_chain()
        if out and enough is not None and enough():
            break
        own_deadline = name in own_clock
        if not own_deadline and _would_overrun(clock, deadline, longest, have_start):
            continue
        began = clock()
        s = make()
        if not own_deadline:
            longest = max(longest, clock() - began)
        if s is not None:
            out.append((name, s))
            if on_schedule is not None:
                on_schedule(name, s)
    return out


def _would_overrun(clock, deadline: float | None, longest: float, have_start) -> bool:
    """Whether a rule with no deadline of its own is to be left out: a schedule that fits is in
    hand (`have_start`), and the rule, taking as long as the longest such one so far, would end
    past `deadline` (each of them builds and canonicalises one whole-graph schedule)."""
    if deadline is None or have_start is None or not have_start():
        return False
    return clock() + longest > deadline


def family_starts(graph: OpGraph, budget: int, candidates,
                  timelines: dict | None = None) -> list[tuple[str, Schedule, float]]:
    """The fastest fitting candidate of each Impl family (Impl 0, and the memory-lean Impls),
    fastest first. LNS is a local search and the family of its start decides where it ends:
    on GoogLeNet (batch 320, analytical A100) at 5 GiB, 300 s of LNS alone from the Impl-0
    greedy rule (+131.5%) reached +32.75%, from the lean greedy rule (+125.7%) only +73.7%,
    although the lean start was the faster one. So `solve` races one start per family.
    `timelines`: name -> the simulator's Timeline of candidates already replayed."""
    out = []
    for lean in (False, True):
        best = best_fitting(graph, budget, [(n, s) for n, s in candidates
                                            if n.startswith("lean/") == lean], timelines)
        if best is not None:
            out.append(best)
    return sorted(out, key=lambda b: b[2])


def best_fitting(graph: OpGraph, budget: int, candidates,
                 timelines: dict | None = None) -> tuple[str, Schedule, float] | None:
    """(name, schedule, seconds) of the fastest candidate whose simulated peak fits the budget
    (`timelines`: name -> Timeline of candidates already replayed)."""
    best = None
    for name, s in candidates:
        tl = timelines[name] if timelines and name in timelines else simulate(graph, s)
        if tl.peak_bytes <= budget and (best is None or tl.total_time < best[2]):
            best = (name, s, tl.total_time)
    return best


def schedule_from_residency(graph: OpGraph, resident: list[set[int]], facts: GraphFacts,
                            impl=None) -> Schedule:
    """The schedule that holds `resident[t]` entering each stage t (t = 0 is the forward keep),
    recomputing, before each stage, what its backward reads or the next stage holds but is not
    resident. The result is canonical (see canonical.py)."""
    ops, sched = graph.ops, facts.scheduled
    impl = tuple(impl) if impl is not None else (0,) * len(ops)
    T = len(graph.backward_order)
    held = set(resident[0])
    stages = []
    for t, k in enumerate(graph.backward_order):
        targets = {v for v in ops[k].impls[impl[k]].saved if sched[v]} | set(resident[t + 1])
        todo = recompute_closure(graph, sched, held, targets)
        if any(ops[j].recompute_unsafe is not None for j in todo):
            raise ValueError("the plan needs an op that must never be recomputed")
        present = held | {w for j in todo for w in ops[j].outputs if sched[w]}
        nxt = set(resident[t + 1]) if t + 1 < T else set()
        stages.append(StageSchedule(op=k, recompute=tuple(sorted(todo)),
                                    drop=tuple(sorted(present - nxt))))
        held = nxt
    s = Schedule(fingerprint=graph.fingerprint, graph_summary=graph.summary(), impl=impl,
                 forward_keep=tuple(sorted(resident[0])), stages=tuple(stages))
    return canonicalize(graph, s, facts)


def least_memory(graph: OpGraph, candidates) -> tuple[str, Schedule, int]:
    """(name, schedule, peak) of the candidate with the smallest simulated peak."""
    best = None
    for name, s in candidates:
        peak = simulate(graph, s).peak_bytes
        if best is None or peak < best[2]:
            best = (name, s, peak)
    return best


def low_memory_schedules(graph: OpGraph, facts: GraphFacts,
                         deadline: float | None = None) -> list[tuple[str, Schedule]]:
    """Candidates for the least peak: storing all, keeping nothing (which is not always the
    least: long recomputation chains hold their branch points), Chen's segments, segments at
    narrow cuts, and the greedy rule pushed towards ever smaller budgets (left out past
    `deadline`)."""
    # Store-all too: where every recomputation costs more scratch than the Values it frees (a
    # graph profiled under autocast), it is the least, and min_budget must not report above it.
    out = [("store_all", store_all_schedule(graph)),
           ("keep_nothing", schedule_from_keep(graph, (), retain="none", facts=facts))]
    n = len(graph.ops)
    for length in sorted({1, 2, 3, max(1, round(n ** 0.5 / 2)), max(1, round(n ** 0.5))}):
        out.append((f"chen/{length}", chen_schedule(graph, facts, length)))
    for length in cut_lengths(graph):
        out.append((f"cuts/{length}", cut_schedule(graph, facts, length)))
    top = simulate(graph, store_all_schedule(graph)).peak_bytes
    for frac in (0.5, 0.35, 0.25, 0.15, 0.0):
        if deadline is not None and time.perf_counter() > deadline:
            break
        out.append((f"greedy/none@{frac}", greedy_schedule(graph, int(top * frac), facts,
                                                           retain="none", deadline=deadline)))
    return out


def lp_rounding(form, backend, *, time_limit_s: float,
                thresholds=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9), on_bound=None, on_solution=None):
    """Round the LP relaxation's residency (all stages) at each threshold. For the time
    objective: (name, schedule, seconds) of the fastest rounding that fits the budget; for the
    peak objective: (name, schedule, peak) of the least peak. None when nothing fits or the LP
    does not solve in time. `on_bound(value)` receives the LP optimum (a lower bound),
    `on_solution(x)` the LP solution (a vector of `form`)."""
    r = backend.solve(form.milp.relaxation(), time_limit_s=time_limit_s, mip_gap=0.0)
    if r.x is None:
        return None
    if r.status == "optimal":
        if on_bound is not None:
            on_bound(r.objective)  # the LP optimum bounds the MILP from below
        if on_solution is not None:
            on_solution(r.x)
    graph, facts = form.graph, form.facts
    impl = form.decode(r.x).impl
    T = form.T
    cands = []
    for th in thresholds:
        resident = [set() for _ in range(T + 1)]
        for (t, v), col in form.S.items():
            if r.x[col] >= th:
                resident[t].add(v)
        try:
            cands.append((f"lp_rounding/{th}", schedule_from_residency(graph, resident, facts,
                                                                        impl)))
        except ValueError:
            continue
    if not cands:
        return None
    if form.objective == "peak":
        return least_memory(graph, cands)
    return best_fitting(graph, form.budget, cands)
