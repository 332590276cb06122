"""solve() and min_budget() as a user sees them: arguments, results, errors and progress."""

from __future__ import annotations

import importlib.util
import json

import pytest

import solver
from solver import (BackendUnavailableError, BudgetParseError, InfeasibleBudgetError, Schedule,
                    simulate, store_all_schedule)
from solver.backends import available, get_backend, known
from solver.backends.base import BackendResult
from solver.backends.highs import HighsBackend
from solver_cases import resnet_like
from test_solver_catalogue import chain


def test_budget_strings_and_result_fields(tmp_path, full_search):
    g = chain()
    r = solver.solve(g, "21B", time_limit_s=30)
    assert r.status == "optimal" and r.backend == "highs"
    assert r.objective == pytest.approx(12.0)
    assert r.predicted_peak_bytes == 21 and r.predicted_time == pytest.approx(12.0)
    assert 0 <= r.mip_gap <= 0.01
    s = r.schedule
    assert s.fingerprint == g.fingerprint and s.graph_summary == g.summary()
    assert s.budget_bytes == 21 and s.mode == "full" and s.created_by == "highs"
    assert s.predicted_peak_bytes == 21 and s.predicted_time == pytest.approx(12.0)
    for key in ("variables", "integer_variables", "constraints", "nonzeros", "first_incumbent_s",
                "lower_bound_s"):
        assert key in r.stats
    # the schedule survives a JSON round trip and still replays to the same numbers
    path = tmp_path / "s.json"
    s.save(path)
    assert simulate(g, Schedule.load(path)).peak_bytes == 21
    json.loads(path.read_text())


def test_budget_units():
    assert solver.parse_bytes("8GiB") == 8 * 2**30
    assert solver.parse_bytes("8GB") == 8 * 10**9
    with pytest.raises(BudgetParseError, match="cannot parse budget"):
        solver.solve(chain(), "eight gigs")


def test_infeasible_budget_names_the_minimum():
    with pytest.raises(InfeasibleBudgetError) as e:
        solver.solve(chain(), 20, time_limit_s=30)
    assert str(e.value).startswith("budget 20 B is below the minimum feasible budget 21 B "
                                   "for chain batch 1 (full mode); its peak is dominated by ")
    assert "--" not in str(e.value)  # the caller's vocabulary: no command-line flag
    assert e.value.budget == 20 and e.value.min_budget == 21


def test_infeasible_when_a_single_point_is_over_budget():
    # forward op1 holds a+b = 20 whatever the schedule: said without any solve
    with pytest.raises(InfeasibleBudgetError, match=r"forward of op 1 op1 alone needs 20 B"):
        solver.solve(chain(), 15)


def test_min_budget():
    assert solver.min_budget(chain()) == 21
    assert solver.min_budget(chain(), mode="checkpoint") == 21


def test_unknown_and_missing_backends_list_the_installed_ones(monkeypatch):
    with pytest.raises(BackendUnavailableError, match=r"unknown MILP backend 'gurobi'.*installed"):
        solver.solve(chain(), 31, backend="gurobi")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pulp" else real(name, *a))
    assert "cbc" not in available() and "highs" in available()
    with pytest.raises(BackendUnavailableError,
                       match=r"'cbc' is not installed \(it needs pulp\); installed here: "):
        get_backend("cbc")
    assert set(known()) == {"highs", "cvxpy", "cvxpy-scipy", "cbc", "pulp-highs"}


def test_bad_mode_and_time_limit():
    with pytest.raises(ValueError, match="mode must be one of"):
        solver.solve(chain(), 31, mode="offload")
    with pytest.raises(ValueError, match="time_limit_s must be positive"):
        solver.solve(chain(), 31, time_limit_s=0)


def test_solver_crash_is_an_error_result(full_search):
    class Crashing(HighsBackend):
        def _solve(self, milp, **kw):
            raise RuntimeError("segfault simulated")

    r = solver.solve(chain(), 21, time_limit_s=10, backend=Crashing())
    assert r.status == "error" and r.schedule is None
    assert "highs failed: RuntimeError: segfault simulated" in r.message


class FindingNothing(HighsBackend):
    """HiGHS timing out without a schedule, alone (no strategies beside it: no LP rounding, no
    large neighbourhoods): a search starved, as a short limit starves it on a large graph."""

    CALLBACKS = False

    def _solve(self, milp, **kw):
        return BackendResult(status="time_limit", x=None, objective=None, bound=None,
                             seconds=1.0, message="HiGHS: Time limit reached")


def test_time_out_without_a_schedule_is_an_error_result():
    r = solver.solve(chain(), 21, time_limit_s=5, warm_start=False, backend=FindingNothing())
    assert r.status == "error" and r.schedule is None
    assert "no schedule found within the time limit of 5 s" in r.message
    assert "raise --time-limit" in r.message


def test_checkpoint_mode_never_picks_another_impl():
    from test_solver_catalogue import two_impl

    full = solver.solve(two_impl(), 24, time_limit_s=30)
    ckpt = solver.solve(two_impl(), 24, mode="checkpoint", time_limit_s=30)
    assert full.schedule.impl[1] == 1 and set(ckpt.schedule.impl) == {0}
    assert full.objective == pytest.approx(10.5) and ckpt.objective == pytest.approx(15.0)
    assert ckpt.schedule.mode == "checkpoint"


def test_verbose_shows_progress(capsys, full_search):
    solver.solve(chain(), 21, time_limit_s=10, verbose=True)
    err = capsys.readouterr().err
    assert "chain 21 B" in err and "overhead" in err


@pytest.mark.slow
def test_resnet50_sized_graph_to_one_percent():
    """A ResNet-50-shaped graph (batch 184, roofline costs) at 8 GiB: to a 1% gap quickly."""
    g = resnet_like()
    r = solver.solve(g, "8GiB", time_limit_s=120)
    assert r.status == "optimal" and r.mip_gap <= 0.01
    assert r.solve_time_s < 120
    assert r.stats["first_incumbent_s"] < 10
    assert simulate(g, r.schedule).peak_bytes <= 8 * 2**30
    base = simulate(g, store_all_schedule(g)).total_time
    assert r.predicted_time < 1.12 * base


def test_lazy_recomputation_rows_restart_when_a_solution_breaks_the_budget(monkeypatch):
    # Branch and bound starts without any recomputation row (no warm start to pick tight
    # points from; lazy rows forced on this small model); its first answer recomputes op0 at 31
    # bytes, over the budget of 30, so the simulator rejects it and the solve restarts with that
    # one row.
    from test_solver_catalogue import multi_output

    monkeypatch.setattr(importlib.import_module("solver.search.models"), "ALL_ROWS_NNZ", 0)

    r = solver.solve(multi_output(), 30, warm_start=False, time_limit_s=20)
    assert r.status == "optimal" and r.objective == pytest.approx(13.0)
    bb = r.stats["branch_and_bound_model"]
    assert bb["restarts"] == 1 and bb["recompute_rows"] == 1
    assert simulate(multi_output(), r.schedule).peak_bytes == 30


def test_small_models_get_every_recomputation_row_and_never_restart():
    from test_solver_catalogue import multi_output

    r = solver.solve(multi_output(), 30, warm_start=False, time_limit_s=20)
    assert r.status == "optimal" and r.objective == pytest.approx(13.0)
    bb = r.stats["branch_and_bound_model"]
    assert bb["restarts"] == 0 and bb["recompute_rows"] is None


def test_phase1_pushes_the_peak_below_the_budget_or_proves_it_cannot(monkeypatch):
    """When no rule fits and min_budget's answer leaves the budget undecided (its least peak
    found above it, its proven bound below), solve first minimises the peak until a schedule
    fits (then optimises time from it) or proves none does. The rules and min_budget are
    stubbed to leave every budget undecided; the exact minimum comes from brute force."""
    import importlib
    import random

    from solver_cases import random_dag
    from solver_reference import exact_min_peak

    solve_mod = importlib.import_module("solver.search.pipeline")
    for seed in (3, 5):  # graphs whose store-all peak is above the least
        g = random_dag(random.Random(seed), 5, two_impl=True)
        least = exact_min_peak(g)
        top = simulate(g, store_all_schedule(g)).peak_bytes
        assert top > least + 1
        monkeypatch.setattr(solve_mod, "family_starts", lambda *a, **k: [])
        monkeypatch.setattr(solve_mod, "min_budget_details",
                            lambda graph, mode="full", **k: (top, 0, False,
                                                             store_all_schedule(graph)))
        r = solver.solve(g, least, time_limit_s=30)
        assert r.stats["heuristic"] == "min_peak/phase1" and "phase1_s" in r.stats
        assert simulate(g, r.schedule).peak_bytes <= least
        with pytest.raises(InfeasibleBudgetError):
            solver.solve(g, least - 1, time_limit_s=30)
        monkeypatch.undo()


def test_family_starts_gives_the_fastest_fitting_start_of_each_impl_family():
    # relu_graph (hand-derived in test_impls_catalogue): Impl 0 peaks at 91 in 6 s, relu_mask
    # at 90 in 6.2 s. At 91 both families fit (Impl 0 first: faster); at 90 only the lean one.
    from solver.analysis import GraphFacts
    from solver.rules.warmstart import family_starts, heuristic_schedules
    from test_impls_catalogue import relu_graph

    g = relu_graph()
    facts = GraphFacts(g, "full")
    both = family_starts(g, 91, heuristic_schedules(g, 91, facts))
    assert [n.startswith("lean/") for n, _, _ in both] == [False, True]
    assert [t for _, _, t in both] == pytest.approx([6.0, 6.2])
    assert all(simulate(g, s).peak_bytes <= 91 for _, s, _ in both)
    (name, s, t), = family_starts(g, 90, heuristic_schedules(g, 90, facts))
    assert name.startswith("lean/") and t == pytest.approx(6.2)
    assert s.impl[1] == 1 and simulate(g, s).peak_bytes <= 90


def test_race_starts_are_distinct_vectors_best_first():
    import importlib

    from solver.formulation import Formulation
    from test_impls_catalogue import relu_graph

    local = importlib.import_module("solver.search.local")
    g = relu_graph()
    form = Formulation(g, 91)
    top = store_all_schedule(g)
    lean = store_all_schedule(g, (0, 1, 0))
    x0 = form.encode(top)
    starts = local.race_starts(form, x0, [("heuristic:a", top), ("heuristic:b", lean)])
    assert [n for n, _ in starts] == ["best", "heuristic:b"]
    assert form.decode(starts[1][1]).impl == (0, 1, 0)


def test_lns_races_one_start_per_impl_family(monkeypatch, full_search):
    """Branch and bound is stubbed to find nothing for 3 s, so LNS does the work: on relu_graph
    at 91 both families fit (Impl 0 store-all, 6 s; relu_mask, 6.2 s), LNS runs a slice from
    each, then goes on from the best, and the answer is the hand-derived optimum."""
    import importlib

    from solver_cases import branch_and_bound_finding_nothing
    from test_impls_catalogue import relu_graph

    bb = importlib.import_module("solver.search.branch_and_bound")
    local = importlib.import_module("solver.search.local")
    monkeypatch.setattr(bb, "run_milp", branch_and_bound_finding_nothing(3.0))
    monkeypatch.setattr(local, "RACE_MIN_REMAINING_S", 0.0)
    monkeypatch.setattr(local, "RACE_SLICE_S", 0.5)
    # Store-all fits at 91 and would be returned without a search (full_search), and the stage
    # bound or the LP would prove it optimal and stop LNS before its race: this test is about
    # the race.
    context = importlib.import_module("solver.search.context")
    monkeypatch.setattr(context.SearchContext, "proven_within_gap", lambda self: False)
    g = relu_graph()
    r = solver.solve(g, 91, time_limit_s=10)
    race = r.stats["lns"]["race"]
    assert len(race) == 2 and "best" in race
    assert any(name.startswith("heuristic:lean/") for name in race)
    assert r.objective == pytest.approx(6.0) and simulate(g, r.schedule).peak_bytes <= 91


def test_a_solution_bytes_over_the_budget_within_the_backends_tolerance_is_not_taken():
    # HiGHS accepts a memory row up to its feasibility tolerance over its bound: on GPT-2 at
    # 8.8 GiB a solution peaked 1 byte over the budget in the simulator. The incumbent pool
    # refuses such a vector; beyond the tolerance it is a formulation bug and says so.
    from solver.formulation import Formulation
    from solver.simulate import simulate, store_all_schedule
    from solver.search.pool import Pool

    g = resnet_like(blocks=(1, 1), batch=64)  # 2.1 GiB: a MILP unit is 2^19 bytes
    sched = store_all_schedule(g)
    peak = simulate(g, sched).peak_bytes
    fits = Formulation(g, peak)
    assert Pool([fits]).offer(fits, fits.encode(sched), "test")
    one_byte = Formulation(g, peak - 1)
    assert not Pool([one_byte]).offer(one_byte, one_byte.encode(sched), "test")
    far = Formulation(g, peak // 2)
    with pytest.raises(AssertionError, match="internal error"):
        Pool([far]).offer(far, far.encode(sched), "test")


def test_a_budget_store_all_fits_is_answered_without_a_search():
    """Store-all on each Op's fastest Impl meets the time floor: when it fits, it is optimal, and
    solve returns it without building the MILP. Just below its peak, the search runs."""
    from test_impls_catalogue import relu_graph

    g = relu_graph()
    peak = simulate(g, store_all_schedule(g)).peak_bytes  # 91: Impl 0 is the fastest
    for mode in ("full", "checkpoint"):
        r = solver.solve(g, peak, mode=mode, time_limit_s=10)
        assert r.status == "optimal" and r.mip_gap == 0.0
        assert r.stats["search"].startswith("skipped")
        assert r.objective == pytest.approx(6.0) and r.schedule.mode == mode
        assert r.schedule.budget_bytes == peak
        assert simulate(g, r.schedule).peak_bytes == r.predicted_peak_bytes <= peak
    r = solver.solve(g, peak - 1, time_limit_s=10)  # only relu_mask (6.2 s, peak 90) fits
    assert "search" not in r.stats or not r.stats["search"].startswith("skipped")
    assert r.objective == pytest.approx(6.2)


def test_an_unproven_least_budget_is_searched_again_with_a_longer_limit():
    """The cache returned an answer found in a short time limit, unproven, to a call with a
    longer limit, at once (hunt52)."""
    pipeline = importlib.import_module("solver.search.pipeline")
    pipeline.MIN_BUDGET_CACHE.clear()
    g = resnet_like(blocks=(1, 1), batch=8)
    real = pipeline.min_budget_details(g, "checkpoint", time_limit_s=20)
    assert real[2]  # proven on this small graph
    store = store_all_schedule(g)
    unproven = (simulate(g, store).peak_bytes, 0, False, store)
    assert unproven[0] > real[0]
    pipeline.MIN_BUDGET_CACHE.put(g, "checkpoint", False, unproven, 1.0)
    assert pipeline.min_budget_details(g, "checkpoint", time_limit_s=1.0) == unproven
    again = pipeline.min_budget_details(g, "checkpoint", time_limit_s=20)
    assert again[0] == real[0] and again[2]
    assert pipeline.min_budget_details(g, "checkpoint", time_limit_s=1.0) == again  # proven
    pipeline.MIN_BUDGET_CACHE.clear()


def test_the_least_budget_is_never_above_store_all():
    """Where every recomputation costs more scratch than it frees (a DeiT profiled under
    autocast), the least-memory rules all peaked above store-all and a time-limited search
    reported a least budget above the store-all peak, a budget store-all itself fits (hunt53:
    329,854 B against 326,876 at 3 s). Store-all is now among the rules' candidates. Here the
    search is starved, as a short limit starves it on a large graph; on this toy Chen's rule with
    segments of one Op is store-all already, so it guards the property rather than the case."""
    import dataclasses

    from toy_graphs import chain as toy_chain

    pipeline = importlib.import_module("solver.search.pipeline")
    pipeline.MIN_BUDGET_CACHE.clear()
    g = toy_chain((100, 200, 300))
    g = dataclasses.replace(g, ops=tuple(dataclasses.replace(op, impls=tuple(
        dataclasses.replace(i, recompute_workspace=10_000) for i in op.impls)) for op in g.ops))
    assert pipeline.min_budget(g, "checkpoint", time_limit_s=5, backend=FindingNothing()) == \
        simulate(g, store_all_schedule(g)).peak_bytes
    pipeline.MIN_BUDGET_CACHE.clear()


def test_full_modes_least_budget_starts_from_checkpoints(monkeypatch):
    """Full mode contains checkpoint mode, so its least budget must never be reported above
    checkpoint's: a checkpoint answer already found is full mode's start. Here full mode's own
    search is starved (its rules give only store-all, its MILP finds nothing), as a time limit
    can starve it on a large graph, and still it reports checkpoint's least peak."""
    pipeline = importlib.import_module("solver.search.pipeline")
    pipeline.MIN_BUDGET_CACHE.clear()
    g = resnet_like(blocks=(1, 1), batch=8)
    checkpoint = pipeline.min_budget_details(g, "checkpoint", time_limit_s=20)
    store = simulate(g, store_all_schedule(g)).peak_bytes
    assert checkpoint[0] < store
    monkeypatch.setattr(pipeline, "low_memory_schedules",
                        lambda graph, facts, deadline=None: [("store_all",
                                                              store_all_schedule(graph))])
    full = pipeline.min_budget_details(g, "full", time_limit_s=20, backend=FindingNothing())
    assert full[0] == checkpoint[0]
    assert simulate(g, full[3]).peak_bytes == full[0]
    pipeline.MIN_BUDGET_CACHE.clear()
    starved = pipeline.min_budget_details(g, "full", time_limit_s=20,
                                          backend=FindingNothing())  # no checkpoint answer
    assert starved[0] == store
    pipeline.MIN_BUDGET_CACHE.clear()
