"""Split backwards (conv_split, linear_split, *_split_mask) and 1-bit masks (monetlike.impls).

Each split Impl computes the layer's gradients in two autograd nodes: the weight half holds the
input and lets it go (an early release, declared to the profiler with `announce_release`), the
input half holds only the weight. Checked here: outputs bitwise equal to plain PyTorch and
gradients equal within `torch.testing.assert_close`'s fp32 defaults (the same kernels split by
their output mask), through the runtime, over two steps; the profile's early release and
workspace against the CPU allocator's count at run time; masks packed 8 to a byte against
`torch.where`, bit for bit; a gradient shared with another branch never written in place.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import monetlike
from monetlike.impls import bitmask
from monetlike.core.torch_private import sole_owner
from runtime_support import (PEAK_TOLERANCE, impl_schedules, measured_peak, profiled_impl_case,
                             weighted_step)
from solver.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")

A100 = "analytical:A100-40GB"


class Chain(nn.Module):
    """conv -> ReLU (in place) -> conv -> ReLU (in place) -> conv: VGG's pattern."""

    def __init__(self, dims=2, **conv):
        super().__init__()
        Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        self.a, self.b, self.c = Conv(3, 6, 3, **conv), Conv(6, 6, 3, **conv), Conv(6, 4, 1)
        self.r1, self.r2 = nn.ReLU(inplace=True), nn.ReLU(inplace=True)

    def forward(self, x):
        return self.c(self.r2(self.b(self.r1(self.a(x)))))


class FnConv(nn.Module):
    """F.conv2d with stride, dilation and groups, keyword arguments included."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)
        self.w2 = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.3)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = F.relu(F.conv2d(x, self.w1, self.bias, stride=2, padding=1))
        return F.conv2d(h, self.w2, None, 1, 2, dilation=2, groups=2)


class Mlp(nn.Module):
    """Linear layers on a 3-d input, an in-place ReLU on one, F.linear without bias."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(5, 16) * 0.2)

    def forward(self, x):
        h = torch.relu_(self.fc1(x))
        return F.linear(torch.tanh(self.fc2(h)), self.w)


class Frozen(nn.Module):
    """A frozen convolution between trained ones: its split holds no input at all."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 6, 3), nn.Conv2d(6, 2, 1)
        self.b.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SharedGrad(nn.Module):
    """relu(h) + h: the add hands one gradient tensor to both branches, so the mask's backward
    must not write it in place (the other branch would read zeros)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return F.relu(h) + h


CASES = {
    "conv2d_chain": (lambda: Chain(), (2, 3, 10, 10), "conv_split"),
    "conv2d_chain_mask": (lambda: Chain(), (2, 3, 10, 10), "conv_split_mask"),
    "conv1d_chain": (lambda: Chain(1, padding=1), (2, 3, 16), "conv_split_mask"),
    "conv3d_chain": (lambda: Chain(3, stride=2), (2, 3, 7, 8, 9), "conv_split"),
    "conv2d_function": (FnConv, (2, 3, 11, 9), "conv_split"),
    "linear": (Mlp, (2, 5, 8), "linear_split"),
    "linear_mask": (Mlp, (2, 5, 8), "linear_split_mask"),
    "frozen_conv": (Frozen, (2, 3, 9, 9), "conv_split"),
    "shared_gradient_mask": (SharedGrad, (2, 3, 6, 6), "relu_mask"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_exact_through_runtime(case):
    model, x, graph, name = profiled_impl_case(CASES, case, A100)
    picked, schedules = impl_schedules(graph, name)
    assert picked, f"{name} did not apply to {case}"
    for schedule in schedules:  # store-all, and recompute everything
        ref = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(copy.deepcopy(model), schedule)
        for seed in (1, 2):
            (out_a, gx_a, gp_a, _), (out_b, gx_b, gp_b, _) = (weighted_step(ref, x, seed),
                                                              weighted_step(wrapped, x, seed))
            assert torch.equal(out_a, out_b)  # the forward: bitwise
            torch.testing.assert_close(gx_b, gx_a)
            for p, q in zip(gp_a, gp_b):
                assert (p is None) == (q is None)
                if p is not None:
                    torch.testing.assert_close(q, p)


def test_profile_declares_the_release_and_the_allocator_agrees():
    """The middle convolution's split lets its input go in its stage: the profile says so (the
    input is its early release, and with the mask the workspace no longer holds the input and
    its gradient together), measured (CPU allocator) and analytical (meta device) alike, though
    in the profile's own step the first ReLU still holds that input; and the runtime's
    peak equals the prediction, with every convolution split, storing all or recomputing all."""
    torch.manual_seed(0)
    model = Chain().train()
    x = torch.randn(4, 3, 24, 24)
    measured = monetlike.profile(model, x, cost="measured", repeat=1)
    with torch.device("meta"):
        meta_model = Chain().train()
    analytical = monetlike.profile(meta_model, torch.randn(4, 3, 24, 24, device="meta"),
                                   cost=A100)
    for g in (measured, analytical):
        mid = g.ops[1]  # [conv b, relu_ r2], reading a's ReLU output
        names = [im.name for im in mid.impls]
        assert names == ["default", "relu_mask", "conv_split", "conv_split_mask"], names
        default, mask, split, split_mask = mid.impls
        (x_in,) = [v for v in mid.inputs if g.values[v].producer is not None]
        assert x_in in split.early_release and x_in in split_mask.early_release
        assert x_in not in default.early_release and x_in not in mask.early_release
        # With the mask, the ReLU's gradient is written in place, so the input gradient's
        # allocation is the stage's peak: without the split the input is still held there.
        # (On the CPU the convolution kernels' own scratch is larger than these tensors.)
        if g is analytical:
            assert split_mask.bwd_workspace < mask.bwd_workspace
    for name in ("conv_split", "conv_split_mask"):
        picked, schedules = impl_schedules(measured, name)
        assert len(picked) == (3 if name == "conv_split" else 2)  # the last conv has no ReLU
        for schedule in schedules:
            wrapped = monetlike.ScheduleWrapper(model, schedule, graph=measured)
            peak = measured_peak(measured, model, wrapped, x)
            predicted = simulate(measured, schedule).peak_bytes
            assert abs(peak - predicted) <= predicted * PEAK_TOLERANCE, (name, peak, predicted)


def test_split_mask_lowers_the_least_budget_of_a_conv_relu_stack():
    """VGG's pattern: with the split and the mask on one Op, each stage holds the layer's input
    or its input gradient, never both, so full mode's least budget is below checkpoint's."""
    import solver

    torch.manual_seed(0)
    # 16 channels: with fewer, the CPU convolution's own scratch outweighs the tensors.
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(16, 16, 3, padding=1),
                                                          nn.ReLU(inplace=True))]).train()
    x = torch.randn(8, 16, 32, 32)
    g = monetlike.profile(model, x, cost="measured", repeat=1)
    full = solver.min_budget(g, mode="full", time_limit_s=20)
    checkpoint = solver.min_budget(g, mode="checkpoint", time_limit_s=20)
    assert full < checkpoint
    schedule = solver.solve(g, full, time_limit_s=20).schedule
    chosen = {g.ops[j].impls[i].name for j, i in enumerate(schedule.impl)}
    assert chosen & {"conv_split", "conv_split_mask"}, chosen
    wrapped = monetlike.ScheduleWrapper(model, schedule, graph=g)
    peak = measured_peak(g, model, wrapped, x)
    assert peak <= full * (1 + PEAK_TOLERANCE)


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 3000), p=st.floats(0.0, 1.0), nans=st.integers(0, 5),
       seed=st.integers(0, 2 ** 16), min_slice=st.sampled_from([8, 64, bitmask.MIN_SLICE]),
       dtype=st.sampled_from(list(_BITS)), integer_kernels=st.booleans())
def test_packed_mask_is_where_bit_for_bit(n, p, nans, seed, min_slice, dtype, integer_kernels):
    """Both ways (bitmask's docstring): the CPU's integer kernels, and the plain kernels that
    CUDA and the meta device run, forced here on the CPU."""
    bits = _BITS[dtype]
    with mock.patch.object(bitmask, "MIN_SLICE", min_slice), \
            mock.patch.object(bitmask, "INTEGER_KERNELS", integer_kernels):
        gen = torch.Generator().manual_seed(seed)
        m = torch.rand(n, generator=gen) < p
        g = torch.randn(n, generator=gen).to(dtype)
        g[torch.randint(0, n, (nans,), generator=gen)] = float("nan")
        g[torch.randint(0, n, (nans,), generator=gen)] = -0.0
        packed = bitmask.pack(m)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        # bit i of byte k is element 8k + i
        assert all(bool(packed[i // 8] >> (i % 8) & 1) == bool(m[i]) for i in range(min(n, 64)))
        want = torch.where(m, 0, g).view(bits)
        before = g.clone()
        assert torch.equal(bitmask.masked_zero(g, packed, False).view(bits), want)
        assert torch.equal(g.view(bits), before.view(bits))  # untouched
        y = torch.randn(n, generator=gen)
        assert torch.equal(bitmask.pack_of(y, lambda t: t <= 0), bitmask.pack(y <= 0))
        assert torch.equal(bitmask.pack(m[1:]), bitmask.pack(m[1:].clone()))  # unaligned view
        h = g.clone()
        assert torch.equal(bitmask.masked_zero(h, packed, True).view(bits), want)
        assert torch.equal(h.view(bits), want)  # written in place


@pytest.mark.parametrize("integer_kernels", [True, False])
def test_pack_gives_every_byte(integer_kernels):
    """All 256 patterns of 8 elements, each packed to its byte (bit i: element i)."""
    m = (torch.arange(256).unsqueeze(-1).bitwise_right_shift(torch.arange(8)) & 1).bool()
    with mock.patch.object(bitmask, "INTEGER_KERNELS", integer_kernels):
        assert torch.equal(bitmask.pack(m.reshape(-1)), torch.arange(256).to(torch.uint8))


@mock.patch.object(bitmask, "MIN_SLICE", 8)
def test_packed_mask_of_a_channels_last_tensor():
    torch.manual_seed(0)
    m = torch.rand(2, 3, 4, 5) < 0.5
    g = torch.randn(2, 3, 4, 5)
    mc, gc = (t.to(memory_format=torch.channels_last) for t in (m, g))
    assert torch.equal(bitmask.masked_zero(gc, bitmask.pack(mc), True), torch.where(m, 0, g))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("args", [(2,), (3, 2, 1), (3, 2, 1, 2, True), (5, 2, 2)])
def test_maxpool_compact_in_slices_is_bitwise(args, channels_last):
    """The batch pooled slice by slice (one sample per slice here) gives the default's output
    and input gradient bit for bit, ties and NaNs included; 4-bit positions (the first three)
    and int8 ones (5x5, area 25). Odd sizes and more: tests/test_impls_pool.py."""
    from monetlike.impls import pool

    torch.manual_seed(0)
    x = torch.randn(5, 3, 11, 9).round()  # rounded: ties inside windows
    x[1, 0, 2, 3] = float("nan")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    g = torch.randn(F.max_pool2d(x, *args).shape)
    kernel, stride, padding, dilation = pool.pool_params(
        *(list(args) + [None, 0, 1][len(args) - 1:])[:4])
    ceil = len(args) > 4 and args[4]
    results = []
    for slicing in (None, 1):
        leaf = x.clone().requires_grad_()
        with mock.patch.object(pool, "MIN_SLICE", slicing or pool.MIN_SLICE):
            if slicing is None:
                y = F.max_pool2d(leaf, *args)
            else:
                y = pool.MaxPoolCompact.apply(leaf, kernel, stride, padding, dilation, ceil)
            y.backward(g)
        results.append((y.detach(), leaf.grad))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0.nan_to_num(), y1.nan_to_num()) and torch.equal(y0.isnan(), y1.isnan())
    assert torch.equal(g0, g1)


def test_sole_owner():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(sole_owner(grad))
            return grad

    x = torch.randn(4, 4, requires_grad=True)
    (Probe.apply(x) * 2).sum().backward()  # a fresh gradient, made for this node alone
    y = x * 1
    (Probe.apply(y) + Probe.apply(y * 1)).mul(2).sum().backward()  # one tensor, two nodes
    Probe.apply(x).sum().backward()  # an expanded gradient (a view)
    user = torch.ones(4, 4)
    Probe.apply(x).backward(user)  # the caller's own tensor
    assert seen[0] is True
    assert False in seen[1:3]  # the first of the two nodes sharing the gradient
    assert seen[3] is False and seen[4] is False


class SharedLinear(nn.Module):
    """One Linear called twice: autograd sums its weight's two gradients into the first that
    reaches it (the later call's), and keeps or copies that tensor by its layout."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(torch.tanh(self.inp(x)))))))


def test_a_split_on_one_call_of_a_shared_linear_is_not_credited_with_the_other_s_saving():
    from solver.simulate import store_all_schedule, with_predictions
    torch.manual_seed(0)
    model = SharedLinear().train()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    graph = monetlike.profile(model, x, repeat=1)
    split = {op.name: next(i for i, im in enumerate(op.impls) if im.name == "linear_split")
             for op in graph.ops if any(im.name == "linear_split" for im in op.impls)}
    assert {"lin", "lin_1"} <= set(split)
    for pick in ((), ("lin",), ("lin_1",), ("lin", "lin_1")):
        impl = tuple(split[op.name] if op.name in pick else 0 for op in graph.ops)
        schedule = with_predictions(graph, store_all_schedule(graph, impl))
        wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
        measured = measured_peak(graph, model, wrapped, (x,))
        # Measured beside a split of the other call, the first call's split was predicted
        # 4,096 B (the weight's gradient) under what it measures.
        assert measured <= schedule.predicted_peak_bytes, (pick, measured)
        if pick in ((), ("lin",)):
            assert measured == schedule.predicted_peak_bytes, (pick, measured)
