"""monetlike: a MONeT-style memory-schedule optimizer for PyTorch training (the torch side).

`profile(model, x)` turns a model into a `solver.OpGraph`; `measure_step(fn)` measures the peak
memory and time of a training step; `ScheduleWrapper` runs a schedule; `optimize` does all three
in one line; `check_schedule` runs a schedule here against plain PyTorch; `backend(budget=...)`
is a torch.compile backend whose partition keeps the step within the budget.
"""

from .capture.trace import TraceError
from .check import CheckReport, check_schedule
from .measure import Measurement, measure_step
from .optimize import min_budget, optimize
from .profile import FSDPConfig, profile
from .runtime.compiled import backend
from .wrapper import ScheduleWrapper

__all__ = ["profile", "FSDPConfig", "measure_step", "Measurement", "TraceError", "ScheduleWrapper",
           "optimize", "min_budget", "check_schedule", "CheckReport", "backend"]
