"""Meta kernels remembered: an aten op on the meta device, called again with the same shapes,
gets fresh outputs of the shapes it gave before, without running its kernel again.

An analytical profile runs on the meta device, where many kernels are Python decompositions
(batch norm's forward and backward, the elementwise prims): on a GoogLeNet profile they were
most of its time. The profile runs the same ops on the same shapes many times: once per memory
round of the Impls, and once per repeated block. A meta kernel computes nothing but its outputs'
sizes, strides and dtypes from its arguments' (and never reads data: there is none), so an op
called with arguments of the same metadata makes outputs of the same metadata, fresh storages as
before; the storage tracker sees the same new storages either way.

Only ops for which that is certain are remembered: no argument written by its schema, no output
aliasing an argument (views, in-place, out=), not seeded by a random generator, not shaped by
data; every tensor a plain strided meta tensor (or a Parameter); every output a fresh storage no
argument shares, of exactly the bytes `torch.empty_strided` gives, checked on the call that fills
the entry. What a kernel writes without its schema saying so (batch norm's running statistics)
is no data on the meta device, and such a write bumps no version counter, so skipping it changes
nothing the profile sees.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.torch_private import tree_leaves

MAX_ENTRIES = 200_000
"""Entries kept at most (then the memo is cleared): a few hundred bytes each."""

_UNCACHED_TAGS = tuple(getattr(torch.Tag, name) for name in (
    "nondeterministic_seeded", "dynamic_output_shape", "data_dependent_output")
    if hasattr(torch.Tag, name))

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no subclass that dispatches on its own

ENABLED = True
"""False: every call runs its kernel (a test compares a profile made both ways)."""

_memo: dict[tuple, tuple] = {}
_cacheable: dict[Any, bool] = {}


def clear() -> None:
    """Forget every remembered call, as in a fresh process."""
    _memo.clear()


def entries() -> int:
    """The number of calls remembered."""
    return len(_memo)


def remembers(func, args: tuple, kwargs: dict) -> bool:
    """Whether `func` called on arguments of this metadata is answered from the memo."""
    key = key_of((args, kwargs))
    return key is not None and (func, torch.get_default_dtype(), key) in _memo


def call(func, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)`, from the memo when it is a meta call seen before."""
    ok = _cacheable.get(func)
    if ok is None:
        ok = _cacheable[func] = cacheable(func)
    if not ok or not ENABLED:
        return func(*args, **kwargs)
    key = key_of((args, kwargs))
    if key is None:
        return func(*args, **kwargs)
    # A factory op without a dtype (arange, full) makes the default dtype, which can change.
    key = (func, torch.get_default_dtype(), key)
    hit = _memo.get(key)
    if hit is not None:
        single, outs = hit
        made = tuple(torch.empty_strided(size, stride, dtype=dtype, device="meta")
                     for size, stride, dtype in outs)
        return made[0] if single else made
    out = func(*args, **kwargs)
    found = _describe(out, args, kwargs)
    if found is not None:
        if len(_memo) >= MAX_ENTRIES:
            _memo.clear()
        _memo[key] = found
    return out


def cacheable(func) -> bool:
    """Whether calls of the aten op `func` may be remembered at all (its schema and tags)."""
    schema = getattr(func, "_schema", None)
    if schema is None or schema.is_mutable:
        return False
    if any(a.alias_info is not None for a in schema.arguments):
        return False
    if not schema.returns or any(r.alias_info is not None or str(r.type) != "Tensor"
                                 for r in schema.returns):
        return False
    return not any(tag in _UNCACHED_TAGS for tag in getattr(func, "tags", ()))


def key_of(x: Any) -> Any:
    """A hashable description of an argument's metadata, or None when it has none."""
    if isinstance(x, torch.Tensor):
        if (type(x) not in _PLAIN or x.device.type != "meta"
                or x.layout is not torch.strided or x.is_conj() or x.is_neg()):
            return None
        return ("t", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)
    if isinstance(x, (tuple, list)):
        keys = tuple(key_of(a) for a in x)
        return None if any(k is None for k in keys) else (type(x).__name__, keys)
    if isinstance(x, dict):
        keys = tuple((k, key_of(v)) for k, v in sorted(x.items()))
        return None if any(k is None for _, k in keys) else ("d", keys)
    if isinstance(x, float):  # hex: -0.0 and 0.0 differ, 1.0 is not 1
        return ("f", x.hex())
    if x is None or isinstance(x, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return (type(x).__name__, x)
    return None


def _describe(out: Any, args: tuple, kwargs: dict) -> tuple | None:
    """(single output?, (size, stride, dtype) per output) when every output is a fresh storage
    that `torch.empty_strided` rebuilds byte for byte; else None."""
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out
    if not isinstance(outs, tuple) or not outs:
        return None
    taken = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
             if isinstance(t, torch.Tensor)}
    described = []
    for t in outs:
        if (not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor
                or t.device.type != "meta" or t.layout is not torch.strided
                or t.is_conj() or t.is_neg() or t.storage_offset() != 0):
            return None
        storage = t.untyped_storage()
        if storage._cdata in taken:
            return None
        taken.add(storage._cdata)
        again = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if again.untyped_storage().nbytes() != storage.nbytes():
            return None
        described.append((tuple(t.shape), t.stride(), t.dtype))
    return single, tuple(described)
