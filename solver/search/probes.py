"""Bound probes: branch and bound under an objective cutoff, proving lines below the incumbent."""

from __future__ import annotations

import time
from typing import Callable

from ..backends.base import INFEASIBLE, SearchCallbacks
from ..formulation import Formulation
from . import branch_and_bound
from .context import SearchContext

PROBE_GAPS = (2.0, 1.5, 1.0)
"""The lines a probe tries to prove, in multiples of the target gap below the incumbent."""


def probe_bounds(ctx: SearchContext, fb: Formulation, mip_gap: float,
                 should_stop: Callable[[], bool]) -> None:
    """Prove lower bounds with branch and bound under an objective cutoff: the lines PROBE_GAPS
    times `mip_gap` below the incumbent, in turn (twice the target first, then closer). Such a
    search only has to show that nothing costs less than the line, so it prunes every node whose
    bound reaches it, where branch and bound proper (which must also find schedules) keeps diving
    there. Measured on UNet (batch 11) at 5 GiB, branch and bound alone on one core beside
    another: the line +27.9% over store-all proven in 110 s and +28.4% in 235 s, where the dual
    bound of plain branch and bound passed them after about 560 s and 950 s. Status infeasible
    proves the line; a search stopped early still proves its dual bound (capped at the line).
    Returns when a better schedule turns up (offered to the pool, so LNS can work from it), when
    `should_stop()`, at the deadline, or when every line is proven.
    `fb` is branch and bound's model with every row (models.every_row), so a schedule the probe
    finds is a schedule of the exact model, and its bounds are valid."""
    assert fb.recompute_points is None, "probes run on models with every recomputation row"
    pool = ctx.pool
    version = pool.version
    callbacks = SearchCallbacks(
        on_solution=lambda x: ctx.offer(fb, x, f"{ctx.backend.name}/probe"),
        should_stop=lambda _bound: (should_stop() or pool.version != version
                                    or time.perf_counter() > ctx.deadline))
    for multiple in PROBE_GAPS:
        gap = multiple * mip_gap
        line = (1 - gap) * pool.obj
        proven = pool.bound("probe")
        if proven is not None and proven >= line:
            continue
        left = ctx.left()
        if left < 1.0 or should_stop() or pool.version != version:
            return
        r = branch_and_bound.run_milp(ctx.new_backend(), fb.milp, time_limit_s=left,
                                      mip_gap=mip_gap, warm_start=None, callbacks=callbacks,
                                      cutoff=line)
        # "infeasible": nothing costs less than the line. HiGHS also ends a search whose tree
        # is exhausted as "optimal" with its dual bound at or above the line.
        done = r.status == INFEASIBLE or (r.bound is not None and r.bound >= line)
        if done:
            proved = line - 1e-9 * max(1.0, abs(line))  # (HiGHS's cutoff tolerance)
        else:
            proved = None if r.bound is None else min(r.bound, line)
        ctx.probes.append((round(gap, 6), "proved" if done else r.status, round(r.seconds, 1)))
        if proved is not None:
            ctx.raise_bound("probe", proved)
        if not done:
            return
