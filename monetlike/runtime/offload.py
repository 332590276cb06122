"""Offload to host memory: the copies behind `Schedule.offload` and `StageSchedule.fetch`.

A Value in `schedule.offload` is copied to pinned host memory right after the Op that produces
it (and writes it in place) has run, on a side CUDA stream so that the copy overlaps the rest of
the forward pass; it then leaves the device at its last forward use like any Value not kept. At
the start of a backward stage whose `fetch` names it, it is copied back (docs/execution-model.md
section 3; the simulator charges each copy bytes / host_bandwidth, no overlap credited).

NOTE [Copy ordering]
- Device to host: the side stream first waits for the current stream (the producing kernels may
  still be queued there), copies, and records an event. `record_stream(side)` tells the caching
  allocator that the side stream uses the Value's device memory, so the memory is reused only
  after the copy finished, even when the forward drops its last reference sooner.
- Host to device: the current stream (in the backward, the stream autograd runs the node on)
  waits for that event, so the host buffer is complete, then copies with non_blocking=True. Every
  later reader (recomputation, backward) is queued on the same stream, after the copy.
- The pinned buffers belong to the step: released when the backward has run every stage, on an
  exception in the forward, or else with the step's autograd graph. PyTorch's pinned-memory
  allocator records the copies issued on a buffer and reuses it only after they finished, so
  releasing a buffer with a copy still queued is safe.

The whole storage of a Value is copied, as raw bytes: the runtime rebuilds every view of it from
its geometry (size, stride, storage offset), which stay valid on the fetched copy.

This path runs only on CUDA. Anywhere else a schedule with offload is refused before any step
runs (`refuse_offload`), not half-way through one. It was written without a GPU to test on: the
CPU tests check the refusal and, with the copies replaced by plain clones, the executor's
bookkeeping; the CUDA test (tests/test_offload_runtime.py) is skipped on a machine without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from solver.errors import ScheduleError
from solver.graph import OpGraph
from solver.schedule import Schedule


def refuse_offload(schedule: Schedule, graph: OpGraph | None, why: str) -> ScheduleError:
    """The error for a schedule that offloads Values where offload cannot run (`why`)."""
    n = len(schedule.offload)
    names = []  # by name when the graph is known (the schedule alone has Value ids)
    for v in schedule.offload[:4]:
        if graph is not None and v < len(graph.values):
            names.append(f"value {v} ({graph.values[v].name})")
        else:
            names.append(f"value {v}")
    more = f", ... ({n - 4} more)" if n > 4 else ""
    return ScheduleError(
        f"ScheduleWrapper: the schedule offloads {n} Value{'s' if n != 1 else ''} to host memory "
        f"({', '.join(names)}{more}), but {why}. Offload to host is a GPU feature: it needs CUDA "
        f"(pinned host memory and copies on a CUDA stream). Re-solve without offload "
        f"(solver.solve(..., offload=False), the default; `monetlike solve` without --offload), "
        f"or run the model and its inputs on a CUDA device")


def check_cuda_available(schedule: Schedule, graph: OpGraph | None) -> None:
    """Raise `refuse_offload` if the schedule offloads and CUDA is not available here."""
    if schedule.offload and not torch.cuda.is_available():
        raise refuse_offload(schedule, graph, "CUDA is not available on this machine")


def check_offload_devices(schedule: Schedule, graph: OpGraph | None, tensors) -> None:
    """Raise `refuse_offload` unless CUDA is available and every tensor in `tensors` (the model's
    parameters and buffers, the inputs) is on a CUDA device. No-op without offload."""
    if not schedule.offload:
        return
    check_cuda_available(schedule, graph)
    others = sorted({str(t.device) for t in tensors if t.device.type != "cuda"})
    if others:
        raise refuse_offload(schedule, graph, f"the model or its inputs are on {', '.join(others)}")


@dataclass
class _HostCopy:
    host: torch.Tensor
    """Pinned uint8 buffer holding the Value's storage bytes."""
    done: "torch.cuda.Event"
    """Recorded on the side stream after the device-to-host copy."""
    dtype: torch.dtype
    device: torch.device


class HostCopies:
    """One step's host copies of offloaded Values (NOTE [Copy ordering])."""

    def __init__(self, side_streams: dict):
        # Side streams are per device and outlive the step (owned by ScheduledForward): creating
        # a stream per step would cost a driver call each time.
        self._streams = side_streams
        self._copies: dict[int, _HostCopy] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def _side(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def offload(self, v: int, x: torch.Tensor) -> None:  # pragma: no cover - needs a GPU
        """Start copying the storage of Value `v` (a tensor `x` on it) to pinned host memory."""
        if x.device.type != "cuda":
            raise ScheduleError(f"ScheduleWrapper: value {v} is on {x.device}, not on a CUDA "
                                f"device; offload to host needs CUDA tensors (a model whose "
                                f"parameters are split across devices?)")
        device = x.device
        storage = x.untyped_storage()
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        side = self._side(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            host.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        src.record_stream(side)
        self._copies[v] = _HostCopy(host, done, x.dtype, device)

    def fetch(self, v: int) -> torch.Tensor:  # pragma: no cover - needs a GPU
        """A device copy of Value `v`'s storage, as a flat tensor of its dtype from offset 0 (so
        views rebuild with their recorded geometry), queued on the current stream."""
        c = self._copies.get(v)
        if c is None:
            raise RuntimeError(f"ScheduleWrapper: fetches value {v}, which has no host copy in "
                               f"this step (not offloaded in this forward?); this is a bug")
        stream = torch.cuda.current_stream(c.device)
        stream.wait_event(c.done)
        dev = torch.empty(c.host.numel(), dtype=torch.uint8, device=c.device)
        dev.copy_(c.host, non_blocking=True)
        return as_typed(dev, c.dtype)

    def release(self) -> None:
        self._copies.clear()


def as_typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes of `raw` (a flat uint8 tensor owning its storage) as a flat `dtype` tensor."""
    return torch.empty(0, dtype=dtype, device=raw.device).set_(
        raw.untyped_storage(), 0, (raw.numel() // dtype.itemsize,), (1,))
