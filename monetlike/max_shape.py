"""Planning for the largest shape a training loop will see (`optimize(max_batch=,
max_seq_len=)`).

Dynamic padding gives every batch its own sequence length, and an epoch's last batch is short.
A schedule is solved once at the largest shape the user names; the wrapper runs any shape up to
it with the same decisions, each new shape replayed by the simulator within the budget first
(NOTE [Smaller shapes] in runtime/wrapper.py). The example is grown to that shape by repeating
its own rows and positions, so token ids, masks and labels stay valid values.
"""

from __future__ import annotations

from typing import Any

import torch

from .core.torch_private import tree_leaves, tree_map_only

__all__ = ["at_largest"]


def _grow(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] >= size:
        return t
    reps = -(-size // t.shape[dim])
    return torch.cat([t] * reps, dim=dim).narrow(dim, 0, size).detach().requires_grad_(
        t.requires_grad)


def at_largest(example: Any, *, max_batch: int | None = None,
               max_seq_len: int | None = None) -> Any:
    """`example` grown to `max_batch` rows (dim 0 of every tensor with the first tensor's batch
    size) and `max_seq_len` positions (dim 1 of every tensor whose dim 1 is the first tensor's:
    input_ids, attention_mask, labels alike). Raises ValueError for a maximum below the
    example's own size: the plan is for the largest shape."""
    tensors = [t for t in tree_leaves(example) if isinstance(t, torch.Tensor)]
    if not tensors or (max_batch is None and max_seq_len is None):
        return example
    first = tensors[0]
    out = example
    for name, value, dim in (("max_batch", max_batch, 0), ("max_seq_len", max_seq_len, 1)):
        if value is None:
            continue
        if first.dim() <= dim:
            raise ValueError(f"{name}={value}: the first input has shape {tuple(first.shape)}, "
                             f"with no dimension {dim} to grow")
        size = int(first.shape[dim])
        if not isinstance(value, int) or value < size:
            raise ValueError(f"{name}: expected an integer at least the example's {size} (the "
                             f"plan is made for the largest shape), got {value!r}")
        out = tree_map_only(torch.Tensor, lambda t, d=dim, s=size, v=value:
                            _grow(t, d, v) if t.dim() > d and t.shape[d] == s else t, out)
    return out
