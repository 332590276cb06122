"""ScheduleWrapper runs any schedule exactly: outputs, input and parameter gradients and buffers
equal plain PyTorch for every model family at three budgets, and the measured peak memory is
the simulator's prediction (docs/execution-model.md: within 1% both ways on the CPU).

Schedules come from tests/runtime_support.py (store-all, every other Value kept, nothing kept);
each is validated by the simulator before it runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchvision

import monetlike
from monetlike.models import transformer_block, two_in_out, unet
from monetlike import ScheduleWrapper
from runtime_support import (PEAK_TOLERANCE, compare_schedule, measured_peak,
                             recomputed_op_count, three_schedules)
from solver.simulate import simulate

tv = torchvision.models


def _vgg11():
    m = tv.vgg11(num_classes=10)
    # torchvision's classifier is 120M parameters; keep VGG-11's features, shrink the head.
    m.avgpool = nn.AdaptiveAvgPool2d(1)
    m.classifier = nn.Sequential(nn.Linear(512, 32), nn.ReLU(True), nn.Dropout(), nn.Linear(32, 10))
    return m


FAMILIES = {
    # name: (factory, input shapes)
    "resnet18": (lambda: tv.resnet18(num_classes=10), [(2, 3, 32, 32)]),
    "mobilenet_v2": (lambda: tv.mobilenet_v2(num_classes=10), [(2, 3, 64, 64)]),
    "densenet": (lambda: tv.densenet.DenseNet(growth_rate=8, block_config=(2, 2),
                                              num_init_features=8, num_classes=10),
                 [(2, 3, 32, 32)]),
    "googlenet": (lambda: tv.googlenet(num_classes=10, aux_logits=False, init_weights=False),
                  [(2, 3, 32, 32)]),
    "vgg11": (_vgg11, [(2, 3, 32, 32)]),
    "unet": (lambda: unet(width=8, depth=2), [(2, 3, 32, 32)]),
    "transformer": (lambda: transformer_block(dim=32, heads=2, dropout=0.5), [(4, 16, 32)]),
    "two_in_out": (lambda: two_in_out(width=8), [(2, 3, 8, 8), (2, 32)]),
}

_CACHE: dict = {}


def family(name):
    """(model, inputs, graph, schedules) for a family, built once per test session."""
    if name not in _CACHE:
        factory, shapes = FAMILIES[name]
        torch.manual_seed(0)
        model = factory()
        inputs = tuple(torch.randn(*s) for s in shapes)
        graph = monetlike.profile(model, inputs, cost="analytical:A100-40GB")
        schedules = three_schedules(graph)
        _CACHE[name] = (model, inputs, graph, schedules)
    return _CACHE[name]


@pytest.mark.parametrize("kind", ["store_all", "middle", "tight"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_exact_gradients(name, kind):
    model, inputs, graph, schedules = family(name)
    schedule = schedules[kind]
    if kind != "store_all":
        assert recomputed_op_count(schedule) > 0, "the schedule must recompute something"
    compare_schedule(model, schedule, inputs, graph, steps=1)


def test_store_all_is_bitwise_exact_with_batchnorm_two_steps():
    model, inputs, graph, schedules = family("resnet18")
    compare_schedule(model, schedules["tight"], inputs, graph, steps=2, exact=True)


pytestmark = pytest.mark.usefixtures("one_thread")

_MEASURED: dict = {}


def measured_family(name):
    """(graph, schedules) of a family's model profiled on this CPU, once per test session."""
    if name not in _MEASURED:
        model, inputs, _, _ = family(name)
        graph = monetlike.profile(model, inputs, cost="measured", repeat=1)
        _MEASURED[name] = (graph, three_schedules(graph))
    return _MEASURED[name]


@pytest.mark.parametrize("name", ["unet", "transformer", "mobilenet_v2", "densenet"])
def test_measured_peak_is_the_simulated_peak(name):
    # The graph of the device the step runs on: the analytical profiles of `family` model a
    # GPU, where dropout keeps a 1-byte mask; the CPU keeps fp32 noise (4 bytes per element).
    model, inputs, _, _ = family(name)
    graph, schedules = measured_family(name)
    plain = measured_peak(graph, model, model, inputs)
    peaks = {}
    for kind in ("store_all", "middle", "tight"):
        s = schedules[kind]
        predicted = simulate(graph, s).peak_bytes
        measured = measured_peak(graph, model, ScheduleWrapper(model, s, graph=graph), inputs)
        peaks[kind] = measured
        # CPU storages are counted exactly (no allocator rounding): the runtime holds what the
        # simulator predicts, both ways
        assert abs(measured - predicted) <= PEAK_TOLERANCE * predicted, (kind, measured, predicted)
    # The store-all schedule is plain PyTorch's memory behaviour.
    assert peaks["store_all"] == plain, (peaks["store_all"], plain)
    # Fewer kept Values never measure more.
    assert peaks["store_all"] >= peaks["middle"] >= peaks["tight"], peaks


@pytest.mark.parametrize("baseline", ["chen_sqrt_n", "greedy"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_exact_gradients_solver_baselines(name, baseline):
    """Schedules made by the solver side (not by these tests) run exactly too."""
    baselines = pytest.importorskip("solver.baselines")
    model, inputs, graph, schedules = family(name)
    if baseline == "chen_sqrt_n":
        result = baselines.chen_sqrt_n(graph)
    else:
        store = simulate(graph, schedules["store_all"]).peak_bytes
        low = simulate(graph, schedules["tight"]).peak_bytes
        result = baselines.greedy(graph, (store + low) // 2)
    if not result.ok:
        pytest.skip(f"{baseline} found no schedule: {result.message}")
    compare_schedule(model, result.schedule, inputs, graph, steps=1)


def test_three_decreasing_budgets_solved_measured_peaks_never_increase():
    from solver import solve
    model, inputs, _, _ = family("unet")
    # Measured on this CPU, so the allocator's count (kernel scratch included) is what is modelled.
    graph, schedules = measured_family("unet")
    store = simulate(graph, schedules["store_all"]).peak_bytes
    low = simulate(graph, schedules["tight"]).peak_bytes
    budgets = [store, (store + low) // 2, low + (store - low) // 5]
    peaks = []
    for budget in budgets:
        result = solve(graph, budget, time_limit_s=10, mip_gap=0.05)
        assert result.ok, result.message
        s = result.schedule
        predicted = simulate(graph, s).peak_bytes
        assert predicted <= budget
        measured = measured_peak(graph, model, ScheduleWrapper(model, s, graph=graph), inputs)
        assert abs(measured - predicted) <= PEAK_TOLERANCE * predicted, (budget, measured,
                                                                          predicted)
        compare_schedule(model, s, inputs, graph, steps=1)
        peaks.append(measured)
    assert peaks[0] >= peaks[1] >= peaks[2], peaks
