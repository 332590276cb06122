"""Budgets people think in: bytes, 'min', '90%' of the store-all peak, 'auto'; an infeasible
budget answered from memory alone, before any step is timed, in the caller's vocabulary."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import monetlike
import solver
from runtime_support import compare_step
from solver import BudgetParseError, BudgetSpec, InfeasibleBudgetError, MonetlikeError
from solver.least_budget import store_all_peak
from solver.units import AUTO_MARGIN, auto_bytes, parse_budget

pytestmark = pytest.mark.usefixtures("one_thread")

CALLS = [0]  # steps run through Counting (module level: the profile deep-copies the model)


class Counting(nn.Module):
    """An identity kept as one leaf op that counts how many steps ran through it."""

    def forward(self, x):
        CALLS[0] += 1
        return x * 1.0


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        Counting(), nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def x():
    torch.manual_seed(1)
    return torch.randn(4, 3, 8, 8)


@pytest.mark.parametrize("text,spec", [
    ("min", BudgetSpec("min")), (" MIN ", BudgetSpec("min")), ("auto", BudgetSpec("auto")),
    ("90%", BudgetSpec("share", 0.9)), ("12.5 %", BudgetSpec("share", 0.125)),
    ("8GiB", BudgetSpec("bytes", 8 * 2**30)), (123, BudgetSpec("bytes", 123)),
])
def test_parse_budget_reads_every_form(text, spec):
    assert parse_budget(text) == spec


def test_relative_budgets_where_bytes_are_needed_say_how_to_resolve_them():
    with pytest.raises(BudgetParseError, match=r"budget '90%' is relative to a model .* "
                                               r"solver.resolve_budget\(graph, '90%'\)"):
        solver.parse_bytes("90%")
    with pytest.raises(BudgetParseError, match="above 0%"):
        parse_budget("0%")
    with pytest.raises(BudgetParseError, match="'min' .*'auto'.*'90%'"):
        parse_budget("lots")


def test_auto_is_free_memory_plus_what_the_step_holds_less_the_margin():
    total, free, resident = 80 * 2**30, 60 * 2**30, 2 * 2**30
    assert auto_bytes(free, total, resident) == free + resident - math.ceil(AUTO_MARGIN * total)
    assert auto_bytes(0, total, 0) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA 'auto' is a real budget")
def test_auto_on_the_cpu_says_it_needs_cuda():
    with pytest.raises(MonetlikeError, match="budget 'auto' reads the free memory of a CUDA "
                                             "device, and the model is on cpu; give the budget"):
        monetlike.optimize(small_cnn(), x(), budget="auto")


def test_resolve_budget_min_and_share():
    graph = monetlike.profile(small_cnn(), x(), cost="analytical:A100-40GB", impls=False)
    store = store_all_peak(graph)
    assert solver.resolve_budget(graph, "90%") == math.ceil(0.9 * store)
    assert solver.resolve_budget(graph, "100%") == store
    assert solver.resolve_budget(graph, "min") == solver.min_budget(graph)
    assert solver.resolve_budget(graph, "1KiB") == 1024
    with pytest.raises(BudgetParseError, match="'auto' is the free memory of the CUDA device"):
        solver.resolve_budget(graph, "auto")


@pytest.mark.parametrize("budget", ["min", "90%"])
def test_optimize_with_min_and_a_share(tmp_path, budget):
    model = small_cnn()
    graph = monetlike.profile(model, x(), cost="analytical:A100-40GB")
    expect = solver.resolve_budget(graph, budget)
    assert expect < store_all_peak(graph)  # both ask for a real schedule
    wrapped = monetlike.optimize(model, x(), budget=budget, cost="analytical:A100-40GB",
                                 cache_dir=tmp_path, time_limit_s=20)
    assert wrapped.schedule.budget_bytes == expect
    assert wrapped.schedule.predicted_peak_bytes <= expect
    compare_step(model, lambda m: monetlike.ScheduleWrapper(m, wrapped.schedule), (x(),))


def test_min_budget_is_public_and_matches_the_solver():
    model = small_cnn()
    graph = monetlike.profile(model, x(), cost="analytical:A100-40GB")
    assert monetlike.min_budget(model, x(), cost="analytical:A100-40GB") == \
        solver.min_budget(graph)


def test_an_infeasible_budget_is_refused_before_any_step_is_timed(tmp_path):
    model = small_cnn()
    CALLS[0] = 0
    least = monetlike.min_budget(model, x(), leaf_modules=[Counting])  # memory only: the steps that takes
    memory_steps = CALLS[0]
    assert memory_steps >= 1
    CALLS[0] = 0
    with pytest.raises(InfeasibleBudgetError) as e:
        monetlike.optimize(model, x(), budget=least - 1, cache_dir=tmp_path,
                           leaf_modules=[Counting])
    assert CALLS[0] == memory_steps  # no timing step ran
    assert e.value.min_budget == least and e.value.budget == least - 1
    text = str(e.value)
    assert "below the minimum feasible budget " in text and f"({least} B) for " in text
    assert "its peak is dominated by " in text and "--" not in text
    CALLS[0] = 0
    monetlike.optimize(model, x(), budget=least, cache_dir=tmp_path, time_limit_s=10,
                       leaf_modules=[Counting])
    assert CALLS[0] > memory_steps + 5  # a feasible budget is timed: warm-up and 5 repeats


def test_where_the_minimum_is_store_all_no_schedule_can_help():
    torch.manual_seed(0)
    model = nn.Linear(64, 64)  # nothing to recompute: the least peak is plain PyTorch's
    xs = torch.randn(2, 64)
    graph = monetlike.profile(model, xs, cost="analytical:A100-40GB")
    least = solver.min_budget(graph)
    assert least == store_all_peak(graph)
    with pytest.raises(InfeasibleBudgetError, match="it equals the store-all peak, so no "
                                                    "schedule can help"):
        monetlike.optimize(model, xs, budget=least - 1, cost="analytical:A100-40GB")


def test_no_highs_banner_unless_verbose():
    quiet = ("import sys; sys.path.insert(0, 'tests'); import solver; "
             "from test_solver_catalogue import chain\n"
             "try: solver.solve(chain(), 20, time_limit_s=10)\n"
             "except solver.InfeasibleBudgetError: pass\n")
    loud = "import highspy; from solver.backends.highs import new_highs; new_highs(highspy, True)"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for code, banner in ((quiet, False), (loud, True)):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert ("Running HiGHS" in out.stdout) == banner, out.stdout


def test_a_second_optimize_reuses_the_timed_profile(tmp_path):
    """NOTE [The profile in the cache]: the second call profiles memory only (the steps
    min_budget runs) and reads the timings kept by the first; another model is timed again."""
    model = small_cnn()
    CALLS[0] = 0
    monetlike.min_budget(model, x(), leaf_modules=[Counting])
    memory_steps = CALLS[0]
    kw = dict(budget="90%", cache_dir=tmp_path, time_limit_s=10, leaf_modules=[Counting])
    CALLS[0] = 0
    first = monetlike.optimize(model, x(), **kw)
    assert CALLS[0] > memory_steps + 5  # timed
    assert len([f for f in os.listdir(tmp_path) if "-profile-" in f]) == 1
    CALLS[0] = 0
    second = monetlike.optimize(model, x(), **kw)
    assert CALLS[0] == memory_steps  # nothing timed
    assert second.schedule.to_dict() == first.schedule.to_dict()
    compare_step(model, lambda m: monetlike.ScheduleWrapper(m, second.schedule,
                                                            leaf_modules=[Counting]), (x(),))
    other = small_cnn()
    other[-1] = nn.Linear(8 * 8 * 8, 12)  # another model: timed again
    CALLS[0] = 0
    monetlike.optimize(other, x(), **kw)
    assert CALLS[0] > memory_steps + 5
