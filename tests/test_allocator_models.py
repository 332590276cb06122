"""Issue 18's two hand-written models, by the CPU allocator's count: a GPT block and a Fire block.

Both missed before the profiler read the allocator (a GPT block's schedules peaked 20-25% above
their budgets; the Fire block 4-7%). For each: plain PyTorch's peak and the solver's schedules at
three budgets between the least feasible peak and store-all, wrapped, peak at or under their
budget and equal to their prediction within 1%, with the same gradients as plain PyTorch.

The Fire block's in-place ReLUs save their outputs, which autograd frees in the middle of the
stage (right after the ReLU's node ran, before the convolution under it allocates its input
gradient): the profile's workspace is measured that way and the Value is the Op's early release
(a schedule that holds it past the stage adds it back; docs/formulation.md, "Early releases").
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monetlike
import solver
from runtime_support import PEAK_TOLERANCE, compare_step, measured_peak, peak_of
from solver.simulate import store_all_schedule


class GptBlock(nn.Module):
    def __init__(self, d: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(p)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Gpt(nn.Module):
    """Embedding plus a learned position Parameter added by broadcast, blocks, a head."""

    def __init__(self, vocab: int = 512, seq: int = 64, d: int = 128, heads: int = 4,
                 layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.position = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.Sequential(*[GptBlock(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.ln(self.blocks(self.embed(tokens) + self.position)))


class Fire(nn.Module):
    """SqueezeNet's block: squeeze, two expand branches with in-place ReLUs, concatenated."""

    def __init__(self, cin: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze, self.relu = nn.Conv2d(cin, squeeze, 1), nn.ReLU(inplace=True)
        self.e1, self.e3 = nn.Conv2d(squeeze, expand, 1), nn.Conv2d(squeeze, expand, 3, padding=1)
        self.r1, self.r3 = nn.ReLU(inplace=True), nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.relu(self.squeeze(x))
        return torch.cat([self.r1(self.e1(x)), self.r3(self.e3(x))], 1)


def fire_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3), Fire(32, 8, 32), Fire(64, 16, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


# CPU kernels split their scratch between intra-op threads, so with several threads a peak
# depends on scheduling (seen: +2048 bytes in one run of a fuzzed model, not in the next). One
# thread makes the allocator's count repeatable, for the profile and the measurement alike.
pytestmark = pytest.mark.usefixtures("one_thread")


def _close(measured: int, predicted: int) -> bool:
    return abs(measured - predicted) <= predicted * PEAK_TOLERANCE


CASES = {  # name: (model, input)
    "gpt": (lambda: Gpt(), lambda: torch.randint(0, 512, (8, 64))),
    "fire": (fire_net, lambda: torch.randn(8, 3, 32, 32)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_peaks_by_the_allocator(name):
    torch.manual_seed(0)
    make_model, make_input = CASES[name]
    model, x = make_model().train(), make_input()
    graph = monetlike.profile(model, x, repeat=1)
    store_all = peak_of(graph, store_all_schedule(graph))
    plain = measured_peak(graph, model, model, (x,))
    assert _close(plain, store_all), (plain, store_all)
    least = solver.min_budget(graph, time_limit_s=30)
    recomputed = 0
    for f in (1, 2, 3):
        budget = least + (store_all - least) * f // 4
        schedule = solver.solve(graph, budget, time_limit_s=8).schedule  # any feasible plan will do
        recomputed += sum(len(s.recompute) for s in schedule.stages)
        predicted = peak_of(graph, schedule)
        wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
        measured = measured_peak(graph, model, wrapped, (x,))
        assert measured <= budget, (budget, measured, predicted)
        assert _close(measured, predicted), (budget, measured, predicted)
        compare_step(model, lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph), (x,),
                     steps=2)
    assert recomputed > 0  # the budgets below store-all made the solver recompute
