"""Saved-tensor handles and the autograd nodes of each Op: the runtime's two hooks into autograd.

- `Saved` is what the pack hook returns for each tensor a backward node saves: either a handle to a
  Value (id and geometry; the tensor itself is dropped, see NOTE [Value handling] in plan.py) or
  the tensor kept as it is (parameters, graph inputs, internals, pass-through Values).
- `grad_fns` finds the autograd nodes that give an Op's results their grad_fn: the stage hooks
  go there (NOTE [Stage boundaries] in step_state.py).
"""

from __future__ import annotations

import torch


class Saved:
    """What the pack hook returns: a Value handle, or a tensor kept as it is."""

    __slots__ = ("tensor", "vid", "size", "stride", "offset", "dtype", "conj", "neg", "version",
                 "lost_graph", "op", "base", "__weakref__")

    def __init__(self, tensor: "torch.Tensor | None", op: int | None):
        self.tensor = tensor
        self.vid: int | None = None
        self.size = self.stride = None
        self.offset = 0
        self.version = tensor._version if tensor is not None else 0
        self.lost_graph = False
        self.op = op
        # The Value's tensor, handed over in its last stage (StepState.on_stage): from then on
        # the handle, like an ordinary saved tensor, keeps it until autograd releases the node.
        self.base: "torch.Tensor | None" = None

    def keep(self) -> "Saved":
        """Keep the tensor itself. A non-leaf is detached: the handle lives inside the autograd
        node that saved it, and a tensor whose grad_fn is that node would make a reference cycle
        that only the garbage collector frees (activations 'freed' seconds late, or never with
        gc disabled). Detaching loses what double backward would need, so it is remembered."""
        t = self.tensor
        if t is not None and t.grad_fn is not None:
            self.tensor = t.detach()
            self.lost_graph = True
        return self

    def let_go(self) -> "Saved":
        """Keep nothing: saved by an Op no backward reaches (NOTE [Ops no backward reaches] in
        plan.py). Unpacking it raises."""
        self.tensor = None
        return self

    def to_value(self, vid: int) -> "Saved":
        """Turn into a handle on Value `vid`: remember the geometry, drop the tensor."""
        t = self.tensor
        self.vid = vid
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()
        # A view may read the Value's storage as another dtype (view_as_complex) or carry a lazy
        # conjugate or negation bit (c.conj(), c.conj().imag): the rebuilt view must too.
        self.dtype, self.conj, self.neg = t.dtype, t.is_conj(), t.is_neg()
        self.lost_graph = t.requires_grad
        self.tensor = None
        return self


def stage_roots(leaves) -> list:
    """Where an Op's stage starts (NOTE [Stage boundaries] in step_state.py): the grad_fns of its
    result tensors among `leaves`, and of their bases where they are views (an in-place write
    through a view, x.narrow(...).copy_(y), gives the base a new grad_fn, CopySlices, through
    which a gradient may enter alone). The profiler claims the same nodes as an Op's roots."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return grad_fns(tensors + [t._base for t in tensors if t._is_view()])


def grad_fns(leaves) -> list:
    """The distinct grad_fn nodes of the tensors among `leaves` (tuple outputs often share one)."""
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            fn = t.grad_fn
            if fn is not None and all(fn is not f for f in out):
                out.append(fn)
    return out


CREATE_GRAPH_MESSAGE = (
    "ScheduleWrapper: a backward with create_graph=True (double backward, e.g. a gradient "
    "penalty) reached a tensor that the schedule saved without its autograd history, so the "
    "higher-order gradient would be wrong; this is not supported. Compute that loss through the "
    "plain model instead: `with wrapper.plain(): loss = ...` runs the same module and parameters "
    "without the schedule.")


def unreached_message(graph, op_id: int) -> str:
    op = graph.ops[op_id]
    return (f"ScheduleWrapper: the backward reached op {op.id} ({op.name}), which the profiled "
            f"training step's backward never ran (its results did not lead to the loss), so "
            f"the schedule kept nothing it saved. Profile with the loss you train with "
            f"(monetlike.profile(..., loss_fn=...)) and solve again.")


def missing_value_message(state, h: Saved) -> str:
    graph = state.plan.graph
    v = graph.values[h.vid]
    op = graph.ops[h.op] if h.op is not None else None
    where = f"the backward of op {op.id} ({op.name})" if op is not None else "a backward node"
    return (f"ScheduleWrapper: {where} needs value {v.id} ({v.name}), which the schedule does not "
            f"hold at this point. This happens on a second backward through the same forward "
            f"(retain_graph=True) after the schedule released it: run the forward again for each "
            f"backward, or use a schedule without recomputation. Otherwise the schedule does not "
            f"match what the model saves: re-profile and solve again.")
