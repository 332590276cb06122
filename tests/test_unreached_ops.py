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
from runtime_support import measured_peak
from solver.rules import schedule_from_keep
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
