"""Where the memory of a training step goes, and what recomputation can and cannot save.

Answers the forum question "checkpointing does not reduce my memory" before anyone tunes anything:
the store-all (plain PyTorch) peak is broken down into parameters, gradients, optimizer state,
inputs, activations by top-level module, op internals and workspace; the phase of the peak is
named; the minimum feasible budget is computed by the solver; and a verdict says how much
scheduling can save, or why it cannot (weights dominate, activations are small, or one op's
working set is the floor).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import solver
from solver.simulate import gradient_bytes_at
from solver.units import format_bytes

from .plotting import axis_unit, save_figure
from .profile import profile

# Below this fraction of the store-all peak, a saving is not worth scheduling for.
NEGLIGIBLE_SAVING = 0.10


@dataclass(frozen=True)
class Explanation:
    model: str
    batch: int
    store_all_peak_bytes: int
    peak_phase: str
    """'forward', 'backward' (with the op named in peak_where) or 'optimizer step'."""
    peak_where: str
    breakdown: dict[str, int]
    """Bytes at the store-all peak by category (sums to store_all_peak_bytes)."""
    activations_by_module: dict[str, int]
    min_budget_bytes: int
    optimizer_step_bytes: int
    verdict: str
    timeline: list[int] = field(repr=False, default_factory=list)
    cost_provenance: str = ""
    """Where the figures come from ('measured:cpu', 'analytical:A100-40GB'): a budget read
    off them holds for a solve of a graph profiled the same way."""

    @property
    def saving_bytes(self) -> int:
        return self.store_all_peak_bytes - self.min_budget_bytes

    def table(self):
        import pandas as pd

        rows = [{"what": k, "bytes": v, "size": format_bytes(v),
                 "share": f"{100 * v / max(1, self.store_all_peak_bytes):.1f}%"}
                for k, v in self.breakdown.items()]
        return pd.DataFrame(rows)

    def report(self) -> str:
        lines = [
            f"{self.model} batch {self.batch}: store-all peak {format_bytes(self.store_all_peak_bytes)} "
            f"in the {self.peak_phase}{' at ' + self.peak_where if self.peak_where else ''}",
            *([f"figures: {self.cost_provenance} (plan with the same --cost for these budgets to "
               f"hold)"] if self.cost_provenance else []),
            "",
            self.table().drop(columns=["bytes"]).to_string(index=False),
            "",
            "activations by top-level module at the peak:",
        ]
        for name, b in sorted(self.activations_by_module.items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"  {name:24s} {format_bytes(b)}")
        lines += [
            "",
            f"optimizer step: {format_bytes(self.optimizer_step_bytes)} (parameters, gradients and "
            f"optimizer state; the step's own temporaries are not modelled)",
            f"minimum feasible budget: {format_bytes(self.min_budget_bytes)} "
            f"(scheduling can save at most {format_bytes(self.saving_bytes)}, "
            f"{100 * self.saving_bytes / max(1, self.store_all_peak_bytes):.1f}%)",
            "",
            f"verdict: {self.verdict}",
        ]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """A PNG: the store-all memory timeline and the breakdown at its peak."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5),
                                       gridspec_kw={"width_ratios": [3, 1]})
        unit, scale = axis_unit(max(self.timeline, default=self.store_all_peak_bytes))
        ys = [b / scale for b in self.timeline]
        ax1.plot(range(len(ys)), ys, lw=1.2, label="store-all (plain PyTorch)")
        ax1.axhline(self.min_budget_bytes / scale, color="tab:red", ls="--",
                    label="minimum feasible budget")
        ax1.set_xlabel("point of the training step (forward ops, then backward stages)")
        ax1.set_ylabel(f"tensor memory ({unit})")
        ax1.set_ylim(bottom=0)
        ax1.set_title(f"{self.model} batch {self.batch}")
        ax1.legend(loc="upper left")
        bottom = 0.0
        for name, b in self.breakdown.items():
            ax2.bar(0, b / scale, bottom=bottom, label=name)
            bottom += b / scale
        ax2.set_xticks([])
        ax2.set_ylabel(f"{unit} at the peak")
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()

        save_figure(fig, path)
        plt.close(fig)


def _top_level_modules(model, graph: solver.OpGraph) -> dict[int, str]:
    """Op id -> the top-level child module it belongs to (functions inherit from their input)."""
    import torch.fx

    try:
        gm = torch.fx.symbolic_trace(model)
        targets = {n.name: (n.op, n.target) for n in gm.graph.nodes}
    except Exception:  # explain still works without module names
        targets = {}
    owner: dict[int, str] = {}
    for op in graph.ops:
        kind, target = targets.get(op.name, (None, None))
        if kind == "call_module":
            owner[op.id] = str(target).split(".")[0]
            continue
        producers = [graph.values[v].producer for v in op.inputs
                     if graph.values[v].producer is not None]
        owner[op.id] = owner[producers[0]] if producers else "(input)"
    return owner


def explain_graph(graph: solver.OpGraph, model=None, *, time_limit_s: float = 60.0) -> Explanation:
    """Explain a profiled graph (model only used to name top-level modules)."""
    sched = solver.store_all_schedule(graph)
    tl = solver.simulate(graph, sched)
    peak = tl.peak_point
    values, ops = graph.values, graph.ops
    grads = gradient_bytes_at(graph, peak)
    # Internals held at the peak: ops whose forward ran and whose backward has not finished.
    if peak.phase == "forward":
        held_ops = [o.id for o in ops if o.id <= peak.op]
    else:
        done = set(graph.backward_order[: (peak.stage or 0)])
        held_ops = [o.id for o in ops if o.has_backward and o.id not in done]
    internals = sum(ops[j].impls[0].internal_bytes for j in held_ops if ops[j].has_backward)
    owner = _top_level_modules(model, graph) if model is not None else {}
    by_module: dict[str, int] = defaultdict(int)
    for v in peak.resident:
        by_module[owner.get(values[v].producer, ops[values[v].producer].kind)] += values[v].bytes
    activations = sum(values[v].bytes for v in peak.resident)
    breakdown = {
        "parameters and buffers": graph.param_bytes,
        "optimizer state": graph.optimizer_bytes,
        "inputs": graph.input_bytes,
        "gradients": grads,
        "activations (kept tensors)": activations,
        "op internals (masks, indices, statistics)": internals,
    }
    breakdown["workspace and the running op's outputs"] = max(0, peak.bytes - sum(breakdown.values()))
    optimizer_step = graph.fixed_bytes + graph.final_grad_bytes
    phase = {"forward": "forward pass", "recompute": "backward pass", "backward": "backward pass",
             "end": "end of the backward pass"}[peak.phase]
    where = ops[peak.op].name if peak.op is not None else ""
    if optimizer_step > peak.bytes:
        phase, where = "optimizer step", ""
    floor = solver.min_budget(graph, time_limit_s=time_limit_s)
    store_all = max(peak.bytes, optimizer_step)
    return Explanation(
        model=graph.model, batch=graph.batch, store_all_peak_bytes=store_all,
        peak_phase=phase, peak_where=where, breakdown=breakdown,
        activations_by_module=dict(by_module), min_budget_bytes=max(floor, optimizer_step),
        optimizer_step_bytes=optimizer_step,
        verdict=_verdict(store_all, max(floor, optimizer_step), breakdown, activations + internals),
        timeline=[p.bytes for p in tl.points], cost_provenance=graph.cost_provenance)


def _verdict(peak: int, floor: int, breakdown: dict[str, int], activation_bytes: int) -> str:
    saving = peak - floor
    share = saving / max(1, peak)
    weights = (breakdown["parameters and buffers"] + breakdown["optimizer state"]
               + breakdown["gradients"])
    if share >= NEGLIGIBLE_SAVING:
        return (f"scheduling can help: the peak can drop from {format_bytes(peak)} to "
                f"{format_bytes(floor)} ({100 * share:.0f}% less) by recomputing activations; "
                f"solve for a budget between the two.")
    if weights >= 0.5 * peak:
        why = (f"parameters, their gradients and optimizer state take {format_bytes(weights)} "
               f"({100 * weights / peak:.0f}% of the peak) and no schedule can drop them; "
               f"use a smaller model or head, mixed precision, or sharded optimizer state")
    elif activation_bytes < 0.25 * peak:
        why = (f"activations are only {format_bytes(activation_bytes)} "
               f"({100 * activation_bytes / peak:.0f}% of the peak), so recomputing them saves "
               f"little")
    else:
        why = ("the floor is the working set of a single op (its inputs, outputs and workspace "
               "must be resident together), which no schedule can split")
    return (f"checkpointing cannot help much here: at best {format_bytes(saving)} "
            f"({100 * share:.1f}%) of {format_bytes(peak)}, because {why}.")


def explain(model, example_inputs, *, optimizer: str | None = None,
            cost: str = "analytical:A100-40GB", time_limit_s: float = 60.0,
            loss_fn=None) -> Explanation:
    """Profile `model` (analytical costs on the meta device by default, with `loss_fn` as
    monetlike.profile takes it) and explain its memory."""

    graph = profile(model, example_inputs, cost=cost, optimizer=optimizer, loss_fn=loss_fn)
    return explain_graph(graph, model, time_limit_s=time_limit_s)
