"""`monetlike.backend(budget=...)`: a torch.compile backend whose partition is the plan.

AOTAutograd traces the joint forward+backward graph and hands it to `CompiledBackend.partition`,
which describes it (joint.py), searches the saved set that fits the budget at the least
recomputation (solver/compiled.py), tags the joint graph so that torch's default partition saves
exactly that set, and checks that the forward it got saves what the plan says.

One plan per step: the budget is the whole step's, so a second graph (a graph break, or a
recompilation for other shapes) is refused, naming where it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from solver.compiled import AUTO_REFUSED, CompiledPlan, JointGraph, plan_saved, resolve_budget
from solver.errors import BudgetParseError, MonetlikeError
from solver.units import format_bytes, parse_budget

from ...core import torch_private
from .joint import describe, measure_ops, saved_names, tag_saved

__all__ = ["CompiledBackend", "GraphBreakError", "PartitionRecord", "COMPILERS"]

COMPILERS = ("aot_eager", "inductor")


class GraphBreakError(MonetlikeError, RuntimeError):
    """torch.compile split the training step into more than one graph."""


@dataclass(frozen=True)
class PartitionRecord:
    """One partitioned graph: the plan and what the forward graph torch built saves."""

    graph: JointGraph
    plan: CompiledPlan
    saved: frozenset[str]
    """The forward values (not primals, not RNG states) the partitioned forward hands on."""
    forward: fx.GraphModule
    backward: fx.GraphModule
    unmeasured: tuple[str, ...] = ()
    """Ops whose scratch and time could not be measured (they would not run on zeros)."""


def _where(gm: fx.GraphModule | None) -> str:
    """Where a dynamo graph starts in the user's code (the first op's stack trace line)."""
    for node in (gm.graph.nodes if gm is not None else ()):
        trace = node.meta.get("stack_trace")
        lines = [ln.strip() for ln in (trace or "").splitlines() if ln.strip()]
        files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        if files:
            i = files[-1]
            return " ".join(lines[i:i + 2])  # 'File "...", line N, in f' and its code
    return "an unknown place (the graph's nodes carry no stack trace)"


class CompiledBackend:
    """A torch.compile backend that runs the step within `budget` bytes (see monetlike.backend)."""

    def __init__(self, budget, *, compiler: str = "aot_eager", width: int = 8,
                 planner: "Callable[[JointGraph, int], CompiledPlan] | None" = None) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"compiler {compiler!r} is not one of {', '.join(COMPILERS)}; "
                             f"'aot_eager' runs the graphs' aten ops (gradients bitwise equal "
                             f"to eager), 'inductor' compiles them")
        self.spec = parse_budget(budget)
        if self.spec.kind == "auto":
            raise BudgetParseError(AUTO_REFUSED)
        self.budget: int | None = int(self.spec.value) if self.spec.kind == "bytes" else None
        """The budget in bytes; a relative form ('min', '90%') is resolved on the joint graph."""
        self.compiler = compiler
        self.width = width
        # the search by default; a seam for a caller (or a test) that picks the saved set itself
        self.planner = planner or (lambda graph, budget: plan_saved(graph, budget, width=width))
        self.records: list[PartitionRecord] = []
        self._graphs: list[fx.GraphModule] = []
        self._compile = (torch_private.aot_backend(self.partition) if compiler == "aot_eager"
                         else torch_private.inductor_backend(self.partition))

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self._graphs.append(gm)
        return self._compile(gm, example_inputs)

    @property
    def record(self) -> PartitionRecord:
        """The one partition this backend made (after the first training step)."""
        if not self.records:
            raise MonetlikeError("no training graph has been compiled yet: run one forward and "
                                 "backward step of the compiled model first")
        return self.records[0]

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        if self.records:
            raise GraphBreakError(
                f"torch.compile handed monetlike.backend a second training graph, starting at "
                f"{_where(self._graphs[-1])}; the first started at {_where(self._graphs[0])}. "
                f"A graph break (or a recompilation for other input shapes or dtypes) splits the "
                f"step, and one plan per graph under one budget is not implemented yet: remove "
                f"the break (torch._dynamo.explain lists them) or use one backend per shape")
        measures = measure_ops(joint)
        graph = describe(joint, num_fwd_outputs, measures)
        self.budget = resolve_budget(graph, self.spec, self.width)
        plan = self.planner(graph, self.budget)
        if plan.prediction.peak_bytes > self.budget:
            raise MonetlikeError(f"the planner's saved set peaks at "
                                 f"{format_bytes(plan.prediction.peak_bytes)}, over the budget "
                                 f"{format_bytes(self.budget)}; expected a plan within it")
        tag_saved(joint, graph, plan.saved)
        kwargs.pop("compiler", None)  # Inductor names itself for its min-cut's op lists
        forward, backward = torch_private.default_partition(
            joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        got = frozenset(n for n in saved_names(forward, num_fwd_outputs)
                        if n in graph.by_name and graph.by_name[n].candidate)
        if got != plan.saved:
            raise MonetlikeError(
                f"torch's partition saved other values than the plan (a monetlike bug, please "
                f"report it): saved but not planned {sorted(got - plan.saved)[:5]}, planned but "
                f"not saved {sorted(plan.saved - got)[:5]}")
        self.records.append(PartitionRecord(graph=graph, plan=plan, saved=got, forward=forward,
                                            backward=backward, unmeasured=measures.failed))
        return forward, backward

    def __repr__(self) -> str:
        budget = str(self.spec) if self.budget is None else format_bytes(self.budget)
        return f"monetlike.backend(budget={budget!r}, compiler={self.compiler!r})"
