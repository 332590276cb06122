"""A recomputed training BatchNorm normalises with its forward's batch statistics (NOTE [BatchNorm
from its statistics] in monetlike.core.recompute.py): the same bits as the kernel, without
computing the statistics again."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import monetlike
from monetlike import ScheduleWrapper
from monetlike.core import recompute as rc
from runtime_support import compare_step, every, keep_schedule, measured_peak, peak_of

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))
            and a.stride() == b.stride())


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 6), c=st.integers(1, 40), spatial=st.lists(st.integers(1, 9), max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]), affine=st.booleans(),
       channels_last=st.booleans(), offset=st.floats(-1e3, 1e3), scale=st.floats(1e-3, 1e3),
       zero_first=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_normalized_with_the_forward_statistics_is_the_kernel_s_output(
        n, c, spatial, dtype, affine, channels_last, offset, scale, zero_first, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, *spatial, generator=g, dtype=dtype) * scale + offset
    if zero_first:
        x[0].zero_()
    if channels_last and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4
                         else torch.channels_last_3d)
    w = torch.randn(c, generator=g, dtype=dtype) if affine else None
    b = torch.randn(c, generator=g, dtype=dtype) if affine else None
    if affine:
        w[0], b[0] = 0.0, -0.0  # a zero scale and a negative zero shift: signs must survive
    expected, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    out = rc.normalized_with(x, w, b, (mean, invstd))
    assert out is not None
    assert _same_bits(out, expected)
    assert _same_bits(out, F.batch_norm(x, None, None, w, b, True, 0.0, 1e-5))


def test_normalized_with_declines_where_the_bits_are_not_known():
    x = torch.randn(4, 3, 5, 5)
    w, b = torch.randn(3), torch.randn(3)
    _, mean, invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    assert rc.normalized_with(x, w, b, None) is None  # no statistics held
    assert rc.normalized_with(x[:, :, 1:], w, b, (mean, invstd)) is None  # not dense
    assert rc.normalized_with(x.bfloat16(), w, b, (mean, invstd)) is None  # reduced precision
    assert rc.normalized_with(x, w.double(), b, (mean, invstd)) is None  # mixed dtypes
    assert rc.normalized_with(x, w, b, (mean[:2], invstd[:2])) is None  # other channels


class Norms(nn.Module):
    """BatchNorm1d, 2d (channels-last input), 3d and the functional form, each recomputable."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.conv3 = nn.Conv3d(8, 4, 1)
        self.bn3 = nn.BatchNorm3d(4)
        self.fc = nn.Linear(4 * 2 * 6 * 6, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.bn2(self.conv(x)))
        h = torch.tanh(self.bn3(self.conv3(h.unsqueeze(2).expand(-1, -1, 2, -1, -1))))
        h = torch.sigmoid(self.bn1(self.fc(h.flatten(1))))
        h = F.batch_norm(h, None, None, self.scale, None, True, 0.1, 1e-5)
        return self.head(torch.relu(h))


def test_recomputed_batchnorms_run_from_their_statistics_bit_for_bit(monkeypatch):
    torch.manual_seed(0)
    model = Norms().train()
    x = torch.randn(4, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    graph = monetlike.profile(model, x, repeat=1)
    schedule = keep_schedule(graph, every(0), "tight", hold="stage")
    norms = {op.id for op in graph.ops if "bn" in op.name or "batch_norm" in op.name}
    recomputed = {j for stage in schedule.stages for j in stage.recompute}
    assert len(norms) == 4 and norms <= recomputed

    calls = []  # whether each BatchNorm recomputation ran from its statistics
    normalized_with = rc.normalized_with

    def spy(*args):
        out = normalized_with(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(rc, "normalized_with", spy)
    wrapped = compare_step(model, lambda m: ScheduleWrapper(m, schedule, graph=graph), (x,),
                           steps=3, exact=True)
    # every recomputation of the four norms, in each of the 3 steps, ran from the statistics
    per_step = sum(j in norms for stage in schedule.stages for j in stage.recompute)
    assert calls == [True] * (3 * per_step)
    assert int(wrapped.model.bn2.num_batches_tracked) == 3

    predicted = peak_of(graph, schedule)
    assert measured_peak(graph, model, ScheduleWrapper(model, schedule, graph=graph), (x,)) \
        == predicted
