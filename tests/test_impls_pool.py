"""maxpool_compact (monetlike/impls/pool.py): the in-window argmax in 4 bits, two to a byte, for
kernel areas <= 16, in an int8 above.

A property test over kernel, stride, padding, dilation, ceil_mode, memory formats (input and
incoming gradient), odd sizes, batch slicing and ties: the output and the input gradient are
plain PyTorch's bit for bit, and what the backward holds is one row of ceil(P / 2) bytes per
sample (P: a sample's output elements) or P int8s. Then each way from indices to positions and
back (lookup tables, or the arithmetic where a window's offsets collide), taken where expected.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
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


# 24 channels: room for the backward's larger tables (few channels take the smaller ones).
@settings(max_examples=40, deadline=None)
@given(geo=poolings(), n=st.integers(0, 3), c=st.sampled_from([1, 2, 3, 24]),
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
    # A window holding no input element (wider than the input, padded) gets an index outside
    # it, and PyTorch's own backward then writes out of bounds (heap corruption, an abort).
    assume(all(any(0 <= o * s - p + j * d < size for j in range(k))
               for k, s, p, d, size, out in zip(kernel, stride, padding, dilation, hw,
                                                y0.shape[-2:])
               for o in range(out)))
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
    pos = torch.randint(0, 16, (3, p), dtype=torch.uint8)
    packed = torch.empty(3, (p + 1) // 2, dtype=torch.uint8)
    pool._pack4(pos, packed)
    assert packed[0, 0] == pos[0, 0] + (16 * pos[0, 1] if p > 1 else 0)  # low nibble first
    for dtype in (torch.int32, torch.long):
        out = torch.empty(3, p, dtype=dtype)
        pool._unpack4(packed, out)
        assert torch.equal(out, pos.to(dtype))


# (shape, kernel, stride, padding, dilation, ceil_mode, forward path, backward path with one
# sample a slice).
# Forward: "plane", non-overlapping windows, one table over the input plane; "window", a table
# over a window's offsets after subtracting its base. Backward: "table", one table over (window,
# position) (many channels); "offsets", a window's offsets, then its base added. None: the
# arithmetic (a window as wide as the row or wider, padded: offsets collide).
PATHS = [
    ((4, 8, 12, 10), (2, 2), (2, 2), (0, 0), (1, 1), False, "plane", "offsets"),
    ((2, 40, 12, 10), (2, 2), (2, 2), (0, 0), (1, 1), False, "plane", "table"),
    ((4, 8, 11, 9), (2, 2), (2, 2), (1, 1), (1, 1), True, "plane", "offsets"),
    ((3, 8, 13, 11), (2, 3), (5, 4), (1, 1), (2, 1), True, "plane", "offsets"),
    ((4, 8, 11, 9), (3, 3), (2, 2), (1, 1), (1, 1), False, "window", "offsets"),
    ((2, 40, 11, 9), (3, 3), (2, 2), (1, 1), (1, 1), True, "window", "table"),
    ((4, 8, 13, 12), (3, 2), (1, 2), (1, 1), (2, 2), True, "window", "offsets"),
    ((4, 8, 12, 12), (5, 5), (2, 3), (2, 1), (1, 1), True, "window", "offsets"),  # int8 form
    ((2, 60, 12, 12), (5, 5), (2, 3), (2, 1), (1, 1), True, "window", "table"),  # int8 form
    ((8, 12, 12), (3, 3), (2, 2), (1, 1), (1, 1), False, "window", "offsets"),  # unbatched
    ((40, 12, 12), (3, 3), (2, 2), (1, 1), (1, 1), False, "window", "table"),  # unbatched
    ((4, 8, 9, 2), (2, 2), (1, 1), (1, 1), (1, 2), False, None, None),
    ((4, 8, 9, 3), (2, 3), (1, 1), (1, 1), (1, 2), True, None, None),
    ((4, 8, 9, 3), (5, 5), (1, 1), (2, 2), (1, 1), True, None, None),  # int8 form
]


@pytest.mark.parametrize("case", PATHS)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("sliced", [False, True])
def test_maxpool_compact_paths(case, channels_last, sliced):
    """Each way of turning indices into positions and back, taken where expected, and plain
    PyTorch's output and input gradient bit for bit (ties and a NaN included)."""
    shape, kernel, stride, padding, dilation, ceil_mode, fwd_path, bwd_path = case
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, shape, generator=gen).float()
    x.view(-1)[5] = float("nan")
    if channels_last and x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    args = (kernel, stride, padding, dilation, ceil_mode)
    y0 = F.max_pool2d(x, *args)
    g = torch.randn(y0.shape, generator=gen)
    seen = {}

    def spy(name):
        real = getattr(pool, name)

        def f(*a, **kw):
            seen[name] = real(*a, **kw)
            return seen[name]
        return f

    leaf0, leaf1 = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.max_pool2d(leaf0, *args).backward(g)
    with mock.patch.object(pool, "MIN_SLICE", 1 if sliced else pool.MIN_SLICE), \
            mock.patch.object(pool, "forward_lookup", spy("forward_lookup")), \
            mock.patch.object(pool, "backward_lookup", spy("backward_lookup")):
        y1 = pool.MaxPoolCompact.apply(leaf1, *args)
        y1.backward(g)
    fwd = seen["forward_lookup"]
    assert (None if fwd is None else "plane" if fwd[1] is None else "window") == fwd_path
    bwd = seen["backward_lookup"]
    bwd = None if bwd is None else "table" if bwd[1].dtype == torch.int32 else "offsets"
    # Unsliced, the batch is one slice: perhaps room for the table where a sample had none.
    assert bwd == bwd_path if sliced else (bwd is None) == (bwd_path is None)
    assert torch.equal(y0.view(torch.int32), y1.detach().view(torch.int32))
    assert torch.equal(leaf0.grad.view(torch.int32), leaf1.grad.view(torch.int32))
