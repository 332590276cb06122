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

The event tree (`kineto_results.experimental_event_tree`) is private profiler API; this module is
the only place that reads it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

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

    def __init__(self) -> None:
        self._prof: profile | None = None
        self._gc_was_enabled = False
        self._active = False
        self._times: list[int] = []
        self._levels: list[int] = []  # the running sum after each event
        self._what: list[str] = []  # per event: the op it happened in, or 'mark'
        self._marks: dict[str, int] = {}  # label -> index of the mark in the replay
        self._watch: list[weakref.ref] = []  # refs whose callbacks report frees

    # -- recording --------------------------------------------------------------------------
    def __enter__(self) -> "AllocatorLog":
        # Cyclic garbage collected mid-recording (a previous step's graph) would free storages
        # at random points: a window's level would drop by memory that is not its business.
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
        from torch._C._profiler import _EventType  # private: see the module docstring

        events: list[tuple[int, int, object, str]] = []  # (time, bytes, mark label or None, op)
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            kind = node.typed[0]
            if kind == _EventType.Allocation:
                f = node.extra_fields
                if f.device.type == "cpu" and f.alloc_size != 0:
                    events.append((node.start_time_ns, int(f.alloc_size), None,
                                   node.parent.name if node.parent is not None else ""))
            elif node.name.startswith(_MARK):
                events.append((node.start_time_ns, 0, node.name[len(_MARK):], "mark"))
            elif node.name.startswith(_FREE):
                events.append((node.start_time_ns, -int(node.name[len(_FREE):]), None,
                               "free of a storage older than the recording"))
        events.sort(key=lambda e: e[0])
        level = 0
        for t, nbytes, label, what in events:
            level += nbytes
            if label is not None:
                self._marks[label] = len(self._times)
            self._times.append(t)
            self._levels.append(level)
            self._what.append(what)
        self._watch = []

    def _index(self, label: object) -> int:
        try:
            return self._marks[str(label)]
        except KeyError:
            raise KeyError(f"AllocatorLog: no mark {label!r} was recorded") from None

    def level(self, label: object) -> int:
        """Bytes allocated (net, since recording started) at mark `label`."""
        return self._levels[self._index(label)]

    def peak_between(self, start: object, end: object | None = None,
                     credit: dict | None = None) -> int:
        """Highest net level from mark `start` to mark `end` (or to the end of the recording).

        `credit` maps mark labels to bytes added back from that mark on: a caller that counts
        some storages apart (the profiler's Values) takes their frees out of the level."""
        i = self._index(start)
        j = self._index(end) if end is not None else len(self._levels) - 1
        if not credit:
            return max(self._levels[i:j + 1])
        at = {self._marks[str(k)]: n for k, n in credit.items() if str(k) in self._marks}
        extra, best = 0, self._levels[i]
        for k in range(i, j + 1):
            extra += at.get(k, 0)
            # A credit's mark comes just before the allocator's free it stands for: read the
            # level at allocator events only, or that storage would count twice.
            if self._what[k] != "mark":
                best = max(best, self._levels[k] + extra)
        return best

    def peak(self) -> int:
        """Highest net level over the whole recording (0 if nothing was allocated)."""
        return max([0, *self._levels])
