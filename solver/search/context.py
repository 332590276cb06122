"""What strategies share, the protocol they follow, and the portfolio that runs them.

A strategy is anything with a `name` and `run(ctx)`: it reads the pool's incumbent, offers the
better schedules it finds (`ctx.offer`) and the bounds it proves (`ctx.raise_bound`), and returns
at the deadline or when `ctx.should_stop()`. The portfolio runs one exact strategy (branch and
bound, the one whose end ends the search) in a thread and the others one after another in the
calling thread beside it: the MIP search of HiGHS is serial, so the two cores each get one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..backends.base import Backend, BackendResult
from ..formulation import Formulation
from .lns import LnsStats
from .pool import Pool
from .progress import Progress


@dataclass
class LnsTally(LnsStats):
    """What the local search did, summed over its runs (SolveResult.stats['lns'])."""
    race: dict[str, float] | None = None
    """Start name -> its objective (seconds) after its race slice, when starts were raced."""

    def add(self, st) -> None:
        self.windows += st.windows
        self.improved += st.improved
        self.timed_out += st.timed_out
        self.rins += st.rins
        self.rins_improved += st.rins_improved
        self.seconds = round(self.seconds + st.seconds, 1)

    def as_dict(self) -> dict:
        out = {"windows": self.windows, "improved": self.improved, "timed_out": self.timed_out,
               "rins": self.rins, "rins_improved": self.rins_improved, "seconds": self.seconds}
        if self.race is not None:
            out["race"] = dict(self.race)
        return out


@dataclass
class SearchContext:
    """One search: the model LNS works on and schedules are decoded from (`form`), the model
    branch and bound works on (`bb_form`, replaced when it restarts with more rows or cuts), the
    pool, the backend, the deadline and the stopping rules."""
    form: Formulation
    bb_form: Formulation
    pool: Pool
    backend: Backend
    deadline: float
    mip_gap: float
    progress: Progress
    verbose: bool = False
    target: float | None = None
    """Objective units: stop once an incumbent reaches it or the bound passes it."""
    finished: threading.Event = field(default_factory=threading.Event)
    """Set when the exact strategy has ended (optimal, infeasible, or out of time)."""
    bb_result: BackendResult | None = None
    """The exact strategy's last answer (its status decides infeasibility)."""
    restarts: int = 0
    """Times branch and bound restarted with more recomputation rows (lazy rows)."""
    probes: list = field(default_factory=list)
    """(gap, outcome, seconds) of each bound probe."""
    lns: LnsTally | None = None
    structured: object | None = None
    """The block-copy strategy's tally (structured.StructuredTally), when it ran."""

    def new_backend(self) -> Backend:
        """A fresh instance of the search's backend (one per concurrent solve)."""
        return type(self.backend)()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    # -- sharing ---------------------------------------------------------------------------------
    def offer(self, form: Formulation, x: np.ndarray, source: str,
              peak: int | None = None) -> bool:
        if self.pool.offer(form, x, source, peak):
            self.progress.update(incumbent=self.pool.obj)
            return True
        return False

    def raise_bound(self, source: str, value: float) -> None:
        if self.pool.raise_bound(source, value):
            self.progress.update(bound=value)

    # -- stopping --------------------------------------------------------------------------------
    def reached(self) -> bool:
        """The incumbent reached the target."""
        t = self.target
        return t is not None and self.pool.obj <= t + 1e-9 * max(1.0, abs(t))

    def proven_within_gap(self) -> bool:
        """A bound from outside the running branch and bound (the stage bound, the probes)
        proves the incumbent within `mip_gap`: nothing is left to search for."""
        proven = self.pool.bound()
        return proven is not None and proven >= (1 - self.mip_gap) * self.pool.obj

    def should_stop(self) -> bool:
        return (self.finished.is_set() or self.reached() or self.proven_within_gap()
                or time.perf_counter() > self.deadline)


class Strategy(Protocol):
    name: str

    def run(self, ctx: SearchContext) -> None:
        """Improve ctx.pool until the deadline or ctx.should_stop()."""


def run_portfolio(ctx: SearchContext, exact: Strategy, helpers: list[Strategy]) -> None:
    """Run `exact` in a thread (ctx.finished is set when it ends) and `helpers` in turn in this
    thread while it runs; return once `exact` has ended."""

    def run_exact():
        try:
            exact.run(ctx)
        finally:
            ctx.finished.set()

    worker = threading.Thread(target=run_exact, name=f"monetlike-{exact.name}", daemon=True)
    worker.start()
    try:
        for strategy in helpers:
            if ctx.should_stop():
                break
            strategy.run(ctx)
    finally:
        ctx.finished.wait()
        worker.join()
