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
(cache_files.py): an entry is returned only for its own budget and after the simulator has
replayed it on this graph within that budget; anything else there is solved again and replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from typing import Any, Iterable

import torch

import solver
from solver.errors import (InfeasibleBudgetError, MonetlikeError, ScheduleError,
                           ScheduleMismatchError)
from solver.graph import OpGraph, cost_device, cost_kind
from solver.schedule import Schedule
from solver.search import min_budget as solver_min_budget
from solver.search.budgets import check_feasible, resolve_budget
from solver.search.pipeline import MIN_BUDGET_TIME_LIMIT_S, MIN_PEAK_SHARE
from solver.search.progress import phase
from solver.units import auto_bytes, format_bytes, parse_budget, parse_bytes
from solver.verify import verified

from . import cache_files
from .core.torch_private import tree_leaves
from .max_shape import at_largest
from .profile import profile, profile_memory
from .profile.costs import parse_cost
from .runtime.compiled import CompiledBackend
from .wrapper import ScheduleWrapper

__all__ = ["optimize", "compiled", "min_budget", "auto_budget", "solve_cached", "default_cache_dir"]

CACHE_VERSION = 2


def default_cache_dir() -> str:
    return os.environ.get("MONETLIKE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "monetlike")


def cache_key(graph: OpGraph, budget: int, solve_kwargs: dict) -> str:
    """The name solve_cached files a schedule under: everything the answer depends on."""
    settings = {
        "version": CACHE_VERSION,
        "fingerprint": graph.fingerprint,
        "budget": budget,
        "param_bytes": graph.param_bytes,
        "optimizer_bytes": graph.optimizer_bytes,
        "input_bytes": graph.input_bytes,
        "memory": graph.memory_digest,
        "cost": graph.cost_provenance,
        "solve": {k: repr(v) for k, v in sorted(solve_kwargs.items())},
    }
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def solve_cached(graph: OpGraph, budget: "int | str", *, cache_dir: str | None = None,
                 verbose: bool = False, solve=None, **solve_kwargs) -> Schedule:
    """Solve `graph` under `budget`, reading and writing the on-disk cache; return the Schedule.
    solve: called as solve(graph, budget_bytes, verbose=..., **solve_kwargs) for a SolveResult
    when the cache has no entry; None: solver.solve.

    Raises InfeasibleBudgetError (with the minimum feasible budget when the solver found it) or
    MonetlikeError when no schedule was found.
    """
    budget_bytes = parse_bytes(budget)
    cache_dir = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    key = cache_key(graph, budget_bytes, solve_kwargs)
    path = cache_files.entry_path(cache_dir, graph.model, graph.batch, key)
    cached = cache_files.read_entry(path)
    if cached is not None:
        # An entry is a claim: it is returned only for the budget it was solved for and only
        # when its decisions, replayed on this graph, fit that budget (solver/verify.py).
        if cached.budget_bytes != budget_bytes:
            cache_files.ignore(path, f"it was solved for a budget of "
                                        f"{_budget_text(cached.budget_bytes)}, not "
                                        f"{_budget_text(budget_bytes)}")
        else:
            try:
                return verified(graph, cached, budget=budget_bytes,
                                source=f"cache entry {path}")
            except (ScheduleError, ScheduleMismatchError) as e:
                cache_files.ignore(path, str(e))
    result = (solver.solve if solve is None else solve)(graph, budget_bytes, verbose=verbose,
                                                        **solve_kwargs)
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
    cache_files.write_entry(path, schedule)
    return schedule


def _budget_text(n: "int | None") -> str:
    return "none" if n is None else f"{format_bytes(n)} ({n} B)"


def optimize(model: torch.nn.Module, example_inputs: Any, *, budget: "int | str",
             cost: str = "measured", optimizer: str | None = None, cache_dir: str | None = None,
             leaf_modules: Iterable = (), loss_fn=None, verbose: bool = False,
             max_batch: int | None = None, max_seq_len: int | None = None, solve=None,
             compile: bool = False, compiler: str = "aot_eager",
             **solve_kwargs) -> "ScheduleWrapper | torch.nn.Module":
    """Profile `model` on `example_inputs`, solve for `budget` (cached), return the wrapper.
    With compile=True: `model` compiled by torch.compile with monetlike.backend at `budget`
    instead (see compiled()).

    budget: the whole training-step peak (parameters, gradients, optimizer state, inputs,
        activations, workspace): bytes or a string such as "8GiB"; "min" (the least budget any
        schedule fits); a share of the store-all (plain PyTorch) peak such as "90%"; or "auto"
        (a CUDA device's free memory, less solver.units.AUTO_MARGIN of its total).
        A budget no schedule fits raises InfeasibleBudgetError, naming the least budget and
        what dominates it, before any step is timed.
    cost: "measured" (time each op here) or "analytical:<DEVICE>" (roofline; see
        monetlike.profile).
    optimizer: None, "sgd" or "adam": optimizer state counted in the budget.
    loss_fn: the training loss of the model's output (monetlike.profile): its memory is part of
        the step's peak. None: the sum of the outputs.
    max_batch, max_seq_len: plan for this many rows (dim 0) and positions (dim 1 of the inputs
        whose dim 1 is the first input's) and run any shape up to them, each new smaller shape
        replayed within the budget by the simulator before it runs (monetlike.max_shape).
        A loss_fn that closes over labels must accept the largest shape's output.
    verbose: the solver's own log (HiGHS) on the console; otherwise one line per phase on a
        terminal and nothing elsewhere.
    solve, solve_kwargs: the solve (None: solver.solve) and what is passed to it (mode, backend,
        time_limit_s, ...), as in solve_cached.
    compile, compiler: see compiled().
    """
    if compile:
        given = {"cost": cost != "measured", "optimizer": optimizer, "cache_dir": cache_dir,
                 "leaf_modules": list(leaf_modules), "loss_fn": loss_fn, "max_batch": max_batch,
                 "max_seq_len": max_seq_len, "solve": solve, **solve_kwargs}
        return compiled(model, example_inputs, budget=budget, compiler=compiler,
                        refused=[k for k, v in given.items() if v not in (None, False, [])])
    spec = parse_budget(budget)
    auto = auto_budget(model, example_inputs) if spec.kind == "auto" else None
    mode, offload = solve_kwargs.get("mode", "full"), solve_kwargs.get("offload", False)
    backend = solve_kwargs.get("backend", "highs")
    # the min-peak search the solve itself would run when no rule fits, with its time share
    # (cached: the solve then finds it done)
    least_s = min(MIN_BUDGET_TIME_LIMIT_S,
                  max(1.0, MIN_PEAK_SHARE * solve_kwargs.get("time_limit_s", 600)))
    resolved: list[int] = []

    def feasible(graph: OpGraph) -> None:
        # memory alone decides it: answered before the profile times anything
        with phase("feasibility", str(spec)):
            b = resolve_budget(graph, spec, mode=mode, backend=backend, auto=auto,
                               offload=offload, time_limit_s=least_s)
            check_feasible(graph, b, mode=mode, backend=backend, offload=offload,
                           time_limit_s=least_s)
        resolved.append(b)
        timed = cached_profile(cache_dir, graph)
        if timed is not None:
            raise _Profiled(timed)  # the same structure and memory timed here before

    leaf_modules = list(leaf_modules)
    example_inputs = at_largest(example_inputs, max_batch=max_batch, max_seq_len=max_seq_len)
    try:
        graph = profile(model, example_inputs, cost=cost, optimizer=optimizer,
                        leaf_modules=leaf_modules, loss_fn=loss_fn, before_timing=feasible)
        keep_profile(cache_dir, graph)
    except _Profiled as done:
        graph = done.graph
    with phase("solve", format_bytes(resolved[0])):
        schedule = solve_cached(graph, resolved[0], cache_dir=cache_dir, verbose=verbose,
                                solve=solve, **solve_kwargs)
    with phase("verify"):
        return ScheduleWrapper(model, schedule, graph=graph, leaf_modules=leaf_modules)


def compiled(model: torch.nn.Module, example_inputs: Any, *, budget: "int | str",
             compiler: str = "aot_eager", refused: Iterable[str] = ()) -> torch.nn.Module:
    """`torch.compile(model, backend=monetlike.backend(budget, compiler=compiler))`, what
    optimize(..., compile=True) returns; the backend is its `monetlike_backend` attribute (its
    `record` holds the plan after the first training step).

    budget: bytes or '8GiB', 'min', a share such as '60%' (of torch's default partition's peak),
        both resolved on the joint graph at the first step, or 'auto' (read here from the CUDA
        device the model is on). The budget counts parameters, inputs, activations and
        gradients, not optimizer state. The plan is made when the first step compiles: an
        infeasible budget raises InfeasibleBudgetError then, naming the least peak.
    compiler: 'aot_eager' (gradients bitwise equal to eager) or 'inductor'.
    refused: names of optimize's arguments the caller set that the compiled path does not take
        (they raise MonetlikeError naming them).
    """
    refused = list(refused)
    if refused:
        raise MonetlikeError(
            f"optimize(..., compile=True) does not take {', '.join(refused)}: the compiled plan "
            f"is made by torch.compile's first step from its own joint graph (its ops timed "
            f"there, nothing cached; the budget counts no optimizer state; the step is "
            f"model(x) and its backward, one input shape); leave them out, or use "
            f"compile=False for the eager schedule")
    if parse_budget(budget).kind == "auto":
        budget = auto_budget(model, example_inputs)
    backend = CompiledBackend(budget, compiler=compiler)
    out = torch.compile(model, backend=backend)
    # torch.compile's module forwards attribute writes to the model: set it on the wrapper itself
    object.__setattr__(out, "monetlike_backend", backend)
    return out


def auto_budget(model: torch.nn.Module, example_inputs: Any) -> int:
    """The budget "auto": the free memory of the CUDA device the model is on, plus the model's
    parameters, buffers and the batch already there (part of the budget), less
    solver.units.AUTO_MARGIN of the device's total memory."""
    tensors = [*model.parameters(), *model.buffers(),
               *(t for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor))]
    device = tensors[0].device if tensors else torch.device("cpu")
    if device.type != "cuda":
        raise MonetlikeError(
            f"budget 'auto' reads the free memory of a CUDA device, and the model is on "
            f"{device}; give the budget in bytes (e.g. '8GiB'), as 'min' (the least feasible) "
            f"or as a share of the store-all peak (e.g. '90%')")
    free, total = torch.cuda.mem_get_info(device)  # pragma: no cover - needs a GPU
    seen: dict = {}
    for t in tensors:  # pragma: no cover - needs a GPU
        if t.device == device:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return auto_bytes(free, total, sum(seen.values()))  # pragma: no cover - needs a GPU


def min_budget(model: torch.nn.Module, example_inputs: Any, *, optimizer: str | None = None,
               loss_fn=None, leaf_modules: Iterable = (), mode: str = "full",
               offload: bool = False, cost: str = "measured",
               time_limit_s: float = MIN_BUDGET_TIME_LIMIT_S) -> int:
    """The least budget (bytes) at which a training step of `model` on `example_inputs` has a
    schedule: its memory profiled (nothing timed), then the solver's exact min-peak search
    (solver.min_budget: exact when proven within `time_limit_s`, else the least found)."""
    if parse_cost(cost)[0] == "measured":
        graph = profile_memory(model, example_inputs, optimizer=optimizer, loss_fn=loss_fn,
                               leaf_modules=list(leaf_modules))
    else:
        graph = profile(model, example_inputs, cost=cost, optimizer=optimizer, loss_fn=loss_fn,
                        leaf_modules=list(leaf_modules))
    return solver_min_budget(graph, mode, time_limit_s=time_limit_s, offload=offload)


class _Profiled(Exception):
    """Stops optimize's profile once its memory is known, with a graph timed here before
    (cached_profile)."""

    def __init__(self, graph: OpGraph):
        super().__init__()
        self.graph = graph


# NOTE [The profile in the cache]
# Measured costs take most of optimize's time (ResNet-18: minutes on a loaded 2-core CPU) and
# change only with the model and the device; the structure and memory are profiled on every
# call anyway (they decide feasibility, before any timing). So a measured graph is kept beside
# the schedules, keyed by the memory-only graph's fingerprint and memory figures, the settings
# of the timing and the device's model, and reused when all of them are the same.
def _profile_path(cache_dir: str | None, graph: OpGraph) -> str | None:
    if cost_kind(graph.cost_provenance) != "memory-only":
        return None  # analytical: nothing is timed, nothing to keep
    meta = graph.meta
    key = {"version": CACHE_VERSION, "fingerprint": graph.fingerprint,
           "memory": graph.memory_digest,
           "device": _device_model(meta.get("device", "")),
           **{k: meta.get(k) for k in ("cost", "repeat", "clock", "torch_version", "optimizer",
                                       "loss", "autocast", "capture", "leaf_modules")}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()
    cache_dir = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    return cache_files.entry_path(cache_dir, graph.model, graph.batch, f"profile-{digest[:16]}")


def _device_model(device: str) -> str:
    """What the timings depend on: the GPU's model, or the CPU's architecture and cores."""
    if device.startswith("cuda") and torch.cuda.is_available():  # pragma: no cover - GPU
        return f"{device} {torch.cuda.get_device_name(torch.device(device))}"
    return f"{device} {platform.machine()} {os.cpu_count()} cores"


def cached_profile(cache_dir: str | None, memory_graph: OpGraph) -> OpGraph | None:
    """The measured graph kept for this memory-only graph (NOTE [The profile in the cache]), if
    it has the same structure and memory; None otherwise (a bad file is timed again)."""
    path = _profile_path(cache_dir, memory_graph)
    graph = None if path is None else cache_files.read_entry(path, OpGraph.from_dict)
    if graph is None:
        return None
    same = (graph.fingerprint == memory_graph.fingerprint
            and graph.memory_digest == memory_graph.memory_digest)
    return graph if same else None


def keep_profile(cache_dir: str | None, graph: OpGraph) -> None:
    """Keep a measured graph for the next optimize of the same model here (atomic write)."""
    if cost_kind(graph.cost_provenance) != "measured":
        return
    memory_view = dataclasses.replace(
        graph, cost_provenance=f"memory-only:{cost_device(graph.cost_provenance)}")
    cache_files.write_entry(_profile_path(cache_dir, memory_view), graph,
                            made="the profile was measured")
