"""A dropout run with dropout_mask is recomputed from its held mask, not drawn again
(NOTE [Recomputed from the mask] in monetlike/impls/dropout.py): the same bits as the forward,
the same gradients as plain PyTorch, the peak the simulator predicts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import monetlike
from monetlike.impls import dropout as dropout_impls
from monetlike import ScheduleWrapper
from monetlike.impls import registry
from runtime_support import PEAK_TOLERANCE, compare_step, measured_peak
from solver.rules.simple import schedule_from_keep
from solver.simulate import simulate


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.25, 0.5, 0.9])
def test_the_mask_gives_the_forward_bits(dtype, p):
    x = torch.randn(33, 65, dtype=dtype)
    x[0, :4] = torch.tensor([float("inf"), float("nan"), -0.0, -float("inf")], dtype=dtype)
    torch.manual_seed(7)
    y, mask = torch.native_dropout(x, p, True)
    again = dropout_impls.dropout_from_mask(x, mask, p)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(y.view(bits), again.view(bits))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.drop(self.a(x)))))


def test_a_recomputed_dropout_mask_applies_the_mask():
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(32, 64)
    graph = monetlike.profile(model, x, cost="measured", repeat=1)
    drop = next(op for op in graph.ops if op.name == "drop")
    k = next(i for i, im in enumerate(drop.impls) if im.name == "dropout_mask")
    # Nothing drawn, so no generator state: its scratch is the mask cast to float32 alone.
    assert drop.impls[k].recompute_workspace == 32 * 256 * 4
    impl = tuple(k if op.id == drop.id else 0 for op in graph.ops)
    schedule = schedule_from_keep(graph, (), retain="saved", impl=impl, mode="full")
    assert any(drop.id in st.recompute for st in schedule.stages)
    calls = []
    spec = registry.get("dropout_mask")
    original = spec.stashed_recompute.run

    def counting(x, mask, p):
        calls.append(p)
        return original(x, mask, p)

    counted = dataclasses.replace(spec, stashed_recompute=dataclasses.replace(
        spec.stashed_recompute, run=counting))
    with registry.registered(counted):
        compare_step(model, lambda m: ScheduleWrapper(m, schedule, graph=graph), (x,), steps=2,
                     exact=True)
    assert calls and all(p == 0.3 for p in calls)
    wrapped = ScheduleWrapper(model, schedule, graph=graph)
    predicted = simulate(graph, schedule).peak_bytes
    measured = measured_peak(graph, model, wrapped, (x,))
    assert abs(measured - predicted) <= PEAK_TOLERANCE * predicted, (measured, predicted)


def test_the_mask_recomputation_scratch_is_in_the_peak():
    """A fuzzed model (tests/fuzz_models.py) whose peak is the dropout's recomputation from its
    mask: 14,760 B measured against 12,716 predicted while the profile took that recomputation
    to allocate nothing beyond its output; the CPU kernel casts the bool mask to float32 in a
    2,048 B temporary (impls/dropout.py, mask_recompute_scratch)."""
    from fuzz_models import Step, build

    program = (Step("dropout", (0, 0, 0), 0.25), Step("slice_cat", (49, 45, 4), 0.5))
    model, tokens = build(program, 1, 51652)
    graph = monetlike.profile(model, tokens, repeat=1)
    drop = next(op for op in graph.ops if op.name == "dropout")
    impl = tuple(next(i for i, im in enumerate(op.impls) if im.name == "dropout_mask")
                 if op.id == drop.id else 0 for op in graph.ops)
    keep = {v.id for v in graph.values if v.name in ("embed", "cat")}
    schedule = schedule_from_keep(graph, keep, retain="all", impl=impl)
    assert any(drop.id in st.recompute for st in schedule.stages)
    predicted = simulate(graph, schedule).peak_bytes
    measured = measured_peak(graph, model, ScheduleWrapper(model, schedule, graph=graph),
                             (tokens,))
    assert measured <= predicted * (1 + PEAK_TOLERANCE), (measured, predicted)


def test_a_bfloat16_dropout_mask_is_drawn_again_when_recomputed():
    """Under CPU autocast the dropout's input is bfloat16, where applying the mask would round
    otherwise than native_dropout: the runtime holds no mask and the recomputation draws the
    same numbers again under the forward's generator state; outputs and gradients stay
    plain autocast's, bit for bit."""
    import copy

    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(32, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        graph = monetlike.profile(model, x, cost="measured", repeat=1)
    drop = next(op for op in graph.ops if op.name == "drop")
    assert graph.values[drop.outputs[0]].dtype == "bfloat16"
    k = next(i for i, im in enumerate(drop.impls) if im.name == "dropout_mask")
    impl = tuple(k if op.id == drop.id else 0 for op in graph.ops)
    schedule = schedule_from_keep(graph, (), retain="saved", impl=impl, mode="full")
    assert any(drop.id in st.recompute for st in schedule.stages)
    wrapped = ScheduleWrapper(copy.deepcopy(model), schedule, graph=graph)
    for seed in range(2):
        grads = []
        for m in (model, wrapped):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            out.float().pow(2).mean().backward()
            grads.append([out.detach()] + [p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            assert torch.equal(a, b)
