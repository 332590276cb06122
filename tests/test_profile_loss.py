"""The user's loss in the profile (`monetlike.profile(loss_fn=...)`).

A step's memory depends on its loss: the loss's forward runs while the whole forward's memory is
live, and its backward hands the model a real output gradient (a sum's is an expanded scalar)
after kernels of its own. A profile made with the default sum can predict far less than such a
step takes; one made with the loss predicts it, by the allocator's count (measure_step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import monetlike
import solver
from fuzz_models import FUZZ_PROGRAMS, Step, build, settle_heap
from monetlike.profile import ProfileError
from runtime_support import PEAK_TOLERANCE, measured_peak, peak_of
from solver.simulate import store_all_schedule

pytestmark = pytest.mark.usefixtures("one_thread")


def _leaves(out):
    return out if isinstance(out, (tuple, list)) else (out,)


# Losses of the model's output(s), each with kernels and transients a sum does not have.
LOSSES = {
    "pow_mean": lambda out: sum(o.float().pow(2).mean() for o in _leaves(out)),
    "mse_to_zero": lambda out: sum(F.mse_loss(o, torch.zeros_like(o)) for o in _leaves(out)),
    "logsumexp": lambda out: sum(o.logsumexp(-1).mean() for o in _leaves(out)),
}


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4096)), torch.randn(64, 8)


def test_a_wide_output_s_loss_is_predicted_only_when_profiled():
    """A 64 x 4096 output: pow(2).mean()'s backward makes two output-sized tensors before the
    model's first stage, the step's peak. The default profile misses them (more than 2x under);
    with the loss, store-all and a solved schedule are predicted within 1%, under the budget."""
    model, x = _wide_model()
    loss = LOSSES["pow_mean"]
    default = monetlike.profile(model, x, repeat=1)
    store = store_all_schedule(default)
    measured = measured_peak(default, model, monetlike.ScheduleWrapper(model, store, graph=default),
                             (x,), loss_fn=loss)
    assert peak_of(default, store) < measured / 2

    graph = monetlike.profile(model, x, repeat=1, loss_fn=loss)
    assert graph.meta["loss"] == "<lambda>" and default.meta["loss"] == "sum of the outputs"
    store = store_all_schedule(graph)
    predicted = peak_of(graph, store)
    measured = measured_peak(graph, model, monetlike.ScheduleWrapper(model, store, graph=graph),
                             (x,), loss_fn=loss)
    assert abs(measured - predicted) <= predicted * PEAK_TOLERANCE, (measured, predicted)


@settings(max_examples=20, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(FUZZ_PROGRAMS, st.sampled_from(sorted(LOSSES)))
# The loss's forward transient, charged to the last Op's forward point, vanished from an in-place
# Impl's point there (it frees its input; the loss's moment does not): 19,440 B measured, 17,392
# predicted, 18,416 budget. It is charged to the first stage now.
@example(((Step("linear", (0, 0, 0), 0.1), Step("reshape_permute", (0, 0, 0), 0.1)), 1, 0),
         "mse_to_zero")
def test_fuzzed_models_with_a_loss(case, loss_name):
    """The fuzzer's models (tests/fuzz_models.py) with a loss drawn from LOSSES: store-all within
    1% of the prediction, and the solver's schedule at a budget between the least feasible peak
    and store-all at or under it."""
    program, n_outputs, seed = case
    loss = LOSSES[loss_name]
    settle_heap()
    model, tokens = build(program, n_outputs, seed)
    graph = monetlike.profile(model, tokens, repeat=1, loss_fn=loss)
    store = store_all_schedule(graph)
    predicted = peak_of(graph, store)
    measured = measured_peak(graph, model, monetlike.ScheduleWrapper(model, store, graph=graph),
                             (tokens,), loss_fn=loss)
    assert abs(measured - predicted) <= predicted * PEAK_TOLERANCE, ("store-all", measured,
                                                                     predicted)
    least = solver.min_budget(graph, time_limit_s=10)
    budget = least + (predicted - least) // 2
    schedule = solver.solve(graph, budget, time_limit_s=10).schedule
    measured = measured_peak(graph, model, monetlike.ScheduleWrapper(model, schedule, graph=graph),
                             (tokens,), loss_fn=loss)
    assert measured <= budget, ("over budget", budget, measured, peak_of(graph, schedule))


@pytest.mark.parametrize("bad, got", [
    (lambda out: out.pow(2), "a tensor of shape (64, 4096)"),
    (lambda out: 1.0, "float"),
    (lambda out: out.detach().sum(), "requires_grad=False"),
])
def test_a_loss_that_is_not_a_scalar_to_differentiate_is_refused(bad, got):
    model, x = _wide_model()
    with pytest.raises(ProfileError, match="loss_fn must return a scalar tensor") as e:
        monetlike.profile(model, x, repeat=1, loss_fn=bad)
    assert got in str(e.value)



def test_the_schedule_cache_tells_losses_apart():
    """monetlike.optimize's cache key covers the memory figures, which a loss changes (the first
    stage's); the same profile made twice keeps the same key (allocator counts, not times)."""
    from monetlike.optimize import cache_key

    model, x = _wide_model()
    first, again = (monetlike.profile(model, x, repeat=1) for _ in range(2))
    with_loss = monetlike.profile(model, x, repeat=1, loss_fn=LOSSES["pow_mean"])
    assert first.fingerprint == with_loss.fingerprint  # the same structure
    assert cache_key(first, 10**7, {}) == cache_key(again, 10**7, {})
    assert cache_key(first, 10**7, {}) != cache_key(with_loss, 10**7, {})


def test_a_loss_in_an_analytical_profile_is_counted_by_the_tracker():
    """On the meta device (analytical costs) the storage tracker watches the loss's forward and
    its backward up to the model's first stage, as the allocator's log does on the CPU. With
    pow(2).mean() on the 64 x 4096 output the two profiles predict the same store-all peak,
    the CPU one checked against the allocator above; the meta profile with the default sum
    predicts a quarter of it. Tensors the loss uses must be on the meta device: a CPU label
    gets an error that says so."""
    model, x = _wide_model()
    loss = LOSSES["pow_mean"]
    cpu = monetlike.profile(model, x, repeat=1, loss_fn=loss)
    meta = monetlike.profile(model, x, cost="analytical:A100-40GB", loss_fn=loss)
    meta_sum = monetlike.profile(model, x, cost="analytical:A100-40GB")
    predicted = peak_of(meta, store_all_schedule(meta))
    assert predicted == peak_of(cpu, store_all_schedule(cpu))
    assert predicted > 3 * peak_of(meta_sum, store_all_schedule(meta_sum))
    assert meta.meta["loss"] == "<lambda>"

    labels = torch.zeros(64, 4096)
    with pytest.raises(ProfileError, match="make the tensors it uses .labels. there"):
        monetlike.profile(model, x, cost="analytical:A100-40GB",
                          loss_fn=lambda out: F.mse_loss(out, labels))
