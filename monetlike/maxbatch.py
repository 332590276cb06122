"""The largest batch whose schedule fits a budget within an overhead limit, found by planning.

No trial runs that hit OOM: each candidate batch is profiled (analytical costs on the meta device
by default, so nothing real is allocated) and solved; the search doubles the batch until a plan
fails, then bisects. It assumes what holds for feed-forward models: if a batch cannot be planned
within the budget and overhead limit, no larger batch can.

What a batch of size b is, in order of precedence:
- `make_inputs(b)`, when given;
- `example_inputs` scaled to b: a tensor, a tuple of positional inputs or a mapping of keyword
  inputs (a Hugging Face batch: input_ids, attention_mask, labels, pixel_values...). Every tensor
  whose first dimension is the example's batch (that of its first tensor) gets b rows, the
  example's rows repeated in turn (so token ids, labels and masks stay valid values; on the meta
  device only the shape matters); the other dimensions (the sequence length) are kept, and so
  are tensors of another first dimension (a broadcast (1, seq) position_ids) and non-tensor
  entries (use_cache=False);
- the model's own `example_inputs(b, seq_len, device=...)` when it has one (the named
  transformers shapes of monetlike.hf_models), with `input_shape` = (seq_len,) or None for the
  model's default;
- a random float tensor of shape (b, *input_shape).
Inputs are made on the meta device for analytical costs (nothing real is allocated), on the CPU
for measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import solver
from solver.units import format_bytes, parse_bytes
from .core.torch_private import tree_leaves, tree_map
from .profile import profile
from .profile.costs import parse_cost


@dataclass(frozen=True)
class MaxBatchResult:
    batch: int
    result: "solver.SolveResult"
    graph: "solver.OpGraph"
    overhead: float
    tried: dict
    """batch -> 'ok', 'infeasible', 'overhead X%' or 'undecided: why' (no schedule found within
    the time limit, not proven infeasible) for each batch planned."""

    def tried_table(self) -> str:
        """Every batch planned, in order, with what became of it in words."""
        import pandas as pd

        words = {"ok": "fits", "infeasible": "does not fit (proven: no schedule fits the budget)"}
        rows = [{"batch": b, "outcome": words.get(why, why if not why.startswith("overhead")
                                                   else f"fits, but {why} is over the limit")}
                for b, why in sorted(self.tried.items())]
        return pd.DataFrame(rows).to_string(index=False)

    def refusal(self) -> str:
        """Why the next batch was refused, in words (whether that is proven)."""
        nxt = self.batch + 1
        why = self.tried.get(nxt)
        if why is None:
            return f"batch {nxt} is past the limit"
        if why == "infeasible":
            return f"batch {nxt} does not fit (proven: no schedule fits the budget)"
        if why.startswith("undecided"):
            return (f"batch {nxt} was not planned: {why}; a longer time limit may fit it (or "
                    f"larger batches)")
        return f"batch {nxt} does not fit: {why}"


def _example_batch(example) -> int:
    """The batch of an example: the first dimension of its first tensor."""
    import torch


    for t in tree_leaves(example):
        if isinstance(t, torch.Tensor):
            if t.dim() == 0:
                raise ValueError("max_batch: example_inputs: expected the first tensor to have a "
                                 "batch dimension, got a scalar tensor; put the batched input "
                                 "(input_ids, pixel_values, x) first")
            return int(t.shape[0])
    raise ValueError(f"max_batch: example_inputs: expected a tensor, a tuple of inputs or a "
                     f"mapping of keyword inputs with at least one tensor, got "
                     f"{type(example).__name__} without one")


def scale_batch(example, batch: int, device=None):
    """`example` (a tensor, tuple/list or mapping of inputs) at `batch` rows (module docstring):
    every tensor whose first dimension is the example's batch is resized along it, the rows
    repeated in turn; everything else is kept. On `device` when given."""
    import torch


    if isinstance(example, (tuple, list)) and not example or \
            not isinstance(example, (torch.Tensor, tuple, list, Mapping)):
        raise ValueError(f"max_batch: example_inputs: expected a tensor, a non-empty tuple of "
                         f"positional inputs or a mapping of keyword inputs (input_ids=..., "
                         f"labels=...), got {type(example).__name__}")
    b0 = _example_batch(example)

    def scale(t):
        if not isinstance(t, torch.Tensor):
            return t
        dev = torch.device(device) if device is not None else t.device
        if t.dim() == 0 or t.shape[0] != b0:
            return t.detach().to(dev)
        shape = (batch, *t.shape[1:])
        if dev.type == "meta" or t.device.type == "meta":
            out = torch.empty(shape, dtype=t.dtype, device=dev)
        else:
            rows = torch.arange(batch, device=t.device) % b0
            out = t.detach()[rows].to(dev)
        return out.requires_grad_(t.requires_grad)

    return tree_map(scale, example)


def max_batch(model, budget: "int | str", input_shape: Sequence[int] | None = None, *,
              max_overhead: float | None = None, cost: str = "analytical:A100-40GB",
              optimizer: str | None = None, limit: int = 1 << 16, time_limit_s: float = 60.0,
              make_inputs: Callable | None = None, example_inputs: Any = None,
              loss_fn: Callable | None = None) -> MaxBatchResult:
    """Largest batch in [1, limit] whose solved schedule fits `budget` with overhead <= max_overhead.

    The batches planned are made as the module docstring says: `make_inputs(b)`, else
    `example_inputs` scaled to b (keyword batches too), else the model's `example_inputs(b,
    seq_len)`, else a float tensor (b, *input_shape). `loss_fn`: the training loss of the
    model's output, as monetlike.profile takes it."""

    budget = parse_bytes(budget)
    device = "meta" if parse_cost(str(cost))[0] == "analytical" else "cpu"
    make_inputs = make_inputs or _batch_maker(model, input_shape, example_inputs, device)
    tried: dict[int, str] = {}
    plans: dict[int, tuple] = {}

    def plan(b: int) -> bool:
        graph = profile(model, make_inputs(b), cost=cost, optimizer=optimizer, loss_fn=loss_fn)
        try:
            r = solver.solve(graph, budget, time_limit_s=time_limit_s)
        except solver.InfeasibleBudgetError:
            tried[b] = "infeasible"
            return False
        if r.schedule is None:
            # Not proven infeasible: the search assumes it is, so the answer may be low.
            tried[b] = f"undecided: {r.message or r.status}"
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


def _batch_maker(model, input_shape, example_inputs, device) -> Callable:
    """b -> the inputs of batch b (module docstring)."""
    import torch

    if example_inputs is not None:
        if input_shape is not None:
            raise ValueError("max_batch: pass input_shape or example_inputs, not both (the "
                             "example's own shapes are kept, only its batch is scaled)")
        scale_batch(example_inputs, 1, "meta")  # its errors now, before any planning
        return lambda b: scale_batch(example_inputs, b, device)
    if callable(getattr(model, "example_inputs", None)):
        return model_batch_maker(model, input_shape, device)
    if input_shape is None:
        raise ValueError(f"max_batch: {type(model).__name__} has no example_inputs(batch, "
                         f"seq_len) method: pass input_shape (the shape after the batch "
                         f"dimension) or example_inputs (a batch to scale)")
    return lambda b: torch.randn(b, *input_shape, device=device)



def _first_tensor(batch):
    import torch


    return next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)), None)


def model_batch_maker(model, input_shape: Sequence[int] | None, device) -> Callable:
    """b -> `model.example_inputs(b, seq_len, device=device)`: the batch a model that makes its
    own (the named transformers shapes of monetlike.hf_models: input_ids, attention_mask, labels,
    or pixel_values and labels) gives at batch b, every batched tensor with b rows.

    `input_shape` is the shape after the batch dimension of the batch's first input: (seq_len,)
    for a token model; an image model's (3, H, W) is set by its config and only checked here.
    None: the model's default. Raises ValueError, naming what applies, when the model cannot
    make a batch of that shape."""
    make = model.example_inputs
    name = type(model).__name__
    shape = tuple(input_shape) if input_shape is not None else None
    seq = shape[0] if shape is not None and len(shape) == 1 else None

    def build(b: int):
        return make(b, seq, device=device)

    try:
        probe = build(1)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}.example_inputs(1, {seq}) failed: {e}") from None
    first = _first_tensor(probe)
    if first is None:
        raise ValueError(f"{name}.example_inputs(1, {seq}) gave no tensor; expected a batch "
                         f"(input_ids=..., labels=...)")
    got = tuple(first.shape[1:])
    if shape is not None and got != shape:
        what = ("one number, the sequence length, like 16" if len(got) == 1 else
                f"{','.join(map(str, got))} (its config sets it) or none")
        raise ValueError(f"input shape {','.join(map(str, shape))} does not apply to {name}: its "
                         f"example_inputs(batch, seq_len) makes a first input of shape "
                         f"{list(got)} after the batch dimension; give {what}")
    return build
