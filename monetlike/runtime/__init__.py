"""The runtime: execute a Schedule inside ordinary autograd (docs/execution-model.md section 5).

- wrapper.py    `ScheduleWrapper`, the nn.Module users hold.
- plan.py       the static join of graph, schedule and traced module, built once per signature.
- executor.py   the scheduled forward (generated code) and the per-step state and stage hooks.
- recompute.py  RNG, autocast and BatchNorm faithful recomputation; side-effect checks.
- hooks.py      saved-tensor handles and the autograd nodes each Op created.
- offload.py    offload to host memory: CUDA side-stream copies, and the refusal elsewhere.
"""

from .wrapper import ScheduleWrapper

__all__ = ["ScheduleWrapper"]
