"""measure_step: the peak includes what is alive at the start, sees backward and frees."""

import math

import torch
import torch.nn as nn

import monetlike
from monetlike import measure_step


def test_counts_live_tensors_at_start():
    held = torch.empty(250_000)  # 1 MB held by the caller throughout
    m = measure_step(lambda: None, warmup=0, repeat=1)
    assert m.start_bytes >= held.numel() * 4
    assert m.peak_bytes == m.start_bytes
    del held


def test_transient_allocation_peak_exact():
    def fn():
        a = torch.empty(1000)          # 4000
        b = torch.empty(500, dtype=torch.float16)  # 1000
        del a
        c = torch.empty(2000)          # 8000, after a is gone
        return None

    m = measure_step(fn, warmup=1, repeat=2)
    assert m.peak_bytes - m.start_bytes == 1000 + 8000
    assert m.seconds >= 0 and m.device == "cpu"


def test_frees_of_preexisting_storages_are_seen():
    box = {"t": torch.empty(100_000)}  # 400 kB alive at start, freed inside

    def fn():
        box.pop("t", None)
        return torch.empty(50_000)      # 200 kB: the peak is the start, not start + 200 kB

    m = measure_step(fn, warmup=0, repeat=1)
    assert m.peak_bytes == m.start_bytes


def test_backward_is_measured():
    torch.manual_seed(0)
    lin = nn.Linear(256, 256, bias=False)
    x = torch.randn(8, 256)

    def step():
        lin.weight.grad = None
        lin(x).relu().sum().backward()

    m = measure_step(step, warmup=0, repeat=1)
    # No gradient exists at the start (warmup=0): at least the weight gradient (256 KiB) appears on top of what was alive at the start.
    assert m.peak_bytes - m.start_bytes >= 256 * 256 * 4
    assert isinstance(m, monetlike.Measurement)


def test_bad_arguments():
    import pytest

    with pytest.raises(ValueError, match="repeat >= 0"):
        measure_step(lambda: None, repeat=-1)
    with pytest.raises(ValueError, match="warmup >= 0"):
        measure_step(lambda: None, warmup=-1)
    calls = []
    m = measure_step(lambda: calls.append(1), warmup=0, repeat=0)  # the peak only: one call
    assert calls == [1] and math.isnan(m.seconds)


def test_kernel_scratch_is_counted_on_the_cpu():
    # A matmul of a transposed operand may pack it into scratch the kernel allocates itself:
    # the storage count cannot see it, the allocator's count must be at least as high.
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)

    def fn():
        return (a.t() @ b.t()).sum()

    m = measure_step(fn, warmup=1, repeat=1)
    tracked, alive = monetlike.measure.storage_peak(fn)
    assert m.peak_bytes >= tracked
    assert m.peak_bytes - m.start_bytes >= 512 * 512 * 4  # the product itself
    assert alive and alive[0][0] >= 512 * 512 * 4


def test_frees_inside_backward_of_preexisting_storages():
    # Gradients set to None inside the step and re-made by the backward: seen freed, then made.
    lin = nn.Linear(512, 512, bias=False)
    x = torch.randn(4, 512)
    lin(x).sum().backward()  # a gradient exists before the measured call

    def step():
        lin.weight.grad = None
        lin(x).sum().backward()

    m = measure_step(step, warmup=0, repeat=1)
    # Without seeing the old gradient's free, the peak would count two gradients on top of the
    # start (which includes one); with it, at most one new gradient plus small activations.
    assert m.peak_bytes - m.start_bytes < 512 * 512 * 4 // 2


def test_stale_frees_from_an_earlier_profile_are_not_counted():
    """The allocator's size table keeps the entry of a block allocated under an earlier profile
    and freed after it; a new block at that address, freed inside the measured step, is reported
    with the stale size. Counted on top of the weakref's free it made ResNet-18's step read up to
    25% low, at random."""
    from torch.profiler import ProfilerActivity, profile

    reused: list[torch.Tensor] = []
    for _ in range(20):  # glibc hands freed chunks back in most tries; retry until it does
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            old = [torch.empty(4096) for _ in range(64)]
        ptrs = {t.data_ptr() for t in old}
        del old
        new = [torch.empty(4096) for _ in range(64)]
        reused = [t for t in new if t.data_ptr() in ptrs]
        del new
        if reused:
            break
    assert reused, "no address was reused: the stale entry cannot be set up"
    freed = sum(t.untyped_storage().nbytes() for t in reused)

    def step():
        reused.clear()
        return torch.empty(1 << 20, dtype=torch.uint8)

    m = measure_step(step, warmup=0, repeat=1)
    assert m.peak_bytes == m.start_bytes - freed + (1 << 20)
