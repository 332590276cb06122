"""Peak tensor memory and step time of a callable, on the device it runs on.

This is the yardstick every prediction is checked against (profiler vs plain PyTorch, runtime vs
simulator). The peak includes tensors already alive when the callable starts, like
`torch.cuda.max_memory_allocated`, because the budget is the whole training-step peak.

- CUDA: the caching allocator's statistics (`reset_peak_memory_stats`, `max_memory_allocated`)
  and CUDA events for time.
- CPU: nothing in PyTorch reports tensor bytes, so: the storages of every CPU tensor reachable by
  `gc.get_objects()` at the start (parameters, inputs, optimizer state, whatever the caller holds),
  plus a storage-tracking TorchDispatchMode during the call (it sees the backward too: the
  autograd engine carries the dispatch-mode stack into the thread that runs the backward). Frees
  of pre-existing storages (e.g. `p.grad = None` inside the step) are seen through weakrefs.
  Kernel-internal scratch buffers that never surface as tensors are invisible, here and in the
  profiler alike.

Time is measured in separate runs without the tracking mode, so its overhead does not count.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .profile.memory import StorageTracker, storage_of

__all__ = ["Measurement", "measure_step", "live_cpu_storages"]


@dataclass(frozen=True)
class Measurement:
    peak_bytes: int
    """Peak tensor bytes during the call, tensors alive at its start included."""
    seconds: float
    """Median wall (CPU) or CUDA-event time of one call."""
    start_bytes: int = 0
    """Tensor bytes alive when the call started."""
    device: str = "cpu"


def live_cpu_storages() -> dict[int, "torch.UntypedStorage"]:
    """Unique storages of all CPU tensors the garbage collector can see, by storage key."""
    gc.collect()
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        # type() rather than isinstance(): isinstance reads `__class__`, which some module-level
        # proxies (deprecated torch aliases) turn into warnings or errors.
        if not issubclass(type(obj), torch.Tensor):
            continue
        try:
            if obj.device.type != "cpu":
                continue
        except Exception:
            continue
        s = storage_of(obj)
        if s is not None:
            found.setdefault(s._cdata, s)
    return found


def _cuda_device(device: "str | torch.device | None") -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def measure_step(fn: Callable[[], object], *, warmup: int = 1, repeat: int = 3,
                 device: "str | torch.device | None" = None) -> Measurement:
    """Run `fn` `warmup` times, then measure its peak tensor memory and its median time.

    `device` defaults to CUDA when it is available, else the CPU.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"measure_step: expected warmup >= 0 and repeat >= 1, got warmup={warmup},"
                         f" repeat={repeat}")
    for _ in range(warmup):
        fn()
    if _cuda_device(device):
        return _measure_cuda(fn, repeat, device)
    return _measure_cpu(fn, repeat)


def _measure_cpu(fn: Callable[[], object], repeat: int) -> Measurement:
    tracker = StorageTracker()
    _track_start(tracker)
    start_bytes = tracker.live
    try:
        with tracker:
            result = fn()
            del result
        peak = tracker.peak
    finally:
        tracker.close()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        del result
        times.append(time.perf_counter() - t0)
    return Measurement(peak_bytes=int(peak), seconds=statistics.median(times),
                       start_bytes=int(start_bytes), device="cpu")


def _track_start(tracker: StorageTracker) -> None:
    # A function of its own so that no local keeps a pre-existing storage alive afterwards:
    # their frees during the step must be seen.
    for s in live_cpu_storages().values():
        tracker.track(s, "start")


def _measure_cuda(fn: Callable[[], object], repeat: int, device) -> Measurement:  # pragma: no cover
    dev = torch.device(device) if device is not None else torch.device("cuda",
                                                                       torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    start_bytes = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    result = fn()
    del result
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        result = fn()
        del result
        b.record()
        torch.cuda.synchronize(dev)
        times.append(a.elapsed_time(b) / 1000.0)
    return Measurement(peak_bytes=int(peak), seconds=statistics.median(times),
                       start_bytes=int(start_bytes), device=str(dev))
