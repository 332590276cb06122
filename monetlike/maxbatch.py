"""The largest batch whose schedule fits a budget within an overhead limit, found by planning.

No trial runs that hit OOM: each candidate batch is profiled (analytical costs on the meta device
by default, so nothing real is allocated) and solved; the search doubles the batch until a plan
fails, then bisects. It assumes what holds for feed-forward models: if a batch cannot be planned
within the budget and overhead limit, no larger batch can.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import solver
from solver.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class MaxBatchResult:
    batch: int
    result: "solver.SolveResult"
    graph: "solver.OpGraph"
    overhead: float
    tried: dict
    """batch -> 'ok', 'infeasible' or 'overhead X%' for each batch planned."""


def max_batch(model, budget: "int | str", input_shape: Sequence[int], *,
              max_overhead: float | None = None, cost: str = "analytical:A100-40GB",
              optimizer: str | None = None, limit: int = 1 << 16, time_limit_s: float = 60.0,
              make_inputs: Callable | None = None) -> MaxBatchResult:
    """Largest batch in [1, limit] whose solved schedule fits `budget` with overhead <= max_overhead."""
    import torch

    from .profile import profile

    budget = parse_bytes(budget)
    make_inputs = make_inputs or (lambda b: torch.randn(b, *input_shape, device="meta"))
    tried: dict[int, str] = {}
    plans: dict[int, tuple] = {}

    def plan(b: int) -> bool:
        graph = profile(model, make_inputs(b), cost=cost, optimizer=optimizer)
        try:
            r = solver.solve(graph, budget, time_limit_s=time_limit_s)
        except solver.InfeasibleBudgetError:
            tried[b] = "infeasible"
            return False
        if r.schedule is None:
            tried[b] = r.status
            return False
        base = solver.simulate(graph, solver.store_all_schedule(graph)).total_time
        overhead = r.predicted_time / base - 1
        if max_overhead is not None and overhead > max_overhead:
            tried[b] = f"overhead {100 * overhead:.1f}%"
            return False
        tried[b] = "ok"
        plans[b] = (r, graph, overhead)
        return True

    first = 1
    try:
        fits = plan(1)
    except Exception as e:  # noqa: BLE001 - only batch 1, and only to try batch 2
        # BatchNorm in training needs more than one value per channel: such a model cannot run
        # at batch 1 at all, so the search starts at 2 (a failure there is raised as it is).
        tried[1] = f"cannot run: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        first, fits = 2, plan(2)
    if not fits:
        raise solver.InfeasibleBudgetError(
            f"even batch {first} does not fit {format_bytes(budget)}"
            f"{'' if max_overhead is None else f' within {100 * max_overhead:.0f}% overhead'} "
            f"({tried[first]}); raise the budget", budget=budget)
    lo, hi = first, 2 * first
    while hi <= limit and plan(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: lo plans, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        if plan(mid):
            lo = mid
        else:
            hi = mid
    r, graph, overhead = plans[lo]
    return MaxBatchResult(batch=lo, result=r, graph=graph, overhead=overhead, tried=tried)
