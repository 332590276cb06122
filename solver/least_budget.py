"""What the least budget is made of, and the one message for a budget below it.

A budget below the least feasible peak is answered with that peak (bytes and a unit) and what
dominates it at its peak point: parameters, gradients, optimizer state, inputs, or the working
set of the op running there (its inputs, outputs, workspace and what recomputation could not
drop). Where the least peak is the store-all peak, no schedule can help, and the message says
so. The wording is the caller's of Python (no command-line flags): the CLI adds its own.
"""

from __future__ import annotations

from .graph import OpGraph
from .schedule import Schedule
from .simulate import gradient_bytes_at, simulate, store_all_schedule
from .units import budget_text, format_bytes


def store_all_peak(graph: OpGraph) -> int:
    """The peak of keeping every activation (plain PyTorch's step), in bytes."""
    return simulate(graph, store_all_schedule(graph)).peak_bytes


def peak_breakdown(graph: OpGraph, schedule: Schedule) -> tuple[str, dict[str, int]]:
    """(the op at the schedule's peak point, bytes there by category; the values sum to the
    peak)."""
    point = simulate(graph, schedule).peak_point
    grads = gradient_bytes_at(graph, point)
    parts = {"parameters and buffers": graph.param_bytes,
             "optimizer state": graph.optimizer_bytes,
             "inputs": graph.input_bytes, "gradients": grads}
    parts["activations and working set"] = max(0, point.bytes - sum(parts.values()))
    where = graph.ops[point.op].name if point.op is not None else "the end of the step"
    return where, parts


def dominant(graph: OpGraph, schedule: Schedule) -> str:
    """The largest part of the schedule's peak, in words with its share."""
    where, parts = peak_breakdown(graph, schedule)
    total = max(1, sum(parts.values()))
    name, b = max(parts.items(), key=lambda kv: kv[1])
    if name == "activations and working set":
        name = f"the working set at {where} (activations that must be resident there)"
    return f"{name}, {format_bytes(b)} ({100 * b / total:.0f}% of it)"


def infeasible_message(graph: OpGraph, budget: int, mode: str, *, least: int, lower: int,
                       proven: bool, schedule: Schedule | None, why: str = "") -> str:
    """The message of InfeasibleBudgetError: the least budget (rounded up, with its bytes: typed
    back it is accepted), what dominates it, what cannot be recomputed, and whether any schedule
    can help."""
    what = f"{graph.model} batch {graph.batch} ({mode} mode)"
    if proven:
        msg = (f"budget {format_bytes(budget)} is below the minimum feasible budget "
               f"{budget_text(least)} for {what}")
    else:
        msg = (f"budget {format_bytes(budget)} is infeasible for {what}: the minimum feasible "
               f"budget is between {budget_text(max(lower, budget + 1))} and {budget_text(least)} "
               f"(not proven within the time limit)")
    if why:
        msg += f" ({why})"
    if schedule is not None:
        msg += f"; its peak is dominated by {dominant(graph, schedule)}"
    held = [op for op in graph.ops if op.recompute_unsafe]
    if held:  # what raises the least budget that the user controls (forward hooks, state)
        msg += (f"; {len(held)} op(s) cannot be recomputed and stay resident, e.g. "
                f"{held[0].name}: {held[0].recompute_unsafe}")
    if least >= store_all_peak(graph):
        msg += ("; it equals the store-all peak, so no schedule can help: reduce the batch, "
                "the model or its precision")
    else:
        msg += f"; give a budget of at least {least} B"
    return msg
