"""Ops no backward reaches (NOTE [Ops no backward reaches] in monetlike/runtime/plan.py).

`gate = (u * scale) > 0.5` gives the product an autograd node (u and scale require grad) that
keeps u until the product dies, past u's last use, though no gradient ever flows through it: the
loss does not depend on a bool mask. The model holds nothing for such an Op; the runtime lets go
of what its nodes save, so the step measures what the schedule predicts. A backward that does
reach such an Op (a loss other than the profiled one) raises and says why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import monetlike
from runtime_support import compare_step, measured_peak
from solver.rules.simple import schedule_from_keep
from solver.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")


class DeadEndGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 512), nn.Linear(512, 4)
        self.scale = nn.Parameter(torch.ones(512))

    def forward(self, x):
        h = self.l1(x)
        u = torch.tanh(h)
        gate = (u * self.scale) > 0.5  # the product's MulBackward saves u
        return self.l2(h.masked_fill(gate, 0.0)), u * 2.0


def _model():
    torch.manual_seed(0)
    return DeadEndGate().train(), torch.randn(64, 16)


def _main_loss(out):
    return out[0].sum()


def test_what_an_unreached_op_saves_is_not_held():
    model, x = _model()
    graph = monetlike.profile(model, x, repeat=1, loss_fn=_main_loss)
    unreached = {op.name for op in graph.ops if not op.has_backward}
    assert {"tanh", "mul", "mul_1"} <= unreached, unreached
    u = next(v for v in graph.values if v.name == "tanh")
    # Everything kept but u, which no backward reads: nothing recomputed. The model frees u
    # after its last use; held by the product's node until the mask is made, it would be alive
    # at the comparison's forward point, above the step's predicted peak.
    schedule = schedule_from_keep(graph, {v.id for v in graph.values} - {u.id}, retain="saved")
    timeline = simulate(graph, schedule)
    assert not any(st.recompute for st in schedule.stages)
    at_gt = next(p for p in timeline.points if p.phase == "forward"
                 and graph.ops[p.op].name == "gt")
    assert at_gt.bytes + u.bytes > timeline.peak_bytes
    measured = measured_peak(graph, model, monetlike.ScheduleWrapper(model, schedule, graph=graph),
                             (x,), loss_fn=_main_loss)
    assert measured == timeline.peak_bytes


def test_a_backward_through_an_unreached_op_says_why():
    model, x = _model()
    graph = monetlike.profile(model, x, repeat=1, loss_fn=_main_loss)
    schedule = schedule_from_keep(graph, set(), retain="saved")
    wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
    out = wrapped(x)
    _main_loss(out).backward()  # the profiled loss: fine
    out = wrapped(x)
    with pytest.raises(RuntimeError, match=r"never ran .*loss_fn="):
        (out[0].sum() + out[1].sum()).backward()


class ViewReadFirstByAGate(nn.Module):
    """A view of a result read first by a product that only makes a mask, then by the path to
    the loss: the view's autograd node is claimed by the first reader's walk."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        t = self.l1(x).transpose(0, 1)
        gate = (t * 0.5) > 0
        return self.l2(t.masked_fill(gate, 0.0).transpose(0, 1))


def test_a_view_claimed_by_an_unreached_reader_starts_no_stage():
    """The product's walk claimed the transpose's node, which runs for masked_fill: the profile
    took that for the product's backward and gave it a stage, which at run time never starts
    (a stage starts at its Op's results' grad_fn); a schedule recomputing there left a later
    stage without its Value ("needs value 5 (cat), which the schedule does not hold", found by
    random fuzz programs). The node now runs in the stage under way."""
    torch.manual_seed(0)
    model, x = ViewReadFirstByAGate().train(), torch.randn(8, 16)
    graph = monetlike.profile(model, x, repeat=1)
    by_name = {op.name: op for op in graph.ops}
    assert not by_name["mul"].has_backward and by_name["masked_fill"].has_backward
    assert by_name["mul"].id not in graph.backward_order
    schedule = schedule_from_keep(graph, set(), retain="saved")
    assert any(st.recompute for st in schedule.stages)
    measured = measured_peak(graph, model, monetlike.ScheduleWrapper(model, schedule, graph=graph),
                             (x,))
    assert measured <= simulate(graph, schedule).peak_bytes
    compare_step(model, lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph), (x,),
                 steps=2)


class SavedAlsoByAGate(nn.Module):
    """s is saved by its own Op's backward (sigmoid keeps its result) and by a product that
    only makes a mask: in a plain step that product's node dies with the product, so s goes
    when the sigmoid's backward is done with it, before the add's backward accumulates."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 256), nn.Linear(16, 256), nn.Linear(256, 4)
        self.scale = nn.Parameter(torch.ones(256))

    def forward(self, x):
        a, b = self.l1(x), self.l2(x)
        s = (a + b).sigmoid_()
        gate = (s * self.scale) > 0.5
        return self.l3(s.masked_fill(gate, 0.0)), a, b


def test_a_value_an_unreached_op_saved_is_freed_as_in_a_plain_step():
    """The profiler held every autograd node of the forward (to know them by id) through the
    backward, the product's among them, and so s: the sigmoid stage's figures counted s to
    the stage's end, 4.4% over the measured store-all (a random fuzz program, seed 3505). The
    nodes no backward reaches are now let go of before the backward, as in a plain step."""
    torch.manual_seed(0)
    model, x = SavedAlsoByAGate().train(), torch.randn(64, 16)
    graph = monetlike.profile(model, x, repeat=1)
    by_name = {op.name: op for op in graph.ops}
    assert not by_name["mul"].has_backward
    for keep in ({v.id for v in graph.values}, set()):
        schedule = schedule_from_keep(graph, keep, retain="saved")
        wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
        assert measured_peak(graph, model, wrapped, (x,)) == simulate(graph, schedule).peak_bytes


class ProbedGate(nn.Module):
    """A probe whose output only makes a mask: no gradient reaches it under the loss of the
    outputs, so the runtime runs it under no_grad (no model output derives from it)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 64), nn.Linear(64, 4)
        self.probe = nn.Linear(64, 64)

    def forward(self, x):
        h = self.l1(x)
        gate = (self.probe(h) * 2.0) > 0
        return self.l2(h.masked_fill(gate, 0.0))


def test_an_op_run_under_no_grad_trains_as_plain_and_a_backward_through_it_says_why():
    """A forward hook that keeps the probe's output (an auxiliary loss on a feature, as feature
    losses do) gets the tensor the node made: it requires grad as in plain PyTorch, and a
    backward from it raises and says why instead of leaving the probe's weights without their
    gradient."""
    torch.manual_seed(0)
    model, x = ProbedGate().train(), torch.randn(8, 16, requires_grad=True)
    captured = []
    model.probe.register_forward_hook(lambda module, args, out: captured.append(out))
    graph = monetlike.profile(model, x, repeat=1)
    by_name = {op.name: op for op in graph.ops}
    assert not by_name["probe"].has_backward and not by_name["mul"].has_backward
    for keep in ({v.id for v in graph.values}, set()):
        schedule = schedule_from_keep(graph, keep, retain="saved")
        wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
        assert measured_peak(graph, model, wrapped, (x,)) == simulate(graph, schedule).peak_bytes
        compare_step(model, lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph), (x,),
                     steps=2, exact=True)
    captured.clear()
    out = wrapped(x)
    assert captured[-1].requires_grad and captured[-1].grad_fn is not None
    with pytest.raises(RuntimeError, match=r"op \d+ \(probe\), which the profiled .*loss_fn="):
        (out.sum() + captured[-1].sum()).backward()


class MaxGate(nn.Module):
    """A reduction with indices (torch.return_types.max) in the part no gradient reaches, read
    by its field name."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = self.l1(x)
        top = (h * 2.0).max(dim=1)
        return self.l2(h.masked_fill(h > top.values.unsqueeze(1) * 0.5, 0.0))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_named_result_of_an_op_run_under_no_grad_keeps_its_type(capture):
    """The result given its grad_fn was rebuilt as a plain tuple, and `top.values` failed under
    fx ("'tuple' object has no attribute 'values'")."""
    torch.manual_seed(0)
    model, x = MaxGate().train(), torch.randn(16, 16, requires_grad=True)
    graph = monetlike.profile(model, x, repeat=1, capture=capture)
    assert not next(op for op in graph.ops if op.name.startswith("max")).has_backward
    for keep in ({v.id for v in graph.values}, set()):
        schedule = schedule_from_keep(graph, keep, retain="saved")
        make = lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph, capture=capture)
        assert measured_peak(graph, model, make(model), (x,)) == simulate(graph, schedule).peak_bytes
        compare_step(model, make, (x,), steps=2, exact=True)
