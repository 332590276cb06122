"""What the capture, the Impls, the profiler and the runtime ask of a module: a submodule or
attribute by its dotted path, and whether a module has hooks that a traced or replaced call would
skip (or a recomputation would run again)."""

from __future__ import annotations

from typing import Any

import torch

from .torch_private import global_module_hooks

MISSING = object()


def attr_path(obj: Any, target: str) -> Any:
    """`obj.a.b.c` for target 'a.b.c', or MISSING."""
    for atom in target.split("."):
        # A submodule directly from its module's registry: Module.__getattr__ is Python code,
        # and the runtime looks up every recomputed Op's modules once per step.
        found = obj._modules.get(atom, MISSING) if isinstance(obj, torch.nn.Module) else MISSING
        obj = getattr(obj, atom, MISSING) if found is MISSING else found
        if obj is MISSING:
            break
    return obj


def module_of(root: Any, target: str) -> torch.nn.Module:
    """The submodule `target` of a module, or as an interpreter sees it (`fetch_attr`: the
    runtime reads the live model, not the traced copy). AttributeError if there is none."""
    fetch = getattr(root, "fetch_attr", None)
    if fetch is not None:
        return fetch(target)
    found = attr_path(root, target)
    if found is MISSING:
        raise AttributeError(f"{type(root).__name__} has no submodule {target!r}")
    return found


def has_forward_hooks(mod: torch.nn.Module, *, including_global: bool = False) -> bool:
    """Forward or forward pre-hooks on the module (and, if asked, registered globally)."""
    return bool(mod._forward_hooks or mod._forward_pre_hooks
                or (including_global and global_module_hooks()))


def has_hooks(mod: torch.nn.Module) -> bool:
    """Any forward or backward (pre-)hook on the module itself."""
    return bool(has_forward_hooks(mod) or mod._backward_hooks or mod._backward_pre_hooks)


def fsdp_units_inside(mod: torch.nn.Module) -> list[str]:
    """Paths of the submodules (the module itself left out) that FSDP2's `fully_shard` made
    units of: their all-gathers run in hooks on their own calls."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule  # public; imported where distributed exists

    return [name for name, m in mod.named_modules() if name and isinstance(m, FSDPModule)]
