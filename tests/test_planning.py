"""pareto and maxbatch: planned with the solver, never by trial runs."""

import pytest
import torch
from torchvision.models.resnet import BasicBlock, ResNet

import solver
from monetlike.maxbatch import max_batch
from monetlike.pareto import pareto, plot_pareto
from monetlike.profile import profile


def _resnet10() -> torch.nn.Module:
    """torchvision's ResNet with one BasicBlock per stage: ResNet-18's kinds of layers
    (convolutions, BatchNorm, in-place ReLU, max-pool, residual adds) in 31 Ops instead of 51,
    which the solves here take a fraction of ResNet-18's time on."""
    return ResNet(BasicBlock, [1, 1, 1, 1])


@pytest.mark.slow
def test_pareto_rows_are_consistent_and_the_plot_is_written(tmp_path):
    g = profile(_resnet10(), torch.randn(64, 3, 128, 128, device="meta"),
                cost="analytical:A100-40GB")
    peak = solver.simulate(g, solver.store_all_schedule(g)).peak_bytes
    floor = solver.min_budget(g)
    budgets = [int(floor + f * (peak - floor)) for f in (0.2, 0.6, 1.0)]
    df = pareto(g, budgets, time_limit_s=20)
    assert len(df) == 3 * 4
    ok = df.dropna(subset=["overhead_pct"])
    assert (ok["peak_bytes"] <= ok["budget_bytes"]).all()
    full = ok[ok.method == "full"].set_index("budget_bytes")["overhead_pct"]
    assert len(full) == 3 and full.iloc[-1] == 0.0  # store-all fits at the peak: no overhead
    assert (full.diff().dropna() <= 1e-9).all()  # more memory never costs more
    for b in budgets:  # the ILP is never worse than a baseline that found a schedule
        rows = ok[ok.budget_bytes == b].set_index("method")["overhead_pct"]
        for m in ("chen_sqrt_n", "greedy"):
            if m in rows and "full" in rows:
                assert rows["full"] <= rows[m] + 1e-6
    png = tmp_path / "p.png"
    plot_pareto(df, str(png), "resnet10")
    assert png.stat().st_size > 10_000


def test_maxbatch_finds_the_boundary():
    model = _resnet10()
    # Near its parameters and gradients (41 MiB): a boundary at a small batch (10) takes fewer
    # bisection steps, each a solve of at most a few seconds (its rules stop at the limit).
    budget = 50 * 2**20
    found = max_batch(model, budget, (3, 64, 64), limit=4096, time_limit_s=2)
    assert found.result.predicted_peak_bytes <= budget
    assert found.tried[found.batch] == "ok"
    assert found.tried.get(found.batch + 1) not in (None, "ok")  # the next batch was refused
    assert found.refusal().startswith(f"batch {found.batch + 1} ")


def test_maxbatch_says_when_the_next_batch_was_only_undecided(monkeypatch):
    """A solve that finds no schedule within its time limit proves nothing: the search treats
    the batch as refused, and the answer says the next batch was undecided, not infeasible."""
    real = solver.solve

    def solve(graph, budget, **kwargs):
        if graph.batch > 3:
            return solver.SolveResult.failure(
                status="error", backend="highs",
                message="no schedule found within the time limit of 1 s; raise --time-limit")
        return real(graph, budget, **kwargs)

    monkeypatch.setattr(solver, "solve", solve)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    found = max_batch(model, "1GiB", (16,), limit=64, time_limit_s=5)
    assert found.batch == 3 and found.tried[3] == "ok"
    assert found.tried[4].startswith("undecided: no schedule found within the time limit")
    assert "a longer time limit may fit it" in found.refusal()
