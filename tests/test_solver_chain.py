"""Chain combination (solver/chain.py): the dynamic programme against brute force over option
tables, the whole rule against brute force over every combination of segment plans replayed by
the simulator, and against the monolithic MILP, on generated chains of a random block."""

from __future__ import annotations

import itertools
import math
import random
from unittest import mock

from hypothesis import example, given, settings
from hypothesis import strategies as st

import solver
from solver.analysis import GraphFacts
from solver.blocks import find_blocks, merged
import solver.chain as chain_mod
from solver.chain import Option, chain_schedule, combine, measure, segment_keeps
from solver.rules import schedule_from_keep
from solver.simulate import simulate, store_all_schedule
from solver_cases import random_repeated


def chain_peak(options, picked) -> int:
    """The chain's model of the step's peak (solver/chain.py), written out."""
    held, peak = 0, 0
    for opts, i in zip(options, picked):
        peak = max(peak, held + opts[i].peak)
        held += opts[i].extra
    return peak


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12), st.integers(0, 5)),
                         min_size=1, max_size=4), min_size=1, max_size=5),
       st.integers(0, 30))
def test_combine_finds_the_brute_force_optimum(table, budget):
    options = [[Option(frozenset(), e, p, float(t)) for e, p, t in seg] for seg in table]
    fitting = [(sum(options[b][i].time for b, i in enumerate(c)), c)
               for c in itertools.product(*(range(len(o)) for o in options))
               if chain_peak(options, c) <= budget]
    picked = combine(options, budget)
    if not fitting:
        assert picked is None
        return
    assert picked is not None and chain_peak(options, picked) <= budget
    assert sum(options[b][i].time for b, i in enumerate(picked)) == min(t for t, _ in fitting)


def _setup(seed: int, k: int, inner: int):
    g = random_repeated(random.Random(seed), k, inner)
    facts = GraphFacts(g, "checkpoint")
    chain = find_blocks(g)
    return g, facts, chain


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10 ** 6), st.integers(2, 3), st.integers(1, 4), st.floats(0.0, 1.0),
       st.sampled_from([chain_mod.ALL_SUBSETS_UP_TO, 1]), st.sampled_from([None, 0, 1]))
@example(seed=0, k=3, inner=3, frac=0.3, subsets=1, pairs=None)
@example(seed=3, k=2, inner=2, frac=0.0, subsets=5, pairs=None)  # a mask needless once both keep
@example(seed=2352, k=2, inner=2, frac=0.0, subsets=5, pairs=None)  # a twin carried from the first
@example(seed=158495, k=2, inner=3, frac=0.0, subsets=5, pairs=None)  # ... from the mask's last reader
def test_chain_schedule_is_the_best_combination_replayed(seed, k, inner, frac, subsets, pairs):
    """Every combination of the segments' options, each replayed by the simulator: the chain's
    model of each combination's recomputation time is the simulator's, and its peak too, or above
    it (safe) where a Value read from outside by every block (the mask) is needless once every
    block keeps what reads it, a saving no block's own replay sees. The rule's schedule is the
    fastest combination the model fits (the exact optimum over every combination, dominated
    options included, when nothing is shared). `subsets` 1 gives options made of prefixes and
    single additions even to these small blocks; `pairs` plans on segments merged two by two
    (blocks.merged: two blocks of at most two ops, so that every combination stays few)."""
    if pairs is not None:
        k, inner = 2, min(inner, 2)
    g, facts, chain = _setup(seed, k, inner)
    assert chain.classes, "the generator repeats a block"
    shared = bool(chain.classes[0].broadcast)
    links = chain if pairs is None else merged(chain, pairs)
    impl = (0,) * len(g.ops)
    forced = frozenset().union(*links.cuts)
    with mock.patch.object(chain_mod, "ALL_SUBSETS_UP_TO", subsets):
        keeps, main = segment_keeps(g, facts, links, impl, forced)
        options = measure(g, facts, links, impl, forced, keeps, main)

        def replay(keep_sets):
            keep = set(forced).union(*keep_sets)
            return simulate(g, schedule_from_keep(g, keep, retain="saved", facts=facts))

        base = replay([]).recompute_time
        modelled = []
        for c in itertools.product(*(range(len(o)) for o in options)):
            tl = replay(options[b][i].keep for b, i in enumerate(c))
            peak = chain_peak(options, c)
            assert peak == tl.peak_bytes if not shared else peak >= tl.peak_bytes
            seconds = base + sum(options[b][i].time for b, i in enumerate(c))
            assert math.isclose(seconds, tl.recompute_time, rel_tol=1e-12, abs_tol=1e-12)
            modelled.append((peak, tl.total_time))
        rows = [(tl.peak_bytes, tl.total_time)
                for tl in (replay(ks) for ks in itertools.product(*keeps))]
        least = min(p for p, _ in modelled)
        top = max(p for p, _ in rows)
        budget = int(least + frac * (top - least))
        s = chain_schedule(g, budget, facts, chain=chain, pairs=pairs)
        assert s is not None
        tl = simulate(g, s)
        assert tl.peak_bytes <= budget
        assert math.isclose(tl.total_time, min(t for p, t in modelled if p <= budget),
                            rel_tol=1e-12)
        if not shared:
            assert math.isclose(tl.total_time, min(t for p, t in rows if p <= budget),
                                rel_tol=1e-12)
            assert chain_schedule(g, least - 1, facts, chain=chain, pairs=pairs) is None


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10 ** 6), st.integers(2, 3), st.integers(1, 3), st.floats(0.0, 1.0))
@example(seed=1889, k=2, inner=1, frac=1.0)  # boundaries alone need more than store-all
def test_chain_schedule_against_the_monolithic_milp(seed, k, inner, frac):
    """The MILP's optimum over every schedule is never slower than the chain's, at the budget and
    at the chain's own peak: the chain's family is part of the MILP's. How often the two are the
    same optimum is scripts/bench_chain.py's count (docs/BENCHMARKS.md, Chain combination): not
    always (the chain keeps the boundaries between its links and retains only what a later
    backward reads). On pairs of segments the chain may find nothing: the boundaries it keeps
    are fewer but its options coarser."""
    g, facts, chain = _setup(seed, k, inner)
    lo = simulate(g, schedule_from_keep(g, set().union(*chain.cuts), retain="saved",
                                        facts=facts)).peak_bytes
    hi = simulate(g, store_all_schedule(g)).peak_bytes
    budget = lo + int(frac * max(0, hi - lo))  # recomputing can need more than store-all
    r = solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
    assert r.status == "optimal"
    for pairs in (None, 0, 1):
        s = chain_schedule(g, budget, facts, chain=chain, pairs=pairs)
        assert s is not None or pairs is not None  # boundaries alone fit
        if s is None:
            continue
        ours = simulate(g, s)
        assert r.predicted_time <= ours.total_time * (1 + 1e-9)
        at_our_peak = solver.solve(g, ours.peak_bytes, mode="checkpoint", time_limit_s=30,
                                   mip_gap=0)
        assert at_our_peak.predicted_time <= ours.total_time * (1 + 1e-9)


def test_solve_leaves_the_costly_rules_out_once_the_chain_is_proven(monkeypatch):
    """On a profiled transformer the chain's schedule is proven within the target gap by the
    closure LP before the rules that take seconds: solve answers with it and never runs the
    ranked, greedy or keep-nothing rules (each made to fail here if called)."""
    import torch

    import monetlike
    from monetlike.models import transformer
    from solver import warmstart

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
