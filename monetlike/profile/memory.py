"""A storage-tracking TorchDispatchMode: which tensor storages are alive, their bytes, the peak.

Both the profiler and `monetlike.measure_step` count memory the way the simulator does: one entry
per storage (so views and in-place results are counted once), `nbytes` of the storage (so dtypes
and over-allocated views are right). On a GPU the caching allocator reports this directly; on the
CPU and on the meta device nothing does, so we watch every aten op's outputs from inside the
dispatcher and see frees through a weakref on each storage's Python object.

Why a weakref works: since PyTorch 2.1 an UntypedStorage's Python object is preserved for as long
as the C++ storage lives (like a Tensor's), so the weakref callback fires when the storage itself
is freed, not when our wrapper goes away. This holds for CPU and meta storages (checked in
tests/test_profile_memory.py).

Storage identity is `untyped_storage()._cdata` (the StorageImpl address). It works on meta tensors
(whose data_ptr is 0) but is only meaningful while the storage is alive, which the weakref
callback guarantees: an entry is removed the moment its storage dies, before the address can be
reused.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from ..core.torch_private import TorchDispatchMode, tree_leaves
from . import meta_memo

# Classes of storages the profiler distinguishes; the tracker itself only sums them.
VALUE, INTERNAL, FIXED, INPUT, OTHER = "value", "internal", "fixed", "input", "other"


def storage_of(t: Any):
    """The UntypedStorage of a plain tensor, or None for tensors without one (sparse, nested)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_key(t: Any) -> int | None:
    """Identity of a tensor's storage (valid only while the storage is alive)."""
    s = storage_of(t)
    return None if s is None else s._cdata


class _Entry:
    __slots__ = ("nbytes", "cls", "tag", "ref")

    def __init__(self, nbytes: int, cls: str, tag: Any, ref: "weakref.ref"):
        self.nbytes, self.cls, self.tag, self.ref = nbytes, cls, tag, ref


class StorageTracker(TorchDispatchMode):
    """Track live storages created by aten ops (plus any registered with `track`).

    Counters: `live` (all tracked bytes), `live_by_class[cls]`, `live_by_tag[(cls, tag)]` (storages
    registered with a tag), `peak` (since construction) and a
    resettable window (`reset_window`, `window_peak`, `window_class_peak`) so a caller can ask
    "what was the peak during this node / this backward stage".

    `observers` are called after every aten op as `obs(func, args, kwargs, out)`; `on_create` is
    called as `on_create(key, nbytes)` for every new storage. The profiler hangs its bookkeeping
    there so that a single dispatch mode does everything (nested modes would each re-wrap).
    """

    def __init__(self, *, default_class: str = OTHER, window_class: str = OTHER):
        super().__init__()
        self.entries: dict[int, _Entry] = {}
        self.live = 0
        self.live_by_class: dict[str, int] = defaultdict(int)
        self.live_by_tag: dict[tuple, int] = defaultdict(int)  # (class, tag) -> bytes, tagged only
        self.peak = 0
        self.default_class = default_class
        self.window_class = window_class
        self.window_peak = 0
        self.window_class_peak = 0
        self.observers: list[Callable] = []
        self.on_create: Callable[[int, int], None] | None = None
        self.on_free: Callable[[int, str, Any], None] | None = None  # (nbytes, class, tag)

    # -- bookkeeping ------------------------------------------------------------------------
    def _freed_cb(self, key: int) -> Callable:
        def cb(ref: "weakref.ref", key: int = key) -> None:
            e = self.entries.get(key)
            if e is not None and e.ref is ref:
                del self.entries[key]
                self.live -= e.nbytes
                self.live_by_class[e.cls] -= e.nbytes
                self._count_tagged(e, -e.nbytes)
                if self.on_free is not None:
                    self.on_free(e.nbytes, e.cls, e.tag)
        return cb

    def track(self, storage, cls: str | None = None, tag: Any = None) -> int:
        """Start tracking `storage` (if not yet tracked) and return its key."""
        key = storage._cdata
        e = self.entries.get(key)
        if e is not None:
            return key
        n = int(storage.nbytes())
        cls = self.default_class if cls is None else cls
        self.entries[key] = _Entry(n, cls, tag, weakref.ref(storage, self._freed_cb(key)))
        self.live += n
        self.live_by_class[cls] += n
        self._count_tagged(self.entries[key], n)
        self._bump()
        if self.on_create is not None:
            self.on_create(key, n)
        return key

    def track_tensors(self, tensors: Iterable[Any], cls: str | None = None) -> None:
        for t in tensors:
            s = storage_of(t)
            if s is not None:
                self.track(s, cls)

    def _count_tagged(self, e: _Entry, nbytes: int) -> None:
        if e.tag is not None:
            key = (e.cls, e.tag)
            self.live_by_tag[key] += nbytes
            if not self.live_by_tag[key]:
                del self.live_by_tag[key]

    def _bump(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
        if self.live > self.window_peak:
            self.window_peak = self.live
        c = self.live_by_class[self.window_class]
        if c > self.window_class_peak:
            self.window_class_peak = c

    def set_class(self, key: int, cls: str, tag: Any = None) -> None:
        e = self.entries[key]
        self.live_by_class[e.cls] -= e.nbytes
        self._count_tagged(e, -e.nbytes)
        e.cls, e.tag = cls, tag
        self.live_by_class[cls] += e.nbytes
        self._count_tagged(e, e.nbytes)

    def class_of(self, key: int | None) -> str | None:
        e = self.entries.get(key) if key is not None else None
        return None if e is None else e.cls

    def tag_of(self, key: int | None) -> Any:
        e = self.entries.get(key) if key is not None else None
        return None if e is None else e.tag

    def nbytes_of(self, key: int) -> int:
        return self.entries[key].nbytes

    def storage(self, key: int):
        """The storage tracked under `key`, or None once it died."""
        e = self.entries.get(key)
        return None if e is None else e.ref()

    def alive(self, key: int) -> bool:
        return key in self.entries

    def reset_window(self) -> None:
        self.window_peak = self.live
        self.window_class_peak = self.live_by_class[self.window_class]

    def close(self) -> None:
        """Forget every entry (dropping the weakrefs, so no callback fires later)."""
        self.entries.clear()

    # -- the dispatch hook ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = meta_memo.call(func, args, kwargs)
        for t in tree_leaves(out):
            s = storage_of(t)
            if s is None:
                continue
            e = self.entries.get(s._cdata)
            if e is None:
                self.track(s)
            elif e.nbytes != s.nbytes():  # resize_ and friends grow or shrink in place
                d = int(s.nbytes()) - e.nbytes
                e.nbytes += d
                self.live += d
                self.live_by_class[e.cls] += d
                self._count_tagged(e, d)
                self._bump()
        for obs in self.observers:
            obs(func, args, kwargs, out)
        return out
