"""What users of checkpointing get bitten by (shared/REFERENCE.md), each checked on ScheduleWrapper.

Every test compares with plain PyTorch on a copy of the same model with the same seed, at a
schedule that recomputes (the tightest of tests/runtime_support.py unless said otherwise).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

import monetlike
from monetlike.models import transformer_block
from monetlike.profile.memory import StorageTracker
from monetlike import ScheduleWrapper
from runtime_support import (compare_schedule, compare_step, every, keep_schedule,
                             recomputed_op_count, step, three_schedules)
from solver.errors import ScheduleError, ScheduleMismatchError
from solver.schedule import StageSchedule
from solver.simulate import store_all_schedule


pytestmark = pytest.mark.usefixtures("one_thread")


def tight(graph):
    return keep_schedule(graph, every(0), "tight", hold="stage")


def profiled(model, inputs, cost="analytical:A100-40GB", **kw):
    return monetlike.profile(model, inputs, cost=cost, **kw)


def small_cnn(norm=nn.BatchNorm2d, dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), norm(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), norm(8), nn.ReLU(inplace=True),
        nn.Flatten(), nn.Dropout(dropout), nn.Linear(8 * 8 * 8, 10))


# ----------------------------------------------------------------------------------------------
# Frozen inputs (LoRA, frozen embeddings): gradients must reach trainable layers that are only
# inside recomputed regions.
# ----------------------------------------------------------------------------------------------
class FrozenEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.l1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.l2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.l2(self.act(self.l1(self.emb(ids)))))


def test_frozen_embedding_trainable_layers_inside_recomputed_region():
    torch.manual_seed(0)
    model = FrozenEmbedding()
    model.emb.weight.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    ids = torch.randint(0, 50, (4, 6))
    graph = profiled(model, (ids,))
    s = tight(graph)
    recomputed = {graph.ops[j].name for st in s.stages for j in st.recompute}
    assert {"emb", "l1", "act"} <= recomputed
    wrapped = compare_schedule(model, s, (ids,), graph, steps=2)
    assert wrapped.model.l1.weight.grad is not None and wrapped.model.l1.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# BatchNorm running statistics updated once per step, also when recomputed.
# ----------------------------------------------------------------------------------------------
def test_batchnorm_five_steps_tight_buffers_bitwise_equal():
    model = small_cnn()
    x = torch.randn(4, 3, 8, 8)
    graph = profiled(model, (x,))
    s = tight(graph)
    bn_ops = [op.id for op in graph.ops if op.kind == "BatchNorm2d"]
    assert all(any(j in st.recompute for st in s.stages) for j in bn_ops)
    wrapped = compare_schedule(model, s, (x,), graph, steps=5, exact=True)
    assert int(wrapped.model[1].num_batches_tracked) == 5


def test_eval_mode_batchnorm_inside_training_model():
    model = small_cnn()
    model[1].eval()  # frozen BatchNorm (detection-style fine-tuning)
    x = torch.randn(4, 3, 8, 8)
    graph = profiled(model, (x,))
    s = tight(graph)
    compare_schedule(model, s, (x,), graph, steps=2)


# ----------------------------------------------------------------------------------------------
# Dropout draws the same mask when recomputed (RNG state replayed).
# ----------------------------------------------------------------------------------------------
def dropout_block():
    """A transformer block with dropout 0.5, its input and its profile."""
    torch.manual_seed(0)
    model = transformer_block(dim=32, heads=2, dropout=0.5)
    x = torch.randn(2, 8, 32)
    return model, x, profiled(model, (x,))


def test_dropout_transformer_tight_same_loss_and_grads():
    model, x, graph = dropout_block()
    s = tight(graph)
    dropouts = [op.id for op in graph.ops if op.kind == "Dropout"]
    assert any(j in st.recompute for st in s.stages for j in dropouts)  # the attention mask
    compare_schedule(model, s, (x,), graph, steps=3)


def test_recomputation_does_not_shift_the_next_steps_random_numbers():
    model, x, graph = dropout_block()
    wrapped = ScheduleWrapper(copy.deepcopy(model), tight(graph), graph=graph)
    torch.manual_seed(1)
    model(x).sum().backward()
    after_plain = torch.rand(3)
    torch.manual_seed(1)
    wrapped(x).sum().backward()
    assert torch.equal(torch.rand(3), after_plain)


@pytest.mark.parametrize("recorded", [True, False])
def test_recomputed_attention_dropout_draws_the_same_mask(recorded):
    # The profiler records which Ops drew random numbers; a graph saved before it did is judged
    # by the names of its Ops, where attention with dropout_p > 0 must count as random.
    from test_impls_internals import ExportedAttention  # attention and dropout, traced by fx here
    torch.manual_seed(0)
    model = ExportedAttention()
    x = torch.randn(3, 7, 16)
    graph = profiled(model, (x,))
    if not recorded:
        graph.meta.pop("random_ops")
    s = tight(graph)
    sdpa = next(op.id for op in graph.ops if op.kind == "scaled_dot_product_attention")
    assert any(sdpa in st.recompute for st in s.stages)
    compare_schedule(model, s, (x,), graph, steps=2)


# ----------------------------------------------------------------------------------------------
# Forward side effects are never replayed: hooks and buffer counters.
# ----------------------------------------------------------------------------------------------
class CountingBlock(nn.Module):
    """Counts its calls in a buffer (like MoE load statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


class SideEffects(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.hooked = nn.Linear(16, 16)
        self.count = CountingBlock()
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.count(torch.relu(self.hooked(torch.relu(self.a(x))))))


def test_hooks_and_buffer_counters_are_never_recomputed():
    torch.manual_seed(0)
    model = SideEffects()
    calls = []
    model.hooked.register_forward_hook(lambda m, i, o: calls.append(1))
    x = torch.randn(4, 16)
    graph = profiled(model, (x,), leaf_modules=[CountingBlock])
    unsafe = {op.name for op in graph.ops if op.recompute_unsafe}
    assert {"hooked", "count"} <= unsafe, unsafe
    s = tight(graph)
    recomputed = {graph.ops[j].name for st in s.stages for j in st.recompute}
    assert recomputed and not (recomputed & unsafe)
    ref = copy.deepcopy(model)
    wrapped = ScheduleWrapper(model, s, graph=graph, leaf_modules=[CountingBlock])
    calls.clear()
    for seed in range(3):
        out_r, _ = step(ref, (x,), seed)
        out_t, _ = step(wrapped, (x,), seed)
        torch.testing.assert_close(out_t, out_r)
    assert len(calls) == 6  # one per forward, 3 plain + 3 wrapped; none from recomputation
    assert int(model.count.calls) == int(ref.count.calls) == 3
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=n)


def test_schedule_recomputing_a_hooked_module_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    graph = profiled(model, (x,))  # profiled without hooks: every op recomputable
    s = tight(graph)
    model[1].register_forward_hook(lambda m, i, o: None)  # registered after solving
    wrapped = ScheduleWrapper(model, s, graph=graph)
    with pytest.raises(ScheduleError, match="forward hooks"):
        wrapped(x)
    with pytest.raises(ScheduleError, match="forward hooks"):  # refused for good
        wrapped(x)


class ThreeLinear(nn.Module):
    """Linear layers a (16 -> 16), b (16 -> b_out) and c (16 -> 4) for a forward to combine."""

    def __init__(self, b_out: int = 16):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, b_out)
        self.c = nn.Linear(16, 4)


class DataDependent(ThreeLinear):
    def forward(self, x):
        h = torch.tanh(self.a(x))
        top, _ = torch.topk(h, 8, dim=1)
        nz = torch.nonzero(h > 0)
        perm = torch.randperm(h.shape[0])
        g = torch.tanh(self.b(h[perm]))
        return self.c(g) + top.sum(1, keepdim=True) + nz.shape[0] * 0.01


def test_topk_nonzero_randperm_are_unsafe_and_never_recomputed():
    torch.manual_seed(0)
    model = DataDependent()
    x = torch.randn(6, 16)
    graph = profiled(model, (x,), cost="measured", repeat=1)  # nonzero cannot run on meta
    kinds = {op.kind: op for op in graph.ops}
    for k in ("topk", "nonzero", "randperm"):
        assert kinds[k].recompute_unsafe, k
    s = tight(graph)
    assert recomputed_op_count(s) > 0
    assert not any(graph.ops[j].recompute_unsafe for st in s.stages for j in st.recompute)
    compare_schedule(model, s, (x,), graph, steps=2)
    # A hand-edited schedule that recomputes topk is refused before anything runs.
    t = 0
    topk = kinds["topk"].id
    bad = s.__class__(**{**s.__dict__, "stages": tuple(
        StageSchedule(op=st.op, recompute=tuple(sorted(set(st.recompute) | {topk})),
                      drop=st.drop) if i == t else st for i, st in enumerate(s.stages))})
    with pytest.raises(ScheduleError):
        ScheduleWrapper(copy.deepcopy(model), bad, graph=graph)(x)


# ----------------------------------------------------------------------------------------------
# In-place operations at region boundaries.
# ----------------------------------------------------------------------------------------------
class InplaceOnView(ThreeLinear):
    def forward(self, x):
        y = self.a(x)
        y[:, :4].mul_(2.0)
        z = y.view(-1, 4, 4).relu_()
        return self.c(torch.tanh(self.b(z.flatten(1))))


def _assert_plain_under_tight_and_every_other(module_class):
    """A `module_class` model runs as plain PyTorch does (two steps) under the tightest schedule
    and under one keeping every other Value."""
    torch.manual_seed(0)
    model = module_class()
    x = torch.randn(4, 16, requires_grad=True)
    graph = profiled(model, (x,))
    for s in (tight(graph), keep_schedule(graph, every(2), "middle", hold="last_use")):
        compare_schedule(model, s, (x,), graph, steps=2)


def test_inplace_on_a_view():
    _assert_plain_under_tight_and_every_other(InplaceOnView)


def test_instancenorm_then_inplace_relu_at_region_boundaries():
    model = small_cnn(norm=lambda c: nn.InstanceNorm2d(c, affine=True))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    graph = profiled(model, (x,))
    for s in three_schedules(graph).values():
        wrapped = ScheduleWrapper(copy.deepcopy(model), s, graph=graph)
        _, (gx,) = step(wrapped, (x,), 0)
        assert gx is not None and gx.abs().sum() > 0
        compare_schedule(model, s, (x,), graph, steps=1)


# ----------------------------------------------------------------------------------------------
# Double backward, second backward.
# ----------------------------------------------------------------------------------------------
def _penalty_grads(module, params, x):
    g, = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    g.pow(2).sum().backward()
    return [p.grad for p in params]


def test_create_graph_gradient_penalty_works_or_is_a_clear_error():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 1))
    x = torch.randn(4, 8, requires_grad=True)
    graph = profiled(model, (x,))
    ref = copy.deepcopy(model)
    expected = _penalty_grads(ref, list(ref.parameters()), x)
    # Store-all saves everything the ordinary way (NOTE [Where the hooks are]): double backward
    # is exact.
    m = copy.deepcopy(model)
    got = _penalty_grads(ScheduleWrapper(m, store_all_schedule(graph), graph=graph),
                         list(m.parameters()), x)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a)
    # A recomputed activation has no history: a clear error, never a wrong penalty.
    m = copy.deepcopy(model)
    wrapped = ScheduleWrapper(m, tight(graph), graph=graph)
    out = wrapped(x)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    # The documented way out computes the right penalty with the same module and parameters.
    for p in m.parameters():
        p.grad = None
    with wrapped.plain():
        got = _penalty_grads(wrapped, list(m.parameters()), x)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a)


def test_second_backward_store_all_works_tight_is_a_clear_error():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8)
    graph = profiled(model, (x,))
    ref = copy.deepcopy(model)
    loss = ref(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    w = ScheduleWrapper(copy.deepcopy(model), store_all_schedule(graph), graph=graph)
    loss = w(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    for p, q in zip(ref.parameters(), w.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    w = ScheduleWrapper(copy.deepcopy(model), tight(graph), graph=graph)
    loss = w(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


class TwoLosses(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc, self.aux = nn.Linear(8 * 8 * 8, 10), nn.Linear(8 * 8 * 8, 3)

    def forward(self, x):
        h = torch.tanh(self.bn(self.c1(x)))
        h = torch.nn.functional.softplus(self.c2(h)).flatten(1)
        return self.fc(h), self.aux(torch.sigmoid(h))


def test_a_second_backward_needing_a_released_value_says_why_in_the_recomputation_too():
    """Two losses of one forward backwarded one after the other: where the second backward's
    recomputation (not its backward) reads a Value the first released, the message said only
    "(second backward?)" (found by a hunt); it now says why and the ways out, as the backward's."""
    torch.manual_seed(0)
    model = TwoLosses().train()
    x = torch.randn(4, 3, 8, 8).requires_grad_()
    graph = monetlike.profile(model, x, repeat=1)
    w = ScheduleWrapper(copy.deepcopy(model), three_schedules(graph)["middle"], graph=graph)
    a, b = w(x)
    a.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError) as e:
        b.sum().backward()
    msg = str(e.value)
    assert "reads value" in msg and "retain_graph=True" in msg
    assert "run the forward again for each backward" in msg


# ----------------------------------------------------------------------------------------------
# Memory comes back after every step, with the garbage collector off (no reference cycles).
# ----------------------------------------------------------------------------------------------
def _live_after_steps(module, params, x, n):
    """Bytes alive after each step, beyond parameters, buffers and the input."""
    params = list(params)
    opt = torch.optim.SGD(params, lr=0.01)
    tracker = StorageTracker()
    # Known before the window, so an alias of them made during the step (the engine detaches
    # saved parameters when it unpacks them) is not counted as new memory.
    tracker.track_tensors([*params, *module.buffers(), x], "fixed")
    start = tracker.live
    lives = []
    gc.collect()
    gc.disable()
    try:
        with tracker:
            for _ in range(n):
                opt.zero_grad(set_to_none=True)
                loss = module(x).sum()
                loss.backward()
                opt.step()
                lives.append(tracker.live - start)  # `loss` (so the graph's nodes) still alive
    finally:
        gc.enable()
        tracker.close()
    return lives


def test_fifty_steps_gc_disabled_memory_back_to_baseline():
    model = small_cnn(dropout=0.5)
    x = torch.randn(4, 3, 8, 8)
    graph = profiled(model, (x,))
    s = tight(graph)
    wrapped = ScheduleWrapper(model, s, graph=graph)
    ref = copy.deepcopy(model)
    plain = _live_after_steps(ref, ref.parameters(), x, 3)
    lives = _live_after_steps(wrapped, wrapped.parameters(), x, 50)
    assert lives[0] == plain[0], (lives[0], plain[0])  # the gradients, nothing else
    assert all(v == lives[0] for v in lives), sorted(set(lives))


# ----------------------------------------------------------------------------------------------
# The wrapper is the model: parameters, state_dict, eval mode, no_grad.
# ----------------------------------------------------------------------------------------------
def test_state_dict_round_trip_and_shared_parameters(tmp_path):
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8)
    graph = profiled(model, (x,))
    w = ScheduleWrapper(model, tight(graph), graph=graph)
    assert list(w.state_dict().keys()) == list(model.state_dict().keys())
    assert all(p is q for p, q in zip(w.parameters(), model.parameters()))
    assert [n for n, _ in w.named_parameters()] == [n for n, _ in model.named_parameters()]
    torch.save(w.state_dict(), tmp_path / "w.pt")
    other = small_cnn()
    for p in other.parameters():
        p.data.add_(1.0)
    other.load_state_dict(torch.load(tmp_path / "w.pt"))
    for a, b in zip(other.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    fresh = small_cnn()
    for p in fresh.parameters():
        p.data.mul_(0.5)
    w.load_state_dict(fresh.state_dict())
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    # A parent module sees the model's keys under its own prefix.
    parent = nn.Module()
    parent.net = w
    assert list(parent.state_dict().keys()) == ["net." + k for k in model.state_dict()]
    parent.load_state_dict(parent.state_dict())


def test_eval_and_no_grad_run_the_model_plainly():
    model = small_cnn(dropout=0.5)
    x = torch.randn(2, 3, 8, 8)
    graph = profiled(model, (x,))
    w = ScheduleWrapper(model, tight(graph), graph=graph)
    w.eval()
    assert not model.training
    torch.testing.assert_close(w(x), model(x))
    w.train()
    assert model.training
    with torch.no_grad():
        torch.manual_seed(0)
        a = w(x)
        torch.manual_seed(0)
        b = model(x)
    torch.testing.assert_close(a, b)
    assert not w.plans  # nothing was profiled or planned


# ----------------------------------------------------------------------------------------------
# A schedule for another graph never runs.
# ----------------------------------------------------------------------------------------------
def test_other_batch_or_shape_raises_schedule_mismatch():
    model = small_cnn()
    x = torch.randn(4, 3, 8, 8)
    graph = profiled(model, (x,))
    w = ScheduleWrapper(model, tight(graph))  # no graph: the first call profiles the structure
    out = w(x)  # the right shape runs
    out.sum().backward()
    w(torch.randn(2, 3, 8, 8)).sum().backward()  # smaller runs: NOTE [Smaller shapes]
    with pytest.raises(ScheduleMismatchError, match=r"input shape \[8, 3, 8, 8\] is larger"):
        w(torch.randn(8, 3, 8, 8))
    bigger = nn.Sequential(*list(small_cnn())[:-1], nn.Linear(8 * 16 * 16, 10))
    w2 = ScheduleWrapper(bigger, tight(graph))
    with pytest.raises(ScheduleMismatchError, match="input_shapes"):
        w2(torch.randn(4, 3, 16, 16))


def test_dataparallel_cpu_runs_and_replicas_are_refused():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8)
    graph = profiled(model, (x,))
    s = tight(graph)
    compare_step(model, lambda m: nn.DataParallel(ScheduleWrapper(m, s, graph=graph)), (x,))
    w = ScheduleWrapper(model, s, graph=graph)
    w._is_replica = True  # what DataParallel's replicate() sets on GPU replicas
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        w(x)


class CopyIntoNarrow(ThreeLinear):
    """An in-place write through a view, read afterwards only through the base."""

    def __init__(self):
        super().__init__(b_out=8)

    def forward(self, x):
        y = self.a(x) + 1.0  # saves nothing, so the write below is legal for autograd
        y.narrow(1, 0, 8).copy_(torch.sigmoid(self.b(x)))
        y.narrow(1, 8, 8).relu_()  # saves its result: a view of y's storage
        return self.c(torch.tanh(y))


def test_copy_into_a_narrow_view_read_through_the_base():
    _assert_plain_under_tight_and_every_other(CopyIntoNarrow)


def test_keyword_inputs_copy_and_pickle(tmp_path):
    from monetlike.models import two_in_out

    torch.manual_seed(0)
    model = two_in_out(width=8)
    image, vec = torch.randn(2, 3, 8, 8), torch.randn(2, 32)
    graph = profiled(model, (image, vec))
    w = ScheduleWrapper(model, tight(graph), graph=graph)
    ref = copy.deepcopy(model)
    a = ref(image, vec=vec)
    b = w(image, vec=vec)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x)
    w2 = copy.deepcopy(w)  # a copy shares nothing with the original and runs on its own
    assert w2.model is not model
    assert all(p is not q for p, q in zip(w2.parameters(), model.parameters()))
    torch.save(w, tmp_path / "w.pt")
    w3 = torch.load(tmp_path / "w.pt", weights_only=False)
    for module in (w2, w3):
        out = module(image, vec)
        sum(o.sum() for o in out).backward()
        assert all(p.grad is not None for p in module.parameters())


class InplaceResidual(nn.Module):
    """`out.add_(identity)` with the identity branch computed after `out`'s creator: the Op of
    bn2 (bn2, add_, relu_) is not contiguous in the forward, and in the backward the engine runs
    part of it, then the downsample branch, then the rest."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.down = nn.Conv2d(4, 8, 1)
        self.down_bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        identity = self.down_bn(self.down(x))
        out.add_(identity)
        out = torch.relu_(out)
        return self.head(out.mean((2, 3)))


def test_inplace_residual_split_stage():
    torch.manual_seed(0)
    model = InplaceResidual()
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    graph = profiled(model, (x,))
    group = next(op for op in graph.ops if op.name == "bn2")
    assert len(group.nodes) == 3, group.nodes  # bn2, add_, relu_
    for s in three_schedules(graph).values():
        compare_schedule(model, s, (x,), graph, steps=2)


def test_parameters_replaced_after_the_first_call_are_used():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8)
    graph = profiled(model, (x,))
    for s in (store_all_schedule(graph), tight(graph)):
        w = ScheduleWrapper(model, s, graph=graph)
        w(x).sum().backward()  # builds the plan
        fresh = small_cnn()
        for p in fresh.parameters():
            p.data.mul_(-1.0)
        model.load_state_dict(fresh.state_dict(), assign=True)  # new Parameter objects
        torch.manual_seed(0)
        out = w(x)
        out.sum().backward()
        torch.manual_seed(0)
        torch.testing.assert_close(out, fresh(x))
        assert all(p.grad is not None for p in model.parameters())


def test_a_graph_of_another_model_is_named_as_a_possible_cause():
    """The wrapper given the graph of another model with the same inputs: the message blamed
    only leaf_modules and forward hooks (found by a hunt)."""
    from collections import OrderedDict

    x = torch.randn(4, 16)
    first = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    other = nn.Sequential(OrderedDict(a=nn.Linear(16, 16), b=nn.Tanh(), c=nn.Linear(16, 4)))
    graph = monetlike.profile(first, x, repeat=1)
    w = ScheduleWrapper(other, store_all_schedule(graph), graph=graph)
    with pytest.raises(ScheduleError, match="the graph was profiled from another model"):
        w(x)
