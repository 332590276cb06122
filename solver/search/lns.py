"""Large-neighbourhood search: improve a feasible MILP solution by re-solving windows of it.

Branch and bound alone finds poor incumbents at tight budgets (DESIGN section 5 measured a 57%
overhead where better exists). A window is a run of consecutive ops: its decisions (which of its
Values are held at each stage, when its ops are recomputed, its Impl) are freed, every other 0/1
column is fixed to the incumbent, and the small MILP that remains is solved exactly or to a short
time limit, starting from the incumbent (so it never gets worse). Windows sweep the graph and
adapt their size: a window solved quickly grows, one that hits its time limit shrinks.

Given a guide (an LP relaxation's solution, `guide`), each new incumbent first gets a RINS step
(relaxation-induced neighbourhood search, Danna, Rothberg and Le Pape 2005): every 0/1 column
on which the LP and the incumbent agree (within RINS_TOL) is fixed, the rest is solved. Windows
free what is near in the graph or in time; RINS frees what the relaxation disputes, wherever it
is. Measured from an earlier zoo build's schedules with the root LP after the recompute-support
cuts, one RINS step took GoogLeNet (batch 320) at 5 GiB from +32.95% over store-all to +30.76%
(2,458 of 19,489 columns free, 35 s) and UNet (batch 11) at 5 GiB from +31.59% to +31.28%
(767 of 2,830 free, 9 s); with a tolerance of 0.1 they reached only +31.03% and +31.46%.

Every accepted solution is a full solution of the whole MILP, so it is a valid incumbent there;
the search proves nothing (bounds come from the full MILP only).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from ..backends.base import Backend
from ..formulation import Formulation

RINS_TOL = 0.02
"""A 0/1 column is fixed by RINS when the guide's value is within this of the incumbent's."""
RINS_TIME_S = 60.0
"""Time limit of one RINS sub-MILP (it runs once per incumbent and guide)."""

DECISIONS = ("M", "S", "R", "O", "Fe")
"""The 0/1 column families, keyed alike in every formulation of one graph, budget and mode."""


def map_decisions(src: Formulation, x: np.ndarray, dst: Formulation) -> np.ndarray:
    """The 0/1 (decision) columns of `x`, a vector of `src`, placed in a vector of `dst` (helper
    columns 0): the two forms may differ in memory rows and helper columns (running sums, lazy
    rows), not in what they decide. A decision `dst` has and `src` lacks gets 0."""
    out = np.zeros(dst.milp.num_vars)
    for family in DECISIONS:
        theirs = getattr(src, family)
        for key, col in getattr(dst, family).items():
            if key in theirs:
                out[col] = x[theirs[key]]
    return out


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
    for v, c in form.O.items():
        owner[c] = values[v].producer
    for (t, v), c in form.Fe.items():
        owner[c] = values[v].producer
    return owner


def column_stages(form: Formulation) -> np.ndarray:
    """The stage each residency or recompute column belongs to (-1: Impl and helper columns,
    which a stage window leaves fixed)."""
    owner = np.full(form.milp.num_vars, -1, dtype=np.int64)
    for (t, v), c in form.S.items():
        owner[c] = t
    for (t, j), c in form.R.items():
        owner[c] = t
    for (t, v), c in form.Fe.items():
        owner[c] = t
    return owner


@dataclasses.dataclass
class LnsStats:
    windows: int = 0  # window sub-MILPs solved
    improved: int = 0  # sub-MILPs (windows and RINS) that beat the incumbent
    timed_out: int = 0  # windows stopped by their time limit
    seconds: float = 0.0  # the whole search's wall time
    rins: int = 0  # RINS sub-MILPs (free where the guide and the incumbent differ)
    rins_improved: int = 0  # ... of which beat the incumbent


class _Neighbourhood:
    """Windows of consecutive owners (ops, or backward stages) swept with an adaptive size."""

    def __init__(self, name: str, owner: np.ndarray, count: int, size: int):
        self.name, self.owner, self.count = name, owner, count
        self.size = max(2, min(size, count))
        self.start = 0

    def window(self) -> tuple[int, int]:
        return self.start, min(self.count, self.start + self.size)

    def advance(self, timed_out: bool, quick: bool) -> bool:
        """Move on (and adapt the size); True when the sweep wrapped around."""
        lo, hi = self.window()
        if timed_out:
            self.size = max(3, int(self.size * 0.75))
        elif quick:
            self.size = min(self.count, int(self.size * 1.25) + 1)
        self.start = lo + max(1, self.size // 2)
        if hi >= self.count:
            self.start = 0
            return True
        return False


def improve(form: Formulation, x: np.ndarray, backend: Backend, *, deadline: float,
            on_improve: Callable[[np.ndarray, float], None] | None = None,
            incoming: Callable[[], "np.ndarray | None"] | None = None,
            should_stop: Callable[[], bool] | None = None,
            guide: Callable[[], "tuple[int, np.ndarray] | None"] | None = None, window: int = 10,
            sub_time_s: float = 5.0, max_quiet_sweeps: int = 2) -> tuple[np.ndarray, LnsStats]:
    """Return the best solution found by sweeping windows until `deadline` (perf_counter time),
    `should_stop()`, or until every neighbourhood spans the whole graph and `max_quiet_sweeps`
    sweeps in a row found nothing. Sweeps alternate between op windows (a run of consecutive ops:
    their Values' residency at every stage, their recomputation, their Impl) and stage windows (a
    run of consecutive backward stages: what is resident and recomputed there, for every op).
    `incoming()` may hand over a better solution found elsewhere (the full MILP);
    `on_improve(x, objective)` is told of each improvement. `guide()` may return (version, LP
    solution as a vector of `form`): each pair of guide version and incumbent gets one RINS step
    before the windows go on."""
    milp = form.milp
    hoods = [_Neighbourhood("ops", column_ops(form), len(form.graph.ops), window),
             _Neighbourhood("stages", column_stages(form), max(1, form.T), window)]
    best, best_obj = x.copy(), milp.objective(x)
    stats = LnsStats()
    started = time.perf_counter()
    quiet = 0
    improved_in_sweep = False
    turn = 0
    cols = np.nonzero(milp.integrality)[0]  # the 0/1 columns
    tried = set()  # (guide version, incumbent objective) pairs RINS has run on

    def sub_solve(free: np.ndarray, limit: float):
        """Solve with every 0/1 column outside `free` fixed to `best`; True if it improved."""
        nonlocal best, best_obj
        fixed = cols[~free]
        lb, ub = milp.lb.copy(), milp.ub.copy()
        vals = np.round(best[fixed])
        lb[fixed] = vals
        ub[fixed] = vals
        r = backend.solve(dataclasses.replace(milp, lb=lb, ub=ub), time_limit_s=limit,
                          mip_gap=1e-6, warm_start=best)
        if r.x is None or not milp.objective(r.x) < best_obj - 1e-9 * max(1.0, abs(best_obj)):
            return r, False
        # re-encode: exact 0/1 values and every helper column at its least value
        best = form.encode(form.decode(r.x))
        best_obj = milp.objective(best)
        if on_improve is not None:
            on_improve(best, best_obj)
        return r, True

    while True:
        now = time.perf_counter()
        if now >= deadline - 0.5 or (should_stop and should_stop()):
            break
        if incoming is not None:
            other = incoming()
            if other is not None and milp.objective(other) < best_obj - 1e-9:
                best, best_obj = other.copy(), milp.objective(other)
        g = guide() if guide is not None else None
        if g is not None and (g[0], best_obj) not in tried:
            tried.add((g[0], best_obj))
            free = np.abs(g[1][cols] - best[cols]) > RINS_TOL
            limit = min(RINS_TIME_S, deadline - now - 0.5)
            if free.any() and limit > 0.2:
                _, better = sub_solve(free, limit)
                stats.rins += 1
                stats.rins_improved += better
                stats.improved += better
                improved_in_sweep |= better
                continue
        hood = hoods[turn]
        lo, hi = hood.window()
        own = hood.owner[cols]
        limit = min(sub_time_s, deadline - now - 0.5)
        if limit <= 0.2:
            break
        r, better = sub_solve((own >= lo) & (own < hi), limit)
        stats.windows += 1
        timed_out = r.status == "time_limit"
        stats.timed_out += timed_out
        stats.improved += better
        improved_in_sweep |= better
        # adapt the window: quick exact solves can afford more freedom, time-outs less
        if hood.advance(timed_out, r.seconds < sub_time_s / 4):
            turn = (turn + 1) % len(hoods)
            if turn == 0:
                quiet = 0 if improved_in_sweep else quiet + 1
                improved_in_sweep = False
                if quiet >= max_quiet_sweeps and all(h.size >= h.count for h in hoods):
                    break
    stats.seconds = time.perf_counter() - started
    return best, stats
