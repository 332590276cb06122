"""In-place Impls (monetlike/impls/inplace.py) on the torch side: where the profiler offers them,
exact gradients through the runtime (forward and recomputation in place), the bytes their backward
holds, and a small residual CNN end to end on measured costs.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monetlike
import solver
from solver.simulate import simulate, store_all_schedule
from runtime_support import (PEAK_TOLERANCE, impl_schedules, measured_peak, profiled_case,
                             weighted_step)
from test_impls import assert_same, bytes_held, held_by_op

A100 = "analytical:A100-40GB"


pytestmark = pytest.mark.usefixtures("one_thread")


class ConvBnAct(nn.Module):
    """conv -> BN -> activation written out of place -> conv. BN saves its input, not its
    output, so the activation may overwrite the BN output."""

    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.act = act
        self.out = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.out(self.act(self.bn(self.conv(x))))


class Residual(nn.Module):
    """Two residual forms: `bn(conv(h)) + h` (the left operand is overwritten, ResNet's main
    path) and `h + bn(conv(h))` (the right one: MobileNetV2's `x + self.conv(x)`), with h read
    by the conv before the add, so only the BN output may be overwritten."""

    def __init__(self, rhs: bool, fn=None):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.rhs, self.fn = rhs, fn

    def forward(self, x):
        h = self.stem(x)
        b = self.bn(self.conv(h))
        if self.fn is not None:
            s = self.fn(b, h)
        else:
            s = h + b if self.rhs else b + h
        return self.head(s)


def torch_relu(x):
    return torch.relu(x)


def f_relu(x):
    return F.relu(x)


def method_relu(x):
    return x.relu()


def torch_sigmoid(x):
    return torch.sigmoid(x)


def method_tanh(x):
    return x.tanh()


def torch_add(b, h):
    return torch.add(b, h)


X = (2, 3, 8, 8)
CASES = {
    "relu_module": (lambda: ConvBnAct(nn.ReLU()), "relu_inplace"),
    "relu_torch": (lambda: ConvBnAct(torch_relu), "relu_inplace"),
    "relu_functional": (lambda: ConvBnAct(f_relu), "relu_inplace"),
    "relu_method": (lambda: ConvBnAct(method_relu), "relu_inplace"),
    "sigmoid_module": (lambda: ConvBnAct(nn.Sigmoid()), "sigmoid_inplace"),
    "sigmoid_torch": (lambda: ConvBnAct(torch_sigmoid), "sigmoid_inplace"),
    "tanh_method": (lambda: ConvBnAct(method_tanh), "sigmoid_inplace"),
    "add_lhs": (lambda: Residual(rhs=False), "add_inplace"),
    "add_rhs": (lambda: Residual(rhs=True), "add_inplace_rhs"),
    "add_torch": (lambda: Residual(rhs=False, fn=torch_add), "add_inplace"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inplace_exact_through_runtime(case):
    factory, name = CASES[case]
    model, x, graph = profiled_case(factory, X, A100)
    picked, schedules = impl_schedules(graph, name)
    assert len(picked) == 1, f"{name} was not offered on {case}"
    j = picked[0]
    recomputed = [t for t, st in enumerate(schedules[1].stages) if j in st.recompute]
    assert recomputed, "keep-nothing must recompute the in-place op"
    for s in schedules:
        assert s.impl[j] != 0  # not reverted: the schedule may run it
        ref_model = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(copy.deepcopy(model), s)
        wrapped.load_state_dict(ref_model.state_dict())
        for seed in (1, 2):  # two steps: BN running statistics stay in step
            assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


@pytest.mark.parametrize("net, name, adds", [("mobilenet_v2", "add_inplace_rhs", 10),
                                             ("transformer", "add_inplace_rhs", 4),
                                             ("resnet18", "add_inplace", 8)])
def test_zoo_models_with_every_residual_add_in_place_are_exact(net, name, adds):
    """Residual adds of real models, all of them in place at once, under keep-nothing (every add
    recomputed in place, dropout recomputed under the replayed RNG; store-all is covered on the
    small modules above). MobileNetV2's `x + self.conv(x)` and the transformer's
    `x + self.attn(...)` overwrite the branch output (x is read by the branch first); ResNet's
    `out += identity; relu(out)` traces as an add followed by an in-place ReLU (one Op) and
    overwrites `out`, the last BatchNorm's output."""
    import torchvision

    from monetlike.models import transformer

    torch.manual_seed(0)
    model, x = {
        "mobilenet_v2": lambda: (torchvision.models.mobilenet_v2(num_classes=10), (2, 3, 32, 32)),
        "transformer": lambda: (transformer(depth=2, dim=32, heads=4), (2, 8, 32)),
        "resnet18": lambda: (torchvision.models.resnet18(num_classes=10), (2, 3, 32, 32)),
    }[net]()
    model.train()
    x = torch.randn(*x).requires_grad_()
    graph = monetlike.profile(model, x, cost=A100)
    picked, schedules = impl_schedules(graph, name)
    assert len(picked) == adds and all(graph.ops[j].kind == "add" for j in picked)
    assert any(j in st.recompute for st in schedules[1].stages for j in picked)
    for s in schedules[1:]:
        ref_model = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(copy.deepcopy(model), s)
        wrapped.load_state_dict(ref_model.state_dict())
        for seed in (1, 2):
            assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


def test_inplace_forward_and_recomputation_are_what_the_simulator_counts():
    # The in-place op's forward point is lower by its output's bytes, and the runtime measures
    # the simulator's peak (store-all and keep-nothing).
    torch.manual_seed(0)
    model = ConvBnAct(nn.ReLU()).train()
    x = torch.randn(4, 3, 16, 16)
    g = monetlike.profile(model, x, repeat=1)  # this CPU's: its allocator is what is measured
    relu = next(o for o in g.ops if o.kind == "ReLU")
    k = next(i for i, im in enumerate(relu.impls) if im.name == "relu_inplace")
    y = g.values[relu.outputs[0]].bytes
    points = {}
    for impl in (0, k):
        s = store_all_schedule(g, tuple(impl if o.id == relu.id else 0 for o in g.ops))
        tl = simulate(g, s)
        points[impl] = next(p.bytes for p in tl.points if p.phase == "forward" and p.op == relu.id)
    assert points[0] - points[k] == y
    _, schedules = impl_schedules(g, "relu_inplace")
    for s in schedules:
        wrapped = monetlike.ScheduleWrapper(model, s, graph=g)
        measured = measured_peak(g, model, wrapped, x)
        assert abs(measured - s.predicted_peak_bytes) <= PEAK_TOLERANCE * s.predicted_peak_bytes, \
            (measured, s.predicted_peak_bytes)


@pytest.mark.parametrize("case, name, per_element", [
    ("relu_module", "relu_inplace", 4),  # the result, fp32
    ("sigmoid_module", "sigmoid_inplace", 4),
    ("add_lhs", "add_inplace", 0),  # add's backward reads nothing
    ("add_rhs", "add_inplace_rhs", 0),
])
def test_declared_bytes_inplace(case, name, per_element):
    torch.manual_seed(0)
    model = CASES[case][0]().train()
    x = torch.randn(*X)
    g = monetlike.profile(model, x, cost=A100)
    op = next(o for o in g.ops if any(im.name == name for im in o.impls))
    k = next(i for i, im in enumerate(op.impls) if im.name == name)
    im = op.impls[k]
    n = 2 * 4 * 8 * 8
    assert im.saved == op.impls[0].saved and im.internal_bytes == 0
    assert held_by_op(g, op, k) == per_element * n
    # What autograd holds for the in-place kernels (the pre-activation t*1 is not saved by *):
    z = torch.randn(2, 4, 8, 8, requires_grad=True)
    other = torch.randn(2, 4, 8, 8, requires_grad=True)
    held = {"relu_inplace": lambda t: torch.relu_(t * 1),
            "sigmoid_inplace": lambda t: torch.sigmoid_(t * 1),
            "add_inplace": lambda t: (t * 1).add_(other),
            "add_inplace_rhs": lambda t: (other * 1).add_(t)}[name]
    assert bytes_held(held, z, fixed=(other,)) == per_element * n
    # The Impl's value is the Value it overwrites: the BN output, the activation's input.
    assert im.overwrites in op.inputs and g.ops[g.values[im.overwrites].producer].kind \
        == "BatchNorm2d"


class NotOffered(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 1)
        self.form = form

    def forward(self, x):
        c = self.conv(x)
        if self.form == "read_later":  # c is read after the ReLU
            return torch.relu(c) * c
        if self.form == "saved_by_conv":  # conv2 saves c (its input) before the ReLU reads it
            return self.conv2(c) + torch.relu(c)
        if self.form == "graph_input":
            return self.conv(torch.relu(x))
        if self.form == "model_output":
            return c, torch.relu(c)
        if self.form == "broadcast_add":  # the output is larger than the left operand
            return c.sum(dim=1, keepdim=True) * 1 + c
        if self.form == "read_by_own_later_node":  # the add's Op is [add, add_]: add_ reads c
            s = c + self.conv2(c)
            return s.add_(c)
        raise ValueError(self.form)


@pytest.mark.parametrize("form", ["read_later", "saved_by_conv", "graph_input", "model_output",
                                  "broadcast_add", "read_by_own_later_node"])
def test_profiler_offers_no_inplace_impl_where_it_would_be_wrong(form):
    torch.manual_seed(0)
    g = monetlike.profile(NotOffered(form).train(), torch.randn(*X), cost=A100)
    inplace = [(o.name, im.name) for o in g.ops for im in o.impls if im.overwrites is not None]
    if form in ("broadcast_add", "read_by_own_later_node"):  # the right operand is fine
        assert [n for _, n in inplace] == ["add_inplace_rhs"]
    elif form == "saved_by_conv":  # not the ReLU; the add may overwrite conv2's output
        assert [n for _, n in inplace] == ["add_inplace"]
    else:
        assert inplace == []


class FrozenStemResNet(nn.Module):
    """A frozen stem (its parameters do not train, the input needs no gradient: its ops have no
    backward) of Conv-ReLU at full resolution, the ReLU written out of place, strided down to a
    small trainable part of Conv-BN-ReLU blocks with out-of-place residual adds
    (`bn(conv(h)) + h`). The stem's ReLU forward point (conv output + ReLU output) is the
    largest point of the step, so only running it in place lowers the least feasible peak. (With
    a BatchNorm in the stem, the BN's own point, input + output, would bind instead: in a
    trainable chain the backward stages, which hold an activation, its gradient and the
    gradient being made, are larger than any out-of-place forward point, so there the in-place
    Impls are offered but do not lower the peak.)"""

    def __init__(self, width=8, blocks=2):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        for p in self.stem.parameters():
            p.requires_grad_(False)
        self.down = nn.Conv2d(16, width, 3, stride=4, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in range(blocks))
        self.bns = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.down(torch.relu(self.stem(x)))
        for conv, bn in zip(self.convs, self.bns):
            h = torch.relu(bn(conv(h)) + h)
        return self.head(h.mean(dim=(2, 3)))


def _step(module, x, seed):
    """One step without an input gradient (the stem has no backward)."""
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = module(x)
    (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters() if p.requires_grad]
    return out.detach(), torch.zeros(()), grads, [b.clone() for b in module.buffers()]


def test_end_to_end_full_mode_picks_inplace_impls():
    torch.manual_seed(0)
    model = FrozenStemResNet().train()
    x = torch.randn(4, 3, 32, 32)
    # The structure on an analytical graph (tensors only; this CPU's kernel scratch moves the
    # binding point elsewhere), the run on this CPU's own measured graph (same fingerprint).
    schedules = []
    for g in (monetlike.profile(model, x, cost=A100), monetlike.profile(model, x, repeat=3)):
        offered = {im.name for o in g.ops for im in o.impls if im.overwrites is not None}
        assert offered == {"relu_inplace", "add_inplace"}
        stem_relu = next(o for o in g.ops if o.kind == "relu" and not o.has_backward)
        low_ckpt = solver.min_budget(g, "checkpoint", time_limit_s=30)
        low_full = solver.min_budget(g, "full", time_limit_s=30)
        if g.cost_provenance.startswith("analytical"):
            # Checkpoint mode's least peak is the stem ReLU's point, conv output + ReLU output
            # (4 x 16 x 32 x 32 x 4 bytes each); in place it holds one of them, another binds.
            y = g.values[stem_relu.outputs[0]].bytes
            assert y == 4 * 16 * 32 * 32 * 4
            default = simulate(g, store_all_schedule(g))
            assert low_ckpt == next(p.bytes for p in default.points if p.op == stem_relu.id)
            assert low_full <= low_ckpt - y // 2
            s = solver.solve(g, low_full, mode="full", time_limit_s=30).schedule
            assert g.ops[stem_relu.id].impls[s.impl[stem_relu.id]].name == "relu_inplace"
            schedules.append((s, None))
    # The analytical plan's budget is an A100's: on this CPU's graph its decisions peak higher,
    # and the gate refuses it as it is; it runs here re-budgeted at the peak it has here.
    here = simulate(g, schedules[0][0]).peak_bytes
    schedules[0] = (dataclasses.replace(schedules[0][0], budget_bytes=here,
                                        predicted_peak_bytes=None), None)
    # On the measured graph which Impl binds (and whether the in-place ReLU is worth its
    # measured time) depends on this CPU: the solved plans fit their budget and run exactly.
    schedules += [(solver.solve(g, b, mode="full", time_limit_s=30).schedule, b)
                  for b in (low_full, (low_full + low_ckpt) // 2)]
    for s, budget in schedules:
        picked = {g.ops[j].impls[k].name for j, k in enumerate(s.impl) if k}
        predicted = simulate(g, s).peak_bytes
        assert budget is None or predicted <= budget
        ref = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(model, s, graph=g)
        for seed in (5, 6):
            assert_same(_step(ref, x, seed), _step(wrapped, x, seed))

        measured = measured_peak(g, model, wrapped, x)
        assert abs(measured - predicted) <= PEAK_TOLERANCE * predicted, (picked, measured,
                                                                          predicted)
