"""Peak tensor memory and step time of a callable, on the device it runs on.

This is the yardstick every prediction is checked against (profiler vs plain PyTorch, runtime vs
simulator). The peak includes tensors already alive when the callable starts, like
`torch.cuda.max_memory_allocated`, because the budget is the whole training-step peak.

- CUDA: the caching allocator's statistics (`reset_peak_memory_stats`, `max_memory_allocated`)
  and CUDA events for time.
- CPU: the allocator's own events, read from the profiler (`allocator.AllocatorLog`): every
  allocation and free the CPU allocator makes during the call, kernel scratch included, replayed
  in time order, on top of the storages of every CPU tensor reachable by `gc.get_objects()` at
  the start (parameters, inputs, optimizer state, whatever the caller holds). Frees of those
  pre-existing storages (e.g. `p.grad = None` inside the step) are seen through weakrefs.
  `storage_peak` gives the older count by storages (a TorchDispatchMode), which cannot see
  kernel scratch: a diagnostic that can name what was alive at its peak.

Time is measured in separate runs without the tracking mode, so its overhead does not count.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .core.allocator import AllocatorLog
from .profile.memory import StorageTracker, storage_of

__all__ = ["Measurement", "measure_step", "live_cpu_storages", "storage_peak"]


@dataclass(frozen=True)
class Measurement:
    peak_bytes: int
    """Peak tensor bytes during the call, tensors alive at its start included."""
    seconds: float
    """Median wall (CPU) or CUDA-event time of one call (NaN when `repeat=0` asked for none)."""
    start_bytes: int = 0
    """Tensor bytes alive when the call started."""
    device: str = "cpu"


def live_cpu_storages(collect: bool = True) -> dict[int, "torch.UntypedStorage"]:
    """Unique storages of all CPU tensors the garbage collector can see, by storage key
    (unreachable cycles collected first unless the caller just did)."""
    if collect:
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
        # A parameter's gradient lives in C++ with no Python object until read: ask for it.
        for t in (obj, obj.grad if obj.is_leaf else None):
            s = storage_of(t)
            if s is not None and s.device.type == "cpu":
                found.setdefault(s._cdata, s)
    return found


def _cuda_device(device: "str | torch.device | None") -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def measure_step(fn: Callable[[], object], *, warmup: int = 1, repeat: int = 3,
                 device: "str | torch.device | None" = None) -> Measurement:
    """Run `fn` `warmup` times, then measure its peak tensor memory and its median time over
    `repeat` further calls (0: the peak only, `seconds` NaN).

    `device` defaults to CUDA when it is available, else the CPU.
    """
    if repeat < 0 or warmup < 0:
        raise ValueError(f"measure_step: expected warmup >= 0 and repeat >= 0, got warmup={warmup},"
                         f" repeat={repeat}")
    for _ in range(warmup):
        fn()
    if _cuda_device(device):
        return _measure_cuda(fn, repeat, device)
    return _measure_cpu(fn, repeat)


def _measure_cpu(fn: Callable[[], object], repeat: int) -> Measurement:
    # Garbage from before the step (a previous step's reference cycles) is collected now: freed
    # by a collection inside the step, it would lower the step's peak at random. Once: a
    # collection walks the whole heap (50 ms in a test process), and nothing between here and
    # the recording makes cycles.
    gc.collect()
    log = AllocatorLog(collect=False)
    start_bytes = _watch_start(log)
    with log:
        result = fn()
        del result
    peak = start_bytes + log.peak()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        del result
        times.append(time.perf_counter() - t0)
    return Measurement(peak_bytes=int(peak), seconds=_median(times),
                       start_bytes=int(start_bytes), device="cpu")


def _median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


def _watch_start(log: AllocatorLog) -> int:
    # A function of its own so that no local keeps a pre-existing storage alive afterwards:
    # their frees during the step must be seen.
    start = live_cpu_storages(collect=False)
    for s in start.values():
        log.free_when_dead(s)
    return sum(int(s.nbytes()) for s in start.values())


def _track_start(tracker: StorageTracker) -> None:
    for s in live_cpu_storages().values():
        tracker.track(s, "start")


def storage_peak(fn: Callable[[], object]) -> tuple[int, list[tuple[int, str]]]:
    """Diagnostic: run `fn` once counting CPU tensor storages (not the allocator), and return the
    peak with the storages alive at that moment, largest first, as (bytes, class) pairs: 'start'
    for those alive before the call, else 'other'. Kernel scratch is invisible here."""
    tracker = StorageTracker()
    _track_start(tracker)
    alive_at_peak: list[tuple[int, str]] = []

    def snapshot(*_):
        if tracker.live >= tracker.peak:
            alive_at_peak[:] = sorted(((e.nbytes, e.cls) for e in tracker.entries.values()),
                                      reverse=True)
    tracker.observers.append(snapshot)
    try:
        with tracker:
            result = fn()
            del result
        return int(tracker.peak), alive_at_peak
    finally:
        tracker.close()


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
    return Measurement(peak_bytes=int(peak), seconds=_median(times),
                       start_bytes=int(start_bytes), device=str(dev))
