"""maxpool_compact (monetlike/impls/pool.py): the in-window argmax in 4 bits, two to a byte, for
kernel areas <= 16, in an int8 above.

A property test over kernel, stride, padding, dilation, ceil_mode, memory formats (input and
incoming gradient), odd sizes, batch slicing and ties: the output and the input gradient are
plain PyTorch's bit for bit, and what the backward holds is one row of ceil(P / 2) bytes per
sample (P: a sample's output elements) or P int8s.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from monetlike.impls import pool

pytestmark = pytest.mark.usefixtures("one_thread")


@st.composite
def poolings(draw):
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    # Sizes from the smallest that gives an output up to a few more (odd ones included).
    hw = tuple(max(1, (k - 1) * d + 1 - 2 * p) + draw(st.integers(0, 6))
               for k, d, p in zip(kernel, dilation, padding))
    return kernel, stride, padding, dilation, draw(st.booleans()), hw


@settings(max_examples=40, deadline=None)
@given(geo=poolings(), n=st.integers(0, 3), c=st.integers(1, 3),
       layout=st.sampled_from(["contiguous", "channels_last", "grad_channels_last"]),
       levels=st.integers(1, 4), nan=st.booleans(), sliced=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_maxpool_compact_is_max_pool2d_bit_for_bit(geo, n, c, layout, levels, nan, sliced,
                                                   seed):
    kernel, stride, padding, dilation, ceil_mode, hw = geo
    gen = torch.Generator().manual_seed(seed)
    shape = ((n,) if n else ()) + (c,) + hw  # n == 0: an unbatched (C, H, W) input
    # Few distinct values: ties inside windows, where the first maximum must win as in PyTorch.
    x = torch.randint(0, levels, shape, generator=gen).float()
    if nan:
        x.view(-1)[torch.randint(0, x.numel(), (1,), generator=gen)] = float("nan")
    if layout == "channels_last" and n:
        x = x.to(memory_format=torch.channels_last)
    args = (kernel, stride, padding, dilation, ceil_mode)
    y0 = F.max_pool2d(x, *args)
    g = torch.randn(y0.shape, generator=gen)
    if layout == "grad_channels_last" and n:
        g = g.to(memory_format=torch.channels_last)
    results = []
    for compact in (False, True):
        leaf = x.clone().requires_grad_()
        # MIN_SLICE 1: up to pool.SLICES slices of the batch, forward and backward.
        with mock.patch.object(pool, "MIN_SLICE", 1 if sliced else pool.MIN_SLICE):
            y = pool.MaxPoolCompact.apply(leaf, *args) if compact else F.max_pool2d(leaf, *args)
            if compact:
                (k,) = y.grad_fn.saved_tensors
            y.backward(g)
        results.append((y.detach(), leaf.grad))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0.view(torch.int32), y1.view(torch.int32))
    assert torch.equal(g0.view(torch.int32), g1.view(torch.int32))
    # The same layout (strides of size-1 dimensions do not matter).
    assert [s for s, d in zip(g1.stride(), g1.shape) if d > 1] == \
        [s for s, d in zip(g0.stride(), g0.shape) if d > 1]
    per_sample = y0[0].numel() if n else y0.numel()
    if kernel[0] * kernel[1] <= pool.PACK_AREA:
        assert k.dtype == torch.uint8 and k.shape == (max(n, 1), (per_sample + 1) // 2)
    else:
        assert k.dtype == torch.int8 and k.numel() == y0.numel()
    assert k.untyped_storage().nbytes() == k.numel()  # its own storage, nothing more


@pytest.mark.parametrize("p", [1, 2, 7, 10])
def test_nibbles_round_trip(p):
    pos = torch.randint(0, 16, (3, p))
    packed = torch.empty(3, (p + 1) // 2, dtype=torch.uint8)
    pool._pack4(pos.clone(), packed)
    assert packed[0, 0] == pos[0, 0] + (16 * pos[0, 1] if p > 1 else 0)  # low nibble first
    out = torch.empty(3, p, dtype=torch.long)
    pool._unpack4(packed, out)
    assert torch.equal(out, pos)
