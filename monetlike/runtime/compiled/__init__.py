"""The compiled runtime: the plan as AOTAutograd's partition (docs/execution-model.md).

- joint.py    AOTAutograd's joint graph described for solver/compiled.py, and the recompute tags.
- partitioner.py `CompiledBackend`, the torch.compile backend `monetlike.backend` returns.
"""

from .partitioner import COMPILERS, CompiledBackend, GraphBreakError, PartitionRecord

__all__ = ["COMPILERS", "CompiledBackend", "GraphBreakError", "PartitionRecord", "backend"]


def backend(budget, *, compiler: str = "aot_eager", width: int = 8,
            planner=None) -> CompiledBackend:
    """A torch.compile backend that keeps the training step's peak within `budget`:
    `torch.compile(model, backend=monetlike.backend(budget="40MiB"))`.

    budget: bytes, or a string such as '40MiB': the step's whole peak (parameters, inputs,
        activations, gradients; no optimizer state); or 'min' (the least peak the plan's search
        reaches) or a share such as '60%' of torch's default partition's peak, both resolved on
        the joint graph at the first step ('auto' is read by monetlike.optimize(compile=True)). compiler: 'aot_eager' (the graphs' aten ops
        run as they are; gradients bitwise equal to eager; the budget is verified by the model)
        or 'inductor' (the same saved set; fused kernels, whose peak the model does not verify).
    width: how many candidate moves the search simulates per step. planner: instead of the search,
        a function (solver.compiled.JointGraph, budget) -> solver.compiled.CompiledPlan.
    Raises InfeasibleBudgetError at the first training step when no saved set fits the budget.
    """
    return CompiledBackend(budget, compiler=compiler, width=width, planner=planner)
