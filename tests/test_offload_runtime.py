"""Offload to host in the runtime: refused up front without CUDA; on CUDA, the same gradients as
plain PyTorch (skipped on a machine without a GPU).

The CPU tests of the executor's bookkeeping (handles instead of saved tensors, the forward copy
freed at its last use, fetch at the stage start, fetched twice, host copies released) replace
the CUDA copies (offload.HostCopies) by plain clones: they check which Values move when, not the
CUDA streams and events, which only the CUDA test runs.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
import torch.nn as nn

import monetlike
import solver
from monetlike import ScheduleWrapper
from monetlike.runtime import step_state as executor_mod
from monetlike import wrapper as wrapper_mod
from monetlike.runtime.offload import as_typed
from runtime_support import compare_step
from solver.errors import ScheduleError
from solver.simulate import simulate, with_predictions


class TwoBranch(nn.Module):
    """relu's output (Value 2) is saved by three backwards: relu, b and c."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32)
        self.d = nn.Linear(32, 4)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.d(torch.tanh(self.b(y)) + self.c(y))


def _setup(device="cpu"):
    torch.manual_seed(0)
    model = TwoBranch().to(device)
    x = torch.randn(8, 16, device=device)
    # Analytical costs: the graph has a host link (the A100 preset's), as a GPU profile would.
    graph = monetlike.profile(model, x, cost="analytical:A100-40GB")
    return model, x, graph


def _needing_stages(graph, schedule, v):
    return [t for t, o in enumerate(graph.backward_order)
            if v in graph.ops[o].impls[schedule.impl[o]].saved]


def offload_schedule(graph, *, refetch: bool = False, v: int | None = None):
    """The store-all schedule with one kept Value moved to host memory: fetched at the first
    stage whose backward needs it and carried to its last use (refetch=False), or fetched and
    dropped at every stage that needs it (refetch=True)."""
    base = solver.store_all_schedule(graph)
    if v is None:  # the kept Value needed by the most stages
        v = max(base.forward_keep, key=lambda u: len(_needing_stages(graph, base, u)))
    need = _needing_stages(graph, base, v)
    assert v in base.forward_keep and need
    stages = []
    for t, st in enumerate(base.stages):
        drop = set(st.drop) - {v}
        fetch = ()
        if refetch and t in need:
            fetch, drop = (v,), drop | {v}
        elif not refetch:
            fetch = (v,) if t == need[0] else ()
            drop = drop | {v} if t == need[-1] else drop
        stages.append(dataclasses.replace(st, fetch=fetch, drop=tuple(sorted(drop))))
    sched = dataclasses.replace(base, forward_keep=tuple(u for u in base.forward_keep if u != v),
                                offload=(v,), stages=tuple(stages))
    return with_predictions(graph, sched), v, need


def test_offload_schedule_is_valid_and_fetches_where_needed():
    _, _, graph = _setup()
    sched, v, need = offload_schedule(graph)
    assert sched.offload == (v,) and v not in sched.forward_keep
    assert [t for t, st in enumerate(sched.stages) if st.fetch] == [need[0]]
    again, _, _ = offload_schedule(graph, refetch=True)
    assert [t for t, st in enumerate(again.stages) if st.fetch] == need and len(need) > 1
    simulate(graph, again)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_offload_is_refused_when_the_wrapper_is_built_without_cuda():
    model, x, graph = _setup()
    sched, v, _ = offload_schedule(graph)
    with pytest.raises(ScheduleError) as e:
        ScheduleWrapper(model, sched)
    msg = str(e.value)
    assert f"offloads 1 Value to host memory (value {v})" in msg
    assert "CUDA is not available" in msg and "GPU feature" in msg and "needs CUDA" in msg
    assert "solver.solve(..., offload=False)" in msg and "CUDA device" in msg
    # With the graph given, the Values are named.
    with pytest.raises(ScheduleError) as e:
        ScheduleWrapper(model, sched, graph=graph)
    assert f"(value {v} ({graph.values[v].name}))" in str(e.value)
    assert "solver.solve(..., offload=False)" in str(e.value)


def test_offload_is_refused_before_the_step_when_the_model_is_on_cpu(monkeypatch):
    """With CUDA present but the model and inputs on the CPU, the first call refuses when the
    plan is made, before anything runs (no gradient, no forward hook fired)."""
    monkeypatch.setattr(wrapper_mod, "check_cuda_available", lambda schedule, graph: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, x, graph = _setup()
    sched, _, _ = offload_schedule(graph)
    wrapped = ScheduleWrapper(model, sched)
    calls = []
    model.a.register_forward_hook(lambda *a: calls.append(1))
    for _ in range(2):  # the refusal is cached for the signature, and says the same
        with pytest.raises(ScheduleError) as e:
            wrapped(x)
        assert "the model or its inputs are on cpu" in str(e.value)
        assert "solver.solve(..., offload=False)" in str(e.value)
    assert calls == [] and all(p.grad is None for p in model.parameters())


def test_schedule_without_offload_is_not_affected():
    """The device check is a no-op without offload: the store-all schedule runs on the CPU."""
    model, x, graph = _setup()
    compare_step(model, lambda m: ScheduleWrapper(m, solver.store_all_schedule(graph)), (x,),
                 exact=True)


class CloneCopies:
    """Stands in for offload.HostCopies on the CPU: the same calls, clones instead of copies."""

    log: list = []

    def __init__(self, side_streams):
        self._copies = {}

    def offload(self, v, x):
        raw = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()).clone()
        self._copies[v] = (raw, x.dtype)
        self.log.append(("offload", v, weakref.ref(x.untyped_storage())))

    def fetch(self, v):
        raw, dtype = self._copies[v]
        self.log.append(("fetch", v))
        return as_typed(raw.clone(), dtype)

    def release(self):
        self._copies.clear()
        self.log.append(("release",))


@pytest.fixture
def clone_copies(monkeypatch):
    monkeypatch.setattr(executor_mod, "HostCopies", CloneCopies)
    monkeypatch.setattr(wrapper_mod, "check_cuda_available", lambda schedule, graph: None)
    monkeypatch.setattr(wrapper_mod, "check_offload_devices", lambda schedule, graph, ts: None)
    CloneCopies.log = []
    return CloneCopies


@pytest.mark.parametrize("refetch", [False, True])
def test_offload_bookkeeping_with_clones(clone_copies, refetch):
    model, x, graph = _setup()
    sched, v, need = offload_schedule(graph, refetch=refetch)
    wrapped = compare_step(model, lambda m: ScheduleWrapper(m, sched), (x,), exact=True, steps=2)
    log = clone_copies.log
    per_step = [("offload", v), *[("fetch", v)] * (len(need) if refetch else 1), ("release",)]
    assert [e[:2] for e in log] == per_step * 2
    # Between forward and backward the forward's copy of the Value is gone: nothing (saved
    # tensor, resident set) holds it, so it left the device at its last forward use.
    clone_copies.log = log = []
    out = wrapped(x)
    (_, _, storage) = log[0]
    assert storage() is None
    assert [e[:2] for e in log] == [("offload", v)]
    out.sum().backward()
    assert log[-1] == ("release",)


def test_host_copies_released_when_the_forward_fails(clone_copies):
    model, x, graph = _setup()
    sched, v, _ = offload_schedule(graph)
    wrapped = ScheduleWrapper(model, sched, graph=graph)  # graph given: no structure profile
    model.d.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        wrapped(x)
    assert [e[:2] for e in clone_copies.log] == [("offload", v), ("release",)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload to host needs CUDA")
@pytest.mark.parametrize("refetch", [False, True])
def test_offload_on_cuda_matches_plain_pytorch(refetch):  # pragma: no cover - needs a GPU
    model, x, graph = _setup("cuda")
    sched, _, _ = offload_schedule(graph, refetch=refetch)
    # A loss on the outputs' device (the default one in runtime_support weights on the CPU).
    compare_step(model, lambda m: ScheduleWrapper(m, sched), (x,), steps=3,
                 loss_fn=lambda out: (out.float() ** 2).sum())
    torch.cuda.synchronize()
