"""The budget vs overhead curve: ours (full and checkpoint modes) against the baselines.

Every point is a schedule evaluated by the simulator, so the curve compares like with like:
predicted peak and predicted step time over the store-all (plain PyTorch) step time.
"""

from __future__ import annotations

from typing import Sequence

import solver
from solver import baselines
from solver.units import format_bytes, parse_bytes

from .plotting import axis_unit, save_figure

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
            except solver.InfeasibleBudgetError as e:
                least = (f"the least budget is {format_bytes(e.min_budget)} ({e.min_budget} B)"
                         if e.min_budget is not None else "no schedule fits")
                rows.append({"budget_bytes": budget, "method": method, "status": "infeasible",
                             "peak_bytes": None, "overhead_pct": None, "reason": least})
                continue
            ok = r.schedule is not None and r.predicted_peak_bytes <= budget
            rows.append({
                "budget_bytes": budget, "method": method,
                "status": r.status if ok else ("over budget" if r.schedule else r.status),
                "peak_bytes": r.predicted_peak_bytes if ok else None,
                "overhead_pct": 100 * (r.predicted_time / base.total_time - 1) if ok else None,
                "reason": "" if ok else _why_not(r, budget),
            })
    df = pd.DataFrame(rows)
    df["budget"] = df["budget_bytes"].map(format_bytes)
    df["peak"] = df["peak_bytes"].map(lambda b: "-" if b is None or b != b
                                      else format_bytes(int(b)))
    df["overhead"] = df["overhead_pct"].map(lambda p: "-" if p is None or p != p
                                            else f"{p:.2f}%")
    return df


def _why_not(r, budget: int) -> str:
    """Why a method gave no point at `budget`, in words."""
    if r.schedule is not None:
        return (f"its schedule peaks at {format_bytes(r.predicted_peak_bytes)}, over the "
                f"budget")
    return (r.message or r.status).splitlines()[0][:120]


def table(df) -> str:
    """The curve as a printed table: sizes and percentages with their units, a reason for
    every point that failed."""
    return df[["budget", "method", "status", "peak", "overhead", "reason"]].to_string(
        index=False)


def plot_pareto(df, path: str, title: str) -> None:
    """Overhead against budget, one line per method, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    unit, scale = axis_unit(float(df["budget_bytes"].max()))
    for method, part in df.groupby("method", sort=False):
        part = part.dropna(subset=["overhead_pct"])
        ax.plot(part["budget_bytes"] / scale, part["overhead_pct"], marker="o", label=method)
    ax.set_xlabel(f"memory budget ({unit})")
    ax.set_ylabel("predicted overhead over plain PyTorch (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
