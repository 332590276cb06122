"""The one gate every plan passes before it runs: the simulator replays it on the model's graph.

A schedule's recorded figures (`budget_bytes`, `predicted_peak_bytes`, `predicted_time`) are
claims of whoever wrote the file: a schedule edited by hand, a zoo entry changed in place or a
cache entry copied onto another key would otherwise run at a peak nobody checked. So wherever a
plan comes from (a file, the zoo, the optimize cache, a solve, a rebind to a smaller shape),
`verified` replays its decisions on the graph of the model it is about to run on and returns it
with the simulator's figures in place of the recorded ones; it raises OverBudgetError when the
replayed peak is above the budget. Figures shown to a user are the ones `verified` returns.
"""

from __future__ import annotations

import dataclasses

from .errors import OverBudgetError
from .graph import OpGraph
from .schedule import Schedule
from .simulate import simulate
from .units import format_bytes

__all__ = ["verified", "budget_limit", "with_recorded_optimizer_state"]


def budget_limit(schedule: Schedule, budget: int | None = None) -> int | None:
    """The peak a schedule must stay within: `budget` when the caller gives one (the budget the
    caller asked for), else the schedule's own budget, else (a schedule made without a budget)
    the peak it claims; None when it makes no claim at all."""
    if budget is not None:
        return budget
    if schedule.budget_bytes is not None:
        return schedule.budget_bytes
    return schedule.predicted_peak_bytes


def verified(graph: OpGraph, schedule: Schedule, *, budget: int | None = None,
             source: str = "schedule") -> Schedule:
    """`schedule` with the simulator's peak on `graph` (and its time, where the graph's costs are
    the schedule's own kind), after proving the peak within `budget_limit(schedule, budget)`.

    Raises ScheduleMismatchError for a schedule of another graph, ScheduleError for decisions
    that are not valid on it and OverBudgetError for a peak above the budget. `source` names
    where the schedule came from, for the message ('schedule file s.json', 'zoo schedule ...')."""
    timeline = simulate(graph, schedule)
    limit = budget_limit(schedule, budget)
    if limit is not None and timeline.peak_bytes > limit:
        what = ("its budget" if limit == schedule.budget_bytes else
                "the peak it records" if budget is None else "the requested budget")
        recorded = schedule.predicted_peak_bytes
        claim = "" if recorded is None or recorded == timeline.peak_bytes else (
            f" (it records a peak of {_both(recorded)}: its decisions were edited, or it was "
            f"made for another budget)")
        raise OverBudgetError(
            f"{source}: replayed by the simulator on this model's graph its decisions peak at "
            f"{_both(timeline.peak_bytes)}, above {what} of {_both(limit)}{claim}; it does not "
            f"run; solve a schedule for this model and budget (monetlike.optimize does it in one "
            f"call)")
    same_costs = graph.cost_provenance == schedule.cost_provenance
    return dataclasses.replace(
        schedule, predicted_peak_bytes=timeline.peak_bytes,
        predicted_time=timeline.total_time if same_costs else None)


def _both(n: int) -> str:
    """'4.06 MiB (4256792 B)': the exact count beside the rounded one, so it can be typed back."""
    return f"{format_bytes(n)} ({n} B)"


def with_recorded_optimizer_state(graph: OpGraph, schedule: Schedule,
                                  fallback: int | None = None) -> OpGraph | None:
    """`graph` (a structure profile, which counts no optimizer state) with the optimizer state
    of the graph the schedule was solved for (its summary records it, else `fallback`), so the
    replay covers the step the budget did; None when neither says."""
    recorded = schedule.graph_summary.get("optimizer_bytes", fallback)
    if isinstance(recorded, int) and not isinstance(recorded, bool) and 0 <= recorded < 2**63:
        return dataclasses.replace(graph, optimizer_bytes=recorded)
    return None
