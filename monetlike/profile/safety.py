"""Which ops must never be recomputed, and why (`Op.recompute_unsafe`).

Recomputation re-runs an op's forward during the backward and must give bitwise the same result
with no extra side effect. The runtime makes random ops on the default generator replayable (it
restores the CPU and CUDA RNG state, as torch.utils.checkpoint does) and recomputes BatchNorm in
batch-statistics mode without touching the running statistics, so dropout and BatchNorm are safe.
What is left unsafe, detected at the aten level while profiling (so it does not matter whether the
user wrote `x.nonzero()`, `torch.nonzero(x)` or a module that calls it):

- data-dependent or nondeterministic ops (output shape or value depends on the data, or on the
  order threads finish): nonzero, unique, topk, sort, kthvalue, randperm, multinomial, `.item()`
  (`_local_scalar_dense`), masked_select, indexing with a boolean mask, ...;
- random ops drawing from an explicit generator (its state is not restored by the runtime);
- collectives (c10d ops): recomputing would issue them again out of step with other ranks;
- modules with forward hooks or forward pre-hooks: the hook would run again;
- ops that write into parameters, buffers (BatchNorm running statistics excepted) or graph inputs;
- ops whose input is overwritten in place by a later op after other ops read it (recomputing
  would give the pre-mutation contents) and the op that overwrites it.
"""

from __future__ import annotations

import torch

from ..core.torch_private import tree_leaves
from ..core.modules import has_forward_hooks
from ..core.torch_private import global_module_hooks

__all__ = ["aten_unsafe_reason", "written_tensors", "module_hook_reason"]

DATA_DEPENDENT = {
    "nonzero", "nonzero_static", "argwhere", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "topk", "sort", "argsort", "msort",
    "kthvalue", "randperm", "multinomial", "_local_scalar_dense", "masked_select", "bincount",
}
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                         "_dtensor"}


def _op_name(func) -> str:
    packet = getattr(func, "_overloadpacket", None)
    return getattr(packet, "__name__", str(func)).split(".")[-1]


def _arg(func, args, kwargs, name: str):
    """The value of schema argument `name` (positional or keyword), or None."""
    if name in kwargs:
        return kwargs[name]
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else None
    return None


def aten_unsafe_reason(func, args, kwargs) -> str | None:
    """Why recomputing something that calls this aten op is unsafe, or None."""
    name = _op_name(func)
    ns = getattr(func, "namespace", "aten")
    if ns in COLLECTIVE_NAMESPACES:
        return f"calls the collective {ns}.{name}"
    if name in DATA_DEPENDENT:
        return f"calls the data-dependent or nondeterministic op aten.{name}"
    if name in ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"):
        indices = _arg(func, args, kwargs, "indices") or []
        for ix in indices:
            if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
                return f"indexes with a boolean mask (aten.{name}): data-dependent shape"
    if name == "repeat_interleave" and isinstance(_arg(func, args, kwargs, "repeats"),
                                                   torch.Tensor):
        return "calls aten.repeat_interleave with tensor repeats: data-dependent shape"
    schema = getattr(func, "_schema", None)
    if schema is not None and any(a.name == "generator" for a in schema.arguments):
        if _arg(func, args, kwargs, "generator") is not None:
            return (f"draws random numbers from an explicit torch.Generator (aten.{name}); only "
                    f"the default generators' state is restored on recomputation")
    return None


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an aten op writes into (in-place and out= arguments), from its schema."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        v = kwargs.get(a.name) if (a.kwarg_only or i >= len(args)) else args[i]
        out.extend(t for t in tree_leaves(v) if isinstance(t, torch.Tensor))
    return out


def module_hook_reason(module: torch.nn.Module, qualname: str) -> str | None:
    """A reason if the module (or anything inside it) has forward hooks or forward pre-hooks."""
    if global_module_hooks():
        return "global forward hooks are registered (nn.modules.module); they would run again"
    for sub_name, m in module.named_modules():
        if has_forward_hooks(m):
            where = qualname + ("." + sub_name if sub_name else "")
            return f"module {where} ({type(m).__name__}) has forward hooks; they would run again"
    return None

