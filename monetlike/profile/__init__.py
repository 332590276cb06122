"""The profiler: a model and an example batch in, a `solver.OpGraph` out.

- api.py          `profile()`: copies the model (deepcopy, or a meta copy for analytical costs),
                  traces it, runs one instrumented step and the timing steps, builds the graph.
- interpreter.py  the fx.Interpreter subclasses: node grouping into Ops, saved tensors, backward
                  stages, per-Op timing.
- memory.py       the storage-tracking TorchDispatchMode (also used by monetlike.measure).
- costs.py        measured timers and the analytical roofline with device presets.
- gpu_like.py     the analytical run's dropout and attention kernels: the preset GPU's, not meta's.
- safety.py       recompute-unsafe detection.
- fsdp.py         FSDPConfig and one rank's memory under FSDP2 (profile(..., fsdp=...)).
"""

from .api import OPTIMIZER_STATE_MULTIPLIER, profile, profile_memory
from .fsdp import FSDPConfig
from .costs import PRESETS, DevicePreset, UnknownDeviceError
from .records import ProfileError

__all__ = ["profile", "profile_memory", "FSDPConfig", "PRESETS", "DevicePreset", "UnknownDeviceError",
           "ProfileError", "OPTIMIZER_STATE_MULTIPLIER"]

