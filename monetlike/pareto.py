"""The budget vs overhead curve: ours (full and checkpoint modes) against the baselines.

Every point is a schedule evaluated by the simulator, so the curve compares like with like:
predicted peak and predicted step time over the store-all (plain PyTorch) step time.
"""

from __future__ import annotations

from typing import Sequence

import solver
from solver.units import format_bytes, parse_bytes
from .plotting import save_figure
from solver import baselines

METHODS = ("full", "checkpoint", "chen_sqrt_n", "greedy")


def pareto(graph: solver.OpGraph, budgets: Sequence["int | str"], *,
           methods: Sequence[str] = METHODS, backend: str = "highs",
           time_limit_s: float = 120.0):
    """One row per (budget, method): status, predicted peak and overhead (a pandas DataFrame)."""
    import pandas as pd

    base = solver.simulate(graph, solver.store_all_schedule(graph))
    rows = []
    for budget in (parse_bytes(b) for b in budgets):
        for method in methods:
            try:
                if method in ("full", "checkpoint"):
                    r = solver.solve(graph, budget, mode=method, backend=backend,
                                     time_limit_s=time_limit_s)
                else:
                    r = getattr(baselines, method)(graph, budget)
            except solver.InfeasibleBudgetError:
                rows.append({"budget_bytes": budget, "method": method, "status": "infeasible",
                             "peak_bytes": None, "overhead_pct": None})
                continue
            ok = r.schedule is not None and r.predicted_peak_bytes <= budget
            rows.append({
                "budget_bytes": budget, "method": method,
                "status": r.status if ok else ("over budget" if r.schedule else r.status),
                "peak_bytes": r.predicted_peak_bytes if ok else None,
                "overhead_pct": 100 * (r.predicted_time / base.total_time - 1) if ok else None,
            })
    df = pd.DataFrame(rows)
    df["budget"] = df["budget_bytes"].map(format_bytes)
    return df


def plot_pareto(df, path: str, title: str) -> None:
    """Overhead against budget, one line per method, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, part in df.groupby("method", sort=False):
        part = part.dropna(subset=["overhead_pct"])
        ax.plot(part["budget_bytes"] / 2**30, part["overhead_pct"], marker="o", label=method)
    ax.set_xlabel("memory budget (GiB)")
    ax.set_ylabel("predicted overhead over plain PyTorch (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
