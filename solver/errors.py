"""The exception family shared by the solver and the torch side.

Every message says what was expected, what was got, and how to fix it. `ValueError` subclasses so
that callers who catch ValueError for bad input keep working.
"""


class MonetlikeError(Exception):
    """Base class of every error this project raises on purpose."""


class FormatError(MonetlikeError, ValueError):
    """A graph or schedule file (or dict) is malformed, truncated, or of another schema version."""


class ScheduleError(MonetlikeError, ValueError):
    """A schedule is not valid for its graph (a Value used while not resident, a bad Impl index)."""


class ScheduleMismatchError(MonetlikeError, ValueError):
    """A schedule was made for another graph (other model, batch, shapes, dtypes or Impl set)."""


class InfeasibleBudgetError(MonetlikeError, ValueError):
    """No schedule fits the budget; the message states the minimum feasible budget."""

    def __init__(self, message: str, *, budget: int | None = None, min_budget: int | None = None):
        super().__init__(message)
        self.budget = budget
        self.min_budget = min_budget


class BackendUnavailableError(MonetlikeError, RuntimeError):
    """The requested MILP backend is unknown or not installed; the message lists installed ones."""


class BudgetParseError(MonetlikeError, ValueError):
    """A budget string such as '8GiB' could not be parsed."""


class OverBudgetError(ScheduleError):
    """A schedule replayed by the simulator on its model's own graph peaks above its budget (its
    decisions do not match the figures it records: edited, or written for another budget)."""
