"""Measuring the registered Impls (monetlike/profile/impl_timing.py): an Impl that fails to run is
left out with a warning, and only it: the Ops timed in the same steps keep theirs."""

import warnings

import pytest
import torch

import monetlike
from monetlike.impls import registry
from monetlike.profile.timing import TimingRun


def _tanh_timing_fails(gm, nodes):
    """An Impl of torch.tanh that runs as the default in the memory step and raises in a timing
    step (as an Impl whose kernel fails on some input would)."""
    if len(nodes) != 1 or nodes[0].op != "call_function" or nodes[0].target is not torch.tanh:
        return None

    def run(interp, node, args, kwargs):
        if isinstance(interp, TimingRun):
            raise RuntimeError("this Impl cannot be timed")
        return torch.tanh(*args, **kwargs)

    return {nodes[0].name: run}


class LinearTanh(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * 2


@pytest.fixture
def failing_impl():
    with registry.registered(registry.ImplSpec("tanh_timing_fails", _tanh_timing_fails,
                                               doc="test only")) as spec:
        yield spec


def test_an_impl_that_cannot_be_timed_is_left_out_and_its_level_keeps_the_others(failing_impl):
    # The Linear's split and the tanh's Impl are each their Op's first candidate (one level),
    # measured in two memory rounds (the tanh reads the Linear's output) and timed together:
    # the failed timing steps are run again round by round.
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = monetlike.profile(LinearTanh(), torch.randn(16, 32), repeat=1)
    impls = {op.name: [i.name for i in op.impls] for op in g.ops}
    lin = next(op for op in g.ops if "linear_split" in [i.name for i in op.impls])
    tanh = next(op for op in g.ops if op.name.startswith("tanh"))
    assert "tanh_timing_fails" not in [i.name for i in tanh.impls], impls
    split = next(i for i in lin.impls if i.name == "linear_split")
    assert split.fwd_time > 0 and split.bwd_time > 0
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any("tanh_timing_fails" in m and "cannot be timed" in m for m in messages), messages
    assert not any("linear_split" in m for m in messages), messages


def test_measured_impls_are_their_defaults_time_plus_what_was_credited():
    """An Impl's measured figures are differences over its Op's default, timed side by side and
    credited by costs.credited_difference: adding the default's median times gives its own."""
    from monetlike.profile.costs import credited_difference
    from monetlike.profile.impl_timing import over_defaults

    alternatives = {3: [dict(name="a", fwd_time=credited_difference([-0.1, 0.2, -0.3]),
                             bwd_time=credited_difference([-0.2, -0.1, -0.3]))],
                    4: [dict(name="b", fwd_time=credited_difference([0.5, 0.7, 0.6]),
                             bwd_time=-3.0)]}
    over_defaults(alternatives, {3: [1.0, 2.0, 9.0], 4: [0.1]}, {3: [1.0], 4: [1.0]})
    (a,), (b,) = alternatives[3], alternatives[4]
    assert (a["fwd_time"], a["bwd_time"]) == pytest.approx((2.0, 0.9))  # no saving; the least
    assert (b["fwd_time"], b["bwd_time"]) == pytest.approx((0.7, 0.0))  # never below zero
