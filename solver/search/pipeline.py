"""`solve` and `min_budget`: validate, find a first incumbent, run the portfolio, certify.

1. Validate: parse the budget, build the MILP (formulation.py), and answer a budget below what
   some point of the step needs whatever the schedule with InfeasibleBudgetError at once.
2. First incumbent: the fastest heuristic schedule of each Impl family that fits
   (rules/warmstart.py; the costly rules are left out once the stage bound proves a cheaper one
   within the gap); when none fits, the least-memory schedule of an exact min-peak solve
   (which also proves infeasibility), pushed below the budget by a min-peak phase when that
   solve left the budget undecided (`min_peak_below`).
3. Portfolio (context.run_portfolio): with a backend that shares while it runs (CALLBACKS), both
   cores work: branch and bound in one thread (branch_and_bound.py), and in the other the LP
   relaxation (relaxation.py), then, where blocks repeat (rules/blocks.find_blocks), tied sub-MILPs
   over groups of identical blocks (structured.py), then large-neighbourhood search (local.py),
   which turns to bound probes (probes.py) when it goes quiet; other backends solve once.
4. Certify: decode the best vector and replay it in the simulator; the peak must fit the budget
   and the time must equal the MILP's objective, or it is a bug and says so. The gap is
   (incumbent - lower bound) / incumbent on the whole step time, as MONeT reports it, the bound
   being the best any relaxation proved (pool.py).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from ..analysis import MODES
from ..backends import get_backend
from ..backends.base import INFEASIBLE, TIME_LIMIT, BackendResult
from ..backends.base import OPTIMAL as B_OPTIMAL
from ..errors import InfeasibleBudgetError
from ..formulation import Formulation
from ..graph import OpGraph
from ..least_budget import infeasible_message
from ..milp import BuildStopped
from ..rules.blocks import find_blocks
from ..rules.simple import baseline_schedules, greedy_baseline_schedule
from ..rules.warmstart import (best_fitting, family_starts, heuristic_schedules, lean_impls,
                               least_memory, low_memory_schedules)
from ..schedule import ERROR, FEASIBLE_AT_TIME_LIMIT, OPTIMAL, Schedule, SolveResult
from ..simulate import simulate, store_all_schedule
from ..stage_bound import stage_bound, stage_least_peak
from ..units import format_bytes, parse_bytes
from .branch_and_bound import BranchAndBound, OneShot
from .context import SearchContext, run_portfolio
from .local import LargeNeighbourhood
from .models import branch_and_bound_form, tight_points
from .pool import Pool
from .progress import Progress
from .relaxation import LpRounding
from .run import Run
from .structured import BlockCopy, repeated_classes

MIN_BUDGET_TIME_LIMIT_S = 120.0
SHORTCUTS = True
"""Whether solve may answer without the MILP (store-all on the fastest Impls when it fits, the
best rule once the floor and stage bound prove it, which also leaves the costly rules out).
Tests of the search and of the backends set it False (tests/solver_cases.no_search_shortcuts)."""
PHASE1_SHARE = 0.7
"""Share of the time left the min-peak phase may take when the budget is undecided."""
MIN_PEAK_SHARE = 0.3
"""Share of the time limit the min-peak solve for a first incumbent may take."""
MIN_SEARCH_S = 1.0
"""With less time than this left once the MILP is built, the best rule is the answer."""
LEAST_RULES_SHARE = 0.2
"""Share of the time left the rules on the least-memory schedule's Impls may take, when no rule
fits on Impl 0 or the lean Impls."""
RULES_SHARE = 0.3
RULES_MIN_S = 10.0
"""The simple rules may take this share of the time limit, and at least RULES_MIN_S (but never
more than the limit: `rules_seconds`), for a first incumbent (rules/warmstart.py runs them
cheapest first and leaves out those not started by then, and the clean-up passes,
rules/simple.py's keep_more, stop there). Without a limit they took 686 s of a 120 s
solve of Llama-1B (608 ops) at 16 GiB; on graphs of a few hundred ops they all take a few
seconds. On the largest graphs the rules are where the time pays (docs/BENCHMARKS.md,
Solver-scale): the MILP there is millions of nonzeros and rarely improves on them, and each
rule's schedule reaches on_incumbent as soon as it is made. Where the MILP will not be built
(MAX_MILP_CELLS, or BUILD_S_PER_CELL beyond what the rules leave) they have the whole limit:
on Llama-70B's per-rank graph the chain combination alone takes 100-150 s."""
MAX_MILP_CELLS = 4_000_000
"""Ops times backward stages above which the MILP is not built (its residency columns grow with
both): the best rule is the answer, with the bound the rules' phase proved. A 48-layer GPT
(817 ops x 817 stages) builds in 18 s at 2 GiB resident; Llama-70B's per-rank graph (3,236 x
3,212) was still building after 5 minutes at 17 GiB and growing, on a 24 GiB machine."""
BUILD_S_PER_CELL = 18.0 / (817 * 817)
"""Seconds the MILP takes to build per op and backward stage (the 48-layer GPT's 18 s, alone
on this machine): where the time left cannot pay for it, the best rule is the answer, so that
a large graph's solve ends near its limit (Llama-3-8B's per-rank graph, 1,316 ops, took 198 s
of a 60 s limit). A first filter: builds stop in time too (`build_stop`)."""
BUILD_STEPS_PER_STAGE = 0.3
"""The build takes about this many closing steps per backward stage (0.31-0.34 on generated
graphs of 109-782 ops, timed side by side): the estimate follows this machine's load now."""
ENCODE_SHARE = 0.1
"""Encoding the rule after the build (Formulation.encode) takes up to this share of the build:
0.067-0.072 at 109, 443 and 782 ops (1.1 s after a 16.9 s build), load about 3."""
CLOSURE_SHARE = 0.2
"""Before the rules that take seconds (or after the rules), the stage bound's closure LP (one
small LP per backward stage, dearest stage first) may take this share of the time limit: 8 s
for all 817 stages of a 48-layer GPT. It is what proves the rules' schedules on the largest
graphs, before the MILP is built, and what lets the costly rules be left out once a cheaper
one is proven."""
CLOSING_STEPS = 4
CLOSING_SHARE = 0.1
"""A solve reserves, from the start, the time its closing work takes, in whole-graph steps (each
as long as the baselines' build and replay, timed first on this graph): the rules end
CLOSING_STEPS steps before the limit (at most CLOSING_SHARE of it), and the closure LP and the
search one step before it. After the rules' deadline, the rule running then ends one step later
(its deadline is read between steps) and its schedule is replayed; the closure LP that proves
it follows (5-6 s on Llama-70B per rank, about two steps), then the answer's replay."""


def closing_reserve(step_s: float, time_limit_s: float) -> float:
    """Seconds the rules leave at the end (CLOSING_STEPS), `step_s` the baselines' time."""
    return min(CLOSING_STEPS * step_s, CLOSING_SHARE * time_limit_s)


def _closing_step(stats: dict) -> float:
    """Seconds the closure LP and the search leave at the end: one step, within the reserve."""
    return min(stats.get("closing_step_s", 0.0), stats.get("closing_reserve_s", 0.0))


def _store_all_time(graph: OpGraph, timelines: dict) -> float:
    """Store-all's step time: the baselines' replay when it ran (a replay of Llama-70B's per-rank
    graph, with store-all's build, takes 1-2 s), else one replay now."""
    tl = timelines.get("baseline/store_all")
    return (tl if tl is not None else simulate(graph, store_all_schedule(graph))).total_time


def _build_estimate(graph: OpGraph, step_s: float | None) -> float:
    """Seconds the MILP's build should take: BUILD_S_PER_CELL, or more where the closing step
    (`step_s`, timed on this graph now) says the machine is slower (BUILD_STEPS_PER_STAGE)."""
    stages = len(graph.backward_order)
    return max(BUILD_S_PER_CELL * len(graph.ops) * stages,
               BUILD_STEPS_PER_STAGE * (step_s or 0.0) * stages)


def build_stop(deadline: float, began: float | None = None, clock=time.perf_counter):
    """A build's should_stop (milp.Builder): whether `deadline` has passed, less ENCODE_SHARE
    of the time since `began` (a build's rule is then encoded, no quicker to stop)."""
    share, began = (0.0, 0.0) if began is None else (ENCODE_SHARE, began)
    return lambda: (now := clock()) >= deadline - share * (now - began)


def rules_seconds(time_limit_s: float) -> float:
    """Seconds the simple rules may take: RULES_SHARE of the limit, at least RULES_MIN_S, never
    more than the limit itself (with the floor alone, a 2 s solve of ResNet-18 took 8-10 s)."""
    return min(time_limit_s, max(RULES_SHARE * time_limit_s, RULES_MIN_S))


def _too_large(graph: OpGraph) -> bool:
    """The MILP of `graph` is not built (MAX_MILP_CELLS)."""
    return len(graph.ops) * len(graph.backward_order) > MAX_MILP_CELLS


def _sharing(be) -> bool:
    """The backend can run beside other strategies, sharing incumbents (and prove probes)."""
    return be.CALLBACKS and be.OBJECTIVE_CUTOFF


def run_search(run: Run, form: Formulation, form_bb: Formulation, pool: Pool,
               progress: Progress, target: float | None = None, race=()) -> SearchContext:
    """Run the portfolio until the run's deadline; the context holds what it did."""
    ctx = SearchContext(form=form, bb_form=form_bb, pool=pool, backend=run.backend,
                        deadline=run.deadline, mip_gap=run.mip_gap, progress=progress,
                        verbose=run.verbose, target=target)
    if _sharing(run.backend):
        # block copy only where blocks repeat (find_blocks: milliseconds at 800 ops)
        chain = find_blocks(form.graph)
        structured = ([BlockCopy(chain)] if repeated_classes(chain, len(form.graph.ops))
                      else [])
        run_portfolio(ctx, BranchAndBound(),
                      [LpRounding(form_bb), *structured, LargeNeighbourhood(race)])
    else:
        run_portfolio(ctx, OneShot(), [])
    return ctx


def _lower_peak(form: Formulation, pool: Pool) -> int:
    """The least peak (bytes) the relaxations proved."""
    lower = form.const_peak
    bound = pool.bound()
    if bound is not None:
        lower = max(lower, int(math.ceil(bound * form.mem_scale - 1e-6 * form.mem_scale)))
    return lower


# ----------------------------------------------------------------------------------------------
# Min budget
# ----------------------------------------------------------------------------------------------
class LeastBudgetCache:
    """The least budgets found in this process, each with the time limit it was found in: an
    unproven answer is found again when a longer limit is asked for."""

    def __init__(self):
        self._answers: dict[tuple, tuple[tuple[int, int, bool, Schedule], float]] = {}

    @staticmethod
    def key(graph: OpGraph, mode: str, offload: bool) -> tuple:
        """What a least budget depends on: the structure and every byte count, not the costs."""
        return (graph.fingerprint, graph.memory_digest, mode,
                graph.host_bandwidth if offload else None)

    def get(self, graph: OpGraph, mode: str, offload: bool):
        """(answer, time limit it was found in), or None."""
        return self._answers.get(self.key(graph, mode, offload))

    def put(self, graph: OpGraph, mode: str, offload: bool,
            answer: tuple[int, int, bool, Schedule], time_limit_s: float) -> None:
        self._answers[self.key(graph, mode, offload)] = (answer, time_limit_s)

    def clear(self) -> None:
        self._answers.clear()


MIN_BUDGET_CACHE = LeastBudgetCache()


def min_budget_details(graph: OpGraph, mode: str = "full", *, backend: str = "highs",
                       time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S, verbose: bool = False,
                       offload: bool = False) -> tuple[int, int, bool, Schedule]:
    """(least feasible peak found, proven lower bound, proven optimal?, a schedule at that peak).

    An exact min-peak MILP (the same model with the peak as objective), started from the
    least-memory rules and improved like `solve` does (LP rounding, LNS beside branch and
    bound). Cached per graph and mode, until a longer time limit is asked for an
    unproven answer."""
    check_time_limit(time_limit_s)
    hit = MIN_BUDGET_CACHE.get(graph, mode, offload)
    if hit is not None and (hit[0][2] or hit[1] >= time_limit_s):
        return hit[0]
    started = time.perf_counter()
    be = get_backend(backend)
    run = Run(graph=graph, mode=mode, backend=be, started=started, time_limit_s=time_limit_s,
              deadline=started + time_limit_s, mip_gap=1e-6, verbose=verbose, offload=offload)
    form = Formulation(graph, None, mode=mode, objective="peak", offload=offload)
    rules_deadline = started + rules_seconds(time_limit_s)
    name, s0, peak0 = least_memory(graph, low_memory_schedules(graph, form.facts,
                                                               deadline=rules_deadline))
    # Full mode contains checkpoint mode (Impl 0 everywhere): a checkpoint answer already found
    # is a start, so full's least budget is never reported above checkpoint's.
    done = MIN_BUDGET_CACHE.get(graph, "checkpoint", offload) if mode == "full" else None
    if done is not None and done[0][0] < peak0:
        name, s0, peak0 = "checkpoint", done[0][3], done[0][0]
    if hit is not None and hit[0][0] < peak0:  # what a shorter solve found: the start
        name, s0, peak0 = "cached", hit[0][3], hit[0][0]
    form_bb = branch_and_bound_form(form) if _sharing(be) else form
    pool = Pool([form, form_bb])
    least = stage_least_peak(form.facts, offload)  # exact bytes, no LP tolerance
    pool.raise_bound("stages", least / form.mem_scale)
    pool.offer_schedule(form, s0, f"heuristic:{name}")
    progress = Progress(verbose or sys.stderr.isatty(), time_limit_s, 1.0, 1.0,
                        f"{graph.model} min budget",
                        peak=form.mem_scale)
    progress.update(incumbent=pool.obj, bound=pool.bound())
    try:
        ctx = run_search(run, form, form_bb, pool, progress)
    finally:
        progress.close()
    best_s = form.decode(pool.get(form)[0])
    best_peak = simulate(graph, best_s).peak_bytes
    if best_peak > peak0:  # never worse than the rule we started from
        best_s, best_peak = s0, peak0
    lower = max(_lower_peak(form, pool), least)
    # optimal: a bound reaches it, or branch and bound proved its incumbent within 1e-6 (and
    # best_peak is no higher)
    proven = lower >= best_peak or (ctx.bb_result is not None
                                    and ctx.bb_result.status == B_OPTIMAL)
    lower = min(lower, best_peak)
    out = (best_peak, lower, proven, best_s)
    MIN_BUDGET_CACHE.put(graph, mode, offload, out, time_limit_s)
    return out


def min_budget(graph: OpGraph, mode: str = "full", *, backend: str = "highs",
               time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S, offload: bool = False) -> int:
    """The least budget (bytes) at which a schedule exists: an exact min-peak solve, warm-started
    from the least-memory rules. Exact when the solve proves it within `time_limit_s` (seconds on
    the models measured); otherwise the least feasible peak found, an upper bound."""
    return min_budget_details(graph, mode, backend=backend, time_limit_s=time_limit_s,
                              offload=offload)[0]


def check_time_limit(time_limit_s) -> None:
    """A time limit is a positive number of seconds (a string such as "5" is refused here, not
    met later as a TypeError inside the search)."""
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) \
            or not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive (a number of seconds), got "
                         f"{type(time_limit_s).__name__} {time_limit_s!r:.40}")


def _infeasible(run: Run, why: str = "", time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S
                ) -> InfeasibleBudgetError:
    """The run's budget fits no schedule: the error, with the least budget found in
    `time_limit_s` (and whether it is proven)."""
    graph, budget, mode = run.graph, run.budget, run.mode
    peak, lower, proven, s = min_budget_details(graph, mode, backend=run.backend.name,
                                                time_limit_s=time_limit_s, offload=run.offload)
    return InfeasibleBudgetError(
        infeasible_message(graph, budget, mode, least=peak, lower=lower, proven=proven,
                           schedule=s, why=why), budget=budget, min_budget=peak)


def min_peak_below(run: Run, start: Schedule) -> tuple[Schedule | None, int]:
    """Phase 1 of a solve whose budget no rule meets: minimise the peak (the min-peak MILP, LNS
    beside branch and bound, from `start`) until a schedule fits the run's budget, the peak is
    proven to stay above it, or the run's deadline. Returns (a schedule that fits, or None; a proven lower
    bound on the least peak, in bytes). Branch and bound runs with the budget as its objective
    cutoff, so it only explores what could fit: its 'infeasible' then means that no schedule
    peaks at or below the budget (the cutoff sits half a memory unit above it, so a schedule
    exactly at the budget is never cut off)."""
    graph, budget, offload = run.graph, run.budget, run.offload
    form = Formulation(graph, None, mode=run.mode, objective="peak", offload=offload)
    least = stage_least_peak(form.facts, offload)
    if least > budget:  # some backward stage cannot come down to the budget
        return None, least
    form_bb = branch_and_bound_form(form)
    pool = Pool([form, form_bb])
    pool.raise_bound("stages", least / form.mem_scale)
    pool.offer_schedule(form, start, "min_peak")
    progress = Progress(run.verbose or sys.stderr.isatty(),
                        max(1.0, run.deadline - time.perf_counter()), 1.0, 1.0,
                        f"{graph.model} peak to {format_bytes(budget)}", peak=form.mem_scale)
    progress.update(incumbent=pool.obj, bound=pool.bound())
    try:
        ctx = run_search(run, form, form_bb, pool, progress, target=budget / form.mem_scale)
    finally:
        progress.close()
    s = form.decode(pool.get(form)[0])
    if simulate(graph, s).peak_bytes <= budget:
        return s, 0
    lower = _lower_peak(form, pool)
    if ctx.bb_result is not None and ctx.bb_result.status == INFEASIBLE:
        lower = max(lower, budget + 1)  # nothing below the cutoff, which lies above the budget
    return None, lower


# ----------------------------------------------------------------------------------------------
# Solve
# ----------------------------------------------------------------------------------------------
def solve(graph: OpGraph, budget, *, mode: str = "full", backend: str = "highs",
          time_limit_s: float = 600, mip_gap: float = 0.01, warm_start: bool = True,
          verbose: bool = False, offload: bool = False, on_incumbent=None) -> SolveResult:
    """The fastest schedule of `graph` within `budget` (bytes, or a string such as '8GiB').

    mode: 'full' (keep/recompute and an Impl per op) or 'checkpoint' (keep/recompute, Impl 0).
    backend: a name from solver.backends.known(), or a Backend instance.
    offload: also let the MILP copy Values to host memory and back (full mode; needs the graph's
    host_bandwidth, a GPU feature at run time).
    on_incumbent: called as on_incumbent(schedule, lower_bound) each time a better schedule is
    found (from the solver's threads: keep it quick), lower_bound being the best valid bound on
    the step time proven so far or None; the schedule is as the MILP decoded it, not yet
    replayed (simulate.with_predictions gives its peak and time). The CLI keeps the last one so
    that Ctrl-C can write the best schedule found so far.
    Returns a SolveResult whose schedule has been replayed by the simulator; raises
    InfeasibleBudgetError (with the minimum feasible budget) when no schedule fits, and
    BackendUnavailableError for an unknown or missing backend. A time-out with no schedule, or a
    solver failure, is a SolveResult with status 'error' and a message.
    time_limit_s bounds every part of the solve, but HiGHS checks its own limit (and calls back)
    only at some points: at the root of a large model it can run past it. Measured on the
    transformer stack (batch 24, 1.09 M nonzeros in branch and bound's model) at 5 GiB with 300 s:
    the solve returned after 336-341 s; HiGHS's log shows 115 s at the root with no LP iteration
    and no log line (in cut separation), ending 41 s past its own limit (a known HiGHS limit:
    ERGO-Code/HiGHS issues 885 and 1278, procedures that check the time too seldom).
    """
    started = time.perf_counter()
    # -- 1. validate ---------------------------------------------------------------------------
    budget = parse_bytes(budget)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_time_limit(time_limit_s)
    be = get_backend(backend)
    deadline = started + time_limit_s
    run = Run(graph=graph, mode=mode, backend=be, started=started, time_limit_s=time_limit_s,
              deadline=deadline, budget=budget, mip_gap=mip_gap, verbose=verbose,
              offload=offload)

    facts = run.facts
    easy = _store_all_if_optimal(run)
    if easy is not None:
        return easy

    # -- 2a. the simple rules, before the MILP is built (it takes 18 s at 817 ops) -------------
    starts, timelines, reported, stage_lower, known_lower = _rules_first(run, warm_start,
                                                                         on_incumbent)
    if starts:
        proven = _rule_if_proven(run, starts[0], timelines, known_lower, stage_lower)
        if proven is not None:
            proven.stats.update(first_incumbent_s=_rounded(reported[1]),
                                best_found_s=_rounded(reported[2]),
                                heuristic=proven.stats["incumbent_source"],
                                heuristic_objective_s=proven.objective)
            return proven

    size = f"{len(graph.ops)} ops x {len(graph.backward_order)} stages"
    if starts and _too_large(graph):
        return _rule_unproven(run, starts[0], timelines, known_lower, stage_lower, reported,
                              f"skipped: the MILP of {size} is too large to build "
                              f"(MAX_MILP_CELLS); the best rule with the bound proven")

    stats, began = run.stats, time.perf_counter()
    build, left = stats.get("build_estimate_s", _build_estimate(graph, None)), deadline - began
    if starts and build > left:
        return _rule_unproven(run, starts[0], timelines, known_lower, stage_lower, reported,
                              f"skipped: building the MILP of {size} would take about "
                              f"{build:.0f} s of the {max(0.0, left):.0f} s left "
                              f"(BUILD_S_PER_CELL); the best rule with the bound proven")
    # With a rule in hand the builds end before the closing reserve, whatever the load: the
    # estimate above cannot see the load that comes after it.
    end = deadline - stats.get("closing_reserve_s", 0.0)
    try:
        form = Formulation(graph, budget, mode=mode, offload=offload, facts=facts,
                           should_stop=build_stop(end, began) if starts else None)
    except BuildStopped:
        return _rule_unproven(run, starts[0], timelines, known_lower, stage_lower, reported,
                              f"skipped: building the MILP of {size} ran out of time after "
                              f"{time.perf_counter() - began:.0f} s (the limit less the "
                              f"closing reserve); the best rule with the bound proven")
    stats.update({**form.stats(), "build_s": round(time.perf_counter() - started, 3),
                  "mode": mode})
    if form.infeasible_points:
        where, need = max(form.infeasible_points, key=lambda p: p[1])
        raise _infeasible(run, f"the {where} alone needs {format_bytes(need)}",
                          min(MIN_BUDGET_TIME_LIMIT_S, time_limit_s))
    base_time = _store_all_time(graph, timelines)
    pool = Pool([form], start=started)
    pool.raise_bound("floor", form.facts.time_floor * form.time_scale)
    if math.isfinite(stage_lower):  # inf would prove the budget infeasible; left to the search
        pool.raise_bound("stages", stage_lower * form.time_scale)

    # -- 2b. first incumbent -------------------------------------------------------------------
    race = []
    if starts:
        pool.offer_schedule(form, starts[0][1], f"heuristic:{starts[0][0]}")
        pool.first_s = reported[1]
        race = [(f"heuristic:{n}", sched) for n, sched, _ in starts]
    elif warm_start:
        race = _no_rule_fits(run, form, pool)
    pool.on_incumbent = on_incumbent
    stats["heuristic"] = pool.source or None
    stats["heuristic_objective_s"] = pool.obj / form.time_scale if pool.has else None

    # -- 3. portfolio --------------------------------------------------------------------------
    if pool.has and deadline - time.perf_counter() < MIN_SEARCH_S:
        # No time left to search (building the MILP took it): the best rule, unproven.
        return _no_search(run, form, pool, base_time,
                          f"skipped: {deadline - time.perf_counter():.1f} s left of "
                          f"{time_limit_s:g} s after building the MILP")
    progress = Progress(verbose or sys.stderr.isatty(), time_limit_s, base_time,
                        form.time_scale, f"{graph.model} {format_bytes(budget)}")
    # the bounds proven before the search (the floor, the stage bound) are the bar's gap too
    progress.update(incumbent=pool.obj, bound=pool.bound())
    form_bb = form
    if _sharing(be):
        points = (tight_points(graph, form.decode(pool.get(form)[0]), budget)
                  if pool.has else None)
        began = time.perf_counter()
        try:  # a second build, about as long as the first
            form_bb = branch_and_bound_form(form, points,
                                            should_stop=build_stop(end) if pool.has else None)
        except BuildStopped:
            progress.close()
            return _no_search(run, form, pool, base_time,
                              f"skipped: building branch and bound's model ran out of time "
                              f"after {time.perf_counter() - began:.0f} s (the limit less the "
                              f"closing reserve)")
    if form_bb.infeasible_points:
        progress.close()
        raise _infeasible(run)
    pool.add_form(form_bb)
    try:
        # the search leaves the closing work (the answer's replay) its step
        ctx = run_search(dataclasses.replace(run, deadline=deadline - _closing_step(stats)),
                      form, form_bb, pool, progress, race=race)
    finally:
        progress.close()

    # -- 4. certify ----------------------------------------------------------------------------
    return _certify(run, ctx, base_time)


def _no_search(run: Run, form: Formulation, pool: Pool, base_time: float, why: str
               ) -> SolveResult:
    """The pool's best (a rule's) certified with the bounds known: no search follows (`why`)."""
    run.stats["search"] = why
    ctx = SearchContext(form=form, bb_form=form, pool=pool, backend=run.backend,
                        deadline=run.deadline, mip_gap=run.mip_gap,
                        progress=Progress(False, 1, 1.0, 1.0, ""))
    return _certify(run, ctx, base_time)


def _rules_first(run: Run, warm_start: bool, on_incumbent) -> tuple[list, dict, list, float,
                                                                    float]:
    """Step 2a of `solve`: the bounds known before anything is solved, and the simple rules
    (when `warm_start`), each schedule replayed as it is made. Returns (the rules' fastest
    start per Impl family that fits, fastest first; their timelines by name; [the best time
    reported, when the first fitting one came, when the best came]; the stage bound; the best
    bound known, in seconds)."""
    graph, budget, facts, offload = run.graph, run.budget, run.facts, run.offload
    started, deadline, time_limit_s, mip_gap = (run.started, run.deadline, run.time_limit_s,
                                                run.mip_gap)
    # Bounds known before anything is solved: the floor, and the greedy stage bound
    # (milliseconds); the closure LP strengthens the latter during the rules. Not before the
    # chain combination: proven early, per-block checkpointing (26.63%) would be the answer for
    # Llama-3-8B at its own peak, where the chain finds 25.71%.
    stage_lower = stage_bound(facts, budget, offload, closure=False)
    known_lower = max(facts.time_floor, stage_lower if math.isfinite(stage_lower) else 0.0)

    # The closure LP strengthens the stage bound before the rules that take seconds (or after
    # the rules, when they are not run); once a rule's schedule is proven within the target gap
    # the rest are left out.
    lower = {"stage": stage_lower, "known": known_lower, "closure": not math.isfinite(stage_lower)}
    closing = [deadline]  # when the closure LP ends (the limit less the closing step)

    def closure_bound():
        if lower["closure"]:
            return
        lower["closure"] = True
        # enough: a bound that proves the best schedule so far within the target gap
        lower["stage"] = max(lower["stage"], stage_bound(
            facts, budget, offload,
            deadline=min(closing[0], time.perf_counter() + CLOSURE_SHARE * time_limit_s),
            enough=(1 - mip_gap) * reported[0] if SHORTCUTS else math.inf))
        lower["known"] = max(lower["known"], lower["stage"])

    starts: list = []
    timelines: dict = {}
    # the best time reported so far; when the first and the best fitting one came
    reported = [math.inf, None, None]
    if warm_start:
        def replay(name, s):
            # Each rule's schedule as it is made: the first that fits is reported at once (on
            # an 800-op graph the rules take 10 s; the first fits in well under one).
            tl = timelines[name] = simulate(graph, s)
            if tl.peak_bytes <= budget and tl.total_time < reported[0]:
                reported[0] = tl.total_time
                reported[2] = time.perf_counter() - started
                if reported[1] is None:
                    reported[1] = reported[2]
                if on_incumbent is not None:
                    on_incumbent(s, lower["known"])

        # The baselines run to the end whatever the deadline, so the answer is never worse:
        # store-all and Chen's first (their time is the closing work's step), the greedy
        # before the chain combination, which takes a share of what it leaves (on Llama-70B
        # per rank the greedy takes 25-30 s, and ran past the limit after the rules).
        began = time.perf_counter()
        baselines = [(f"baseline/{name}", s) for name, s in baseline_schedules(graph, budget,
                                                                               greedy=False)]
        for name, s in baselines:
            replay(name, s)
        step = run.stats["closing_step_s"] = time.perf_counter() - began
        reserve = run.stats["closing_reserve_s"] = closing_reserve(step, time_limit_s)
        closing[0] = deadline - _closing_step(run.stats)
        # Where the MILP will not be built, or its build would not fit in the time the rules
        # leave, the rules (and the closure LP) have the whole limit but the reserve.
        rules_time = rules_seconds(time_limit_s)
        build = run.stats["build_estimate_s"] = _build_estimate(graph, step)
        rules_deadline = (deadline - reserve if _too_large(graph)
                          or build > time_limit_s - rules_time
                          else min(deadline - reserve, started + rules_time))

        def greedy():
            if len(baselines) == 2:
                baselines.append(("baseline/greedy", greedy_baseline_schedule(graph, budget)))
                replay(*baselines[-1])

        made = heuristic_schedules(
            graph, budget, facts, deadline=rules_deadline, on_schedule=replay,
            before_costly=closure_bound, before_chain=greedy,
            enough=lambda: _proven_within(lower["known"], reported[0], mip_gap),
            have_start=lambda: reported[0] < math.inf)
        greedy()  # where the rules ended before the chain (a rule proven within the gap)
        starts = family_starts(graph, budget, baselines + made, timelines)
    closure_bound()
    return starts, timelines, reported, lower["stage"], lower["known"]


def _no_rule_fits(run: Run, form: Formulation, pool: Pool) -> list[tuple[str, Schedule]]:
    """No rule fits: offer the pool the least-memory schedule of an exact min-peak solve when it
    fits, or one pushed below the budget by a min-peak phase; raise InfeasibleBudgetError when
    no schedule can fit. Then the rules once more, on that schedule's Impls (`_least_rules`);
    returns the fastest of them that fits, as a start to race (or nothing)."""
    # No rule fits: the least-memory schedule decides feasibility and is a start.
    graph, budget, be, deadline = run.graph, run.budget, run.backend, run.deadline
    peak, lower, proven, s = min_budget_details(
        graph, run.mode, backend=be.name if be.WARM_START else "highs",
        time_limit_s=min(MIN_BUDGET_TIME_LIMIT_S, max(1.0, MIN_PEAK_SHARE * run.time_limit_s)),
        offload=run.offload)
    least = None
    if peak <= budget:
        pool.offer_schedule(form, s, "min_peak")
        least = s
    elif lower > budget:
        raise _infeasible(run)
    elif _sharing(be):
        # Undecided: the budget lies between the proven least peak and the least found. Phase 1
        # (as MOCCASIN's): push the peak below the budget, or prove it cannot go there, before
        # optimising time. Branch and bound on the time model with no incumbent found nothing in
        # 600 s on MobileNetV2 (batch 272) at 7 GiB, while the min-peak search (LNS on the peak)
        # went below 7 GiB in about 100 s.
        now = time.perf_counter()
        s1, lower1 = min_peak_below(
            run.phase(deadline=now + PHASE1_SHARE * (deadline - now), mip_gap=1e-6), s)
        run.stats["phase1_s"] = round(time.perf_counter() - pool.start, 3)
        if s1 is not None:
            pool.offer_schedule(form, s1, "min_peak/phase1")
            least = s1
        elif lower1 > budget:
            raise InfeasibleBudgetError(infeasible_message(
                graph, budget, run.mode, least=peak, lower=lower1, proven=False, schedule=s,
                why="proven: no schedule peaks at or below it"), budget=budget, min_budget=peak)
    return _least_rules(run, form, pool, least)


def _least_rules(run: Run, form: Formulation, pool: Pool, least: Schedule | None
                 ) -> list[tuple[str, Schedule]]:
    """The rules on the Impls of `least` (a schedule that fits; None: nothing to do), for at most
    LEAST_RULES_SHARE of the time left; the fastest that fits is offered to the pool and
    returned as a start. The least-memory schedule itself recomputes nearly everything, while
    the lean Impls (each op's least held bytes, not its least contribution to the peak) can
    miss the choice that lets any other plan fit (docs/formulation.md, section 7, has a
    measured case)."""
    graph, budget, deadline = run.graph, run.budget, run.deadline
    impl = tuple(least.impl) if least is not None else ()
    if not any(impl) or impl == lean_impls(graph, form.facts):
        return []  # the rules ran on these Impls already
    now = time.perf_counter()
    made = heuristic_schedules(graph, budget, form.facts,
                               deadline=now + LEAST_RULES_SHARE * max(0.0, deadline - now),
                               impls=[("least/", impl)])
    best = best_fitting(graph, budget, made)
    run.stats["least_rules_s"] = round(time.perf_counter() - now, 3)
    if best is None:
        return []
    name, s, _ = best
    pool.offer_schedule(form, s, f"heuristic:{name}")
    return [(f"heuristic:{name}", s)]


def _store_all_if_optimal(run: Run) -> SolveResult | None:
    """Store-all on each Op's fastest Impl, when it fits the budget: its time is the time floor
    (no schedule is faster), so it is optimal without building the MILP (which takes seconds
    even on a ResNet-18; maxbatch and generous budgets ask this often). None otherwise."""
    if not SHORTCUTS:
        return None
    graph, facts = run.graph, run.facts
    schedule = store_all_schedule(graph, facts.fastest_impls)
    tl = simulate(graph, schedule)
    floor = facts.time_floor
    if tl.peak_bytes > run.budget or tl.total_time > floor + 1e-9 * max(1.0, floor):
        return None  # over the budget, or an Impl clash put a slower Impl back
    base_time = (tl.total_time if not any(schedule.impl)
                 else simulate(graph, store_all_schedule(graph)).total_time)
    return _answer_without_search(run, schedule, tl, floor, {"floor_bound_s": floor}, base_time,
                                  "store_all",
                                  "skipped: store-all on the fastest Impls fits the budget")


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _proven_within(lower: float, seconds: float, mip_gap: float) -> bool:
    """Whether the bound `lower` proves a schedule of `seconds` within `mip_gap` of optimal
    (never without SHORTCUTS: no rule is then the answer, and the costly rules all run)."""
    return SHORTCUTS and lower >= (1 - mip_gap) * seconds


def _rule_if_proven(run: Run, best, timelines: dict, lower: float, stage_lower: float
                    ) -> SolveResult | None:
    """The best rule's schedule (`best`: name, schedule, seconds), when `lower`, the bound known
    before any search (the floor, the stage bound), proves it within `mip_gap`: no MILP is
    built. None otherwise."""
    name, schedule, seconds = best
    if not _proven_within(lower, seconds, run.mip_gap):
        return None
    graph = run.graph
    tl = timelines[name] if name in timelines else simulate(graph, schedule)
    return _answer_without_search(
        run, schedule, tl, lower,
        {"floor_bound_s": run.facts.time_floor, "stage_bound_s": stage_lower},
        _store_all_time(graph, timelines), f"heuristic:{name}",
        "skipped: the floor and stage bound prove the best rule within the target gap")


def _rule_unproven(run: Run, best, timelines: dict, lower: float, stage_lower: float,
                   reported: list, why: str) -> SolveResult:
    """The best rule's schedule as the answer when no search can follow (`why`), with its gap
    to `lower` (status 'optimal' only if that proves it within the target gap)."""
    name, schedule, _ = best
    graph = run.graph
    tl = timelines[name] if name in timelines else simulate(graph, schedule)
    r = _answer_without_search(
        run, schedule, tl, lower,
        {"floor_bound_s": run.facts.time_floor, "stage_bound_s": stage_lower},
        _store_all_time(graph, timelines), f"heuristic:{name}", why)
    r.stats.update(first_incumbent_s=_rounded(reported[1]), best_found_s=_rounded(reported[2]),
                   heuristic=f"heuristic:{name}", heuristic_objective_s=tl.total_time)
    if r.mip_gap > run.mip_gap + 1e-9:
        r = dataclasses.replace(r, status=FEASIBLE_AT_TIME_LIMIT)
    return r


def _answer_without_search(run: Run, schedule: Schedule, tl, lower: float, bounds: dict,
                           base_time: float, source: str, why: str) -> SolveResult:
    """A schedule proven within the target gap before any MILP (`lower` a valid bound on the
    step time), as solve's answer."""
    mode, budget = run.mode, run.budget
    gap = max(0.0, (tl.total_time - lower) / tl.total_time) if tl.total_time > 0 else 0.0
    schedule = _answered(schedule, tl, gap, lower, base_time, mode=mode, budget_bytes=budget,
                         created_by=source)
    stats = {"mode": mode, "search": why, "lower_bound_s": lower, **bounds,
             **{k: run.stats.get(k) for k in ("closing_step_s", "closing_reserve_s",
                                              "build_estimate_s")},
             "store_all_time_s": base_time, "incumbent_source": source}
    return SolveResult(status=OPTIMAL, schedule=schedule, objective=tl.total_time,
                       predicted_peak_bytes=tl.peak_bytes, predicted_time=tl.total_time,
                       mip_gap=gap, solve_time_s=time.perf_counter() - run.started,
                       backend=run.backend.name, stats=stats)


def _answered(schedule: Schedule, tl, gap: float | None, lower: float | None, base_time: float,
              **changes) -> Schedule:
    """`schedule` as solve's answer: the simulator's peak and time (`tl`), and in its meta the
    gap, the lower bound (seconds) and store-all's time."""
    return dataclasses.replace(schedule, **changes, predicted_peak_bytes=tl.peak_bytes,
                               predicted_time=tl.total_time,
                               meta={"mip_gap": gap, "lower_bound_s": lower,
                                     "store_all_time_s": base_time})


def _certify(run: Run, ctx: SearchContext, base_time: float) -> SolveResult:
    """The SolveResult of a search: its best schedule replayed by the simulator, with the gap."""
    form, pool, be, stats = ctx.form, ctx.pool, run.backend, run.stats
    r = ctx.bb_result or BackendResult(status=TIME_LIMIT, x=None, objective=None, bound=None,
                                       seconds=0.0, message=stats.get("search", "no search"))
    graph, budget = form.graph, form.budget
    if ctx.lns is not None:
        stats["lns"] = ctx.lns.as_dict()
    if ctx.structured is not None:
        stats["structured"] = ctx.structured.as_dict()
    solve_s = time.perf_counter() - run.started
    if r.status == INFEASIBLE:
        raise _infeasible(run)
    x, _, _ = pool.get(form)
    stats["message"] = r.message
    fb = ctx.bb_form
    if fb is not form:
        stats["branch_and_bound_model"] = {
            **fb.stats(), "recompute_rows": None if fb.recompute_points is None
            else len(fb.recompute_points), "restarts": ctx.restarts,
            "support_cuts": len(fb.support_cuts)}
    if r.status == "error":  # a solver failure is reported, even with a heuristic in hand
        return SolveResult.failure(status=ERROR, backend=be.name, solve_time_s=solve_s,
                                   stats=stats, message=r.message)
    if x is None:
        return SolveResult.failure(
            status=ERROR, backend=be.name, solve_time_s=solve_s, stats=stats,
            message=f"no schedule found within the time limit of {run.time_limit_s:g} s "
                    f"({r.message}); raise --time-limit")

    schedule = form.decode(x)
    tl = simulate(graph, schedule)
    claimed = form.seconds(x)
    # The MILP and the simulator must agree: anything else is a bug in the formulation.
    assert tl.peak_bytes <= budget, (
        f"internal error: the MILP's schedule peaks at {tl.peak_bytes} bytes in the simulator, "
        f"over the budget {budget}")
    assert abs(tl.total_time - claimed) <= 1e-7 * max(1.0, tl.total_time), (
        f"internal error: the MILP claims {claimed} s, the simulator says {tl.total_time} s")
    bound = pool.bound()
    lower = None if bound is None else min(bound / form.time_scale, tl.total_time)
    gap = None if lower is None else max(0.0, (tl.total_time - lower) / tl.total_time)
    proven = gap is not None and gap <= run.mip_gap + 1e-9
    status = OPTIMAL if proven else FEASIBLE_AT_TIME_LIMIT
    schedule = _answered(schedule, tl, gap, lower, base_time, created_by=be.name)

    def seconds(source):
        b = pool.bound(source)
        return None if b is None else b / form.time_scale

    stats.update({"first_incumbent_s": None if pool.first_s is None else round(pool.first_s, 3),
                  "best_found_s": None if pool.last_s is None else round(pool.last_s, 3),
                  "lower_bound_s": lower, "incumbent_source": pool.source,
                  # which relaxation gave the bound: the LP's, branch and bound's, the probes'
                  "floor_bound_s": seconds("floor"), "stage_bound_s": seconds("stages"),
                  "lp_bound_s": seconds("lp"),
                  "bb_bound_s": seconds("branch_and_bound"),
                  "probe_bound_s": seconds("probe"),
                  "probes": list(ctx.probes),  # each probe's (gap, status, seconds)
                  "store_all_time_s": base_time, "backend_status": r.status})
    return SolveResult(status=status, schedule=schedule, objective=tl.total_time,
                       predicted_peak_bytes=tl.peak_bytes, predicted_time=tl.total_time,
                       mip_gap=gap, solve_time_s=solve_s, backend=be.name, stats=stats)
