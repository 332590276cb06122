"""monetlike: a MONeT-style memory-schedule optimizer for PyTorch training (the torch side).

`profile(model, x)` turns a model into a `solver.OpGraph`; `measure_step(fn)` measures the peak
memory and time of a training step. Other entry points (`ScheduleWrapper`, `optimize`) are added
by their own modules below.
"""

from .measure import Measurement, measure_step
from .profile import profile
from .trace import TraceError

__all__ = ["profile", "measure_step", "Measurement", "TraceError"]
