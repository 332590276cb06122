"""pareto and maxbatch tables read in the model's units, with a reason for every failed point."""

from __future__ import annotations

import torch
import torch.nn as nn

import monetlike
import solver
from monetlike.maxbatch import MaxBatchResult
from monetlike.pareto import pareto, table
from monetlike.plotting import axis_unit
from solver.units import format_bytes


def _graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 4))
    return monetlike.profile(model, torch.randn(4, 3, 8, 8), cost="analytical:A100-40GB")


def test_pareto_table_names_units_and_why_a_point_failed():
    g = _graph()
    floor = solver.min_budget(g)
    top = solver.simulate(g, solver.store_all_schedule(g)).peak_bytes
    df = pareto(g, [floor - 1, top], methods=("full", "chen_sqrt_n"), time_limit_s=10)
    text = table(df)
    assert "NaN" not in text and "None" not in text
    low = df[df.budget_bytes == floor - 1].set_index("method")
    assert low.status["full"] == "infeasible"
    assert low.reason["full"] == f"the least budget is {format_bytes(floor)} ({floor} B)"
    assert low.status["chen_sqrt_n"] != "infeasible" and low.reason["chen_sqrt_n"]
    high = df[(df.budget_bytes == top) & (df.method == "full")].iloc[0]
    assert high.reason == "" and high.peak == format_bytes(high.peak_bytes)
    assert high.overhead == f"{high.overhead_pct:.2f}%"
    assert axis_unit(top) == ("MiB", 2**20) if top < 2**30 else ("GiB", 2**30)
    assert axis_unit(100 * 2**20) == ("MiB", 2**20) and axis_unit(3 * 2**30)[0] == "GiB"


def test_maxbatch_lists_every_batch_tried_with_its_outcome():
    r = MaxBatchResult(batch=4, result=None, graph=None, overhead=0.0,
                       tried={1: "ok", 2: "ok", 4: "ok", 8: "infeasible", 5: "overhead 12.5%",
                              6: "undecided: no schedule within 2 s"})
    lines = r.tried_table().splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["1", "2", "4", "5", "6", "8"]
    assert "fits, but overhead 12.5% is over the limit" in lines[4]
    assert "undecided: no schedule within 2 s" in lines[5]
    assert "does not fit (proven: no schedule fits the budget)" in lines[6]
