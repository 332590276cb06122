"""monetlike's solver side: the IR, schedules, the simulator, the MILP and its backends.

Never imports torch: a graph profiled on a GPU box can be solved on any CPU box.
"""

from .errors import (BackendUnavailableError, BudgetParseError, FormatError, InfeasibleBudgetError,
                     MonetlikeError, ScheduleError, ScheduleMismatchError)
from .graph import Impl, Op, OpGraph, Value
from .schedule import Schedule, SolveResult, StageSchedule
from .simulate import Timeline, simulate, store_all_schedule
from .units import BudgetSpec, format_bytes, parse_budget, parse_bytes

__all__ = [
    "BackendUnavailableError", "BudgetParseError", "FormatError", "InfeasibleBudgetError",
    "MonetlikeError", "ScheduleError", "ScheduleMismatchError", "Impl", "Op", "OpGraph", "Value",
    "Schedule", "SolveResult", "StageSchedule", "Timeline", "simulate", "store_all_schedule",
    "format_bytes", "parse_bytes", "parse_budget", "BudgetSpec",
]

# The MILP side: solve, the minimum feasible budget, the baselines.
from .search import min_budget, solve  # noqa: E402
from .search.budgets import check_feasible, resolve_budget  # noqa: E402
from . import baselines  # noqa: E402

__all__ += ["solve", "min_budget", "resolve_budget", "check_feasible", "baselines"]
