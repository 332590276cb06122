"""Relative budgets into bytes against a graph: 'min', '90%' of the store-all peak, 'auto'."""

from __future__ import annotations

import math
import time

from ..analysis import GraphFacts
from ..errors import BudgetParseError, InfeasibleBudgetError
from ..graph import OpGraph
from ..least_budget import infeasible_message, store_all_peak
from ..stage_bound import stage_least_peak
from ..units import BudgetSpec, parse_budget
from ..rules.warmstart import least_memory, low_memory_schedules
from .pipeline import MIN_BUDGET_TIME_LIMIT_S, rules_seconds, min_budget, min_budget_details


def resolve_budget(graph: OpGraph, budget, *, mode: str = "full", backend: str = "highs",
                   auto: int | None = None, offload: bool = False,
                   time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S) -> int:
    """Bytes for `budget` (any form `solver.units.parse_budget` reads) on `graph`.

    'min': the least feasible peak (`min_budget`: a schedule exists there); '90%': that share
    of the store-all peak, rounded up to a byte; 'auto': `auto`, the bytes the caller read off
    its device (the solver has no device)."""
    spec = parse_budget(budget)
    if spec.kind == "bytes":
        return int(spec.value)
    if spec.kind == "min":
        return min_budget(graph, mode, backend=backend, time_limit_s=time_limit_s,
                          offload=offload)
    if spec.kind == "share":
        return int(math.ceil(spec.value * store_all_peak(graph)))
    if auto is None:
        raise BudgetParseError("budget 'auto' is the free memory of the CUDA device the model "
                               "trains on, which the solver cannot read; give it as `auto=` "
                               "(bytes), or use monetlike.optimize, which reads it")
    return int(auto)


def check_feasible(graph: OpGraph, budget: int, *, mode: str = "full", backend: str = "highs",
                   offload: bool = False, time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S) -> None:
    """Raise InfeasibleBudgetError when no schedule of `graph` fits `budget` (bytes): memory
    alone decides it, so a graph whose costs are not measured yet answers it. Cheapest first:
    store-all fits; a least-memory rule fits; else the min-peak search (`min_budget_details`,
    cached per graph, so a solve that follows does not search again)."""
    if budget >= store_all_peak(graph):
        return
    facts = GraphFacts(graph, mode)
    if stage_least_peak(facts, offload) <= budget:
        deadline = time.perf_counter() + rules_seconds(time_limit_s)
        if least_memory(graph, low_memory_schedules(graph, facts, deadline))[2] <= budget:
            return
    peak, lower, proven, s = min_budget_details(graph, mode, backend=backend,
                                                time_limit_s=time_limit_s, offload=offload)
    if peak > budget and (proven or lower > budget):
        raise InfeasibleBudgetError(
            infeasible_message(graph, budget, mode, least=peak, lower=lower, proven=proven,
                               schedule=s), budget=budget, min_budget=peak)


__all__ = ["resolve_budget", "check_feasible", "BudgetSpec"]
