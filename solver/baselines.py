"""Baselines: schedules from simple rules, each `f(graph, budget=None) -> SolveResult`.

- `store_all`: plain PyTorch (keep everything a backward reads).
- `checkpoint_only`: the MILP with keep/recompute decisions only, every op on Impl 0.
- `chen_sqrt_n`: Chen et al. 2016: cut the forward graph at articulation Values into segments of
  about sqrt(n) ops, keep the segment boundaries, and recompute a segment's interior at the first
  backward stage that needs it (then hold it until its last use).
- `greedy`: start from store-all and stop keeping the Values with the most bytes per second of
  recomputation until the budget fits.

Every schedule is built by the rules of rules/simple.py and evaluated by the simulator; nothing here
predicts memory.
Budgets: `budget=None` returns the baseline's schedule whatever its peak. With a budget, a
heuristic whose schedule does not fit returns `SolveResult.failure(status="error")` whose message
gives the peak it reached (a heuristic's miss proves nothing about the budget); `checkpoint_only`
behaves like `solve` and raises `InfeasibleBudgetError` with the minimum feasible budget.
"""

from __future__ import annotations

import dataclasses
import math
import time

from .graph import OpGraph
from .rules.simple import chen_sqrt_n_schedule, greedy_baseline_schedule
from .schedule import ERROR, HEURISTIC, Schedule, SolveResult
from .search import solve
from .simulate import simulate, store_all_schedule
from .units import format_bytes, parse_bytes


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------
def _result(graph: OpGraph, schedule: Schedule, budget: int | None, name: str,
            started: float, stats: dict | None = None) -> SolveResult:
    tl = simulate(graph, schedule)
    schedule = dataclasses.replace(schedule, budget_bytes=budget, created_by=f"baseline:{name}",
                                   predicted_peak_bytes=tl.peak_bytes,
                                   predicted_time=tl.total_time)
    seconds = time.perf_counter() - started
    if budget is not None and tl.peak_bytes > budget:
        return SolveResult.failure(
            status=ERROR, backend=f"baseline:{name}", solve_time_s=seconds,
            stats={"peak_bytes": tl.peak_bytes, **(stats or {})},
            message=f"{name} reaches a peak of {format_bytes(tl.peak_bytes)}, over the budget of "
                    f"{format_bytes(budget)}; the budget may still be feasible (try solve)")
    return SolveResult(status=HEURISTIC, schedule=schedule, objective=tl.total_time,
                       predicted_peak_bytes=tl.peak_bytes, predicted_time=tl.total_time,
                       mip_gap=None, solve_time_s=seconds, backend=f"baseline:{name}",
                       stats=dict(stats or {}))


def store_all(graph: OpGraph, budget=None) -> SolveResult:
    """Plain PyTorch: every Value a backward reads is kept until its last stage."""
    started = time.perf_counter()
    budget = None if budget is None else parse_bytes(budget)
    return _result(graph, store_all_schedule(graph), budget, "store_all", started)


def checkpoint_only(graph: OpGraph, budget=None, **kwargs) -> SolveResult:
    """The MILP with keep/recompute decisions only (every op on Impl 0). Without a budget, the
    budget is the store-all peak (so it returns store-all's time at most)."""
    if budget is None:
        budget = simulate(graph, store_all_schedule(graph)).peak_bytes
    return solve(graph, budget, mode="checkpoint", **kwargs)


def chen_sqrt_n(graph: OpGraph, budget=None) -> SolveResult:
    """Chen et al.'s sqrt(n) checkpointing on the articulation Values of the forward graph."""
    started = time.perf_counter()
    budget = None if budget is None else parse_bytes(budget)
    return _result(graph, chen_sqrt_n_schedule(graph), budget, "chen_sqrt_n", started,
                   {"segment_length": math.sqrt(len(graph.ops))})


def greedy(graph: OpGraph, budget=None) -> SolveResult:
    """Drop kept Values by bytes per recompute second until the budget fits (no budget: the
    store-all schedule)."""
    started = time.perf_counter()
    budget = None if budget is None else parse_bytes(budget)
    if budget is None:
        return _result(graph, store_all_schedule(graph), None, "greedy", started)
    return _result(graph, greedy_baseline_schedule(graph, budget), budget, "greedy", started)


BASELINES = {"store_all": store_all, "checkpoint_only": checkpoint_only,
             "chen_sqrt_n": chen_sqrt_n, "greedy": greedy}
