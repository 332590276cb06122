"""Costs in context (monetlike.calibrate): the calibrated graph keeps its structure, its sums
match the step as timed, recomputations are timed as they run, and the model is left as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import monetlike
from monetlike.calibrate import CalibrationError, calibrate
from monetlike.models import unet
from monetlike.profile.costs import credited_difference, in_context_difference
from monetlike import ScheduleWrapper
from solver.rules.simple import schedule_from_keep
from solver.simulate import simulate, store_all_schedule


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model = unet(width=8, depth=2)
    x = torch.randn(2, 3, 32, 32)
    return model, x, monetlike.profile(model, x, cost="measured", repeat=1)


def test_calibrated_costs_sum_to_the_timed_step_and_keep_the_fingerprint(small):
    model, x, graph = small
    cal = calibrate(model, x, graph, steps=2)
    info = cal.meta["calibration"]
    assert cal.fingerprint == graph.fingerprint
    assert sum(op.impls[0].fwd_time for op in cal.ops) == pytest.approx(info["forward_s"])
    assert sum(op.impls[0].bwd_time for op in cal.ops) == pytest.approx(info["backward_s"])
    assert all(im.recompute_time is not None for op in cal.ops for im in op.impls)
    # Every Op the recompute-everything schedule recomputes was timed in context.
    everything = schedule_from_keep(graph, (), retain="all")
    timed = {j for st in everything.stages for j in st.recompute}
    assert info["recompute_timed_ops"] == len(timed)
    assert info["recompute_timed_ops"] >= len(graph.ops) // 2
    # Impl 0's forward and backward times are scaled; the other Impls' are fitted in context
    # (test_impls_are_charged_what_they_cost_in_context). A recomputation timed in context is
    # the same for every Impl (it runs the default nodes under no_grad), an untimed one is the
    # Impl's own rerun time, scaled as the forward.
    for a, b in zip(graph.ops, cal.ops):
        assert b.impls[0].fwd_time == pytest.approx(a.impls[0].fwd_time * info["forward_scale"])
        assert b.impls[0].bwd_time == pytest.approx(a.impls[0].bwd_time * info["backward_scale"])
        for ia, ib in zip(a.impls, b.impls):
            if a.id in timed:
                assert ib.recompute_time == b.impls[0].recompute_time
            else:
                assert ib.recompute_time == pytest.approx(ia.rerun_time * info["forward_scale"]
                                                          + info["runtime_per_recompute_s"])
    # The runtime's own work is fitted so that the calibrated graph predicts the timed
    # recompute-everything steps (unless the timings alone already predicted them as longer).
    predicted = simulate(cal, everything).total_time
    assert info["runtime_per_recompute_s"] >= 0
    if info["runtime_per_recompute_s"] > 0:
        assert predicted == pytest.approx(info["recompute_step_s"])
    else:
        assert predicted >= info["recompute_step_s"]


def test_calibration_leaves_the_model_as_it_was(small):
    model, x, graph = small
    torch.manual_seed(5)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    grads = {n: p.grad for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    calibrate(model, x, graph, steps=1)
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert p.grad is grads[n] and torch.equal(p, params[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    for p in model.parameters():
        p.grad = None


def test_recomputations_are_timed_once_each_as_scheduled(small):
    model, x, graph = small
    schedule = schedule_from_keep(graph, (), retain="all")
    wrapped = ScheduleWrapper(model, schedule, graph=graph)
    expected = sorted(j for st in schedule.stages for j in st.recompute)
    with wrapped.timing_recomputations() as times:
        wrapped(x).sum().backward()
    assert sorted(j for j, ts in times.items() for _ in ts) == expected
    assert all(t >= 0 for ts in times.values() for t in ts)
    wrapped(x).sum().backward()  # outside the block nothing is recorded
    assert sum(map(len, times.values())) == len(expected)
    model.zero_grad(set_to_none=True)


def test_bad_calls_are_refused_with_the_reason(small):
    model, x, graph = small
    analytical = monetlike.profile(model, x, cost="analytical:A100-40GB")
    with pytest.raises(CalibrationError, match="cost='measured'"):
        calibrate(model, x, analytical)
    with pytest.raises(CalibrationError, match="steps"):
        calibrate(model, x, graph, steps=0)
    model.eval()
    try:
        with pytest.raises(CalibrationError, match="eval mode"):
            calibrate(model, x, graph)
    finally:
        model.train()


def test_a_dropout_mask_recomputation_is_timed_from_its_mask():
    """NOTE [Recomputed from the mask]: that Impl's recompute_time is its own timing, not the
    default's draw."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Dropout(0.3),
                                torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 4))
    x = torch.randn(16, 32)
    graph = monetlike.profile(model, x, cost="measured", repeat=1)
    cal = calibrate(model, x, graph, steps=2)
    assert cal.meta["calibration"]["mask_recompute_timed_ops"] == 1
    (drop,) = [op for op in cal.ops if any(im.name == "dropout_mask" for im in op.impls)]
    mask = next(im for im in drop.impls if im.name == "dropout_mask")
    # Timed apart: another number than the default's (a draw of the same numbers), and both
    # hold the runtime's share.
    share = cal.meta["calibration"]["runtime_per_recompute_s"]
    assert mask.recompute_time != drop.impls[0].recompute_time
    assert mask.recompute_time >= share and drop.impls[0].recompute_time >= share


class StepClock:
    """A fake Timer (calibrate's `timer` seam): every timed step takes one second, whatever runs
    in it. No Impl can then show a saving in context."""

    def __init__(self):
        self.now = 0.0

    def mark(self):
        self.now += 0.5
        return self.now

    def sync(self):
        pass

    def seconds(self, a, b):
        return b - a


def test_credited_difference_credits_only_a_saving_every_pair_showed():
    assert credited_difference([]) == 0.0
    assert credited_difference([0.3, 0.1, 0.2]) == pytest.approx(0.2)  # a cost: the median
    assert credited_difference([-0.3, -0.1, -0.2]) == pytest.approx(-0.1)  # the least saving
    assert credited_difference([-0.3, 0.1, -0.2]) == 0.0  # one pair did not save: nothing
    assert credited_difference([0.0, -1.0, -1.0]) == 0.0


def test_the_per_op_prediction_stands_within_the_middle_half_of_what_context_measured():
    diffs = [1.0, 2.0, 3.0, 4.0, 5.0]  # quartiles 1.5 and 4.5
    assert in_context_difference(3.9, diffs) == pytest.approx(3.9)
    assert in_context_difference(0.2, diffs) == pytest.approx(1.5)
    assert in_context_difference(9.0, diffs) == pytest.approx(4.5)
    # a saving: only as far as every round showed one
    assert in_context_difference(-1.0, [-2.0, 0.5, -1.0, -3.0, -0.5]) == 0.0
    assert in_context_difference(-9.0, [-2.0, -0.5, -1.0, -3.0, -0.7]) == pytest.approx(-0.5)
    assert in_context_difference(-1.0, []) == 0.0 and in_context_difference(2.0, [7.0]) == 7.0


def test_an_impl_saving_not_measured_in_context_is_not_credited():
    """A profile that says an Impl is faster than its Op's default (here made so: every Impl's
    per-Op times cut to a tenth) is not believed unless the whole step choosing it measured a
    saving beside the defaults' step; with a clock under which every step takes the same time,
    none did, so every Impl costs at least its default, and no store-all step choosing one is
    predicted faster than the defaults' (in context it measured no difference)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(288, 4))
    x = torch.randn(2, 3, 8, 8)
    graph = monetlike.profile(model, x, cost="measured", repeat=1)
    cheap = dataclasses.replace(graph, ops=tuple(dataclasses.replace(op, impls=(op.impls[0], *(
        dataclasses.replace(im, fwd_time=im.fwd_time / 10, bwd_time=im.bwd_time / 10)
        for im in op.impls[1:]))) for op in graph.ops))
    assert any(im.fwd_time + im.bwd_time < op.impls[0].fwd_time + op.impls[0].bwd_time
               for op in cheap.ops for im in op.impls[1:])
    cal = calibrate(model, x, cheap, steps=1, timer=StepClock())
    info = cal.meta["calibration"]["impls_in_context"]
    names = {im.name for op in graph.ops for im in op.impls[1:]}
    assert names and set(info) <= names and info
    base = simulate(cal, store_all_schedule(cal)).total_time
    for name, figures in info.items():
        assert figures["measured_s"] == 0.0 and figures["credited_s"] == 0.0
        impl = tuple(next((k for k, im in enumerate(op.impls) if im.name == name), 0)
                     for op in cal.ops)
        assert simulate(cal, store_all_schedule(cal, impl)).total_time >= base - 1e-12
    for op in cal.ops:
        d = op.impls[0]
        for im in op.impls[1:]:
            assert im.fwd_time + im.bwd_time >= d.fwd_time + d.bwd_time - 1e-12, (op.id, im.name)
