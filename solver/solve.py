"""`solve` and `min_budget`: from a graph and a budget to a checked SolveResult.

The pipeline: build the MILP (formulation.py); answer a budget below what some point of the step
needs whatever the schedule with InfeasibleBudgetError at once; take the fastest heuristic
schedule that fits as the first incumbent (warmstart.py), or, when none fits, the least-memory
schedule from an exact min-peak solve (which also proves infeasibility), pushed below the budget
by a first min-peak phase when that solve left the budget undecided (`_min_peak_below`); then
solve. With the HiGHS backend both cores work: one thread runs branch and bound (on an equivalent
model with full memory sums and lazy recomputation rows, see `_branch_and_bound_form`, tightened
first by rounds of recompute-support cuts, `_tighten` and cuts.py), the other solves the LP
relaxation (a bound at once, and LP rounding) and then improves the incumbent by
large-neighbourhood search (lns.py), first racing one start per Impl family for a short slice
each (the start decides where a local search ends), and on small models turning to bound
probes (`_probe_bounds`: branch and bound under an objective cutoff) while no better schedule
turns up; each hands the other its better solutions through HiGHS's callbacks. Every answer is
decoded into a Schedule and replayed by the simulator: the peak must fit the budget and the time
must equal the MILP's objective, or it is a bug and says so.

Gaps are (incumbent - lower bound) / incumbent on the whole step time (forward + recomputation +
backward), as MONeT reports them. Lower bounds come only from relaxations of the exact model
(its LP, or branch and bound on it with some recomputation rows left out, both with valid cuts
added, or a probe's branch and bound under a cutoff), never from the heuristics or LNS, which
fix columns.
"""

from __future__ import annotations

import math
import sys
import threading
import time

import numpy as np

from . import cuts, lns
from .analysis import MODES
from .backends import get_backend
from .backends.base import INFEASIBLE as B_INFEASIBLE
from .backends.base import BackendResult
from .backends.base import OPTIMAL as B_OPTIMAL
from .errors import InfeasibleBudgetError
from .formulation import Formulation
from .graph import OpGraph
from .schedule import ERROR, FEASIBLE_AT_TIME_LIMIT, OPTIMAL, Schedule, SolveResult
from .simulate import simulate, store_all_schedule
from .units import format_bytes, parse_bytes
from .warmstart import (family_starts, heuristic_schedules, least_memory, low_memory_schedules,
                        lp_rounding)

MIN_BUDGET_TIME_LIMIT_S = 120.0
RACE_SLICE_S = 45.0
"""Seconds of LNS per start when racing starts (GoogLeNet 5 GiB: after 45 s the Impl-0 start
was at +66%, the lean one at +112%; they ended at +32.8% and +73.7%)."""
RACE_SLICE_SHARE = 0.25
"""At most this share of the time left per start (45 s from 180 s left on; a 60 s solve of
GoogLeNet at 5 GiB races two 10 s slices and ends at +86.97% against +117.23% from the lean
start alone)."""
RACE_MIN_REMAINING_S = 30.0
"""Race only with at least this much time left (LNS windows take up to 5 s each; a 30 s solve
of GoogLeNet at 5 GiB has about 20 s after the LP, and 5 s slices changed nothing): shorter
solves go on from the best start."""
ALL_ROWS_NNZ = 200_000
"""Below this many nonzeros (full memory sums, every recomputation row) branch and bound gets
the whole model rather than lazy rows. UNet (batch 11): 97,532; GoogLeNet (batch 320): 1.25 M.
Lazy rows restart branch and bound, which loses its tree (UNet at 5 GiB restarted 2-6 times)."""
PROBE_QUIET_S = 30.0
"""Seconds without a better schedule (from LNS or branch and bound) after which the LNS thread
turns to proving bounds (`_probe_bounds`) until a better schedule turns up. Only where branch
and bound has every row (ALL_ROWS_NNZ): each probe starts a search from the root, cheap there
(UNet at batch 11: about 20 s) and minutes on the large models, where LNS also keeps finding
better schedules late. Probes on lazy rows proved no more than branch and bound's own bound
while LNS lost their time (docs/BENCHMARKS.md, Solver: GoogLeNet at 5 GiB)."""
PROBE_GAPS = (2.0, 1.5, 1.0)
"""The lines a probe tries to prove, in multiples of the target gap below the incumbent."""
CUT_ROUNDS = 8
"""Root rounds of recompute-support cuts (LP, separate, add) before branch and bound."""
ROW_TOLERANCE_UNITS = 1e-5
"""How far past a row's bound (in the MILP's scaled units, ~4096 at the budget) a backend's
solution may be and still count as its feasibility tolerance (HiGHS: 1e-6 per row) rather than
a bug in the formulation."""
CUT_TIME_SHARE = 0.15
"""At most this share of the time left goes to the cut rounds. Measured on the profiled
GoogLeNet (batch 320): 2 rounds (5 s) at 9 GiB, 4 rounds (47 s) at 5 GiB."""


# ----------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------
class _Progress:
    """A tqdm bar over the time limit showing the incumbent's overhead and the gap (thread-safe);
    silent unless verbose or stderr is a terminal."""

    def __init__(self, enabled: bool, time_limit_s: float, base_time: float, time_scale: float,
                 desc: str, peak: float | None = None):
        self.enabled = enabled
        self.base, self.scale = base_time, time_scale
        self.peak_scale = peak  # set when the objective is the peak (MILP units -> bytes)
        self.lock = threading.Lock()
        self.incumbent = self.bound = None
        self.start = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=max(1, int(math.ceil(time_limit_s))), unit="s", desc=desc,
                            leave=True, file=sys.stderr, dynamic_ncols=True,
                            bar_format="{desc}: {n:.0f}/{total}s |{bar}| {postfix}")

    def update(self, incumbent=None, bound=None) -> None:
        """incumbent and bound in MILP objective units."""
        if self.bar is None:
            return
        with self.lock:
            if incumbent is not None and np.isfinite(incumbent):
                self.incumbent = incumbent if self.incumbent is None else min(self.incumbent,
                                                                              incumbent)
            if bound is not None and np.isfinite(bound):
                self.bound = bound if self.bound is None else max(self.bound, bound)
            post = []
            if self.incumbent is not None and self.peak_scale is not None:
                post.append(f"peak {format_bytes(int(self.incumbent * self.peak_scale))}")
            elif self.incumbent is not None:
                post.append(f"overhead {100 * (self.incumbent / self.scale / self.base - 1):.2f}%")
            if self.incumbent is not None and self.bound is not None:
                post.append(f"gap {100 * max(0.0, 1 - self.bound / self.incumbent):.2f}%")
            self.bar.set_postfix_str(", ".join(post) or "searching", refresh=False)
            self.bar.n = min(self.bar.total, time.perf_counter() - self.start)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------
# Min budget
# ----------------------------------------------------------------------------------------------
_MIN_BUDGET_CACHE: dict[tuple, tuple[int, int, bool, Schedule]] = {}


def min_budget_details(graph: OpGraph, mode: str = "full", *, backend: str = "highs",
                       time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S, verbose: bool = False,
                       offload: bool = False) -> tuple[int, int, bool, Schedule]:
    """(least feasible peak found, proven lower bound, proven optimal?, a schedule at that peak).

    An exact min-peak MILP (the same model with the peak as objective), started from the
    least-memory rules and improved like `solve` does (LP rounding, LNS beside branch and
    bound). Cached per graph and mode."""
    key = (graph.fingerprint, hash((graph.stage_grad_bytes, graph.final_grad_bytes,
                                    graph.param_bytes, graph.optimizer_bytes,
                                    tuple((i.internal_bytes, i.fwd_workspace, i.bwd_workspace,
                                           i.recompute_transient, i.early_release)
                                          for op in graph.ops for i in op.impls))), mode,
           graph.host_bandwidth if offload else None)
    if key in _MIN_BUDGET_CACHE:
        return _MIN_BUDGET_CACHE[key]
    started = time.perf_counter()
    be = get_backend(backend)
    form = Formulation(graph, None, mode=mode, objective="peak", offload=offload)
    name, s0, peak0 = least_memory(graph, low_memory_schedules(graph, form.facts))
    form_bb = _branch_and_bound_form(form) if be.name == "highs" else form
    shared = _Shared([form, form_bb])
    shared.offer_schedule(form, s0, f"heuristic:{name}")
    progress = _Progress(verbose, time_limit_s, 1.0, 1.0, f"{graph.model} min budget",
                         peak=form.mem_scale)
    try:
        r, _, _ = _optimize(form, form_bb, be, shared, started + time_limit_s, 1e-6, verbose,
                            progress)
    finally:
        progress.close()
    x, _, _ = shared.get(form)
    best_s = form.decode(x)
    best_peak = simulate(graph, best_s).peak_bytes
    if best_peak > peak0:  # never worse than the rule we started from
        best_s, best_peak = s0, peak0
    lower = form.const_peak
    for bound in (r.bound, shared.lp_bound):
        if bound is not None:
            lower = max(lower, int(math.ceil(bound * form.mem_scale - 1e-6 * form.mem_scale)))
    # optimal: branch and bound proved its incumbent within 1e-6, and best_peak is no higher
    proven = lower >= best_peak or r.status == B_OPTIMAL
    lower = min(lower, best_peak)
    out = (best_peak, lower, proven, best_s)
    _MIN_BUDGET_CACHE[key] = out
    return out


def min_budget(graph: OpGraph, mode: str = "full", *, backend: str = "highs",
               time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S, offload: bool = False) -> int:
    """The least budget (bytes) at which a schedule exists: an exact min-peak solve, warm-started
    from the least-memory rules. Exact when the solve proves it within `time_limit_s` (seconds on
    the models measured); otherwise the least feasible peak found, an upper bound."""
    return min_budget_details(graph, mode, backend=backend, time_limit_s=time_limit_s,
                              offload=offload)[0]


def _infeasible(graph: OpGraph, budget: int, mode: str, backend: str, time_limit_s: float,
                why: str = "", offload: bool = False) -> InfeasibleBudgetError:
    peak, lower, proven, _ = min_budget_details(graph, mode, backend=backend,
                                                time_limit_s=time_limit_s, offload=offload)
    what = f"{graph.model} batch {graph.batch}"
    if proven:
        msg = (f"budget {format_bytes(budget)} is below the minimum feasible "
               f"{format_bytes(peak)} for {what} ({mode} mode); raise --budget")
    else:
        msg = (f"budget {format_bytes(budget)} is infeasible for {what} ({mode} mode): the "
               f"minimum feasible budget is between {format_bytes(max(lower, budget + 1))} and "
               f"{format_bytes(peak)} (not proven within the time limit); raise --budget")
    if why:
        msg += f" ({why})"
    return InfeasibleBudgetError(msg, budget=budget, min_budget=peak)


# ----------------------------------------------------------------------------------------------
# Solve
# ----------------------------------------------------------------------------------------------
class _Shared:
    """The best schedule known to any thread, with its column vector in each formulation.

    Branch and bound may run on a different (equivalent) formulation from the LNS (full memory
    sums against running sums); a schedule found in one is encoded into the others when offered,
    so each thread reads a vector of its own model. Objectives agree across them (same costs,
    same scaling)."""

    def __init__(self, forms):
        self.forms = list({id(f): f for f in forms}.values())
        self.lock = threading.Lock()
        self.xs: dict[int, np.ndarray] = {}
        self.obj = math.inf
        self.source = ""
        self.first_s = None
        self.last_s = None
        self.start = time.perf_counter()
        self.version = 0
        self.lp_bound = None
        """The LP relaxation's value, when a helper solved it: a valid lower bound."""
        self.proven = None
        """The best bound the probes proved (`_probe_bounds`): a valid lower bound."""
        self.probes = []
        """(gap, outcome, seconds) of each probe, for the statistics."""
        self.restarts = 0
        """Times branch and bound restarted with more recomputation rows (lazy rows)."""
        self.guide = None
        """(version, x): the latest LP relaxation solution as a vector of the first formulation
        (the one LNS works on), its RINS guide."""
        self.on_incumbent = None
        """solve(on_incumbent=...): told of every better schedule, with the best proven bound."""

    def set_guide(self, form: Formulation, x: np.ndarray, replace: bool = True) -> None:
        """Offer an LP solution of `form` as the RINS guide (with `replace=False` only when
        there is none yet: the cut rounds' LPs are tighter than the plain one)."""
        if not replace and self.guide is not None:
            return
        mapped = lns.map_decisions(form, x, self.forms[0])
        with self.lock:
            if replace or self.guide is None:
                self.guide = (1 if self.guide is None else self.guide[0] + 1, mapped)

    def offer(self, form: Formulation, x: np.ndarray, source: str,
              peak: int | None = None) -> bool:
        """Take x (a vector of `form`) if it beats the best; True if it did. `peak`: the
        simulated peak of its schedule, when the caller has it already."""
        obj = form.milp.objective(x)
        if not obj < self.obj - 1e-9 * max(1.0, abs(obj)):
            return False
        schedule = form.decode(x)
        if form.objective == "time":
            if peak is None:
                peak = simulate(form.graph, schedule).peak_bytes
            over = peak - form.budget
            if over > 0:
                # Within the backend's feasibility tolerance a memory row can pass a few bytes
                # over the budget (seen: 1 byte on GPT-2 at 8.8 GiB): not a schedule. More than
                # the tolerance is a formulation bug.
                assert over <= ROW_TOLERANCE_UNITS * form.mem_scale, (
                    f"internal error: a MILP solution ({source}) peaks {over} bytes over the "
                    f"budget {form.budget} in the simulator")
                return False
        xs = {id(f): (np.array(x, dtype=float) if f is form else f.encode(schedule))
              for f in self.forms}
        with self.lock:
            if obj < self.obj - 1e-9 * max(1.0, abs(obj)):
                self.xs, self.obj, self.source = xs, obj, source
                self.version += 1
                self.last_s = time.perf_counter() - self.start
                if self.first_s is None:
                    self.first_s = self.last_s
                accepted = True
            else:
                accepted = False
        if accepted and self.on_incumbent is not None:
            # Bounds are kept in the MILP's scaled time units (every form shares the scaling).
            bounds = [b / form.time_scale for b in (self.lp_bound, self.proven) if b is not None]
            self.on_incumbent(schedule, max(bounds) if bounds else None)
        return accepted

    def offer_schedule(self, form: Formulation, schedule, source: str) -> bool:
        return self.offer(form, form.encode(schedule), source)

    def add_form(self, form: Formulation, replacing: Formulation | None = None) -> None:
        """Start keeping vectors of `form` too (the best is encoded into it now), and stop
        keeping those of `replacing` (a branch-and-bound model that was restarted)."""
        with self.lock:
            if replacing is not None and replacing is not self.forms[0]:
                self.forms = [f for f in self.forms if f is not replacing]
                self.xs.pop(id(replacing), None)
            if any(f is form for f in self.forms):
                return
            self.forms.append(form)
            first = next((f for f in self.forms if id(f) in self.xs), None)
            if first is not None:
                self.xs[id(form)] = form.encode(first.decode(self.xs[id(first)]))

    def get(self, form: Formulation):
        """(vector of `form` or None, objective, version)."""
        with self.lock:
            return self.xs.get(id(form)), self.obj, self.version

    @property
    def has(self) -> bool:
        return bool(self.xs)


def _branch_and_bound_form(form: Formulation, points=None,
                           support_cuts=frozenset()) -> Formulation:
    """The formulation branch and bound runs on: full memory sums (HiGHS solved the root LP of
    the full-sum form up to three times faster than the running-sum form on the profiled
    GoogLeNet) and, for the time objective on a model above ALL_ROWS_NNZ, memory rows only at
    the recomputation points in `points` (lazy rows: on the profiled GoogLeNet and ResNet-50 at
    5 GiB the LP bound is the same without any of them and the LP solves seven times faster; the
    simulator checks every solution and the loop in `_solve_concurrently` adds the points a
    solution violates), plus the recompute-support cuts `support_cuts` (solver/cuts.py)."""
    nnz = form.full_sum_nnz + form.milp.nnz  # of the full-sum form with every row
    if form.objective != "time":
        points = None
    elif _every_row(form):
        points = None  # small enough for every row: no restarts that lose the tree
    elif points is None:
        points = frozenset()
    big = points is None and nnz > 2_500_000
    if big and not support_cuts:
        return form
    return Formulation(form.graph, form.budget, mode=form.mode, objective=form.objective,
                       running_sums=big, recompute_points=points, offload=form.offload,
                       support_cuts=support_cuts)


def _every_row(form: Formulation) -> bool:
    """Small enough (ALL_ROWS_NNZ) for branch and bound to get every recomputation row."""
    return form.full_sum_nnz + form.milp.nnz <= ALL_ROWS_NNZ


def _tighten(form: Formulation, form_bb: Formulation, shared: "_Shared", progress: "_Progress",
             deadline: float) -> Formulation:
    """Root cut rounds for branch and bound's model: solve its LP relaxation, add the
    recompute-support cuts the LP solution breaks (solver/cuts.py), again, until none is broken,
    the bound stops moving, or CUT_ROUNDS or CUT_TIME_SHARE of the time left is used. Every LP
    optimum is a valid bound (the cuts remove no schedule) and is reported as one. Returns the
    model with the cuts (or `form_bb` itself when there is nothing to tighten)."""
    if form_bb.objective != "time" or form_bb is form:
        return form_bb
    paths = cuts.support_paths(form_bb)
    if not paths:
        return form_bb
    stop_at = time.perf_counter() + CUT_TIME_SHARE * (deadline - time.perf_counter())
    fb, last = form_bb, None
    for _ in range(CUT_ROUNDS):
        left = stop_at - time.perf_counter()
        if left <= 0:
            break
        r = highspy_backend().solve(fb.milp.relaxation(), time_limit_s=left, mip_gap=0.0)
        if r.status != B_OPTIMAL or r.x is None:
            break
        _lp_bound(shared, progress, r.objective)
        shared.set_guide(fb, r.x)
        if last is not None and r.objective - last <= 1e-4 * max(1.0, abs(r.objective)):
            break
        last = r.objective
        found = cuts.separate(fb, r.x, paths)
        if not found:
            break
        fb = _branch_and_bound_form(form, fb.recompute_points, fb.support_cuts | set(found))
    return fb


def _tight_points(graph: OpGraph, schedule: Schedule, budget: int, share: float = 0.9):
    """(stage, op) of the recomputation points of `schedule` within `share` of the budget."""
    return frozenset((p.stage, p.op) for p in simulate(graph, schedule).points
                     if p.phase == "recompute" and p.bytes >= share * budget)


def _min_peak_below(graph: OpGraph, budget: int, mode: str, start: Schedule, deadline: float,
                    verbose: bool, offload: bool) -> tuple[Schedule | None, int]:
    """Phase 1 of a solve whose budget no rule meets: minimise the peak (the min-peak MILP, LNS
    beside branch and bound, from `start`) until a schedule fits `budget`, the peak is proven
    to stay above it, or `deadline`. Returns (a schedule that fits, or None; a proven lower
    bound on the least peak, in bytes). Branch and bound runs with the budget as its objective
    cutoff, so it only explores what could fit: its 'infeasible' then means that no schedule
    peaks at or below the budget (the cutoff sits half a memory unit above it, so a schedule
    exactly at the budget is never cut off)."""
    form = Formulation(graph, None, mode=mode, objective="peak", offload=offload)
    form_bb = _branch_and_bound_form(form)
    shared = _Shared([form, form_bb])
    shared.offer_schedule(form, start, "min_peak")
    target = budget / form.mem_scale
    progress = _Progress(verbose, max(1.0, deadline - time.perf_counter()), 1.0, 1.0,
                         f"{graph.model} peak to {format_bytes(budget)}", peak=form.mem_scale)
    try:
        r, _, _ = _solve_concurrently(form, form_bb, shared, deadline, 1e-6, verbose, progress,
                                      target=target)
    finally:
        progress.close()
    x, _, _ = shared.get(form)
    s = form.decode(x)
    if simulate(graph, s).peak_bytes <= budget:
        return s, 0
    lower = form.const_peak
    if r.status == B_INFEASIBLE:
        lower = budget + 1  # nothing below the cutoff, which lies above the budget
    for bound in (r.bound, shared.lp_bound):
        if bound is not None and np.isfinite(bound):
            lower = max(lower, int(math.ceil(bound * form.mem_scale - 1e-6 * form.mem_scale)))
    return None, lower


def solve(graph: OpGraph, budget, *, mode: str = "full", backend: str = "highs",
          time_limit_s: float = 600, mip_gap: float = 0.01, warm_start: bool = True,
          verbose: bool = False, offload: bool = False, on_incumbent=None) -> SolveResult:
    """The fastest schedule of `graph` within `budget` (bytes, or a string such as '8GiB').

    mode: 'full' (keep/recompute and an Impl per op) or 'checkpoint' (keep/recompute, Impl 0).
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
    budget = parse_bytes(budget)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s!r}")
    be = get_backend(backend)
    deadline = started + time_limit_s
    form = Formulation(graph, budget, mode=mode, offload=offload)
    build_s = time.perf_counter() - started
    stats = {**form.stats(), "build_s": round(build_s, 3), "mode": mode}
    if form.infeasible_points:
        where, need = max(form.infeasible_points, key=lambda p: p[1])
        raise _infeasible(graph, budget, mode, backend, min(MIN_BUDGET_TIME_LIMIT_S,
                                                            time_limit_s),
                          why=f"the {where} alone needs {format_bytes(need)}", offload=offload)
    base_time = simulate(graph, store_all_schedule(graph)).total_time
    shared = _Shared([form])
    shared.start = started
    shared.on_incumbent = on_incumbent

    # -- first incumbent -----------------------------------------------------------------------
    race: list[tuple[str, Schedule]] = []
    if warm_start:
        starts = family_starts(graph, budget, heuristic_schedules(graph, budget, form.facts))
        if starts:
            shared.offer_schedule(form, starts[0][1], f"heuristic:{starts[0][0]}")
            race = [(f"heuristic:{n}", s) for n, s, _ in starts]
        else:
            # No rule fits: the least-memory schedule decides feasibility and is a start.
            peak, lower, proven, s = min_budget_details(
                graph, mode, backend=backend if be.WARM_START else "highs",
                time_limit_s=min(MIN_BUDGET_TIME_LIMIT_S, max(1.0, 0.3 * time_limit_s)),
                offload=offload)
            if peak <= budget:
                shared.offer_schedule(form, s, "min_peak")
            elif lower > budget:
                raise _infeasible(graph, budget, mode, backend, MIN_BUDGET_TIME_LIMIT_S,
                                  offload=offload)
            elif be.name == "highs":
                # Undecided: the budget lies between the proven least peak and the least found.
                # Phase 1 (as MOCCASIN's): push the peak below the budget, or prove it cannot
                # go there, before optimising time. Branch and bound on the time model with no
                # incumbent found nothing in 600 s on MobileNetV2 (batch 272) at 7 GiB, while
                # the min-peak search (LNS on the peak) went below 7 GiB in about 100 s.
                remaining = deadline - time.perf_counter()
                s1, lower1 = _min_peak_below(graph, budget, mode, s,
                                             time.perf_counter() + 0.7 * remaining, verbose,
                                             offload)
                stats["phase1_s"] = round(time.perf_counter() - started, 3)
                if s1 is not None:
                    shared.offer_schedule(form, s1, "min_peak/phase1")
                elif lower1 > budget:
                    raise InfeasibleBudgetError(
                        f"budget {format_bytes(budget)} is infeasible for {graph.model} batch "
                        f"{graph.batch} ({mode} mode): proven, no schedule peaks at or below it "
                        f"(the least peak found is {format_bytes(peak)}); raise --budget",
                        budget=budget, min_budget=peak)
    stats["heuristic"] = shared.source or None
    stats["heuristic_objective_s"] = (shared.obj / form.time_scale if shared.has else None)

    progress = _Progress(verbose or sys.stderr.isatty(), time_limit_s, base_time,
                         form.time_scale, f"{graph.model} {format_bytes(budget)}")
    if shared.has:
        progress.update(incumbent=shared.obj)
    points = None
    if be.name == "highs" and shared.has:
        points = _tight_points(graph, form.decode(shared.get(form)[0]), budget)
    form_bb = _branch_and_bound_form(form, points) if be.name == "highs" else form
    if form_bb.infeasible_points:
        progress.close()
        raise _infeasible(graph, budget, mode, backend, MIN_BUDGET_TIME_LIMIT_S, offload=offload)
    shared.add_form(form_bb)
    try:
        r, lns_stats, form_bb = _optimize(form, form_bb, be, shared, deadline, mip_gap,
                                          verbose, progress, race=race)
    finally:
        progress.close()
    if lns_stats is not None:
        stats["lns"] = lns_stats
    solve_s = time.perf_counter() - started

    if r.status == B_INFEASIBLE:
        raise _infeasible(graph, budget, mode, backend, MIN_BUDGET_TIME_LIMIT_S, offload=offload)
    x, obj, _ = shared.get(form)
    stats["message"] = r.message
    if form_bb is not form:
        stats["branch_and_bound_model"] = {
            **form_bb.stats(), "recompute_rows": None if form_bb.recompute_points is None
            else len(form_bb.recompute_points), "restarts": shared.restarts,
            "support_cuts": len(form_bb.support_cuts)}
    if r.status == "error":  # a solver failure is reported, even with a heuristic in hand
        return SolveResult.failure(status=ERROR, backend=be.name, solve_time_s=solve_s,
                                   stats=stats, message=r.message)
    if x is None:
        return SolveResult.failure(
            status=ERROR, backend=be.name, solve_time_s=solve_s, stats=stats,
            message=f"no schedule found within the time limit of {time_limit_s:g} s "
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
    lower = None
    bound = r.bound
    if bound is None and r.status == B_OPTIMAL and r.objective is not None:
        # the backend proved its answer within mip_gap but reports no number (SCIPY)
        bound = r.objective - mip_gap * abs(r.objective)
    for other in (shared.lp_bound, shared.proven):
        if other is not None:
            bound = other if bound is None else max(bound, other)
    if bound is not None:
        lower = min(bound / form.time_scale, tl.total_time)
    gap = None if lower is None else max(0.0, (tl.total_time - lower) / tl.total_time)
    proven = gap is not None and gap <= mip_gap + 1e-9
    status = OPTIMAL if proven else FEASIBLE_AT_TIME_LIMIT
    schedule = Schedule(**{**schedule.__dict__, "created_by": be.name,
                           "predicted_peak_bytes": tl.peak_bytes,
                           "predicted_time": tl.total_time,
                           "meta": {"mip_gap": gap, "lower_bound_s": lower,
                                    "store_all_time_s": base_time}})
    stats.update({"first_incumbent_s": None if shared.first_s is None else round(shared.first_s, 3),
                  "best_found_s": None if shared.last_s is None else round(shared.last_s, 3),
                  "lower_bound_s": lower, "incumbent_source": shared.source,
                  # which relaxation gave the bound: the LP's, or branch and bound's dual bound
                  "lp_bound_s": (None if shared.lp_bound is None
                                 else shared.lp_bound / form.time_scale),
                  "bb_bound_s": None if r.bound is None else r.bound / form.time_scale,
                  # bounds the probes proved (_probe_bounds), and each probe's (gap, status, s)
                  "probe_bound_s": (None if shared.proven is None
                                    else shared.proven / form.time_scale),
                  "probes": list(shared.probes),
                  "store_all_time_s": base_time, "backend_status": r.status})
    return SolveResult(status=status, schedule=schedule, objective=tl.total_time,
                       predicted_peak_bytes=tl.peak_bytes, predicted_time=tl.total_time,
                       mip_gap=gap, solve_time_s=solve_s, backend=be.name, stats=stats)


def _optimize(form: Formulation, form_bb: Formulation, be, shared: _Shared, deadline: float,
              mip_gap: float, verbose: bool, progress: _Progress, race=()):
    """Solve until `deadline`, improving `shared`; returns the branch-and-bound BackendResult
    (its bound, with the LP relaxation's, is the only valid lower bound), LNS statistics (or
    None) and the model branch and bound ended on. `form` is the model for LNS and decoding,
    `form_bb` the one branch and bound starts on; `race`: (name, schedule) starts for LNS to
    race (see `_solve_concurrently`)."""
    if be.name != "highs":
        # Other backends: one solve, warm-started where the backend takes it.
        x0 = shared.get(form_bb)[0]
        r = be.solve(form_bb.milp, time_limit_s=max(0.1, deadline - time.perf_counter()),
                     mip_gap=mip_gap, warm_start=x0 if be.WARM_START else None,
                     verbose=verbose, progress=lambda sec, inc, bd: progress.update(inc, bd))
        if r.x is not None:
            shared.offer(form_bb, r.x, be.name)
        return r, None, form_bb
    return _solve_concurrently(form, form_bb, shared, deadline, mip_gap, verbose, progress,
                               race=race)


def _solve_concurrently(form: Formulation, form_bb: Formulation, shared: _Shared,
                        deadline: float, mip_gap: float, verbose: bool, progress: _Progress,
                        target: float | None = None, race=()):
    """Branch and bound on the whole MILP in a thread (after root cut rounds, `_tighten`); in
    this one, the LP relaxation (a bound, and LP rounding) and then LNS. Each hands the other
    its better solutions through HiGHS's improving-solution and user-solution callbacks. When
    branch and bound runs with lazy recomputation rows (see `_branch_and_bound_form`), each of
    its solutions is replayed by the simulator first: a valid one is shared, one that breaks the
    budget at a recomputation point stops the solve, and it restarts with rows at those points
    (from the best valid schedule).
    With `target` (objective units): stop once an incumbent reaches it or the bound exceeds it,
    and give branch and bound the cutoff target + 0.5 (a status 'infeasible' then means that no
    solution is at or below the target).
    `race`: (name, schedule) starts of different Impl families. Where LNS starts decides where
    it ends (see warmstart.family_starts), so with two or more distinct starts and time to spare
    LNS first runs a short slice from each on its own (not taking the others' solutions), then
    goes on from the best solution known.
    Once LNS has gone PROBE_QUIET_S without a better schedule (small models, time objective,
    no target), this thread runs bound probes (`_probe_bounds`) until one turns up.
    Returns the last branch-and-bound BackendResult and the LNS statistics."""
    assert shared.forms[0] is form, "LNS works on the first formulation of `shared`"
    graph, budget = form.graph, form.budget
    done = threading.Event()
    result: dict = {}
    state = {"form": form_bb, "injected": 0, "violated": set(), "stop": False}

    def consider(fb: Formulation, x: np.ndarray) -> None:
        """Share a solution of branch and bound once the simulator accepts it."""
        if len(x) != fb.milp.num_vars:
            return
        peak = None
        if fb.recompute_points is not None:
            tl = simulate(graph, fb.decode(x))
            if tl.peak_bytes > budget:
                state["violated"] |= {(p.stage, p.op) for p in tl.points
                                      if p.phase == "recompute" and p.bytes > budget}
                state["stop"] = True
                return
            peak = tl.peak_bytes
        if shared.offer(fb, x, "highs", peak):
            progress.update(incumbent=fb.milp.objective(x))

    def on_improving(e):
        consider(state["form"], np.array(e.data_out.mip_solution, dtype=float))

    def on_user_solution(e):
        x, obj, version = shared.get(state["form"])
        if x is None or version == state["injected"]:
            return
        if obj < e.data_out.mip_primal_bound - 1e-9 * max(1.0, abs(obj)):
            e.data_in.setSolution(x)
            e.data_in.user_has_solution = True
        state["injected"] = version

    def on_logging(e):
        # its bound is valid (each model is a relaxation); its incumbent may not be yet
        progress.update(bound=e.data_out.mip_dual_bound)

    def reached() -> bool:
        return target is not None and shared.obj <= target + 1e-9 * max(1.0, abs(target))

    def proven_within_gap() -> bool:
        """The probes (`_probe_bounds`) proved the incumbent within `mip_gap`."""
        return shared.proven is not None and shared.proven >= (1 - mip_gap) * shared.obj

    def on_interrupt(e):
        if state["stop"] or reached() or proven_within_gap() or (
                target is not None and e.data_out.mip_dual_bound > target + 1e-6):
            e.interrupt()

    def run_full():
        try:
            # root cut rounds in this thread, so LP rounding and LNS go on beside them
            first = state["form"]
            tightened = _tighten(form, first, shared, progress, deadline)
            if tightened is not first:
                shared.add_form(tightened, replacing=first)
                state["form"] = tightened
            while True:
                fb = state["form"]
                x0, _, version = shared.get(fb)
                state["injected"] = version
                state["stop"] = False
                options = {} if target is None else {"objective_bound": target + 0.5}
                r = _HighsWithCallbacks(on_improving, on_user_solution, on_logging,
                                        on_interrupt, options).solve(
                    fb.milp, time_limit_s=max(0.1, deadline - time.perf_counter()),
                    mip_gap=mip_gap, warm_start=x0, verbose=verbose)
                result["r"] = r
                if r.x is not None:  # also when HiGHS never ran (an empty model)
                    consider(fb, r.x)
                if (not state["violated"] or state["violated"] <= fb.recompute_points
                        or time.perf_counter() > deadline - 1.0):
                    break  # (a point already present: a tolerance effect, not a missing row)
                # lazy rows: restart with rows at the points the last solution broke
                points = fb.recompute_points | state["violated"]
                state["violated"] = set()
                nxt = _branch_and_bound_form(form, points, fb.support_cuts)
                if nxt.infeasible_points:
                    # a point over budget whatever the decisions: so is the next real point
                    result["r"] = BackendResult(status=B_INFEASIBLE, x=None, objective=None,
                                                bound=None, seconds=0.0,
                                                message=f"{nxt.infeasible_points[0][0]} is "
                                                        f"over budget whatever the schedule")
                    break
                shared.add_form(nxt, replacing=fb)
                state["form"] = nxt
                shared.restarts += 1
        finally:
            done.set()

    worker = threading.Thread(target=run_full, name="monetlike-milp", daemon=True)
    worker.start()
    lns_stats = None
    try:
        remaining = deadline - time.perf_counter()
        # The LP relaxation: a valid bound at once (branch and bound's root can take minutes)
        # and LP rounding. Worth it when there is time for it and for the search after.
        if remaining > 20 and not done.is_set() and not reached():
            rounded = lp_rounding(form_bb, highspy_backend(),
                                  time_limit_s=min(120.0, 0.3 * remaining),
                                  on_bound=lambda b: _lp_bound(shared, progress, b),
                                  on_solution=lambda x: shared.set_guide(form_bb, x, False))
            if rounded is not None and shared.offer_schedule(form, rounded[1], rounded[0]):
                progress.update(incumbent=shared.obj)
        # Wait for a first incumbent (from the heuristics or branch and bound) before LNS.
        while not shared.has and not done.wait(0.2):
            if time.perf_counter() > deadline:
                break
        x0 = shared.get(form)[0]
        if x0 is not None and not done.is_set() and not reached():
            lns_stats = {"windows": 0, "improved": 0, "timed_out": 0, "rins": 0,
                         "rins_improved": 0, "seconds": 0.0}

            def tally(st):
                lns_stats["windows"] += st.windows
                lns_stats["improved"] += st.improved
                lns_stats["timed_out"] += st.timed_out
                lns_stats["rins"] += st.rins
                lns_stats["rins_improved"] += st.rins_improved
                lns_stats["seconds"] = round(lns_stats["seconds"] + st.seconds, 1)

            seen = {"version": shared.get(form)[2]}

            def on_improve(x, obj):
                if shared.offer(form, x, "lns"):
                    seen["version"] = shared.get(form)[2]
                    progress.update(incumbent=obj)

            def stop():
                return done.is_set() or reached() or proven_within_gap()

            starts = _race_starts(form, x0, race)
            remaining = deadline - time.perf_counter()
            if len(starts) > 1 and remaining > RACE_MIN_REMAINING_S:
                slice_s = min(RACE_SLICE_S, RACE_SLICE_SHARE * remaining)
                lns_stats["race"] = {}
                for name, xs in starts:
                    if stop():
                        break
                    x, st = lns.improve(form, xs, highspy_backend(),
                                        deadline=min(deadline, time.perf_counter() + slice_s),
                                        on_improve=on_improve,
                                        should_stop=stop, guide=lambda: shared.guide)
                    tally(st)
                    lns_stats["race"][name] = form.milp.objective(x) / form.time_scale
            x0, _, seen["version"] = shared.get(form)

            def incoming():
                x, _, version = shared.get(form)
                if version != seen["version"]:
                    seen["version"] = version
                    return x
                return None

            # LNS until it has gone PROBE_QUIET_S without a better schedule from anywhere, then
            # probes (bounds) until one turns up, and LNS again from it (time objective only).
            probing = target is None and form.objective == "time" and _every_row(form)
            probed_version = None
            while not stop() and time.perf_counter() < deadline - 0.5:
                began = time.perf_counter()

                def quiet():
                    if not probing or shared.version == probed_version:
                        return False
                    last = shared.start + (shared.last_s or 0.0)
                    return time.perf_counter() - max(last, began) > PROBE_QUIET_S

                x0 = shared.get(form)[0]
                _, st = lns.improve(form, x0, highspy_backend(), deadline=deadline,
                                    on_improve=on_improve, incoming=incoming,
                                    should_stop=lambda: stop() or quiet(),
                                    guide=lambda: shared.guide)
                tally(st)
                if stop() or not quiet():
                    break  # the deadline, or LNS ran out of windows
                probed_version = shared.version
                _probe_bounds(state["form"], shared, progress, deadline, mip_gap, stop)
    finally:
        done.wait()
        worker.join()
    return result["r"], lns_stats, state["form"]


def _probe_bounds(fb: Formulation, shared: _Shared, progress: _Progress, deadline: float,
                  mip_gap: float, should_stop) -> None:
    """Prove lower bounds with branch and bound under an objective cutoff (HiGHS's
    objective_bound): the lines PROBE_GAPS times `mip_gap` below the incumbent, in turn (twice
    the target first, then closer). Such a search only has to show that nothing costs less than
    the line, so it prunes every node whose bound reaches it, where branch and bound proper
    (which must also find schedules) keeps diving there. Measured on UNet (batch 11) at 5 GiB,
    branch and bound alone on one core beside another: the line +27.9% over store-all proven in
    110 s and +28.4% in 235 s, where the dual bound of plain branch and bound passed them after
    about 560 s and 950 s. Status infeasible proves the line; a search stopped early still
    proves its dual bound (capped at the line). Returns when a better schedule turns up (offered
    to `shared`, so LNS can work from it), when `should_stop()`, at the deadline, or when every
    line is proven.
    `fb` is branch and bound's model with every row (`_every_row`), so a schedule the probe finds
    is a schedule of the exact model, and its bounds are valid."""
    assert fb.recompute_points is None, "probes run on models with every recomputation row"
    version = shared.version

    def on_improving(e):
        x = np.array(e.data_out.mip_solution, dtype=float)
        if len(x) == fb.milp.num_vars and shared.offer(fb, x, "highs/probe"):
            progress.update(incumbent=fb.milp.objective(x))

    def on_interrupt(e):
        if should_stop() or shared.version != version or time.perf_counter() > deadline:
            e.interrupt()

    for multiple in PROBE_GAPS:
        gap = multiple * mip_gap
        line = (1 - gap) * shared.obj
        if shared.proven is not None and shared.proven >= line:
            continue
        left = deadline - time.perf_counter()
        if left < 1.0 or should_stop() or shared.version != version:
            return
        r = _HighsWithCallbacks(on_improving, lambda e: None, lambda e: None, on_interrupt,
                                {"objective_bound": line}).solve(
            fb.milp, time_limit_s=left, mip_gap=mip_gap, warm_start=None)
        # "infeasible": nothing costs less than the line. HiGHS also ends a search whose tree
        # is exhausted as "optimal" with its dual bound at or above the line.
        done = r.status == B_INFEASIBLE or (r.bound is not None and r.bound >= line)
        if done:
            proved = line - 1e-9 * max(1.0, abs(line))  # (HiGHS's cutoff tolerance)
        else:
            proved = None if r.bound is None else min(r.bound, line)
        shared.probes.append((round(gap, 6), "proved" if done else r.status, round(r.seconds, 1)))
        if proved is not None:
            with shared.lock:
                if shared.proven is None or proved > shared.proven:
                    shared.proven = proved
            progress.update(bound=proved)
        if not done:
            return


def _race_starts(form: Formulation, x0: np.ndarray, race) -> list[tuple[str, np.ndarray]]:
    """The distinct LNS starts: the best solution now (LP rounding or branch and bound may have
    beaten the heuristics) and each start of `race`, as vectors of `form`."""
    out = [("best", x0)]
    for name, s in race:
        x = form.encode(s)
        if not any(np.array_equal(np.round(x), np.round(y)) for _, y in out):
            out.append((name, x))
    return out


def _lp_bound(shared: _Shared, progress: _Progress, bound: float) -> None:
    """Record an LP optimum as a lower bound (the largest one seen is kept)."""
    if shared.lp_bound is None or bound > shared.lp_bound:
        shared.lp_bound = bound
        progress.update(bound=bound)


def highspy_backend():
    from .backends.highs import HighsBackend
    return HighsBackend()


class _HighsWithCallbacks:
    """The HiGHS backend with extra callbacks subscribed (improving solution, user solution,
    logging, interrupt)."""

    def __init__(self, on_improving, on_user_solution, on_logging, on_interrupt=None,
                 options=None):
        self.cbs = (on_improving, on_user_solution, on_logging, on_interrupt)
        self.options = dict(options or {})

    def solve(self, milp, **kw):
        from .backends.highs import HighsBackend

        be = HighsBackend()
        be.extra_callbacks = self.cbs
        be.options = {**HighsBackend.options, **self.options}
        return be.solve(milp, **kw)
