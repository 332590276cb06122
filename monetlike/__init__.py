"""monetlike: a MONeT-style memory-schedule optimizer for PyTorch training (the torch side).

`profile(model, x)` turns a model into a `solver.OpGraph`; `measure_step(fn)` measures the peak
memory and time of a training step. Other entry points (`ScheduleWrapper`, `optimize`) are added
by their own modules below.
"""

from .measure import Measurement, measure_step
from .profile import profile
from .trace import TraceError

__all__ = ["profile", "measure_step", "Measurement", "TraceError"]

# The runtime (ScheduleWrapper), the one-line entry point and the check behind `monetlike check`.
from .check import CheckReport, check_schedule  # noqa: E402
from .optimize import min_budget, optimize  # noqa: E402
from .runtime import ScheduleWrapper  # noqa: E402

__all__ += ["ScheduleWrapper", "optimize", "min_budget", "check_schedule", "CheckReport"]
