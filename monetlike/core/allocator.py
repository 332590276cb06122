"""The CPU allocator's own count of bytes, read from the profiler's memory events.

On CUDA the caching allocator keeps live statistics (`max_memory_allocated`). On the CPU nothing
in PyTorch reports them live, but `torch.profiler.profile(profile_memory=True)` records every
allocation and free the CPU allocator makes, kernel scratch included (a matmul's packed copy, an
`empty` inside a backward formula): the CPU counterpart of `max_memory_allocated`. This module
runs code under it and replays those events in time order.

Two things the events do not carry, supplied here:
- Points in time: `mark(label)` leaves a zero-length `record_function` event, so a caller can ask
  for the allocator's level at a mark and its peak between two marks (a node, a backward stage).
- Frees of storages allocated before profiling started: the allocator reports them with no size
  (it never saw them allocated). `free_when_dead` watches such a storage and, when it dies,
  leaves a mark carrying its size, which the replay subtracts.
- Which frees are real: the allocator's size table outlives a profile, and an entry whose block
  was freed while no profile ran stays behind; a later block at that address, freed while
  profiling, is reported with the stale size. So the replay subtracts only frees of blocks it saw
  allocated (ResNet-18's step read 7-25% low on such frees, at random).

The events come from the profiler's private event tree, read through
`torch_private.profiler_events`.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import sys
import weakref
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from . import torch_private

__all__ = ["AllocatorLog"]

_MARK = "monetlike.mark/"
_FREE = "monetlike.free/"


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence what kineto's C++ prints to fd 2 when a profile starts and stops (trace-point and
    GPU-probe lines that would reach every CPU user of measure_step and profile)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


class AllocatorLog:
    """`with AllocatorLog() as log: ...` records the CPU allocator's events; afterwards
    `level(label)`, `peak_between(a, b)` and `peak()` replay them (bytes, relative to the start)."""

    def __init__(self, collect: bool = True) -> None:
        self._collect = collect  # False: the caller has just collected garbage
        self._prof: profile | None = None
        self._gc_was_enabled = False
        self._active = False
        self._times: list[int] = []
        self._levels: list[int] = []  # the running sum after each event
        self._marks: dict[str, int] = {}  # label -> index of the mark in the replay
        # blocks allocated while recording: (address, bytes, position allocated, position
        # freed or None if alive at the end), in the order allocated
        self._blocks: list[tuple[int, int, int, int | None]] = []
        self._watch: list[weakref.ref] = []  # refs whose callbacks report frees

    # -- recording --------------------------------------------------------------------------
    def __enter__(self) -> "AllocatorLog":
        # Cyclic garbage collected mid-recording (a previous step's graph) would free storages
        # at random points: a window's level would drop by memory that is not its business.
        if self._collect:
            gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        if self._gc_was_enabled:
            gc.enable()
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self._replay()
        self._prof = None

    def mark(self, label: object) -> None:
        """Leave a point in time named `label` (any value whose str is unique among marks)."""
        if self._active:
            with record_function(_MARK + str(label)):
                pass

    def free_when_dead(self, storage: "torch.UntypedStorage") -> None:
        """Count the free of `storage`, allocated before recording started, when it happens."""
        n = int(storage.nbytes())
        if n == 0:
            return

        def died(_ref, n=n, log=weakref.ref(self)):
            me = log()
            if me is not None and me._active:
                with record_function(_FREE + str(n)):
                    pass
        self._watch.append(weakref.ref(storage, died))

    # -- replay -----------------------------------------------------------------------------
    def _replay(self) -> None:
        events: list[tuple[int, int, object, int]] = []  # (time, bytes, mark or None, address)
        for start, name, alloc in torch_private.profiler_events(self._prof):
            if alloc is not None:
                device, nbytes, ptr = alloc
                if device == "cpu" and nbytes != 0:
                    events.append((start, nbytes, None, ptr))
            elif name.startswith(_MARK):
                events.append((start, 0, name[len(_MARK):], 0))
            elif name.startswith(_FREE):
                events.append((start, -int(name[len(_FREE):]), None, 0))
        events.sort(key=lambda e: e[0])
        level = 0
        allocated: dict[int, int] = {}  # address -> index in _blocks, of blocks still alive
        for t, nbytes, label, ptr in events:
            if ptr:
                if nbytes > 0:
                    allocated[ptr] = len(self._blocks)
                    self._blocks.append((ptr, nbytes, len(self._times), None))
                else:
                    i = allocated.pop(ptr, None)
                    if i is None:
                        nbytes = 0  # a block from before recording: counted by free_when_dead
                    else:
                        b = self._blocks[i]
                        self._blocks[i] = (*b[:3], len(self._times))
            level += nbytes
            if label is not None:
                self._marks[label] = len(self._times)
            self._times.append(t)
            self._levels.append(level)
        self._watch = []

    def position(self, label: object) -> int:
        """Where mark `label` falls in the recording (an index for `level_at`)."""
        try:
            return self._marks[str(label)]
        except KeyError:
            raise KeyError(f"AllocatorLog: no mark {label!r} was recorded") from None

    def level(self, label: object) -> int:
        """Bytes allocated (net, since recording started) at mark `label`."""
        return self._levels[self.position(label)]

    def level_at(self, position: int) -> int:
        """Bytes allocated (net, since recording started) at `position`."""
        return self._levels[position]

    def peak_position(self, start: object, end: object | None = None) -> int:
        """The first position of the highest net level from mark `start` to mark `end` (or to
        the end of the recording)."""
        i = self.position(start)
        j = self.position(end) if end is not None else len(self._levels) - 1
        window = self._levels[i:j + 1]
        return i + window.index(max(window))

    def peak_between(self, start: object, end: object | None = None) -> int:
        """Highest net level from mark `start` to mark `end` (or to the end of the recording)."""
        return self._levels[self.peak_position(start, end)]

    def blocks_left(self, start: object, end: object) -> list[tuple[int, int, int, int | None]]:
        """Blocks allocated between marks `start` and `end` and still allocated at `end`:
        (address, bytes, position allocated, position freed or None if never freed)."""
        i, j = self.position(start), self.position(end)
        first = bisect.bisect_right(self._blocks, i, key=lambda b: b[2])  # in allocation order
        last = bisect.bisect_left(self._blocks, j, key=lambda b: b[2])
        return [b for b in self._blocks[first:last] if b[3] is None or b[3] > j]

    def peak(self) -> int:
        """Highest net level over the whole recording (0 if nothing was allocated)."""
        return max([0, *self._levels])
