"""Baselines: known schedules on hand-built graphs, every result replayed by the simulator, and the
documented behaviour at budgets they cannot meet."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import solver
from solver import InfeasibleBudgetError, baselines, simulate
from solver.analysis import GraphFacts
from solver.rules import simple as rules
from solver.rules.simple import articulation_values, schedule_from_keep
from solver_cases import GraphBuilder, random_dag
from test_solver_catalogue import chain, diamond, skip


def unit_chain(n: int):
    """x -> op0 -> v0 -> ... -> op{n-1} -> v{n-1} (output); size 10, fwd 1, bwd 1, saves input."""
    b = GraphBuilder(f"chain{n}")
    v = b.input("x", 0)
    for i in range(n):
        v = b.op(f"op{i}", [v], 10 if i < n - 1 else 1)
    return b.build(outputs=v)


def _replayed(graph, r):
    tl = simulate(graph, r.schedule)
    assert r.predicted_peak_bytes == tl.peak_bytes == r.schedule.predicted_peak_bytes
    assert r.predicted_time == tl.total_time == r.objective
    return tl


def test_store_all():
    g = chain()
    r = baselines.store_all(g)
    assert r.status == "heuristic" and r.backend == "baseline:store_all"
    assert r.schedule.created_by == "baseline:store_all"
    tl = _replayed(g, r)
    assert (tl.peak_bytes, tl.total_time) == (31, 11.0)
    assert baselines.store_all(g, "31B").ok


def test_chen_sqrt_n_on_a_nine_op_chain():
    # every Value of a chain is an articulation point; segments of sqrt(9) = 3 ops keep v2 and
    # v5, and each segment's interior is recomputed once, at the first stage that needs it
    g = unit_chain(9)
    r = baselines.chen_sqrt_n(g)
    s = r.schedule
    assert [g.values[v].name for v in s.forward_keep] == ["op2", "op5"]
    rec = {g.ops[st.op].name: [g.ops[j].name for j in st.recompute] for st in s.stages
           if st.recompute}
    assert rec == {"op8": ["op6", "op7"], "op5": ["op3", "op4"], "op2": ["op0", "op1"]}
    tl = _replayed(g, r)
    assert tl.total_time == 9 + 9 + 6
    assert r.stats["segment_length"] == 3


def test_articulation_values():
    assert [chain().values[v].name for v in articulation_values(chain())] == ["op0", "op1", "op2"]
    assert [skip().values[v].name for v in articulation_values(skip())] == ["op0"]
    assert articulation_values(diamond()) == [1]


def test_greedy_fits_the_budget_and_keeps_what_it_can():
    g = unit_chain(9)
    top = baselines.store_all(g).predicted_peak_bytes
    r = baselines.greedy(g, top)  # nothing to drop
    assert r.predicted_time == baselines.store_all(g).predicted_time
    for budget in (top - 10, top - 30, 60):
        r = baselines.greedy(g, budget)
        assert r.status == "heuristic" and r.predicted_peak_bytes <= budget
        _replayed(g, r)
    assert baselines.greedy(g, 60).predicted_time > baselines.greedy(g, top - 10).predicted_time


def test_heuristics_report_a_budget_they_cannot_meet():
    g = chain()
    for f in (baselines.store_all, baselines.chen_sqrt_n, baselines.greedy):
        r = f(g, 20)
        assert r.status == "error" and r.schedule is None
        assert "over the budget of 20 B; the budget may still be feasible" in r.message
        assert r.stats["peak_bytes"] > 20


def test_checkpoint_only_is_the_checkpoint_milp():
    g = chain()
    r = baselines.checkpoint_only(g, 21)
    assert r.status == "optimal" and r.schedule.mode == "checkpoint"
    assert r.objective == pytest.approx(12.0)
    assert baselines.checkpoint_only(g).objective == pytest.approx(11.0)  # store-all budget
    with pytest.raises(InfeasibleBudgetError, match="below the minimum feasible budget 21 B"):
        baselines.checkpoint_only(g, 20)


@pytest.mark.parametrize("seed", range(5))
def test_baselines_never_beat_the_milp(seed):
    g = random_dag(random.Random(seed), 10)
    top = baselines.store_all(g).predicted_peak_bytes
    for frac in (1.0, 0.8, 0.6):
        budget = int(top * frac)
        try:
            best = solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
        except InfeasibleBudgetError:
            continue
        for f in (baselines.store_all, baselines.chen_sqrt_n, baselines.greedy):
            r = f(g, budget)
            if r.ok:
                _replayed(g, r)
                assert r.predicted_time >= best.objective - 1e-9


def test_schedule_from_keep_retention_policies():
    g = unit_chain(6)
    facts = GraphFacts(g, "full")
    times = {}
    for retain in ("all", "saved", "none"):
        s = schedule_from_keep(g, (), retain=retain, facts=facts)
        times[retain] = simulate(g, s).total_time
    # keeping nothing and holding what was recomputed: each op recomputed once (5 ops)
    assert times["all"] == times["saved"] == 6 + 6 + 5
    # recomputing from the input at every stage: 5 + 4 + 3 + 2 + 1
    assert times["none"] == 6 + 6 + 15


def dense_like(layers: int = 4):
    """DenseNet in miniature: each layer concatenates every earlier feature map (cat saves
    nothing), normalizes (cheap, saves its input) and convolves (dear, saves its input) into a new
    feature map that only later concatenations read."""
    b = GraphBuilder("dense")
    x = b.input("x", 0)
    feats = [b.op("conv0", [x], 10, fwd=10.0, saved=())]
    for i in range(layers):
        width = 10 * len(feats)
        cat = b.op(f"cat{i}", feats, width, fwd=0.1, saved=(), kind="cat")
        norm = b.op(f"norm{i}", [cat], width, fwd=0.1, kind="BatchNorm2d")
        feats.append(b.op(f"conv{i + 1}", [norm], 10, fwd=10.0, kind="Conv2d"))
    return b.build(outputs=b.op("head", [feats[-1]], 1, fwd=0.1)), feats


def test_ranked_keeps_feature_maps_no_backward_reads():
    """The memory-efficient DenseNet schedule: keep the feature maps, recompute the cheap
    concatenations and normalizations. Greedy only drops from store-all's keep set, which never
    holds the feature maps, so under the same budget it must recompute the dear convolutions."""
    g, feats = dense_like()
    facts = GraphFacts(g, "checkpoint")
    top = simulate(g, schedule_from_keep(g, (), retain="none", facts=facts)).peak_bytes
    store_all = simulate(g, solver.store_all_schedule(g))
    budget = (top + store_all.peak_bytes) // 2
    ranked = rules.ranked_schedule(g, budget, facts)
    assert ranked is not None
    tl = simulate(g, ranked)
    assert tl.peak_bytes <= budget < store_all.peak_bytes
    recomputed = [j for st in ranked.stages for j in st.recompute]
    assert recomputed and all(g.ops[j].name.startswith(("cat", "norm")) for j in recomputed)
    # the recomputed concatenations read feature maps kept from the forward
    read = {v for j in recomputed for v in g.ops[j].inputs} & set(feats)
    assert read and read <= set(ranked.forward_keep), (read, ranked.forward_keep)
    greedy = rules.greedy_schedule(g, budget, facts)
    g_tl = simulate(g, greedy)
    assert g_tl.peak_bytes > budget or g_tl.total_time > tl.total_time


def test_ranked_none_when_nothing_fits():
    g, _ = dense_like()
    facts = GraphFacts(g, "checkpoint")
    assert rules.ranked_schedule(g, 1, facts) is None


def _keep_more_case(seed: int, n: int, frac: float):
    """(graph, budget, build, candidates, start) for keep_more on a random DAG: keep nothing
    under a random retention policy, the budget a fraction of the way from there to store-all."""
    rng = random.Random(seed)
    g = random_dag(rng, n)
    facts = GraphFacts(g, "full")
    retain = rng.choice(["saved", "all", "none"])

    def build(keep):
        return schedule_from_keep(g, keep, retain=retain, facts=facts)

    start = build(())
    least = simulate(g, start).peak_bytes
    top = simulate(g, solver.store_all_schedule(g)).peak_bytes
    budget = least + int(max(0, top - least) * frac)
    candidates = [v.id for v in g.values if v.producer is not None and facts.scheduled[v.id]
                  and facts.horizon[v.id] >= 0]
    rng.shuffle(candidates)
    return g, budget, build, candidates, start


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.integers(0, 10 ** 6), st.integers(3, 14), st.floats(0.0, 1.0))
def test_keep_more_fits_and_only_gets_faster(seed, n, frac):
    """From a kept set that fits, keep_more returns a schedule that fits and is no slower; the
    ranked rule, which ends with it, fits too."""
    g, budget, build, candidates, start = _keep_more_case(seed, n, frac)
    s = rules.keep_more(g, budget, (), candidates, build)
    tl, t0 = simulate(g, s), simulate(g, start)
    assert tl.peak_bytes <= budget
    assert tl.total_time <= t0.total_time
    ranked = rules.ranked_schedule(g, budget, GraphFacts(g, "full"))
    assume(ranked is not None)
    assert simulate(g, ranked).peak_bytes <= budget


def test_keep_more_is_not_vacuous():
    """On random DAGs at budgets between keep-nothing and store-all, keep_more finds a faster
    schedule in many cases (the property above holds with something to hold it on)."""
    faster = 0
    for seed in range(40):
        g, budget, build, candidates, start = _keep_more_case(seed, 10, 0.5)
        faster += (simulate(g, rules.keep_more(g, budget, (), candidates, build)).total_time
                   < simulate(g, start).total_time)
    assert faster >= 10, faster
