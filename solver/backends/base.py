"""What every MILP backend promises: one `solve(milp, ...)` returning one `BackendResult`.

A backend translates a `formulation.MILP` into its solver's input, runs it under a time limit and
translates the answer back: the best incumbent (a full column vector), its objective, and the
solver's proven lower bound when it reports one. It never sees a graph or a schedule; the search
decodes and checks the answer with the simulator. Capabilities are class attributes, so callers
can ask before they pass a warm start or expect a bound, and availability is checked with
`importlib.util.find_spec`, which does not load native code.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import numpy as np

# Backend status vocabulary (search/pipeline.py maps it onto the SolveResult statuses).
OPTIMAL = "optimal"          # proven within the requested gap
TIME_LIMIT = "time_limit"    # stopped by the time limit (x is the incumbent, if any)
INFEASIBLE = "infeasible"    # proven infeasible
ERROR = "error"              # the solver failed; message says how


@dataclass
class BackendResult:
    status: str
    x: np.ndarray | None
    objective: float | None
    """Objective of x in the MILP's own units (c.x + offset)."""
    bound: float | None
    """A proven lower bound on the MILP optimum, or None when the solver reports none."""
    seconds: float
    first_incumbent_s: float | None = None
    message: str = ""
    log: list = field(default_factory=list)


Progress = Callable[[float, "float | None", "float | None"], None]
"""progress(seconds, incumbent objective or None, lower bound or None), called as the solve runs."""


@dataclass
class SearchCallbacks:
    """What a backend with CALLBACKS calls while it searches (from the solver's own thread, so
    each must be quick): the hooks through which it shares incumbents with other searches."""

    on_solution: "Callable[[np.ndarray], None] | None" = None
    """Told of each improving solution (a full column vector)."""
    offer: "Callable[[float], np.ndarray | None] | None" = None
    """Given the backend's incumbent objective: a better full vector for it to take, or None."""
    on_bound: "Callable[[float], None] | None" = None
    """Told of its proven (dual) bound as it rises."""
    should_stop: "Callable[[float], bool] | None" = None
    """Given its dual bound: True to stop the search now (the incumbent is returned)."""


class Backend:
    """Base class: subclasses set the capability attributes and implement `_solve`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()
    """Importable top-level modules it needs."""
    MIP_CAPABLE: ClassVar[bool] = True
    WARM_START: ClassVar[bool] = False
    """Accepts a full feasible solution vector as its first incumbent."""
    TIME_LIMIT: ClassVar[bool] = True
    """Stops at the time limit and returns its incumbent."""
    DUAL_BOUND: ClassVar[bool] = False
    """Reports a proven lower bound (so a gap can be stated)."""
    PROGRESS: ClassVar[bool] = False
    """Reports incumbents and bounds while it runs."""
    CALLBACKS: ClassVar[bool] = False
    """Takes `callbacks=SearchCallbacks(...)`: shares incumbents and bounds while it runs, and
    stops when asked (what lets the search run it beside other strategies)."""
    OBJECTIVE_CUTOFF: ClassVar[bool] = False
    """Takes `cutoff=`: it prunes everything whose objective is not below the cutoff, so status
    'infeasible' then means that no solution is below it (what bound probes need)."""

    @classmethod
    def available(cls) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in cls.requires)

    def solve(self, milp, *, time_limit_s: float, mip_gap: float,
              warm_start: np.ndarray | None = None, verbose: bool = False,
              progress: Progress | None = None, callbacks: SearchCallbacks | None = None,
              cutoff: float | None = None) -> BackendResult:
        if callbacks is not None and not self.CALLBACKS:
            raise ValueError(f"backend {self.name!r} takes no search callbacks (CALLBACKS is "
                             f"False); ask `backend.CALLBACKS` before passing them")
        if cutoff is not None and not self.OBJECTIVE_CUTOFF:
            raise ValueError(f"backend {self.name!r} takes no objective cutoff "
                             f"(OBJECTIVE_CUTOFF is False)")
        if milp.num_vars == 0:  # nothing to decide; several solvers refuse an empty model
            ok = bool(np.all(milp.row_lo <= 0) and np.all(milp.row_hi >= 0))
            return BackendResult(status=OPTIMAL if ok else INFEASIBLE,
                                 x=np.zeros(0) if ok else None,
                                 objective=milp.offset if ok else None,
                                 bound=milp.offset if ok else None, seconds=0.0,
                                 first_incumbent_s=0.0 if ok else None,
                                 message="empty model: nothing to decide")
        extra = {}
        if self.CALLBACKS:
            extra["callbacks"] = callbacks
        if self.OBJECTIVE_CUTOFF:
            extra["cutoff"] = cutoff
        try:
            return self._solve(milp, time_limit_s=time_limit_s, mip_gap=mip_gap,
                               warm_start=warm_start if self.WARM_START else None,
                               verbose=verbose, progress=progress, **extra)
        except Exception as e:  # a crash of the solver is an answer, not a traceback
            return BackendResult(status=ERROR, x=None, objective=None, bound=None, seconds=0.0,
                                 message=f"{self.name} failed: {type(e).__name__}: {e}")

    def _solve(self, milp, *, time_limit_s, mip_gap, warm_start, verbose, progress, **extra):
        raise NotImplementedError(f"backend {self.name!r} does not implement _solve")


def finite(a: np.ndarray, inf: float) -> np.ndarray:
    """Replace +-inf by +-`inf` (solvers that want their own infinity)."""
    return np.where(np.isinf(a), np.sign(a) * inf, a)
