"""`monetlike.optimize`: profile, solve (cached on disk), wrap; the one-line entry point.

    wrapped = monetlike.optimize(model, x, budget="8GiB")
    wrapped(x).sum().backward()

The schedule is cached as JSON under `cache_dir` (default `$MONETLIKE_CACHE` or
`~/.cache/monetlike`), keyed by everything that changes the answer: the graph fingerprint (model
structure, batch, shapes, dtypes, Impl set), the budget, the memory figures (fixed memory, what
each Impl holds and its workspaces, each stage's gradients: a `loss_fn` changes the first
stage's), the cost provenance and the solver settings. Measured costs differ a little
from run to run, so they are not part of the key: a cached schedule is reused as long as the
structure and settings are the same. Files are written atomically (a reader sees the old file
or the new one), so concurrent processes never read half a schedule. The cache is untrusted input
(schedule_cache.py): an entry is returned only for its own budget and after the simulator has
replayed it on this graph within that budget; anything else there is solved again and replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterable

import torch

from solver.errors import (InfeasibleBudgetError, MonetlikeError, ScheduleError,
                           ScheduleMismatchError)
from solver.graph import OpGraph
from solver.schedule import Schedule, SolveResult
from solver.units import format_bytes, parse_bytes
from solver.verify import verified

from . import schedule_cache
from .runtime import ScheduleWrapper

__all__ = ["optimize", "solve_cached", "default_cache_dir"]

CACHE_VERSION = 2


def default_cache_dir() -> str:
    return os.environ.get("MONETLIKE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "monetlike")


def _cache_key(graph: OpGraph, budget: int, solve_kwargs: dict) -> str:
    settings = {
        "version": CACHE_VERSION,
        "fingerprint": graph.fingerprint,
        "budget": budget,
        "param_bytes": graph.param_bytes,
        "optimizer_bytes": graph.optimizer_bytes,
        "input_bytes": graph.input_bytes,
        "memory": _memory_figures(graph),
        "cost": graph.cost_provenance,
        "solve": {k: repr(v) for k, v in sorted(solve_kwargs.items())},
    }
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _memory_figures(graph: OpGraph) -> str:
    """A digest of every byte count the simulator reads (the allocator's, so the same from run
    to run; unlike measured times, which are left out of the key)."""
    figures = [graph.stage_grad_bytes, graph.final_grad_bytes, [v.bytes for v in graph.values],
               [[(i.saved, i.internal_bytes, i.fwd_workspace, i.bwd_workspace,
                  i.recompute_workspace, i.overwrites, i.early_release) for i in op.impls]
                for op in graph.ops]]
    return hashlib.sha256(json.dumps(figures).encode()).hexdigest()[:16]


def _solve(graph: OpGraph, budget: int, **kwargs) -> SolveResult:
    from solver import solve
    return solve(graph, budget, **kwargs)


def solve_cached(graph: OpGraph, budget: "int | str", *, cache_dir: str | None = None,
                 **solve_kwargs) -> Schedule:
    """Solve `graph` under `budget`, reading and writing the on-disk cache; return the Schedule.

    Raises InfeasibleBudgetError (with the minimum feasible budget when the solver found it) or
    MonetlikeError when no schedule was found.
    """
    budget_bytes = parse_bytes(budget)
    cache_dir = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    key = _cache_key(graph, budget_bytes, solve_kwargs)
    path = schedule_cache.entry_path(cache_dir, graph.model, graph.batch, key)
    cached = schedule_cache.read_entry(path)
    if cached is not None:
        # An entry is a claim: it is returned only for the budget it was solved for and only
        # when its decisions, replayed on this graph, fit that budget (solver/verify.py).
        if cached.budget_bytes != budget_bytes:
            schedule_cache.ignore(path, f"it was solved for a budget of "
                                        f"{_budget_text(cached.budget_bytes)}, not "
                                        f"{_budget_text(budget_bytes)}")
        else:
            try:
                return verified(graph, cached, budget=budget_bytes,
                                source=f"cache entry {path}")
            except (ScheduleError, ScheduleMismatchError) as e:
                schedule_cache.ignore(path, str(e))
    result = _solve(graph, budget_bytes, **solve_kwargs)
    if not result.ok:
        message = (f"no schedule for {graph.model} batch {graph.batch} within "
                   f"{format_bytes(budget_bytes)}: {result.message}")
        if result.status == "infeasible":
            raise InfeasibleBudgetError(message, budget=budget_bytes,
                                        min_budget=(result.stats or {}).get("min_budget"))
        raise MonetlikeError(message)
    # Proven within the requested budget, so recorded with it (the key it is cached under).
    schedule = dataclasses.replace(
        verified(graph, result.schedule, budget=budget_bytes, source="the solved schedule"),
        budget_bytes=budget_bytes)
    schedule_cache.write_entry(path, schedule)
    return schedule


def _budget_text(n: "int | None") -> str:
    return "none" if n is None else f"{format_bytes(n)} ({n} B)"


def optimize(model: torch.nn.Module, example_inputs: Any, *, budget: "int | str",
             cost: str = "measured", optimizer: str | None = None, cache_dir: str | None = None,
             leaf_modules: Iterable = (), loss_fn=None, **solve_kwargs) -> ScheduleWrapper:
    """Profile `model` on `example_inputs`, solve for `budget` (cached), return the wrapper.

    budget: bytes or a string such as "8GiB" (the whole training-step peak: parameters,
        gradients, optimizer state, inputs, activations, workspace).
    cost: "measured" (time each op here) or "analytical:<DEVICE>" (roofline; see
        monetlike.profile).
    optimizer: None, "sgd" or "adam": optimizer state counted in the budget.
    loss_fn: the training loss of the model's output (monetlike.profile): its memory is part of
        the step's peak. None: the sum of the outputs.
    solve_kwargs: passed to solver.solve (mode, backend, time_limit_s, ...).
    """
    from .profile import profile

    budget_bytes = parse_bytes(budget)
    leaf_modules = list(leaf_modules)
    graph = profile(model, example_inputs, cost=cost, optimizer=optimizer,
                    leaf_modules=leaf_modules, loss_fn=loss_fn)
    schedule = solve_cached(graph, budget_bytes, cache_dir=cache_dir, **solve_kwargs)
    return ScheduleWrapper(model, schedule, graph=graph, leaf_modules=leaf_modules)
