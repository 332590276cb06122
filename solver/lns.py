"""Large-neighbourhood search: improve a feasible MILP solution by re-solving windows of it.

Branch and bound alone finds poor incumbents at tight budgets (DESIGN section 5 measured a 57%
overhead where better exists). A window is a run of consecutive ops: its decisions (which of its
Values are held at each stage, when its ops are recomputed, its Impl) are freed, every other 0/1
column is fixed to the incumbent, and the small MILP that remains is solved exactly or to a short
time limit, starting from the incumbent (so it never gets worse). Windows sweep the graph and
adapt their size: a window solved quickly grows, one that hits its time limit shrinks. Every
accepted solution is a full solution of the whole MILP, so it is a valid incumbent there; the
search proves nothing (bounds come from the full MILP only).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .backends.base import Backend
from .formulation import Formulation


def column_ops(form: Formulation) -> np.ndarray:
    """The op each 0/1 column belongs to (-1 for helper columns, never fixed)."""
    owner = np.full(form.milp.num_vars, -1, dtype=np.int64)
    values = form.graph.values
    for (t, v), c in form.S.items():
        owner[c] = values[v].producer
    for (t, j), c in form.R.items():
        owner[c] = j
    for (j, i), c in form.M.items():
        owner[c] = j
    return owner


@dataclasses.dataclass
class LnsStats:
    windows: int = 0
    improved: int = 0
    timed_out: int = 0
    seconds: float = 0.0


def improve(form: Formulation, x: np.ndarray, backend: Backend, *, deadline: float,
            on_improve: Callable[[np.ndarray, float], None] | None = None,
            incoming: Callable[[], "np.ndarray | None"] | None = None,
            should_stop: Callable[[], bool] | None = None, window: int = 16,
            sub_time_s: float = 8.0, max_quiet_sweeps: int = 2) -> tuple[np.ndarray, LnsStats]:
    """Return the best solution found by sweeping windows until `deadline` (perf_counter time),
    `should_stop()`, or `max_quiet_sweeps` sweeps in a row at the largest window without an
    improvement. `incoming()` may hand over a better solution found elsewhere (the full MILP);
    `on_improve(x, objective)` is told of each improvement."""
    milp = form.milp
    owner = column_ops(form)
    integer_cols = np.nonzero(milp.integrality & (owner >= 0))[0]
    n_ops = len(form.graph.ops)
    best, best_obj = x.copy(), milp.objective(x)
    stats = LnsStats()
    started = time.perf_counter()
    size = max(2, min(window, n_ops))
    quiet = 0
    start = 0
    improved_in_sweep = False
    while True:
        now = time.perf_counter()
        if now >= deadline - 0.5 or (should_stop and should_stop()):
            break
        if incoming is not None:
            other = incoming()
            if other is not None and milp.objective(other) < best_obj - 1e-9:
                best, best_obj = other.copy(), milp.objective(other)
        lo, hi = start, min(n_ops, start + size)
        free = (owner[integer_cols] >= lo) & (owner[integer_cols] < hi)
        fixed = integer_cols[~free]
        lb, ub = milp.lb.copy(), milp.ub.copy()
        vals = np.round(best[fixed])
        lb[fixed] = vals
        ub[fixed] = vals
        sub = dataclasses.replace(milp, lb=lb, ub=ub)
        limit = min(sub_time_s, deadline - now - 0.5)
        if limit <= 0.2:
            break
        r = backend.solve(sub, time_limit_s=limit, mip_gap=1e-6, warm_start=best)
        stats.windows += 1
        timed_out = r.status == "time_limit"
        stats.timed_out += timed_out
        if r.x is not None and milp.objective(r.x) < best_obj - 1e-9 * max(1.0, abs(best_obj)):
            # re-encode: exact 0/1 values and every helper column at its least value
            best = form.encode(form.decode(r.x))
            best_obj = milp.objective(best)
            stats.improved += 1
            improved_in_sweep = True
            if on_improve is not None:
                on_improve(best, best_obj)
        # adapt the window: quick exact solves can afford more freedom, time-outs less
        if timed_out:
            size = max(4, int(size * 0.75))
        elif r.seconds < sub_time_s / 4:
            size = min(n_ops, int(size * 1.25) + 1)
        start = lo + max(1, size // 2)
        if hi >= n_ops:
            start = 0
            quiet = 0 if improved_in_sweep else quiet + 1
            improved_in_sweep = False
            if quiet >= max_quiet_sweeps and size >= n_ops:
                break
    stats.seconds = time.perf_counter() - started
    return best, stats

