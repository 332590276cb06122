"""Large-neighbourhood search (lns.py) as a strategy: race the starts, go on from the best, and
turn to bound probes when it has gone quiet."""

from __future__ import annotations

import time

import numpy as np

from ..formulation import Formulation
from . import lns
from .context import LnsTally, SearchContext
from .models import every_row
from .probes import probe_bounds

RACE_SLICE_S = 45.0
"""Seconds of LNS per start when racing starts (GoogLeNet 5 GiB: after 45 s the Impl-0 start
was at +66%, the lean one at +112%; they ended at +32.8% and +73.7%)."""
RACE_SLICE_SHARE = 0.25
"""At most this share of the time left per start (45 s from 180 s left on; a 60 s solve of
GoogLeNet at 5 GiB races two 10 s slices and ends at +86.97% against +117.23% from the lean
start alone)."""
RACE_MIN_REMAINING_S = 30.0
"""Race only with at least this much time left (LNS windows take up to 5 s each; a 30 s solve
of GoogLeNet at 5 GiB has about 20 s after the LP, and 5 s slices changed nothing): shorter
solves go on from the best start."""
PROBE_QUIET_S = 30.0
"""Seconds without a better schedule (from LNS or branch and bound) after which the search
turns to proving bounds (probes.probe_bounds) until a better schedule turns up. Only where
branch and bound has every row (models.every_row): each probe starts a search from the root,
cheap there (UNet at batch 11: about 20 s) and minutes on the large models, where LNS also keeps
finding better schedules late. Probes on lazy rows proved no more than branch and bound's own
bound while LNS lost their time (docs/BENCHMARKS.md, Solver: GoogLeNet at 5 GiB)."""
FIRST_INCUMBENT_POLL_S = 0.2
HEAD_START_S = 0.5
"""Seconds (at most a tenth of the time left) branch and bound runs alone before LNS starts.
On a small graph it ends within them, and LNS, whose first window then spans the whole graph,
would only have solved the same MILP again beside it (a quarter of the fuzzer's solver time)."""


def race_starts(form: Formulation, x0: np.ndarray, race) -> list[tuple[str, np.ndarray]]:
    """The distinct LNS starts: the best solution now (LP rounding or branch and bound may have
    beaten the heuristics) and each start of `race`, as vectors of `form`."""
    out = [("best", x0)]
    for name, s in race:
        x = form.encode(s)
        if not any(np.array_equal(np.round(x), np.round(y)) for _, y in out):
            out.append((name, x))
    return out


class LargeNeighbourhood:
    """LNS on `ctx.form`. `race`: (name, schedule) starts of different Impl families. Where LNS
    starts decides where it ends (see warmstart.family_starts), so with two or more distinct
    starts and time to spare it first runs a short slice from each on its own (not taking the
    others' solutions), then goes on from the best solution known. Once it has gone
    PROBE_QUIET_S without a better schedule (time objective, no target, a model with every row),
    it runs bound probes until one turns up."""
    name = "lns"

    def __init__(self, race=()):
        self.race = list(race)

    def run(self, ctx: SearchContext) -> None:
        form, pool = ctx.form, ctx.pool
        assert pool.forms[0] is form, "LNS works on the first formulation of the pool"
        if ctx.finished.wait(min(HEAD_START_S, 0.1 * max(0.0, ctx.left()))):
            return
        # Wait for a first incumbent (from the heuristics or branch and bound).
        while not pool.has and not ctx.finished.wait(FIRST_INCUMBENT_POLL_S):
            if ctx.left() < 0:
                return
        x0 = pool.get(form)[0]
        if x0 is None or ctx.should_stop():
            return
        tally = ctx.lns = LnsTally()
        seen = {"version": pool.get(form)[2]}

        def on_improve(x, obj):
            if ctx.offer(form, x, "lns"):
                seen["version"] = pool.get(form)[2]

        def guide():
            return pool.guide

        starts = race_starts(form, x0, self.race)
        if len(starts) > 1 and ctx.left() > RACE_MIN_REMAINING_S:
            slice_s = min(RACE_SLICE_S, RACE_SLICE_SHARE * ctx.left())
            tally.race = {}
            for name, xs in starts:
                if ctx.should_stop():
                    break
                x, st = lns.improve(form, xs, ctx.new_backend(),
                                    deadline=min(ctx.deadline, time.perf_counter() + slice_s),
                                    on_improve=on_improve, should_stop=ctx.should_stop,
                                    guide=guide)
                tally.add(st)
                tally.race[name] = form.milp.objective(x) / form.time_scale
        seen["version"] = pool.get(form)[2]

        def incoming():
            x, _, version = pool.get(form)
            if version != seen["version"]:
                seen["version"] = version
                return x
            return None

        probing = ctx.target is None and form.objective == "time" and every_row(form)
        probed_version = None
        while not ctx.should_stop() and ctx.left() > 0.5:
            began = time.perf_counter()

            def quiet():
                if not probing or pool.version == probed_version:
                    return False
                last = pool.start + (pool.last_s or 0.0)
                return time.perf_counter() - max(last, began) > PROBE_QUIET_S

            _, st = lns.improve(form, pool.get(form)[0], ctx.new_backend(),
                                deadline=ctx.deadline, on_improve=on_improve,
                                incoming=incoming,
                                should_stop=lambda: ctx.should_stop() or quiet(), guide=guide)
            tally.add(st)
            if ctx.should_stop() or not quiet():
                break  # the deadline, or LNS ran out of windows
            probed_version = pool.version
            probe_bounds(ctx, ctx.bb_form, ctx.mip_gap, ctx.should_stop)
