"""Costs in context (monetlike.calibrate): the calibrated graph keeps its structure, its sums
match the step as timed, recomputations are timed as they run, and the model is left as it was."""

from __future__ import annotations

import pytest
import torch

import monetlike
from monetlike.calibrate import CalibrationError, calibrate
from monetlike.models import unet
from monetlike import ScheduleWrapper
from solver.rules.simple import schedule_from_keep


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
    # Each Impl keeps its own forward and backward times relative to Impl 0; a recomputation
    # timed in context is the same for every Impl (it runs the default nodes under no_grad), an
    # untimed one is the Impl's own rerun time, scaled as the forward.
    for a, b in zip(graph.ops, cal.ops):
        for ia, ib in zip(a.impls, b.impls):
            assert ib.fwd_time == pytest.approx(ia.fwd_time * info["forward_scale"])
            assert ib.bwd_time == pytest.approx(ia.bwd_time * info["backward_scale"])
            if a.id in timed:
                assert ib.recompute_time == b.impls[0].recompute_time
            else:
                assert ib.recompute_time == pytest.approx(ia.rerun_time * info["forward_scale"]
                                                          + info["runtime_per_recompute_s"])
    # The runtime's own work is fitted so that the calibrated graph predicts the timed
    # recompute-everything steps (unless the timings alone already predicted them as longer).
    from solver.simulate import simulate

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
