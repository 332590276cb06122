"""The scheduled forward is fx's generated code with only the nodes a schedule needs routed through
the runtime (NOTE [Generated forward] in monetlike/runtime/executor.py), and only the backward
stages that act are hooked. These tests pin what the runtime touches for a schedule recomputing
one Op, and that the step stays exact and at its predicted peak.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchvision

import monetlike
from monetlike import ScheduleWrapper
from monetlike.runtime.executor import ScheduledForward
from runtime_support import PEAK_TOLERANCE, compare_step, keep_schedule, measured_peak
from solver.simulate import simulate


def _one_recompute(graph):
    """A schedule that drops one BatchNorm(+ReLU) output in the middle of the model."""
    norms = [v.id for v in graph.values if v.producer is not None
             and graph.ops[v.producer].kind == "BatchNorm2d" and v.id not in graph.outputs]
    target = norms[len(norms) // 2]
    schedule = keep_schedule(graph, lambda v: v != target, "one", hold="last_use")
    assert sum(len(s.recompute) for s in schedule.stages) >= 1
    return schedule


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    # Measured costs: the peak is compared with the CPU's, kernel scratch included, which an
    # analytical profile cannot know (on an AVX2-only CPU this ResNet-18's plain step measured
    # 60 MB over what the analytical profile counts; it matched on an AVX-512 one).
    return model, x, monetlike.profile(model, x, repeat=1)


def test_only_runtime_nodes_call_into_the_runtime(resnet, monkeypatch):
    model, x, graph = resnet
    schedule = _one_recompute(graph)
    wrapped = ScheduleWrapper(model, schedule, graph=graph)
    calls = []
    original = ScheduledForward.run_node

    def counting(self, i, args, kwargs):
        calls.append(self._nodes[i].name)
        return original(self, i, args, kwargs)

    monkeypatch.setattr(ScheduledForward, "run_node", counting)
    wrapped(x).sum().backward()
    (plan,) = wrapped.plans
    n_nodes = len(plan.gm.graph.nodes)
    # Every call is a runtime node, each runs once, and they are few: the rest is plain code.
    assert sorted(calls) == sorted(plan.runtime_nodes)
    assert len(calls) < n_nodes / 4, (len(calls), n_nodes)
    # Only the stages that act are active, and each active stage is one that acts.
    assert 0 < len(plan.active_stages) < len(graph.backward_order) / 4
    held = plan.held
    for t in plan.active_stages:
        st, rel = schedule.stages[t], plan.releases[t]
        released = {*rel.at_start, *rel.at_end, *(v for vs in rel.after_recompute for v in vs)}
        assert st.fetch or st.recompute or released & held


def test_one_recompute_is_exact_and_at_its_predicted_peak(resnet):
    model, x, graph = resnet
    schedule = _one_recompute(graph)
    compare_step(model, lambda m: ScheduleWrapper(m, schedule, graph=graph), (x,), steps=2,
                 exact=True)
    wrapped = ScheduleWrapper(model, schedule, graph=graph)
    predicted = simulate(graph, schedule).peak_bytes
    measured = measured_peak(graph, model, wrapped, (x,))
    assert abs(measured - predicted) <= PEAK_TOLERANCE * predicted, (measured, predicted)


class _NamedLikeTheRunner(nn.Module):
    """A model whose input is called like the generated forward's own first argument."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, _runner):
        return self.b(torch.relu(self.a(_runner)))


def test_an_input_named_like_the_runner_is_not_shadowed():
    torch.manual_seed(0)
    model = _NamedLikeTheRunner()
    x = torch.randn(4, 8)
    graph = monetlike.profile(model, x, cost="analytical:A100-40GB")
    schedule = keep_schedule(graph, lambda v: False, "none", hold="stage")
    assert sum(len(s.recompute) for s in schedule.stages) >= 1
    compare_step(model, lambda m: ScheduleWrapper(m, schedule, graph=graph), (x,), exact=True)


class _Counter(nn.Module):
    """Writes a buffer in its forward: recomputing it would count twice."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return torch.relu(x) * 2


class _WithCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.counter = _Counter()
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.counter(self.a(x)))


def test_a_module_writing_its_buffer_is_refused_when_a_stale_graph_recomputes_it():
    """The profiler marks the counter unsafe to recompute; a graph that lost the mark (edited by
    hand, profiled by an older version) must still never make the runtime count twice."""
    import dataclasses

    from solver.errors import ScheduleError

    torch.manual_seed(0)
    model = _WithCounter()
    x = torch.randn(4, 8)
    graph = monetlike.profile(model, x, cost="analytical:A100-40GB", leaf_modules=["counter"])
    counter = next(op for op in graph.ops if op.name == "counter")
    assert counter.recompute_unsafe is not None
    stale = dataclasses.replace(graph, ops=tuple(
        dataclasses.replace(op, recompute_unsafe=None) if op is counter else op
        for op in graph.ops))
    schedule = keep_schedule(stale, lambda v: False, "none", hold="stage")
    assert any(counter.id in st.recompute for st in schedule.stages)
    wrapped = ScheduleWrapper(model, schedule, graph=stale, leaf_modules=["counter"])
    before = model.counter.calls.clone()
    with pytest.raises(ScheduleError, match="writes its buffer 'calls'"):
        wrapped(x).sum().backward()
    assert model.counter.calls == before + 1  # the forward ran once; nothing was recomputed


def test_a_recomputation_runs_as_generated_code(resnet, monkeypatch):
    """NOTE [Generated recomputation]: a recomputed Op's nodes are its own generated code; only
    its arguments from outside the Op, its norms (run without running statistics) and the
    registering of its Values call back into the runtime, once each."""
    from monetlike.runtime.step_state import Recomputation

    model, x, graph = resnet
    schedule = _one_recompute(graph)
    wrapped = ScheduleWrapper(model, schedule, graph=graph)
    calls = {"arg": [], "run": [], "made": []}
    for name in calls:
        original = getattr(Recomputation, name)

        def counting(self, i, *rest, _name=name, _original=original):
            calls[_name].append(i)
            return _original(self, i, *rest)

        monkeypatch.setattr(Recomputation, name, counting)
    wrapped(x).sum().backward()
    (plan,) = wrapped.plans
    recomputed = [j for st in schedule.stages for j in st.recompute]
    nodes = list(plan.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    outside = sorted({index[a] for j in recomputed for n in plan.op_nodes[j]
                      for a in n.all_input_nodes if plan.node_op.get(a.name) != j})
    norms = sorted(index[n] for j in recomputed for n in plan.op_nodes[j]
                   if n.op == "call_module" and "bn" in n.target)
    assert norms, "the schedule recomputes a BatchNorm"
    assert sorted(calls["arg"]) == outside
    assert sorted(calls["run"]) == norms
    assert sorted(calls["made"]) == sorted(index[plan.nodes[graph.ops[j].name]]
                                           for j in recomputed)
