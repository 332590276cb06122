"""Recompute-support cuts (solver/cuts.py): every cut holds for every schedule, so optima are
unchanged; separation finds exactly the most violated cut per path and stage; and they raise the
LP bound where the LP ramps a Value's residency up through tiny recomputations."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver
from solver import simulate, store_all_schedule
from solver.backends.highs import HighsBackend
from solver.cuts import SupportCut, all_support_cuts, separate, support_paths, support_terms
from solver.formulation import Formulation
from solver_cases import (GraphBuilder, random_chain, random_dag, random_inplace_dag,
                          random_schedules)
from solver_reference import exact_optimum

GRAPHS = {"chain": random_chain, "dag": lambda rng, n: random_dag(rng, n, two_impl=True),
          "inplace": random_inplace_dag}


def _graph(kind: str, seed: int, n: int):
    return GRAPHS[kind](random.Random(seed), n)


def _with_every_cut(g, budget, **kw):
    plain = Formulation(g, budget, **kw)
    return plain, Formulation(g, budget, support_cuts=frozenset(all_support_cuts(plain)), **kw)


def _solved(milp, integer=True):
    return HighsBackend().solve(milp if integer else milp.relaxation(), time_limit_s=30,
                                mip_gap=0)


def _optimum(milp, integer=True):
    r = _solved(milp, integer)
    return None if r.x is None else r.objective


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), n=st.integers(2, 8), kind=st.sampled_from(sorted(GRAPHS)),
       offload=st.booleans())
def test_every_cut_holds_for_every_schedule(seed, n, kind, offload):
    g = _graph(kind, seed, n)
    if offload:
        g = dataclasses.replace(g, host_bandwidth=1.0)
    budget = simulate(g, store_all_schedule(g)).peak_bytes
    for s in random_schedules(g, random.Random(seed), random_impls=kind == "inplace"):
        _, f = _with_every_cut(g, max(budget, simulate(g, s).peak_bytes), offload=offload)
        assert f.milp.violations(f.encode(s)) == []


@pytest.mark.parametrize("kind,seed", [("chain", s) for s in range(4)]
                         + [("dag", s) for s in range(6)] + [("inplace", s) for s in range(3)])
def test_cuts_keep_the_exact_optimum(kind, seed):
    """The MILP with every cut against the exhaustive search (no shared code), at three
    budgets; the LP relaxation never drops."""
    g = _graph(kind, seed, 6)
    peak = simulate(g, store_all_schedule(g)).peak_bytes
    for share in (0.8, 0.6, 0.45):
        budget = int(peak * share)
        plain, cut = _with_every_cut(g, budget)
        ref = exact_optimum(g, budget)
        if plain.infeasible_points or ref is None:
            assert ref is None or not plain.infeasible_points
            continue
        assert _optimum(cut.milp) / cut.time_scale == pytest.approx(ref[0], rel=1e-9)
        assert _optimum(cut.milp, False) >= _optimum(plain.milp, False) - 1e-9


def _ramp_case():
    """A random DAG (seed 240, 8 ops) at 60% of its store-all peak where the LP is 1048 time
    units, 1064 with the cuts, and the optimum 1104: found by a search over random graphs."""
    rng = random.Random(240)
    g = random_dag(rng, rng.randint(5, 10), two_impl=True)
    return g, int(simulate(g, store_all_schedule(g)).peak_bytes * 0.6)


def test_cuts_raise_the_lp_bound_where_it_ramps():
    g, budget = _ramp_case()
    plain, cut = _with_every_cut(g, budget)
    lp, lp_cut, opt = _optimum(plain.milp, False), _optimum(cut.milp, False), _optimum(plain.milp)
    assert lp < lp_cut <= opt
    assert _optimum(cut.milp) == pytest.approx(opt, rel=1e-12)
    # the plain LP solution breaks cuts, and separation finds them
    assert separate(plain, _solved(plain.milp, integer=False).x)


def test_solve_reports_the_bound_the_cuts_give():
    """solve's root cut rounds: the reported LP bound is above the plain LP relaxation (of the
    model with every memory row), which it could not be without cuts."""
    g, budget = _ramp_case()
    plain = Formulation(g, budget)
    r = solver.solve(g, budget, time_limit_s=60, mip_gap=0)
    lp = _optimum(plain.milp, False) / plain.time_scale
    assert r.stats["lp_bound_s"] > lp * (1 + 1e-9)
    assert r.stats["branch_and_bound_model"]["support_cuts"] > 0
    assert r.objective == pytest.approx(_optimum(plain.milp) / plain.time_scale, rel=1e-12)


def _violation(form, cut, x):
    return sum(a * x[c] for c, a in support_terms(form, cut))


@pytest.mark.parametrize("seed", range(12))
def test_separation_finds_the_most_violated_cut_per_path_and_stage(seed):
    """Against brute force over every cut, on the LP solution (which ramps) and on random
    fractional vectors."""
    kind = sorted(GRAPHS)[seed % 3]
    g = _graph(kind, seed, 8)
    f = Formulation(g, int(simulate(g, store_all_schedule(g)).peak_bytes * 0.6))
    if f.infeasible_points:
        return
    np_rng = np.random.default_rng(seed)
    lp = _solved(f.milp, integer=False).x
    for x in (lp, np_rng.random(f.milp.num_vars), np.round(np_rng.random(f.milp.num_vars), 1)):
        if x is None:
            continue
        best: dict = {}
        for c in all_support_cuts(f):
            key = (c.value, c.path, c.last)
            best[key] = max(best.get(key, -np.inf), _violation(f, c, x))
        found = separate(f, x, min_violation=0.01, limit=10**9)
        want = {k for k, v in best.items() if v > 0.01}
        assert {(c.value, c.path, c.last) for c in found} == want
        for c in found:
            assert _violation(f, c, x) == pytest.approx(best[c.value, c.path, c.last], abs=1e-9)
        assert [_violation(f, c, x) for c in found] == sorted(
            (_violation(f, c, x) for c in found), reverse=True)


def test_paths_follow_inputs_and_stop_at_the_depth():
    g = _graph("chain", 3, 6)
    f = Formulation(g, simulate(g, store_all_schedule(g)).peak_bytes)
    for depth in (1, 2, 3):
        paths = support_paths(f, depth)
        assert paths and max(len(p) for _, p in paths) <= depth
        for v, path in paths:
            chain = (v,) + path
            for a, u in zip(chain, chain[1:]):
                assert u in g.ops[g.values[a].producer].inputs


def test_a_cut_off_the_input_chain_is_refused():
    b = GraphBuilder("two")
    x = b.input("x", 1)
    a = b.op("a", [x], 4, saved=("in0",))
    c = b.op("c", [a], 4, saved=("in0",))
    y = b.op("y", [c], 4, saved=("in0",))
    g = b.build(outputs=y)
    with pytest.raises(ValueError, match="is not an input of the producer"):
        Formulation(g, 100, support_cuts=frozenset({SupportCut(a, (c,), 0, 1)}))
