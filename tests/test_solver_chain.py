"""Chain combination (solver/rules/chain.py): the dynamic programme against brute force over option
tables, the whole rule against brute force over every combination of segment plans replayed by
the simulator, and against the monolithic MILP, on generated chains of a random block."""

from __future__ import annotations

import itertools
import math
import random
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import solver
from solver.analysis import GraphFacts
from solver.rules.blocks import find_blocks
import solver.rules.chain as chain_mod
from solver.rules.chain import (Link, Option, chain_links, chain_schedule, combine, picked_keep,
                          segment_keeps)
from solver.rules.simple import schedule_from_keep
from solver.simulate import simulate, store_all_schedule
from solver_cases import random_repeated


def chain_peak(links, picked) -> int:
    """The chain's model of the step's peak (solver/rules/chain.py), written out."""
    held, peak = 0, 0
    for li, oi in picked:
        o = links[li].options[oi]
        peak = max(peak, held + o.peak)
        held += o.extra
    return peak


def every_choice(links, segments):
    """Every choice of links covering 0..segments end to end, with one option per link."""
    def paths(a):
        if a == segments:
            yield []
            return
        for li, link in enumerate(links):
            if link.start == a:
                for rest in paths(link.stop):
                    yield [li] + rest
    for path in paths(0):
        for opts in itertools.product(*(range(len(links[li].options)) for li in path)):
            yield list(zip(path, opts))


def seconds_of(links, picked) -> float:
    return sum(links[li].options[oi].time for li, oi in picked)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.data(), st.integers(0, 30))
def test_combine_finds_the_brute_force_optimum(segments, data, budget):
    """Links of any span (some boundaries reachable only through long links, some not at
    all) with option tables: the programme's choice is the fastest that fits, as brute force
    over every covering and every option finds it."""
    spans = data.draw(st.lists(st.tuples(st.integers(0, segments - 1), st.integers(1, 3)),
                               min_size=1, max_size=7))
    option = st.tuples(st.integers(-3, 6), st.integers(0, 12), st.integers(0, 5))
    links = [Link(a, min(segments, a + n),
                  [Option(frozenset(), e, p, float(t))
                   for e, p, t in data.draw(st.lists(option, min_size=1, max_size=4))])
             for a, n in spans]
    fitting = [(seconds_of(links, c), c) for c in every_choice(links, segments)
               if chain_peak(links, c) <= budget]
    picked = combine(links, segments, budget)
    if not fitting:
        assert picked is None
        return
    assert picked is not None and chain_peak(links, picked) <= budget
    assert [links[li].start for li, _ in picked][0] == 0
    assert all(links[a].stop == links[b].start for (a, _), (b, _) in zip(picked, picked[1:]))
    assert links[picked[-1][0]].stop == segments
    assert seconds_of(links, picked) == min(t for t, _ in fitting)


def _setup(seed: int, k: int, inner: int):
    g = random_repeated(random.Random(seed), k, inner)
    facts = GraphFacts(g, "checkpoint")
    chain = find_blocks(g)
    return g, facts, chain


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10 ** 6), st.integers(2, 3), st.integers(1, 4), st.floats(0.0, 1.0),
       st.booleans(), st.sampled_from([1, 2]))
@example(seed=0, k=3, inner=3, frac=0.3, subsets=False, longest=1)
@example(seed=3, k=2, inner=2, frac=0.0, subsets=True, longest=1)  # a mask needless once both keep
@example(seed=2352, k=2, inner=2, frac=0.0, subsets=True, longest=1)  # a twin carried from the first
@example(seed=158495, k=2, inner=3, frac=0.0, subsets=True, longest=1)  # ... from the mask's last reader
def test_chain_schedule_is_the_best_combination_replayed(seed, k, inner, frac, subsets, longest):
    """Every choice of links and of their options, each replayed by the simulator: the chain's
    model of each choice's recomputation time is the simulator's, and its peak too, or above it
    (safe) where a Value read from outside by every block (the mask) is needless once every
    block keeps what reads it, a saving no block's own replay sees. The rule's schedule is the
    fastest choice the model fits (the exact optimum over every choice, dominated options
    included, when nothing is shared). `subsets` False gives options made of prefixes and single
    additions even to these small links; `longest` 2 adds the runs of two segments (two blocks
    of at most two ops then, so that every choice stays few)."""
    if longest > 1:
        k, inner = 2, min(inner, 2)
    g, facts, chain = _setup(seed, k, inner)
    assert chain.classes, "the generator repeats a block"
    shared = bool(chain.classes[0].broadcast)
    impl = (0,) * len(g.ops)
    S = len(chain.segments)
    small = ({"ALL_SUBSETS_UP_TO": 1, "SUBSET_WORK": 0} if not subsets else
             {"ALL_SUBSETS_UP_TO": chain_mod.ALL_SUBSETS_UP_TO})
    with mock.patch.multiple(chain_mod, **small):
        links = chain_links(g, facts, chain, impl, longest)

        def replay(picked):
            return simulate(g, schedule_from_keep(g, picked_keep(chain, links, picked),
                                                  retain="saved", facts=facts))

        base = replay([(li, 0) for li, link in enumerate(links) if link.stop - link.start == 1])
        modelled, rows = [], []
        for c in every_choice(links, S):
            tl = replay(c)
            peak = chain_peak(links, c)
            assert peak == tl.peak_bytes if not shared else peak >= tl.peak_bytes
            seconds = base.recompute_time + seconds_of(links, c)
            assert math.isclose(seconds, tl.recompute_time, rel_tol=1e-12, abs_tol=1e-12)
            modelled.append((peak, tl.total_time))
        least = min(p for p, _ in modelled)
        top = max(p for p, _ in modelled)
        budget = int(least + frac * (top - least))
        s = chain_schedule(g, budget, facts, chain=chain, longest=longest)
        assert s is not None
        tl = simulate(g, s)
        assert tl.peak_bytes <= budget
        assert math.isclose(tl.total_time, min(t for p, t in modelled if p <= budget),
                            rel_tol=1e-12)
        if not shared and longest == 1:  # every option of every segment, dominated ones too
            keeps, _ = segment_keeps(g, facts, chain, impl, frozenset().union(*chain.cuts))
            forced = frozenset().union(*chain.cuts)
            rows = [(r.peak_bytes, r.total_time) for r in (
                simulate(g, schedule_from_keep(g, forced.union(*ks), retain="saved",
                                               facts=facts)) for ks in itertools.product(*keeps))]
            assert math.isclose(tl.total_time, min(t for p, t in rows if p <= budget),
                                rel_tol=1e-12)
        if not shared:
            assert chain_schedule(g, least - 1, facts, chain=chain, longest=longest) is None


def _budget_between(g, facts, chain, frac):
    """A budget `frac` of the way from the boundaries-only peak to store-all's."""
    lo = simulate(g, schedule_from_keep(g, set().union(*chain.cuts), retain="saved",
                                        facts=facts)).peak_bytes
    hi = simulate(g, store_all_schedule(g)).peak_bytes
    return lo + int(frac * max(0, hi - lo))  # recomputing can need more than store-all


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10 ** 6), st.integers(2, 3), st.integers(1, 3), st.floats(0.0, 1.0))
@example(seed=1889, k=2, inner=1, frac=1.0)  # boundaries alone need more than store-all
def test_chain_schedule_against_the_monolithic_milp(seed, k, inner, frac):
    """The MILP's optimum over every schedule is never slower than the chain's, on single
    segments and on runs of up to three, at the budget and at the chain's own peak: the chain's
    family is part of the MILP's. How often the two are the same optimum is
    scripts/bench_chain.py's count (docs/BENCHMARKS.md, Chain combination): not always, the
    MILP may recompute a Value twice, earlier than on demand, or hold what it recomputed for a
    later recomputation, which no kept set with the chain's retention expresses."""
    g, facts, chain = _setup(seed, k, inner)
    budget = _budget_between(g, facts, chain, frac)
    r = solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
    assert r.status == "optimal"
    for longest in (1, 3):
        s = chain_schedule(g, budget, facts, chain=chain, longest=longest)
        assert s is not None  # boundaries alone fit
        ours = simulate(g, s)
        assert ours.peak_bytes <= budget
        assert r.predicted_time <= ours.total_time * (1 + 1e-9)
        at_our_peak = solver.solve(g, ours.peak_bytes, mode="checkpoint", time_limit_s=30,
                                   mip_gap=0)
        assert at_our_peak.predicted_time <= ours.total_time * (1 + 1e-9)


@pytest.mark.parametrize("seed", [5, 20, 44, 45, 57])
def test_runs_of_segments_find_the_milps_optimum_where_single_segments_did_not(seed):
    """Generated chains (bench_chain.py's first 60) on which the chain missed the MILP's optimum
    while it kept every boundary (and, for all five, also on pairs of segments): the optimum
    drops boundaries inside a run of up to three segments and keeps Values apart in it (seed
    5: two block outputs, with neither boundary), which runs of three with every subset of a
    small run as an option find."""
    rng = random.Random(seed)
    k, inner, frac = rng.randint(2, 3), rng.randint(1, 3), rng.random()
    g, facts, chain = _setup(seed, k, inner)
    budget = _budget_between(g, facts, chain, frac)
    r = solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
    assert r.status == "optimal"
    single = simulate(g, chain_schedule(g, budget, facts, chain=chain)).total_time
    assert single > r.predicted_time * (1 + 1e-9)
    runs = simulate(g, chain_schedule(g, budget, facts, chain=chain, longest=3))
    assert runs.peak_bytes <= budget
    assert math.isclose(runs.total_time, r.predicted_time, rel_tol=1e-9)


def test_solve_leaves_the_costly_rules_out_once_the_chain_is_proven(monkeypatch):
    """On a profiled transformer the chain's schedule is proven within the target gap by the
    closure LP before the rules that take seconds: solve answers with it and never runs the
    ranked, greedy or keep-nothing rules (each made to fail here if called)."""
    import torch

    import monetlike
    from monetlike.models import transformer
    from solver.rules import warmstart

    g = monetlike.profile(transformer(depth=4, dim=64, heads=4),
                          torch.randn(2, 64, 64, device="meta"), cost="analytical:A100-40GB")
    budget = int(simulate(g, store_all_schedule(g)).peak_bytes * 0.7)

    def not_run(*a, **k):
        raise AssertionError("a costly rule ran after a cheaper one was proven")

    for name in ("ranked_schedule", "greedy_schedule", "schedule_from_keep"):
        monkeypatch.setattr(warmstart, name, not_run)
    r = solver.solve(g, budget, mode="checkpoint", time_limit_s=60, mip_gap=0.02)
    assert r.status == "optimal" and r.stats["incumbent_source"] == "heuristic:chain"
    assert r.mip_gap <= 0.02 and simulate(g, r.schedule).peak_bytes <= budget
