"""A progress bar over the time limit: the incumbent's overhead (or peak) and the gap."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time

import numpy as np

from ..units import format_bytes


TICK_S = 1.0
"""Seconds between redraws of the bar's clock."""


class Progress:
    """A tqdm bar over the time limit showing the incumbent's overhead and the gap (thread-safe);
    silent unless verbose or stderr is a terminal."""

    def __init__(self, enabled: bool, time_limit_s: float, base_time: float, time_scale: float,
                 desc: str, peak: float | None = None):
        self.enabled = enabled
        self.base, self.scale = base_time, time_scale
        self.peak_scale = peak  # set when the objective is the peak (MILP units -> bytes)
        self.lock = threading.Lock()
        self.incumbent = self.bound = None
        self.start = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=max(1, int(math.ceil(time_limit_s))), unit="s", desc=desc,
                            leave=True, file=sys.stderr, dynamic_ncols=True,
                            bar_format="{desc}: {n:.0f}/{total}s |{bar}| {postfix}")
            # The solver reports only when it finds something: the clock moves on its own.
            self._stop = threading.Event()
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self.update()

    def update(self, incumbent=None, bound=None) -> None:
        """incumbent and bound in MILP objective units."""
        if self.bar is None:
            return
        with self.lock:
            if self.bar is None:  # closed meanwhile (the clock's thread)
                return
            if incumbent is not None and np.isfinite(incumbent):
                self.incumbent = incumbent if self.incumbent is None else min(self.incumbent,
                                                                              incumbent)
            if bound is not None and np.isfinite(bound):
                self.bound = bound if self.bound is None else max(self.bound, bound)
            post = []
            if self.incumbent is not None and self.peak_scale is not None:
                post.append(f"peak {format_bytes(int(self.incumbent * self.peak_scale))}")
            elif self.incumbent is not None:
                post.append(f"overhead {100 * (self.incumbent / self.scale / self.base - 1):.2f}%")
            if self.bound is not None and self.peak_scale is not None:
                post.append(f"bound {format_bytes(int(self.bound * self.peak_scale))}")
            elif self.bound is not None:
                post.append(f"bound {100 * (self.bound / self.scale / self.base - 1):.2f}%")
            if self.incumbent is not None and self.bound is not None:
                post.append(f"gap {100 * max(0.0, 1 - self.bound / self.incumbent):.2f}%")
            self.bar.set_postfix_str(", ".join(post) or "searching", refresh=False)
            self.bar.n = min(self.bar.total, time.perf_counter() - self.start)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self._stop.set()
            with self.lock:
                self.bar.close()
                self.bar = None


@contextlib.contextmanager
def phase(name: str, detail: str = ""):
    """One line on stderr when the phase `name` (capture, memory, timing, solve, verify) ends,
    with its seconds: only on a terminal, so logs and pipes stay quiet."""
    started = time.perf_counter()
    yield
    if sys.stderr.isatty():
        extra = f" ({detail})" if detail else ""
        print(f"monetlike: {name}{extra} {time.perf_counter() - started:.1f} s", file=sys.stderr,
              flush=True)
