"""The storage tracker: counts storages once, sees frees (CPU and meta), resizes and backward."""

import gc

import torch

from monetlike.profile.memory import OTHER, StorageTracker, storage_key


def test_counts_storages_once_and_sees_frees_cpu():
    tr = StorageTracker()
    with tr:
        a = torch.empty(100)            # 400 bytes
        v = a.view(10, 10)              # a view: same storage, not counted again
        a.add_(1)                       # in place: same storage
        b = torch.empty(50, dtype=torch.float64)  # 400 bytes
        assert tr.live == 800
        del a
        assert tr.live == 800           # the view keeps the storage alive
        del v
        assert tr.live == 400           # freed when the last tensor on it goes
        del b
    assert tr.live == 0 and tr.peak == 800


def test_meta_storages_are_tracked_and_freed():
    tr = StorageTracker()
    with tr:
        a = torch.empty(1000, device="meta")
        key = storage_key(a)
        assert tr.live == 4000 and tr.class_of(key) == OTHER
        b = a * 2
        assert tr.live == 8000
        del a, b
    assert tr.live == 0 and tr.peak == 8000
    assert not tr.alive(key)


def test_window_and_classes():
    tr = StorageTracker(window_class="grad")
    with tr:
        a = torch.empty(10)
        tr.set_class(storage_key(a), "grad")
        tr.reset_window()
        b = torch.empty(20)
        del b
        assert tr.window_peak == 40 + 80 and tr.window_class_peak == 40
        del a


def test_sees_backward_ops_and_resize():
    x = torch.randn(64, requires_grad=True)
    tr = StorageTracker()
    names = []
    tr.observers.append(lambda f, a, k, o: names.append(str(f)))
    with tr:
        y = (x * 2).relu().sum()
        y.backward()
        r = torch.empty(0)
        r.resize_(100)
        assert tr.live_by_class[OTHER] >= 400
    assert any("threshold_backward" in n for n in names)  # the backward ran under the mode
    assert x.grad is not None
    del r, y
    gc.collect()
