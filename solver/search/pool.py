"""The pool every strategy shares: the best schedule known, and the best lower bounds proven.

Strategies may run on different (equivalent) formulations of one graph and budget: branch and
bound on full memory sums with lazy recomputation rows, LNS on running sums. A schedule found in
one is encoded into the others when offered, so each reads a vector of its own model; objectives
agree across them (same costs, same scaling). Every schedule offered is replayed by the simulator
before it is taken (for the time objective): it must fit the budget.

Bounds come only from relaxations of the exact model (its LP, branch and bound on it, a probe
under a cutoff), never from the heuristics or LNS, which fix columns; each is kept per source,
in the MILP's scaled units.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

import numpy as np

from ..formulation import Formulation
from ..simulate import simulate
from .lns import map_decisions

ROW_TOLERANCE_UNITS = 1e-5
"""How far past a row's bound (in the MILP's scaled units, ~4096 at the budget) a backend's
solution may be and still count as its feasibility tolerance (HiGHS: 1e-6 per row) rather than
a bug in the formulation."""

BOUND_SOURCES = ("floor", "stages", "lp", "branch_and_bound", "probe")
"""Where a valid lower bound can come from: the step with nothing recomputed on the fastest
Impls (GraphFacts.time_floor: weak, but there before anything is solved), the stage bound
(solver/stage_bound.py: what each backward stage must pay to fit, computed in milliseconds, so
graphs too big for the LP still get an honest gap), the LP relaxation (with the cuts, if any),
branch and bound's dual bound (its model is a relaxation: lazy rows only leave rows out), and the
bound probes (branch and bound under a cutoff)."""


class Pool:
    """The incumbent (a vector per formulation), its provenance, and the bounds (thread-safe)."""

    def __init__(self, forms: list[Formulation], start: float | None = None):
        self.forms = list({id(f): f for f in forms}.values())
        self.lock = threading.Lock()
        self.xs: dict[int, np.ndarray] = {}
        self.obj = math.inf
        self.source = ""
        self.start = time.perf_counter() if start is None else start
        self.first_s: float | None = None
        self.last_s: float | None = None
        """Seconds from `start` to the first and to the latest better schedule."""
        self.version = 0
        """Bumped with each better schedule."""
        self.bounds: dict[str, float] = {}
        """The largest bound each source proved (MILP units)."""
        self.guide: tuple[int, np.ndarray] | None = None
        """(version, x): the latest LP solution as a vector of the first formulation (the one
        LNS works on), its RINS guide."""
        self.on_incumbent: Callable | None = None
        """solve(on_incumbent=...): told of every better schedule, with the best proven bound
        in seconds."""

    # -- incumbents ------------------------------------------------------------------------------
    def offer(self, form: Formulation, x: np.ndarray, source: str,
              peak: int | None = None) -> bool:
        """Take x (a vector of `form`) if it beats the best; True if it did. `peak`: the
        simulated peak of its schedule, when the caller has it already."""
        obj = form.milp.objective(x)
        if not obj < self.obj - 1e-9 * max(1.0, abs(obj)):
            return False
        schedule = form.decode(x)
        if form.objective == "time":
            if peak is None:
                peak = simulate(form.graph, schedule).peak_bytes
            over = peak - form.budget
            if over > 0:
                # Within the backend's feasibility tolerance a memory row can pass a few bytes
                # over the budget (seen: 1 byte on GPT-2 at 8.8 GiB): not a schedule. More than
                # the tolerance is a formulation bug.
                assert over <= ROW_TOLERANCE_UNITS * form.mem_scale, (
                    f"internal error: a MILP solution ({source}) peaks {over} bytes over the "
                    f"budget {form.budget} in the simulator")
                return False
        xs = {id(f): (np.array(x, dtype=float) if f is form else f.encode(schedule))
              for f in self.forms}
        with self.lock:
            accepted = obj < self.obj - 1e-9 * max(1.0, abs(obj))
            if accepted:
                self.xs, self.obj, self.source = xs, obj, source
                self.version += 1
                self.last_s = time.perf_counter() - self.start
                if self.first_s is None:
                    self.first_s = self.last_s
        if accepted and self.on_incumbent is not None:
            bound = self.bound()
            self.on_incumbent(schedule, None if bound is None else bound / form.time_scale)
        return accepted

    def offer_schedule(self, form: Formulation, schedule, source: str) -> bool:
        return self.offer(form, form.encode(schedule), source)

    def get(self, form: Formulation) -> tuple[np.ndarray | None, float, int]:
        """(vector of `form` or None, objective, version)."""
        with self.lock:
            return self.xs.get(id(form)), self.obj, self.version

    @property
    def has(self) -> bool:
        return bool(self.xs)

    def add_form(self, form: Formulation, replacing: Formulation | None = None) -> None:
        """Start keeping vectors of `form` too (the best is encoded into it now), and stop
        keeping those of `replacing` (a branch-and-bound model that was restarted)."""
        with self.lock:
            if replacing is not None and replacing is not self.forms[0]:
                self.forms = [f for f in self.forms if f is not replacing]
                self.xs.pop(id(replacing), None)
            if any(f is form for f in self.forms):
                return
            self.forms.append(form)
            first = next((f for f in self.forms if id(f) in self.xs), None)
            if first is not None:
                self.xs[id(form)] = form.encode(first.decode(self.xs[id(first)]))

    # -- bounds ----------------------------------------------------------------------------------
    def raise_bound(self, source: str, value: float) -> bool:
        """Record a lower bound proven by `source` (one of BOUND_SOURCES); True if it is the
        largest that source has proven."""
        assert source in BOUND_SOURCES, f"unknown bound source {source!r}"
        if value is None or not np.isfinite(value):
            return False
        with self.lock:
            if source in self.bounds and value <= self.bounds[source]:
                return False
            self.bounds[source] = value
            return True

    def bound(self, source: str | None = None) -> float | None:
        """The best lower bound (MILP units) from `source`, or from any source."""
        with self.lock:
            if source is not None:
                return self.bounds.get(source)
            return max(self.bounds.values()) if self.bounds else None

    # -- the RINS guide --------------------------------------------------------------------------
    def set_guide(self, form: Formulation, x: np.ndarray, replace: bool = True) -> None:
        """Offer an LP solution of `form` as the RINS guide (with `replace=False` only when
        there is none yet: the cut rounds' LPs are tighter than the plain one)."""
        if not replace and self.guide is not None:
            return
        mapped = map_decisions(form, x, self.forms[0])
        with self.lock:
            if replace or self.guide is None:
                self.guide = (1 if self.guide is None else self.guide[0] + 1, mapped)
