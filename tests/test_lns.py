"""Large-neighbourhood search (solver/search/lns.py): decisions move between formulations of one
graph, and the RINS step frees exactly the 0/1 columns on which the guide and the incumbent
disagree, never makes the incumbent worse, and takes it to the optimum when the guide is the
optimum."""

from __future__ import annotations

import functools
import importlib
import random
import time

import numpy as np
import pytest

import solver
from solver import simulate, store_all_schedule
from solver.backends.highs import HighsBackend
from solver.formulation import Formulation
from solver.search import lns
from solver_cases import branch_and_bound_finding_nothing, random_dag, random_schedules


def _optimum(g, budget) -> float:
    """The MILP optimum in seconds (the MILP is checked against exhaustive search elsewhere:
    test_solver_exact, test_cuts)."""
    form = Formulation(g, budget)
    r = HighsBackend().solve(form.milp, time_limit_s=30, mip_gap=0)
    assert r.status == "optimal"
    return r.objective / form.time_scale


def _case(seed: int):
    """A random two-Impl DAG, a random schedule (the start), a budget at the start's peak and
    the optimum there; None when the start is already optimal."""
    rng = random.Random(seed)
    g = random_dag(rng, 7, two_impl=True)
    peak_all = simulate(g, store_all_schedule(g)).peak_bytes
    for start in random_schedules(g, random.Random(seed), random_impls=True):
        tl = simulate(g, start)
        if tl.peak_bytes < peak_all:
            opt = _optimum(g, tl.peak_bytes)
            if opt < tl.total_time * (1 - 1e-9):
                return g, tl.peak_bytes, start, opt
    return None


N_CASES = 6


@functools.cache
def cases() -> tuple:
    """The first N_CASES seeds with a start to improve, solved on first use (in the worker that
    runs these tests, not in every worker that collects the file)."""
    return tuple(c for c in (_case(seed) for seed in range(40)) if c is not None)[:N_CASES]


class _Recording:
    """HiGHS, remembering which 0/1 columns each sub-MILP left free."""

    def __init__(self):
        self.free = []

    def solve(self, milp, **kw):
        cols = np.nonzero(milp.integrality)[0]
        self.free.append(set(cols[milp.lb[cols] < milp.ub[cols]].tolist()))
        return HighsBackend().solve(milp, **kw)


def test_there_are_cases():
    assert len(cases()) == N_CASES  # each parametrized case has its graph


@pytest.mark.parametrize("case", range(N_CASES))
def test_map_decisions_carries_a_schedule_between_forms(case):
    """Running sums with every row to full sums with lazy rows (branch and bound's form) and
    back: the same schedule, and decisions only (helper columns are recomputed by encode)."""
    g, budget, start, _ = cases()[case]
    form = Formulation(g, budget)
    form_bb = Formulation(g, budget, running_sums=False, recompute_points=frozenset())
    x = form.encode(start)
    y = lns.map_decisions(form, x, form_bb)
    assert form_bb.decode(y) == form.decode(x)
    back = lns.map_decisions(form_bb, y, form)
    ints = np.nonzero(form.milp.integrality)[0]
    assert np.array_equal(back[ints], x[ints])


@pytest.mark.parametrize("case", range(N_CASES))
def test_rins_guided_by_the_optimum_reaches_it_in_one_step(case):
    g, budget, start, opt = cases()[case]
    form = Formulation(g, budget)
    x0 = form.encode(start)
    x_opt = form.encode(solver.solve(g, budget, time_limit_s=30, mip_gap=0).schedule)
    be = _Recording()
    best, stats = lns.improve(form, x0, be, deadline=time.perf_counter() + 30,
                              guide=lambda: (1, x_opt), should_stop=lambda: len(be.free) >= 1)
    ints = np.nonzero(form.milp.integrality)[0]
    disagree = {int(c) for c in ints if abs(x_opt[c] - x0[c]) > lns.RINS_TOL}
    assert be.free[0] == disagree  # the first sub-MILP is the RINS step, freeing exactly these
    assert stats.rins == 1 and stats.rins_improved == 1 and stats.windows == 0
    assert form.milp.objective(best) / form.time_scale == pytest.approx(opt, rel=1e-9)
    assert simulate(g, form.decode(best)).peak_bytes <= budget


@pytest.mark.parametrize("case", range(N_CASES))
def test_rins_runs_once_per_guide_and_incumbent_and_never_worsens(case):
    g, budget, start, opt = cases()[case]
    form = Formulation(g, budget)
    x0 = form.encode(start)
    rng = np.random.default_rng(case)
    lp = rng.random(form.milp.num_vars)  # any vector in [0, 1] may guide; bounds stay valid
    be = _Recording()
    best, stats = lns.improve(form, x0, be, deadline=time.perf_counter() + 30,
                              guide=lambda: (7, lp))
    assert stats.rins >= 1
    assert stats.rins <= stats.improved + 1  # a repeat only after the incumbent moved
    assert form.milp.objective(best) <= form.milp.objective(x0) + 1e-9
    assert form.milp.objective(best) / form.time_scale >= opt * (1 - 1e-9)
    assert simulate(g, form.decode(best)).peak_bytes <= budget


def test_a_guide_equal_to_the_incumbent_frees_nothing_and_is_skipped():
    g, budget, start, _ = cases()[0]
    form = Formulation(g, budget)
    x0 = form.encode(start)
    be = _Recording()
    _, stats = lns.improve(form, x0, be, deadline=time.perf_counter() + 30,
                           guide=lambda: (1, x0), should_stop=lambda: len(be.free) >= 1)
    assert stats.rins == 0 and stats.windows == 1  # the first sub-MILP was a window


def test_solve_reports_rins_steps_with_the_lp_as_guide(monkeypatch):
    """Branch and bound is stubbed to find nothing, so the LP (solved beside it, also the guide)
    and LNS do the work; the answer is still the optimum."""
    bb = importlib.import_module("solver.search.branch_and_bound")
    monkeypatch.setattr(bb, "run_milp", branch_and_bound_finding_nothing(4.0))
    for g, budget, _, opt in cases():
        r = solver.solve(g, budget, time_limit_s=25, mip_gap=0)
        assert r.objective == pytest.approx(opt, rel=1e-9)
        if r.stats["lns"] is not None and r.stats["lns"]["rins"] >= 1:
            break
    else:
        pytest.fail("no case ran a RINS step")


# -- probes (search/probes.py): branch and bound under an objective cutoff proves bounds ---------
def _incumbent(form, schedule_or_x, mip_gap):
    """A search context whose pool holds `schedule_or_x`, with 30 s to go."""
    from solver.search.context import SearchContext
    from solver.search.pool import Pool
    from solver.search.progress import Progress

    pool = Pool([form])
    x = schedule_or_x if isinstance(schedule_or_x, np.ndarray) else form.encode(schedule_or_x)
    assert pool.offer(form, x, "test")
    return SearchContext(form=form, bb_form=form, pool=pool, backend=HighsBackend(),
                         deadline=time.perf_counter() + 30, mip_gap=mip_gap,
                         progress=Progress(False, 10, 1.0, 1.0, "test"))


def test_probes_prove_both_lines_below_an_optimal_incumbent():
    from solver.search.probes import probe_bounds

    for g, budget, _, opt in cases()[:3]:
        form = Formulation(g, budget)
        r = HighsBackend().solve(form.milp, time_limit_s=30, mip_gap=0)
        ctx = _incumbent(form, r.x, 0.05)
        probe_bounds(ctx, form, 0.05, lambda: False)
        # nothing costs less than the optimum, so every line (10%, 7.5% and 5% below) is proven
        assert [(gap, status) for gap, status, _ in ctx.probes] == [
            (0.1, "proved"), (0.075, "proved"), (0.05, "proved")]
        proven = ctx.pool.bound("probe")
        assert proven <= r.objective
        assert proven == pytest.approx(0.95 * r.objective, rel=1e-8)


def test_a_probe_above_the_optimum_hands_over_a_better_schedule():
    probes = importlib.import_module("solver.search.probes")

    for g, budget, start, opt in cases():
        form = Formulation(g, budget)
        ctx = _incumbent(form, start, 0.0)
        pool = ctx.pool
        start_obj = pool.obj
        gap = (1 - opt * form.time_scale / start_obj) / 4  # the first line lies above the optimum
        assert probes.PROBE_GAPS[0] == 2.0
        if gap < 1e-4:
            continue
        probes.probe_bounds(ctx, form, gap, lambda: False)
        assert pool.obj < start_obj and pool.source == "highs/probe"
        assert len(ctx.probes) == 1  # it returned at once, for LNS to go on from there
        x, obj, _ = pool.get(form)
        tl = simulate(g, form.decode(x))
        assert tl.peak_bytes <= budget
        assert tl.total_time == pytest.approx(obj / form.time_scale, rel=1e-9)
        # whatever the probe proved is a lower bound of the optimum
        proven = pool.bound("probe")
        assert proven is None or proven <= opt * form.time_scale * (1 + 1e-9)
        return
    pytest.fail("no case whose start is far enough from the optimum")


def test_solve_turns_to_probes_when_lns_is_quiet(monkeypatch):
    # Branch and bound proper finds nothing (stubbed); probes may run at once. The bound the
    # solve reports then comes from the probes, and it is valid.
    bb = importlib.import_module("solver.search.branch_and_bound")
    real = bb.run_milp
    stub = branch_and_bound_finding_nothing(6.0)

    def runner(backend, milp, **kw):
        probe = kw.get("cutoff") is not None
        return real(backend, milp, **kw) if probe else stub(backend, milp, **kw)

    monkeypatch.setattr(bb, "run_milp", runner)
    monkeypatch.setattr(importlib.import_module("solver.search.local"), "PROBE_QUIET_S", 0.0)
    for g, budget, _, opt in cases():
        r = solver.solve(g, budget, time_limit_s=20, mip_gap=0.05)
        if r.stats["probes"]:
            assert r.stats["probe_bound_s"] <= opt * (1 + 1e-9)
            assert r.stats["lower_bound_s"] <= opt * (1 + 1e-9)
            if r.status == "optimal":
                assert r.mip_gap <= 0.05 + 1e-9
                return
    pytest.fail("no case proved its gap by probes")
