"""The exact strategies: branch and bound sharing incumbents while it runs, or one plain solve.

`BranchAndBound` (backends with CALLBACKS): root rounds of recompute-support cuts first
(`tighten`, cuts.py), then branch and bound on `ctx.bb_form`, taking the pool's better
schedules as they turn up and offering its own. When it runs with lazy recomputation rows
(models.branch_and_bound_form), each of its solutions is replayed by the simulator first: a
valid one is shared; one that breaks the budget at a recomputation point stops the search,
which restarts with rows at those points, from the best valid schedule.
`OneShot` (other backends): one solve, warm-started where the backend takes it.
"""

from __future__ import annotations

import time

import numpy as np

from .. import cuts
from ..backends.base import INFEASIBLE, OPTIMAL, BackendResult, SearchCallbacks
from ..formulation import Formulation
from ..milp import BuildStopped
from ..simulate import simulate
from .context import SearchContext
from .models import branch_and_bound_form

CUT_ROUNDS = 8
"""Root rounds of recompute-support cuts (LP, separate, add) before branch and bound."""
CUT_TIME_SHARE = 0.15
"""At most this share of the time left goes to the cut rounds. Measured on the profiled
GoogLeNet (batch 320): 2 rounds (5 s) at 9 GiB, 4 rounds (47 s) at 5 GiB."""


def run_milp(backend, milp, **kw) -> BackendResult:
    """Every branch-and-bound run of the search goes through here (tests stand in for it)."""
    return backend.solve(milp, **kw)


class BranchAndBound:
    name = "branch_and_bound"

    def run(self, ctx: SearchContext) -> None:
        form, pool = ctx.form, ctx.pool
        graph, budget = form.graph, form.budget
        state = {"injected": 0, "violated": set(), "stop": False}

        def consider(fb: Formulation, x: np.ndarray) -> None:
            """Share a solution once the simulator accepts it."""
            if len(x) != fb.milp.num_vars:
                return
            peak = None
            if fb.recompute_points is not None:
                tl = simulate(graph, fb.decode(x))
                if tl.peak_bytes > budget:
                    state["violated"] |= {(p.stage, p.op) for p in tl.points
                                          if p.phase == "recompute" and p.bytes > budget}
                    state["stop"] = True
                    return
                peak = tl.peak_bytes
            ctx.offer(fb, x, ctx.backend.name, peak)

        def offer(primal_bound: float):
            x, obj, version = pool.get(ctx.bb_form)
            if x is None or version == state["injected"]:
                return None
            state["injected"] = version
            if obj < primal_bound - 1e-9 * max(1.0, abs(obj)):
                return x
            return None

        def should_stop(dual_bound: float) -> bool:
            t = ctx.target
            return (state["stop"] or ctx.reached() or ctx.proven_within_gap()
                    or (t is not None and dual_bound > t + 1e-6))

        callbacks = SearchCallbacks(
            on_solution=lambda x: consider(ctx.bb_form, x), offer=offer,
            on_bound=lambda b: ctx.raise_bound("branch_and_bound", b), should_stop=should_stop)

        first = ctx.bb_form
        tightened = tighten(ctx, first)
        if tightened is not first:
            pool.add_form(tightened, replacing=first)
            ctx.bb_form = tightened
        while True:
            fb = ctx.bb_form
            x0, _, version = pool.get(fb)
            state["injected"] = version
            state["stop"] = False
            r = run_milp(ctx.new_backend(), fb.milp, time_limit_s=max(0.1, ctx.left()),
                         mip_gap=ctx.mip_gap, warm_start=x0, verbose=ctx.verbose,
                         callbacks=callbacks,
                         cutoff=None if ctx.target is None else ctx.target + 0.5)
            ctx.bb_result = r
            if r.x is not None:  # also when the backend never ran (an empty model)
                consider(fb, r.x)
            ctx.raise_bound("branch_and_bound", r.bound)
            if (not state["violated"] or state["violated"] <= fb.recompute_points
                    or ctx.left() < 1.0):
                break  # (a point already present: a tolerance effect, not a missing row)
            # lazy rows: restart with rows at the points the last solution broke
            points = fb.recompute_points | state["violated"]
            state["violated"] = set()
            try:  # the model's build is as long as the first one's: it too ends in time
                nxt = branch_and_bound_form(form, points, fb.support_cuts,
                                            should_stop=ctx.should_stop)
            except BuildStopped:
                break
            if nxt.infeasible_points:
                # a point over budget whatever the decisions: so is the next real point
                ctx.bb_result = BackendResult(
                    status=INFEASIBLE, x=None, objective=None, bound=None, seconds=0.0,
                    message=f"{nxt.infeasible_points[0][0]} is over budget whatever the "
                            f"schedule")
                break
            pool.add_form(nxt, replacing=fb)
            ctx.bb_form = nxt
            ctx.restarts += 1


def tighten(ctx: SearchContext, form_bb: Formulation) -> Formulation:
    """Root cut rounds for branch and bound's model: solve its LP relaxation, add the
    recompute-support cuts the LP solution breaks (solver/cuts.py), again, until none is broken,
    the bound stops moving, or CUT_ROUNDS or CUT_TIME_SHARE of the time left is used. Every LP
    optimum is a valid bound (the cuts remove no schedule) and is reported as one. Returns the
    model with the cuts (or `form_bb` itself when there is nothing to tighten)."""
    if form_bb.objective != "time" or form_bb is ctx.form:
        return form_bb
    paths = cuts.support_paths(form_bb)
    if not paths:
        return form_bb
    stop_at = time.perf_counter() + CUT_TIME_SHARE * ctx.left()
    fb, last = form_bb, None
    for _ in range(CUT_ROUNDS):
        left = stop_at - time.perf_counter()
        if left <= 0:
            break
        r = ctx.new_backend().solve(fb.milp.relaxation(), time_limit_s=left, mip_gap=0.0)
        if r.status != OPTIMAL or r.x is None:
            break
        ctx.raise_bound("lp", r.objective)
        ctx.pool.set_guide(fb, r.x)
        if last is not None and r.objective - last <= 1e-4 * max(1.0, abs(r.objective)):
            break
        last = r.objective
        found = cuts.separate(fb, r.x, paths)
        if not found:
            break
        try:
            fb = branch_and_bound_form(ctx.form, fb.recompute_points,
                                       fb.support_cuts | set(found),
                                       should_stop=lambda: time.perf_counter() >= stop_at)
        except BuildStopped:
            break
    return fb


class OneShot:
    """One solve of `ctx.bb_form` by a backend that cannot share while it runs."""
    name = "one_shot"

    def run(self, ctx: SearchContext) -> None:
        be = ctx.backend
        x0 = ctx.pool.get(ctx.bb_form)[0]
        r = be.solve(ctx.bb_form.milp, time_limit_s=max(0.1, ctx.left()), mip_gap=ctx.mip_gap,
                     warm_start=x0 if be.WARM_START else None, verbose=ctx.verbose,
                     progress=lambda sec, inc, bd: ctx.progress.update(inc, bd))
        ctx.bb_result = r
        if r.x is not None:
            ctx.offer(ctx.bb_form, r.x, be.name)
        bound = r.bound
        if bound is None and r.status == OPTIMAL and r.objective is not None:
            # the backend proved its answer within mip_gap but reports no number (SCIPY)
            bound = r.objective - ctx.mip_gap * abs(r.objective)
        ctx.raise_bound("branch_and_bound", bound)
