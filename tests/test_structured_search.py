"""The block-copy strategy (solver/search/structured.py): a copied plan lands on the twin's own
ops, Values and stages (checked by op names, not by the strategy's mapping); the tied sub-MILP
reaches the monolithic MILP's optimum when that optimum is symmetric and is never below it; the
strategy's answers are feasible in the simulator and never worse than its start; and the
portfolio runs it only where blocks repeat."""

from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest

from solver.analysis import GraphFacts
from solver.backends.highs import HighsBackend
from solver.rules.blocks import find_blocks
from solver.formulation import Formulation
from solver.rules.simple import schedule_from_keep
from solver.search import pipeline, structured
from solver.search.context import SearchContext
from solver.search.pool import Pool
from solver.search.progress import Progress
from solver.simulate import simulate, store_all_schedule
from solver.rules.warmstart import heuristic_schedules
from solver_cases import GraphBuilder, random_dag
from test_blocks import H, stacked


def _strip(name: str) -> str:
    """'h2.b' -> 'b': an op's name inside its block (stacked() names block i's ops h{i}.*)."""
    return name.split(".", 1)[1]


def _plan(g, s, i: int) -> tuple:
    """Block i's plan, in names local to the block: which of its Values the forward keeps, and
    per stage of its own ops what is recomputed and dropped of the block."""
    ops = {o.id for o in g.ops if o.name.startswith(f"h{i}.")}
    vals = {w for j in ops for w in g.ops[j].outputs}
    name = lambda v: _strip(g.values[v].name)  # noqa: E731
    keep = sorted(name(v) for v in s.forward_keep if v in vals)
    stages = []
    for st in s.stages:
        if st.op in ops:
            stages.append((_strip(g.ops[st.op].name),
                           sorted(_strip(g.ops[j].name) for j in st.recompute if j in ops),
                           sorted(name(v) for v in st.drop if v in vals)))
    return keep, stages


def _optimum(form) -> np.ndarray:
    r = HighsBackend().solve(form.milp, time_limit_s=30, mip_gap=0)
    assert r.status == "optimal"
    return form.encode(form.decode(r.x))


# ----------------------------------------------------------------------------------------------
# The mapping, checked by names
# ----------------------------------------------------------------------------------------------
def test_hand_made_three_blocks_the_copied_plan_is_the_representatives_on_every_twin():
    """Three blocks: the first (whose backward comes last: the representative) drops its `a`
    output (saved by `b`) and recomputes it; the twins keep everything. Copying gives every
    twin the same plan in its own names (its Values kept, its op recomputed at its own stage)
    and a valid schedule; the tied columns include residency across other blocks' stages."""
    g, first, _ = stacked(3)
    facts = GraphFacts(g, "full")
    names = {v.name: v.id for v in g.values}
    keep = {v.id for v in g.values if v.producer is not None} - {names["h0.a"]}
    start = schedule_from_keep(g, keep, retain="all", facts=facts, mode="checkpoint")
    budget = simulate(g, store_all_schedule(g)).peak_bytes
    form = Formulation(g, budget, facts=facts)
    x = form.encode(start)
    chain = find_blocks(g)
    ties = structured.tie_group(structured.ColumnIndex(form), chain, chain.classes[0].members)
    assert chain.segments[ties.rep].start == first  # the first block's backward comes last
    rep_plan = _plan(g, form.decode(x), 0)
    assert rep_plan != _plan(g, form.decode(x), 1)  # the start is not symmetric
    assert any(st[1] == ["a"] for st in rep_plan[1])  # a is recomputed
    y = structured.copy_plan(x, ties)
    s = form.decode(y)
    simulate(g, s)  # valid
    assert [_plan(g, s, i) for i in range(3)] == [rep_plan] * 3
    # the twins' residency at stages before their own backward is tied too (held from forward)
    stage_cols = {c for c in ties.pairs[:, 1]
                  if any(c == form.S.get((t, names["h2.a"])) for t in range(form.T))}
    assert stage_cols, "h2.a's residency columns should be tied"
    ok = structured.checked(form, y)
    assert ok is not None and ok[1] <= budget


def test_a_wrong_stage_shift_breaks_the_copy(monkeypatch):
    """The check above can fail: tie stages with a shift off by one and the twins' plans are no
    longer the representative's."""
    g, _, _ = stacked(3)
    facts = GraphFacts(g, "full")
    names = {v.name: v.id for v in g.values}
    keep = {v.id for v in g.values if v.producer is not None} - {names["h0.a"]}
    start = schedule_from_keep(g, keep, retain="all", facts=facts, mode="checkpoint")
    form = Formulation(g, simulate(g, store_all_schedule(g)).peak_bytes, facts=facts)
    x = form.encode(start)
    chain = find_blocks(g)
    right = structured.stage_renaming
    monkeypatch.setattr(structured, "stage_renaming",
                        lambda ch, a, b: (lambda t, f=right(ch, a, b): None if f(t) is None
                                          else f(t) + 1))
    ties = structured.tie_group(structured.ColumnIndex(form), chain, chain.classes[0].members)
    s = form.decode(structured.copy_plan(x, ties))
    rep_plan = _plan(g, form.decode(x), 0)
    assert [_plan(g, s, i) for i in range(3)] != [rep_plan] * 3


def test_group_sweeps_go_from_pairs_to_the_whole_class():
    assert list(structured.group_sweeps((0, 1, 2, 3, 4))) == [
        [(0, 1), (2, 3)], [(0, 1, 2, 3)], [(0, 1, 2, 3, 4)]]
    assert list(structured.group_sweeps((4, 5))) == [[(4, 5)]]
    assert list(structured.group_sweeps((1, 2, 3))) == [[(1, 2)], [(1, 2, 3)]]


# ----------------------------------------------------------------------------------------------
# Tied sub-MILPs against the monolithic optimum
# ----------------------------------------------------------------------------------------------
def rich_stack(k: int, rng: random.Random):
    """Prologue, k identical blocks of 5 ops with random sizes and costs (a Value read twice,
    ops that save their input or output), epilogue: more to decide per block than stacked()."""
    sz = [rng.choice([8, 16, 32, 48]) for _ in range(4)]
    fw = [rng.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(4)]
    b = GraphBuilder("rich")
    x = b.input("x", 4)
    h = b.op("embed", [x], H, kind="Embedding")
    for i in range(k):
        a = b.op(f"h{i}.a", [h], sz[0], saved=("in0",), fwd=fw[0], kind="A")
        c = b.op(f"h{i}.b", [a], sz[1], saved=("out0",), fwd=fw[1], kind="B")
        d = b.op(f"h{i}.c", [c], sz[2], saved=("in0",), fwd=fw[2], kind="C")
        e = b.op(f"h{i}.d", [d, a], sz[3], saved=("in0", "in1"), fwd=fw[3], kind="D")
        h = b.op(f"h{i}.add", [h, e], H, saved=(), kind="add")
    h = b.op("norm", [h], H, kind="LayerNorm")
    return b.build(outputs=b.op("loss", [h], 4, kind="Loss"))


def _slowest_start(g, form):
    """The slowest simple rule that fits the budget (as the pool will see it), so that there
    is something to improve; None when none fits."""
    fits = []
    for _, sched in heuristic_schedules(g, form.budget, form.facts):
        try:
            s = form.decode(form.encode(sched))
        except ValueError:
            continue
        tl = simulate(g, s)
        if tl.peak_bytes <= form.budget:
            fits.append((tl.total_time, s))
    return max(fits, key=lambda f: f[0])[1] if fits else None


def _case(seed: int):
    """2-4 identical rich blocks, a budget at a random fraction of store-all's peak where some
    rule fits, the optimum there."""
    rng = random.Random(seed)
    g = rich_stack(rng.choice([2, 3, 4]), rng)
    facts = GraphFacts(g, "full")
    peak_all = simulate(g, store_all_schedule(g)).peak_bytes
    u = rng.uniform(0.5, 0.9)
    while True:  # store-all fits at u = 1
        form = Formulation(g, int(min(1.0, u) * peak_all), facts=facts)
        if form.infeasible_points or _slowest_start(g, form) is None:
            u += 0.05
            continue
        return g, form, _optimum(form)


N_CASES = 12


@functools.cache
def case_at(seed: int):
    """Solved on first use, in the worker that runs the test (each worker collects every file:
    made at import, the 12 optima cost both of them 6 s of CPU before any test ran)."""
    return _case(seed)


def _symmetric(form, chain, x) -> bool:
    ties = structured.tie_group(structured.ColumnIndex(form), chain, chain.classes[0].members)
    ints = np.nonzero(form.milp.integrality)[0]
    return np.array_equal(np.round(structured.copy_plan(x, ties)[ints]), np.round(x[ints]))


def test_some_cases_have_a_symmetric_optimum():
    syms = [_symmetric(form, find_blocks(g), x)
            for g, form, x in map(case_at, range(N_CASES))]
    assert any(syms)


@pytest.mark.parametrize("case", range(N_CASES))
def test_tied_sub_milp_reaches_a_symmetric_optimum_and_never_passes_the_optimum(case):
    """Scramble every block column of the optimum and solve the tied sub-MILP with the rest
    fixed to it: a symmetric optimum is a solution of the sub-MILP, so it is reached exactly;
    otherwise the answer (a symmetric plan) is no better than the optimum. Either way it is a
    valid schedule whose simulated time is the MILP's objective."""
    g, form, xopt = case_at(case)
    chain = find_blocks(g)
    ties = structured.tie_group(structured.ColumnIndex(form), chain, chain.classes[0].members)
    x0 = xopt.copy()
    x0[ties.free] = np.random.default_rng(case).integers(0, 2, len(ties.free))
    r = HighsBackend().solve(structured.tied_milp(form.milp, x0, ties), time_limit_s=30,
                             mip_gap=0)
    opt = form.milp.objective(xopt)
    if _symmetric(form, chain, xopt):
        assert r.status == "optimal"
        assert abs(r.objective - opt) <= 1e-6 * max(1.0, opt)
    if r.x is not None:
        y = structured.copy_plan(r.x, ties)
        assert abs(form.milp.objective(y) - r.objective) <= 1e-6 * max(1.0, opt)
        y = form.encode(form.decode(y))
        assert form.milp.objective(y) >= opt - 1e-6 * max(1.0, opt)
        tl = simulate(g, form.decode(y))
        assert tl.peak_bytes <= form.budget
        assert abs(tl.total_time - form.seconds(y)) <= 1e-7 * max(1.0, tl.total_time)
        assert _symmetric(form, chain, y)


# ----------------------------------------------------------------------------------------------
# The strategy
# ----------------------------------------------------------------------------------------------
def _context(form, start, seconds=20.0) -> SearchContext:
    pool = Pool([form])
    pool.offer_schedule(form, start, "start")
    return SearchContext(form=form, bb_form=form, pool=pool, backend=HighsBackend(),
                         deadline=time.perf_counter() + seconds, mip_gap=1e-6,
                         progress=Progress(False, seconds, 1.0, 1.0, ""))


@pytest.mark.parametrize("case", range(N_CASES))
def test_the_strategy_is_feasible_never_worse_than_its_start_never_below_the_optimum(case):
    """From the slowest rule that fits."""
    g, form, xopt = case_at(case)
    ctx = _context(form, _slowest_start(g, form))
    obj0 = ctx.pool.obj
    structured.BlockCopy(time_share=1.0, sub_time_s=5.0).run(ctx)
    x, obj, _ = ctx.pool.get(form)
    tally = ctx.structured
    assert tally is not None and tally.sub_milps >= 1
    tl = simulate(g, form.decode(x))
    assert tl.peak_bytes <= form.budget
    assert abs(tl.total_time - obj / form.time_scale) <= 1e-7 * max(1.0, tl.total_time)
    opt = form.milp.objective(xopt)
    assert opt - 1e-6 * max(1.0, opt) <= obj <= obj0
    assert (obj < obj0) == (tally.improved + tally.copies_improved > 0)
    assert ctx.pool.source.startswith("structured") == (obj < obj0)


def test_the_strategy_does_nothing_without_repeated_blocks():
    g = random_dag(random.Random(3), 7)
    form = Formulation(g, simulate(g, store_all_schedule(g)).peak_bytes)
    ctx = _context(form, store_all_schedule(g))
    version = ctx.pool.version
    structured.BlockCopy().run(ctx)
    assert ctx.structured is None and ctx.pool.version == version


def test_an_over_budget_copy_is_not_offered():
    """A copied plan that does not fit is rejected by the simulator check, not offered: the
    representative keeps everything, a twin recomputes, and the budget is the start's peak."""
    g, _, _ = stacked(3)
    facts = GraphFacts(g, "full")
    names = {v.name: v.id for v in g.values}
    # twins h1, h2 drop their `a` output; h0 (the representative) keeps everything
    keep = {v.id for v in g.values if v.producer is not None} - {names["h1.a"], names["h2.a"]}
    start = schedule_from_keep(g, keep, retain="all", facts=facts, mode="checkpoint")
    budget = simulate(g, start).peak_bytes
    form = Formulation(g, budget, facts=facts)
    x = form.encode(start)
    chain = find_blocks(g)
    ties = structured.tie_group(structured.ColumnIndex(form), chain, chain.classes[0].members)
    y = structured.copy_plan(x, ties)
    over = simulate(g, form.decode(y)).peak_bytes
    assert over > budget  # the copy (keep everything everywhere) needs more
    assert structured.checked(form, y) is None


class _Recording:
    made = []

    def __init__(self, chain):
        type(self).made.append(chain)
        self.name = "recording"

    def run(self, ctx):
        pass


@pytest.mark.parametrize("repeated", [True, False])
def test_the_portfolio_runs_block_copy_only_where_blocks_repeat(monkeypatch, repeated):
    monkeypatch.setattr(pipeline, "BlockCopy", _Recording)
    g = stacked(4)[0] if repeated else random_dag(random.Random(3), 7)
    # Half-way between the least budget and store-all's peak: at store-all's peak solve answers
    # without a search.
    store = simulate(g, store_all_schedule(g)).peak_bytes
    budget = (pipeline.min_budget(g, time_limit_s=10) + store) // 2
    _Recording.made = []  # the least-budget search above runs the portfolio too
    r = pipeline.solve(g, budget, time_limit_s=10)
    assert "search" not in r.stats or not r.stats["search"].startswith("skipped")
    assert len(_Recording.made) == (1 if repeated else 0)
