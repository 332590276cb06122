"""Operator implementations (monetlike.impls): exact results, declared bytes, end-to-end runs.

Each Impl must give outputs bitwise equal to plain PyTorch and gradients equal to it (they come
out bitwise equal here), and hold between forward and backward exactly the bytes the profiler
declares for it: the saved Values plus `internal_bytes`, checked against hand-derived numbers on
tiny modules.
"""

from __future__ import annotations

import copy
import math
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn as nn
import torch.nn.functional as F

import monetlike
import solver
from monetlike.impls import names
from solver.backends import available as available_backends
from solver.schedule import Schedule
from solver.simulate import simulate, store_all_schedule, with_predictions
from runtime_support import (PEAK_TOLERANCE, impl_schedules, measured_peak, profiled_impl_case,
                             weighted_step)

A100 = "analytical:A100-40GB"


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# Tiny modules, one per form an Impl must recognise
# ----------------------------------------------------------------------------------------------
class ConvAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = act

    def forward(self, x):
        return self.act(self.conv(x))


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.conv(x)) * 2


def relu_method(x):
    return x.relu()


def relu_method_(x):
    return x.relu_()


def relu_inplace_kw(x):
    return F.relu(x, inplace=True)


class ConvBnRelu(nn.Module):
    def __init__(self, inplace=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=inplace)
        with torch.no_grad():
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class ConvBnAct(nn.Module):
    """Conv-BN-activation, MobileNetV2's block (torchvision: ReLU6(inplace=True))."""

    def __init__(self, act, affine=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, affine=affine)
        self.act = act
        if affine:
            with torch.no_grad():
                # Wide enough that the BN output crosses both bounds of ReLU6 and hardtanh(-1, 1).
                self.bn.weight.uniform_(2.0, 4.0)
                self.bn.bias.uniform_(1.0, 2.0)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class FnBnAct(ConvBnAct):
    """The same with the activation as a function call."""

    def __init__(self, fn):
        super().__init__(None)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.bn(self.conv(x)))


def relu6_inplace_kw(x):
    return F.relu6(x, inplace=True)


def hardtanh_inplace_pos(x):
    return F.hardtanh(x, -0.5, 0.75, True)


def hardtanh_underscore(x):
    return F.hardtanh_(x, -1.0, 2.0)


def hardtanh_out(x):
    return F.hardtanh(x, min_val=-0.25, max_val=0.5)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.a(x)
        return self.relu(self.b(y) + y)


class Pool(nn.Module):
    def __init__(self, pool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = pool

    def forward(self, x):
        return self.pool(self.conv(x)) * 2


class FnPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return F.max_pool2d(self.conv(x), 3, 2, 1) * 2


class Drop(nn.Module):
    def __init__(self, functional=False):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.functional = functional

    def forward(self, x):
        h = self.fc(x)
        h = F.dropout(h, 0.3, self.training) if self.functional else self.drop(h)
        return h * 2


X_IMG = (2, 3, 8, 8)
CASES = {
    "relu_module": (lambda: ConvAct(nn.ReLU()), X_IMG, "relu_mask"),
    "relu_module_inplace": (lambda: ConvAct(nn.ReLU(inplace=True)), X_IMG, "relu_mask"),
    "relu_function": (lambda: Fn(F.relu), X_IMG, "relu_mask"),
    "relu_function_inplace": (lambda: Fn(relu_inplace_kw), X_IMG, "relu_mask"),
    "relu_torch_": (lambda: Fn(torch.relu_), X_IMG, "relu_mask"),
    "relu_method": (lambda: Fn(relu_method), X_IMG, "relu_mask"),
    "relu_method_": (lambda: Fn(relu_method_), X_IMG, "relu_mask"),
    "bn_relu_mask": (lambda: ConvBnRelu(), X_IMG, "relu_mask"),
    "bn_relu_lean": (lambda: ConvBnRelu(), X_IMG, "bn_relu_lean"),
    "add_relu_mask": (lambda: Residual(), (2, 4, 8, 8), "relu_mask"),
    "relu6_module": (lambda: ConvAct(nn.ReLU6()), X_IMG, "hardtanh_mask"),
    "relu6_module_inplace": (lambda: ConvAct(nn.ReLU6(inplace=True)), X_IMG, "hardtanh_mask"),
    "hardtanh_module_inplace": (lambda: ConvAct(nn.Hardtanh(-0.5, 0.25, inplace=True)), X_IMG,
                                "hardtanh_mask"),
    "relu6_function": (lambda: Fn(F.relu6), X_IMG, "hardtanh_mask"),
    "relu6_function_inplace": (lambda: Fn(relu6_inplace_kw), X_IMG, "hardtanh_mask"),
    "hardtanh_function_inplace": (lambda: Fn(hardtanh_inplace_pos), X_IMG, "hardtanh_mask"),
    "hardtanh_underscore": (lambda: Fn(hardtanh_underscore), X_IMG, "hardtanh_mask"),
    "hardtanh_function": (lambda: Fn(hardtanh_out), X_IMG, "hardtanh_mask"),
    "bn_relu6_mask": (lambda: ConvBnAct(nn.ReLU6(inplace=True)), X_IMG, "hardtanh_mask"),
    "bn_relu6_lean": (lambda: ConvBnAct(nn.ReLU6(inplace=True)), X_IMG, "bn_hardtanh_lean"),
    "bn_hardtanh_lean": (lambda: ConvBnAct(nn.Hardtanh(-1.0, 1.0, inplace=True)), X_IMG,
                         "bn_hardtanh_lean"),
    "bn_hardtanh_lean_no_affine": (lambda: ConvBnAct(nn.Hardtanh(-0.5, 0.5, inplace=True),
                                                     affine=False), X_IMG, "bn_hardtanh_lean"),
    "bn_relu6_function_lean": (lambda: FnBnAct(relu6_inplace_kw), X_IMG, "bn_hardtanh_lean"),
    "bn_hardtanh_function_lean": (lambda: FnBnAct(hardtanh_inplace_pos), X_IMG,
                                  "bn_hardtanh_lean"),
    "maxpool_module": (lambda: Pool(nn.MaxPool2d(2)), X_IMG, "maxpool_compact"),
    "maxpool_padded_dilated": (lambda: Pool(nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True)),
                               (2, 3, 11, 9), "maxpool_compact"),
    "maxpool_function": (lambda: FnPool(), (2, 3, 7, 9), "maxpool_compact"),
    "dropout_module": (lambda: Drop(), (8, 16), "dropout_regen"),
    "dropout_function": (lambda: Drop(functional=True), (8, 16), "dropout_regen"),
}


def _with_impl(graph, name: str) -> tuple[Schedule, list[int]]:
    """Store-all schedule with Impl `name` on every Op that has it."""
    impl, picked = [], []
    for op in graph.ops:
        k = next((i for i, im in enumerate(op.impls) if im.name == name), 0)
        impl.append(k)
        if k:
            picked.append(op.id)
    base = store_all_schedule(graph)
    s = Schedule(fingerprint=base.fingerprint, graph_summary=base.graph_summary,
                 impl=tuple(impl), forward_keep=base.forward_keep, stages=base.stages,
                 mode="full", created_by="tests:impl", cost_provenance=graph.cost_provenance)
    return with_predictions(graph, s), picked


def assert_same(a, b):
    out_a, gx_a, gp_a, buf_a = a
    out_b, gx_b, gp_b, buf_b = b
    assert torch.equal(out_a, out_b)  # forward: bitwise
    torch.testing.assert_close(gx_b, gx_a, rtol=0, atol=0)
    for p, q in zip(gp_a, gp_b):
        torch.testing.assert_close(q, p, rtol=0, atol=0)
    for p, q in zip(buf_a, buf_b):  # running stats updated exactly once
        assert torch.equal(p, q)


@pytest.mark.parametrize("case", list(CASES))
def test_impl_exact_through_runtime(case):
    model, x, graph, name = profiled_impl_case(CASES, case, A100)
    schedule, picked = _with_impl(graph, name)
    assert picked, f"{name} did not apply to {case}"
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule)
    for seed in (1, 2):  # two steps: running statistics stay in step
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


@pytest.mark.parametrize("name", ["hardtanh_mask", "bn_hardtanh_lean"])
def test_torchvision_mobilenet_v2_exact(name):
    """The real model: every one of its 35 [BatchNorm, ReLU6_] Ops runs the Impl, bitwise."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10).train()
    x = torch.randn(2, 3, 64, 64).requires_grad_()
    graph = monetlike.profile(model, x, cost=A100)
    schedule, picked = _with_impl(graph, name)
    assert len(picked) == 35 and all(graph.ops[j].kind == "BatchNorm2d" for j in picked)
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule)
    for seed in (1, 2):
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


def bytes_held(fn, x, fixed=()) -> int:
    """Bytes the backward holds after the forward, by the saved-tensor accounting: unique
    storages of the tensors autograd saved, except the leaf input and the module's parameters
    and buffers (fixed memory). Saved tensors that alias each other count once."""
    held: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        held.setdefault(s._cdata, int(s.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    skip = {t.untyped_storage()._cdata for t in (x, *fixed)}
    del y
    return sum(n for k, n in held.items() if k not in skip)


def held_by_op(graph, op, k) -> int:
    im = op.impls[k]
    return im.internal_bytes + sum(graph.values[v].bytes for v in im.saved
                                   if graph.values[v].producer is not None)


def test_declared_bytes_relu_mask():
    torch.manual_seed(0)
    model = ConvAct(nn.ReLU()).train()
    x = torch.randn(*X_IMG)
    g = monetlike.profile(model, x, cost=A100)
    relu = next(o for o in g.ops if o.kind == "ReLU")
    default, mask, inplace = relu.impls  # relu_inplace: tests/test_impls_inplace.py
    assert mask.name == "relu_mask" and inplace.name == "relu_inplace"
    n = 2 * 4 * 8 * 8
    assert default.saved == relu.outputs and default.internal_bytes == 0
    assert mask.saved == () and mask.internal_bytes == n // 8  # 1 bit per element
    from monetlike.impls.relu import RELU, ActMask

    z = torch.randn(2, 4, 8, 8, requires_grad=True)
    assert bytes_held(lambda t: torch.relu(t * 1), z) == 4 * n  # the output; t*1 is not saved
    assert bytes_held(lambda t: ActMask.apply(t * 1, RELU, False), z) == n // 8
    assert held_by_op(g, relu, 0) == 4 * n and held_by_op(g, relu, 1) == n // 8


@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU6()], ids=["relu_mask", "hardtanh_mask"])
def test_mask_impl_figures_do_not_depend_on_what_ran_before(act):
    """The packed masks' tables are made once per process: made inside the first profile's
    measured step, they counted in its mask Impl's stage (a fuzzed ReLU: 43,008 B against 6,080
    in every later profile). Now made ahead of it (ImplSpec.warm)."""
    from monetlike.impls import bitmask

    torch.manual_seed(0)
    model, x = ConvAct(act).train(), torch.randn(*X_IMG)

    def mask_impl():
        graph = monetlike.profile(model, x, repeat=1)
        return next(im for op in graph.ops for im in op.impls if im.name.endswith("_mask"))

    def memory(im):  # every figure but the measured times
        return {k: v for k, v in dataclasses.asdict(im).items() if not k.endswith("_time")}

    bitmask.forget_tables()  # as in a fresh process
    first = memory(mask_impl())
    assert ("keep", "cpu") in bitmask.tables_made(), \
        "the profile used no keep table: the test no longer tests the tables"
    assert memory(mask_impl()) == first


@pytest.mark.parametrize("family", ["relu", "relu6"])
def test_declared_bytes_bn_act(family):
    from monetlike.impls.hardtanh import Hardtanh
    from monetlike.impls.relu import RELU, BnActLean

    act, plain, lean_act = {
        "relu": (nn.ReLU(inplace=True), torch.relu_, RELU),
        "relu6": (nn.ReLU6(inplace=True), lambda t: F.relu6(t, inplace=True), Hardtanh(0.0, 6.0)),
    }[family]
    torch.manual_seed(0)
    model = ConvBnAct(act).train()
    g = monetlike.profile(model, torch.randn(*X_IMG), cost=A100)
    conv, bn = g.ops[0], g.ops[1]
    names_ = {"relu": ["default", "relu_mask", "bn_relu_lean"],
              "relu6": ["default", "hardtanh_mask", "bn_hardtanh_lean"]}[family]
    assert [i.name for i in bn.impls] == names_
    n, c = 2 * 4 * 8 * 8, 4
    default, mask, lean = bn.impls
    if family == "relu":  # in-place ReLU saves its output: the BN output Value
        assert set(default.saved) == set(conv.outputs) | set(bn.outputs)
        assert default.internal_bytes == 2 * c * 4  # save_mean, save_invstd
    else:  # in-place ReLU6 saves a clone of its input (4 bytes per element): internal, held
        # to the backward whatever the schedule says; the BN output Value is not saved
        assert default.saved == conv.outputs
        assert default.internal_bytes == 2 * c * 4 + 4 * n
    assert mask.saved == conv.outputs and mask.internal_bytes == 2 * c * 4 + n // 8
    assert lean.saved == conv.outputs and lean.internal_bytes == 0
    assert lean.bwd_time > default.bwd_time  # it recomputes the pre-activation

    bn_mod = nn.BatchNorm2d(4)
    fixed = [*bn_mod.parameters(), *bn_mod.buffers()]
    z = torch.randn(2, 4, 8, 8, requires_grad=True)
    # Plain: BN input (t*1), the activation's output or clone, statistics. Lean: the BN input.
    assert bytes_held(lambda t: plain(bn_mod(t * 1)), z, fixed) == 4 * n + 4 * n + 2 * c * 4
    assert bytes_held(lambda t: BnActLean.apply(t * 1, bn_mod.weight, bn_mod.bias, bn_mod,
                                                 lean_act), z, fixed) == 4 * n
    assert held_by_op(g, bn, 0) == 4 * n + 4 * n + 2 * c * 4
    assert held_by_op(g, bn, 1) == 4 * n + 2 * c * 4 + n // 8
    assert held_by_op(g, bn, 2) == 4 * n


def test_declared_bytes_hardtanh_mask():
    from monetlike.impls.hardtanh import Hardtanh
    from monetlike.impls.relu import ActMask

    n = 2 * 4 * 8 * 8
    z = torch.randn(2, 4, 8, 8, requires_grad=True)
    relu6 = Hardtanh(0.0, 6.0)
    # Out of place the default holds its input Value; in place, autograd's clone of the input
    # (it is about to be overwritten), a storage of no Value: internal. The mask: 1 bit each.
    assert bytes_held(lambda t: F.relu6(t * 1), z) == 4 * n
    assert bytes_held(lambda t: F.relu6(t * 1, inplace=True), z) == 4 * n
    assert bytes_held(lambda t: ActMask.apply(t * 1, relu6, False), z) == n // 8
    assert bytes_held(lambda t: ActMask.apply(t * 1, relu6, True), z) == n // 8
    for inplace in (False, True):
        torch.manual_seed(0)
        model = ConvAct(nn.ReLU6(inplace=inplace)).train()
        g = monetlike.profile(model, torch.randn(*X_IMG), cost=A100)
        op = g.ops[-1]
        # In place, the Op is [conv, relu6_]: the convolution's split Impls apply to it too.
        assert [i.name for i in op.impls] == (
            ["default", "hardtanh_mask", "conv_split", "conv_split_mask"] if inplace
            else ["default", "hardtanh_mask"])
        default, mask = op.impls[:2]
        if inplace:  # one Op [conv, relu6_]: the clone is internal, nothing is a saved Value
            assert len(g.ops) == 1 and default.saved == () and default.internal_bytes == 4 * n
        else:  # its own Op: the conv output Value is saved
            assert default.saved == g.ops[0].outputs and default.internal_bytes == 0
        assert mask.saved == () and mask.internal_bytes == n // 8
        assert held_by_op(g, op, 0) == 4 * n and held_by_op(g, op, 1) == n // 8


def _same_as_default(x, grad, default, impl):
    """Run `default` and `impl` on x (x[0] is NaN) and backpropagate `grad`: outputs equal (NaN
    where NaN) and input gradients bitwise equal; returns the Impl's input gradient."""
    results = []
    for fn in (default, impl):
        leaf = x.clone().requires_grad_()
        y = fn(leaf * 1)
        y.backward(grad)
        results.append((y.detach(), leaf.grad))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0.nan_to_num(), y1.nan_to_num()) and y1.isnan().tolist()[0]
    assert torch.equal(g0, g1)
    return g1


@pytest.mark.parametrize("inplace", [False, True])
def test_hardtanh_mask_at_the_bounds_and_nan(inplace):
    """The mask is hardtanh_backward's condition exactly: zero gradient at and beyond both bounds,
    the gradient through for a NaN input (as the default gives; `lo < out < hi` would zero it)."""
    from monetlike.impls.hardtanh import Hardtanh
    from monetlike.impls.relu import ActMask

    lo, hi = -1.0, 2.0
    x = torch.tensor([float("nan"), -float("inf"), -3.0, lo, -0.5, 0.0, 1.5, hi, 5.0,
                      float("inf")])
    grad = torch.linspace(1.0, 2.0, x.numel())
    g1 = _same_as_default(x, grad, lambda t: F.hardtanh(t, lo, hi, inplace),
                          lambda t: ActMask.apply(t, Hardtanh(lo, hi), inplace))
    assert g1.tolist() == [grad[0].item(), 0, 0, 0, grad[4].item(), grad[5].item(),
                           grad[6].item(), 0, 0, 0]


def _near(bounds) -> list[float]:
    """Floats at, beside (one ulp either way) and between the bounds, and the special ones."""
    out = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.0]
    for b in bounds:
        t = torch.tensor(b, dtype=torch.float32)
        out += [b, torch.nextafter(t, torch.tensor(math.inf)).item(),
                torch.nextafter(t, torch.tensor(-math.inf)).item()]
    return out


BOUNDS = [(0.0, 6.0), (-1.0, 1.0), (-2.5, 0.5), (0.25, 0.25000003), (1e-40, 2e-40), (-3.0, -3.0),
          (0, 6), (-math.inf, 2.0), (0.0, math.inf)]


def _check_masks(xs, lo, hi, dtype):
    from monetlike.impls.hardtanh import Hardtanh
    from monetlike.impls.relu import RELU

    x = torch.tensor(xs, dtype=torch.float32).to(dtype)
    y = F.hardtanh(x, lo, hi)
    assert torch.equal(Hardtanh(lo, hi).mask(y), (x <= lo) | (x >= hi)), (lo, hi, x, y)
    r = torch.relu(x)
    assert torch.equal(RELU.mask(r), r <= 0), (x, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lo,hi", BOUNDS)
def test_activation_masks_are_the_default_backward_s_condition(lo, hi, dtype):
    """Each mask is where the default backward zeroes the gradient, element for element, on
    values at, one ulp beside and between the bounds, NaN, infinities, subnormals and -0.0:
    threshold_backward's `out <= 0` for ReLU, hardtanh_backward's `in <= lo || in >= hi`."""
    _check_masks(_near((lo, hi)), lo, hi, dtype)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(xs=st.lists(st.floats(width=32), min_size=1, max_size=40),
       bounds=st.sampled_from(BOUNDS),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_activation_masks_on_any_floats(xs, bounds, dtype):
    _check_masks(xs, *bounds, dtype)


@pytest.mark.parametrize("inplace", [False, True])
def test_relu_impls_at_zero_and_nan(inplace):
    """relu_mask and bn_relu_lean zero the gradient exactly where threshold_backward does
    (`out <= 0`), so a NaN output passes its gradient as in plain PyTorch (`out > 0` would zero
    it), and the gradient at 0 is 0."""
    from monetlike.impls.relu import RELU, ActMask, BnActLean

    x = torch.tensor([float("nan"), -float("inf"), -2.0, -0.0, 0.0, 1e-30, 3.0, float("inf")])
    grad = torch.linspace(1.0, 2.0, x.numel())
    g1 = _same_as_default(x, grad, lambda t: F.relu(t, inplace),
                          lambda t: ActMask.apply(t, RELU, inplace))
    assert g1.tolist() == [grad[0].item(), 0, 0, 0, 0, grad[5].item(), grad[6].item(),
                           grad[7].item()]
    # BN + in-place ReLU with a NaN in one channel: the lean backward recomputes the
    # pre-activation and tests it as the default tests the output.
    bn = nn.BatchNorm1d(2).train()
    z = torch.tensor([[float("nan"), 1.0], [0.5, -1.0], [2.0, 3.0]])
    out = []
    for lean in (False, True):
        m = copy.deepcopy(bn)
        leaf = z.clone().requires_grad_()
        y = (BnActLean.apply(leaf, m.weight, m.bias, m, RELU) if lean
             else F.relu(m(leaf), inplace=True))
        y.backward(torch.ones_like(y))
        out.append((leaf.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("grad_kind", ["contiguous", "transposed", "expanded"])
@pytest.mark.parametrize("act", ["relu", "hardtanh"])
@pytest.mark.parametrize("min_slice", [8, None])
def test_mask_impls_give_the_default_s_gradient_layout(grad_kind, act, min_slice):
    """The input gradient of relu_mask and hardtanh_mask has the strides of the default's (an
    elementwise kernel of the gradient and the saved output decides them), and the same bits.
    With a contiguous one where the default's was transposed (the gradient of a sum is expanded:
    the output's layout wins), a transposed Linear's split backward copied it: 2,048 B over the
    prediction (tests/test_fuzz_models.py). Sliced (min_slice 8) and whole."""
    from unittest import mock

    from monetlike.impls import bitmask
    from monetlike.impls.hardtanh import Hardtanh
    from monetlike.impls.relu import RELU, ActMask

    torch.manual_seed(0)
    base = torch.randn(4, 16, 8)
    grad = {"contiguous": torch.randn(4, 8, 16),
            "transposed": torch.randn(4, 16, 8).transpose(1, 2),
            "expanded": torch.ones(()).expand(4, 8, 16)}[grad_kind]
    fn, impl = ((lambda t: F.relu(t)), RELU) if act == "relu" else \
        ((lambda t: F.hardtanh(t, -0.5, 0.5)), Hardtanh(-0.5, 0.5))
    got = []
    with mock.patch.object(bitmask, "MIN_SLICE", min_slice or bitmask.MIN_SLICE):
        for masked in (False, True):
            x = base.clone().requires_grad_()
            y = ActMask.apply(x.transpose(1, 2), impl, False) if masked else fn(x.transpose(1, 2))
            g, = torch.autograd.grad(y, x, grad)
            got.append(g)
    assert got[1].stride() == got[0].stride(), grad_kind
    assert torch.equal(got[1], got[0])


def test_hardtanh_matching_refuses_what_it_cannot_do():
    from monetlike.impls.hardtanh import hardtanh_call
    from monetlike.capture.trace import trace

    class PreActivationRead(ConvBnAct):
        def forward(self, x):  # the BN output is also read after the in-place ReLU6
            y = self.bn(self.conv(x))
            return F.relu6(y, inplace=True) + y

    class GraphBound(nn.Module):
        def forward(self, x):  # a bound computed in the graph is not known when matching
            return F.hardtanh(x, -1.0, x.size(0))

    torch.manual_seed(0)
    x = torch.randn(*X_IMG)
    # Out of place (the activation is its own Op) and a BN output with a second reader: no
    # bn_hardtanh_lean (nothing would keep the pre-activation), but hardtanh_mask on the ReLU6.
    for model in (ConvBnAct(nn.ReLU6()), PreActivationRead(nn.ReLU6())):
        g = monetlike.profile(model.train(), x, cost=A100)
        per_op = [[i.name for i in o.impls] for o in g.ops]
        assert not any("bn_hardtanh_lean" in p for p in per_op), per_op
        assert sum("hardtanh_mask" in p for p in per_op) == 1, per_op
    gm = trace(GraphBound())
    node = next(n for n in gm.graph.nodes if n.target is F.hardtanh)
    assert hardtanh_call(gm, node) is None
    gm = trace(Fn(hardtanh_inplace_pos))
    node = next(n for n in gm.graph.nodes if n.target is F.hardtanh)
    inplace, act = hardtanh_call(gm, node)
    assert inplace is True and (act.min_val, act.max_val) == (-0.5, 0.75)


def _allocator_held(fn, x) -> int:
    """Bytes the CPU allocator still holds after `fn(x)` besides the result's storage: what the
    backward holds, by the allocator's own count (temporaries of `fn` are freed by then; `x` a
    leaf: `x * 1` would keep its wrapped scalar, 8 bytes, in the graph)."""
    from monetlike.core.allocator import AllocatorLog

    with AllocatorLog() as log:
        log.mark("before")
        y = fn(x)
        log.mark("after")
    held = log.level("after") - log.level("before") - y.untyped_storage().nbytes()
    del y
    return held


@pytest.mark.parametrize("pool, per_sample", [
    (nn.MaxPool2d(2), 4 * 4 * 4 // 2),  # area 4: 4-bit positions, two to a byte
    (nn.MaxPool2d(4, 2, 1), 4 * 4 * 4 // 2),  # area 16: still 4 bits
    (nn.MaxPool2d(5, 1, 2), 4 * 8 * 8),  # area 25: one int8 per output element
])
def test_declared_bytes_maxpool_compact(pool, per_sample):
    torch.manual_seed(0)
    model = Pool(pool).train()
    x = torch.randn(*X_IMG)
    g = monetlike.profile(model, x, cost=A100)
    conv, op = g.ops[0], g.ops[1]
    default, compact = op.impls
    out = 2 * 4 * 4 * 4 if pool.stride == 2 else 2 * 4 * 8 * 8
    assert default.saved == conv.outputs and default.internal_bytes == 8 * out  # int64 indices
    assert compact.saved == () and compact.internal_bytes == 2 * per_sample
    from monetlike.impls.pool import MaxPoolCompact

    z = torch.randn(2, 4, 8, 8, requires_grad=True)
    args = (pool.kernel_size, pool.stride, pool.padding, pool.dilation, False)
    args = tuple((a, a) if isinstance(a, int) else a for a in args[:4]) + (False,)
    assert bytes_held(lambda t: F.max_pool2d(t * 1, *args), z) == 4 * 2 * 4 * 8 * 8 + 8 * out
    for fmt in (torch.contiguous_format, torch.channels_last):
        zf = z.detach().to(memory_format=fmt).requires_grad_()
        assert bytes_held(lambda t: MaxPoolCompact.apply(t * 1, *args), zf) == 2 * per_sample
        assert _allocator_held(lambda t: MaxPoolCompact.apply(t, *args), zf) == 2 * per_sample


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_held_bytes_maxpool_compact_odd_sample(fmt):
    """A sample of 9 output elements keeps ceil(9 / 2) = 5 bytes, its own row: 3 samples hold
    15 bytes (not ceil(27 / 2) = 14), by the saved-tensor accounting and by the allocator's."""
    from monetlike.impls.pool import MaxPoolCompact

    z = torch.randn(3, 1, 7, 7).to(memory_format=fmt).requires_grad_()
    fn = lambda t: MaxPoolCompact.apply(t, (3, 3), (2, 2), (0, 0), (1, 1), False)  # noqa: E731
    assert fn(z).shape == (3, 1, 3, 3)
    assert bytes_held(lambda t: fn(t * 1), z) == _allocator_held(fn, z) == 3 * 5


def test_declared_bytes_dropout_regen():
    torch.manual_seed(0)
    model = Drop().train()
    x = torch.randn(8, 16)
    g = monetlike.profile(model, x, cost="measured", repeat=1)
    drop = next(o for o in g.ops if o.kind == "Dropout")
    default, regen, mask = drop.impls
    rng = torch.get_rng_state().numel()  # the CPU generator state, bytes (uint8)
    assert default.saved == () and default.internal_bytes == 8 * 32 * 4  # CPU: float32 noise
    assert regen.saved == () and regen.internal_bytes == rng
    assert mask.name == "dropout_mask" and mask.saved == () and mask.internal_bytes == 8 * 32
    from monetlike.impls.dropout import DropoutRegen

    z = torch.randn(8, 32, requires_grad=True)
    assert bytes_held(lambda t: F.dropout(t, 0.3, True), z) == 8 * 32 * 4
    assert bytes_held(lambda t: DropoutRegen.apply(t, 0.3), z) == rng
    from monetlike.impls.dropout import DropoutMask

    assert bytes_held(lambda t: DropoutMask.apply(t, 0.3), z) == 8 * 32
    # On a GPU profile the default holds a bool mask (1 byte per element), as dropout_mask would:
    # it is not offered there (ImplSpec.devices), so GPU graphs keep their columns and
    # fingerprints.
    ga = monetlike.profile(model, x, cost=A100)
    da = next(o for o in ga.ops if o.kind == "Dropout")
    assert [(im.name, im.internal_bytes) for im in da.impls] == [("default", 8 * 32),
                                                                 ("dropout_regen", rng)]


@pytest.mark.parametrize("functional", [False, True], ids=["module", "function"])
def test_dropout_mask_exact_through_runtime(functional):
    """As test_impl_exact_through_runtime, on a CPU profile (the only one offering the mask)."""
    torch.manual_seed(0)
    model = Drop(functional=functional).train()
    x = torch.randn(8, 16).requires_grad_()
    graph = monetlike.profile(model, x, cost="measured", repeat=1)
    schedule, picked = _with_impl(graph, "dropout_mask")
    assert [graph.ops[j].kind for j in picked] == ["Dropout" if not functional else "dropout"]
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule)
    for seed in (1, 2):
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.77])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_dropout_mask_bitwise(dtype, p, layout):
    """The 1-byte mask gives F.dropout's output and input gradient bit for bit on the CPU, signed
    zeros included; a NaN of the incoming gradient stays NaN where the default's does (its
    payload bits may differ: bf16 arithmetic on the CPU does not keep them)."""
    from monetlike.impls.dropout import DropoutMask

    base = torch.randn(37, 129, dtype=dtype)
    x = (base if layout == "contiguous" else base.t()).requires_grad_()
    grad = torch.randn(x.shape, dtype=dtype)
    grad.view(-1)[:7] = float("nan")
    grad.view(-1)[7:20] = -3.0
    outs = []
    for f in (lambda t: F.dropout(t, p, True), lambda t: DropoutMask.apply(t, p)):
        torch.manual_seed(3)
        y = f(x)
        (gx,) = torch.autograd.grad(y, x, grad)
        outs.append((y.detach(), gx))
    (y0, g0), (y1, g1) = outs
    assert y1.stride() == y0.stride()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32 if dtype == torch.float32 \
        else torch.int64
    assert torch.equal(y0.contiguous().view(bits), y1.contiguous().view(bits))
    nan = g0.isnan()
    assert torch.equal(nan, g1.isnan()) and nan.any()
    assert torch.equal(g0[~nan].view(bits), g1[~nan].view(bits))


def test_full_mode_picks_dropout_mask_on_a_cpu_profile():
    """Measured on the CPU, dropout's default holds 4 bytes per element of noise. Without the
    1-byte mask the least full-mode budget is higher (proven by the exact min-peak solve), so
    at the least budget every backend's plan holds the mask; and it runs exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024), nn.Dropout(0.4), nn.Linear(1024, 16),
                          nn.Dropout(0.4), nn.Linear(16, 1024), nn.Dropout(0.4),
                          nn.Linear(1024, 1)).train()
    x = torch.randn(64, 16).requires_grad_()  # _run compares the input gradient too
    g = monetlike.profile(model, x, cost="measured", repeat=1)
    low_ckpt = solver.min_budget(g, "checkpoint", time_limit_s=30)
    low_full = solver.min_budget(g, "full", time_limit_s=30)
    no_mask = g.without_impl("dropout_mask")
    assert low_full < solver.min_budget(no_mask, "full", time_limit_s=30)
    assert low_full < low_ckpt
    drops = [o for o in g.ops if o.kind == "Dropout"]
    for backend in available_backends():
        r = solver.solve(g, low_full, mode="full", backend=backend, time_limit_s=30)
        names = {g.ops[o.id].impls[r.schedule.impl[o.id]].name for o in drops}
        assert "dropout_mask" in names, (backend, names)
        assert simulate(g, r.schedule).peak_bytes <= low_full
    ref = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, r.schedule)
    assert_same(weighted_step(ref, x, 5), weighted_step(wrapped, x, 5))


def test_impls_are_registered_and_checkpoint_mode_ignores_them():
    assert {"relu_mask", "bn_relu_lean", "maxpool_compact", "dropout_regen", "hardtanh_mask",
            "bn_hardtanh_lean"} <= names()
    torch.manual_seed(0)
    g = monetlike.profile(ConvBnRelu().train(), torch.randn(*X_IMG), cost=A100)
    plain = monetlike.profile(ConvBnRelu().train(), torch.randn(*X_IMG), cost=A100, impls=False)
    assert all(len(o.impls) == 1 for o in plain.ops)
    assert any(len(o.impls) > 1 for o in g.ops)
    peak = simulate(g, store_all_schedule(g)).peak_bytes
    r = solver.solve(g, peak - 1, mode="checkpoint", time_limit_s=20) \
        if peak - 1 >= solver.min_budget(g, "checkpoint", time_limit_s=20) else None
    if r is not None:
        assert all(k == 0 for k in r.schedule.impl)


# ----------------------------------------------------------------------------------------------
# End to end: a small VGG-like network with BN, in-place ReLU, max-pool and dropout
# ----------------------------------------------------------------------------------------------
class SmallVGG(nn.Module):
    def __init__(self):
        super().__init__()

        def blk(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*blk(3, 16), *blk(16, 16), nn.MaxPool2d(2), *blk(16, 32),
                                      nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
                                        nn.Dropout(0.5), nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


class SmallMobile(nn.Module):
    """MobileNetV2's pieces (torchvision's own blocks): Conv-BN-ReLU6(inplace) and inverted
    residuals (expand, depthwise, project, residual add), then pooling, dropout, a classifier."""

    def __init__(self):
        super().__init__()
        from torchvision.models.mobilenetv2 import InvertedResidual
        from torchvision.ops.misc import Conv2dNormActivation

        self.features = nn.Sequential(
            Conv2dNormActivation(3, 16, stride=1, norm_layer=nn.BatchNorm2d,
                                 activation_layer=nn.ReLU6),
            InvertedResidual(16, 16, 1, 4), InvertedResidual(16, 24, 2, 4),
            InvertedResidual(24, 24, 1, 4))
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                        nn.Linear(24, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


@pytest.mark.parametrize("net, families", [
    (SmallVGG, {"relu_mask", "bn_relu_lean", "maxpool_compact", "dropout_regen"}),
    (SmallMobile, {"hardtanh_mask", "bn_hardtanh_lean"}),
], ids=["SmallVGG", "SmallMobile"])
def test_end_to_end_full_mode_picks_impls(net, families):
    torch.manual_seed(0)
    model = net().train()
    x = torch.randn(8, 3, 32, 32).requires_grad_()
    # Which Impls the solver needs, on a GPU's graph (tensors only: the structure) ...
    g = monetlike.profile(model, x, cost=A100)
    low_ckpt = solver.min_budget(g, "checkpoint", time_limit_s=30)
    low_full = solver.min_budget(g, "full", time_limit_s=30)
    assert low_full < low_ckpt  # the Impls lower the least feasible peak
    with pytest.raises(solver.InfeasibleBudgetError):
        solver.solve(g, low_full, mode="checkpoint", time_limit_s=30)
    for budget in (low_full, (low_full + low_ckpt) // 2):
        s = solver.solve(g, budget, mode="full", time_limit_s=30).schedule
        picked = [g.ops[j].impls[k].name for j, k in enumerate(s.impl) if k]
        assert set(picked) & families, ("full mode below the checkpoint minimum must pick "
                                        "one of this network's Impls", picked)
        assert simulate(g, s).peak_bytes <= budget
    # ... and run on this CPU's own graph, whose allocator count (kernel scratch included) is
    # what is measured: at its least full-mode budget, within budget, same numbers.
    g = monetlike.profile(model, x, repeat=1)
    budget = solver.min_budget(g, "full", time_limit_s=30)
    s = solver.solve(g, budget, mode="full", time_limit_s=30).schedule
    predicted = simulate(g, s).peak_bytes
    ref = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, s, graph=g)
    assert_same(weighted_step(ref, x, 5), weighted_step(wrapped, x, 5))
    measured = measured_peak(g, model, wrapped, x)
    picked = [g.ops[j].impls[k].name for j, k in enumerate(s.impl) if k]
    assert measured <= budget, (picked, measured, budget)
    assert measured <= predicted * (1 + PEAK_TOLERANCE), (picked, measured, predicted)


class WideMlp(nn.Module):
    """Linear -> ReLU -> Linear(..., 1): recomputing the ReLU is the step's tightest point when
    the recomputation makes no mask."""

    def __init__(self):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 1)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


@pytest.mark.parametrize("cost", ["measured", A100])
def test_recomputation_under_no_grad_makes_no_internals(cost):
    # The runtime recomputes under no_grad, where relu_mask's mask is not made: the profiler
    # measures that (recompute_workspace 0 beside 1 bit per element of internals) and the
    # simulator's peak is the runtime's. The rule before it, internals + workspace as the
    # recomputation's transient, over-counts this schedule by the mask.
    import dataclasses

    torch.manual_seed(0)
    model = WideMlp().train()
    x = torch.randn(64, 8)
    g = monetlike.profile(model, x, cost=cost, repeat=1)
    relu = next(o for o in g.ops if o.kind == "ReLU")
    k = next(i for i, im in enumerate(relu.impls) if im.name == "relu_mask")
    assert relu.impls[k].internal_bytes == 64 * 512 // 8  # the mask, held forward to backward
    assert relu.impls[k].recompute_workspace == relu.impls[0].recompute_workspace == 0
    _, (_, s) = impl_schedules(g, "relu_mask")
    assert s.impl[relu.id] == k and any(relu.id in st.recompute for st in s.stages)
    if cost != "measured":
        return  # an analytical graph models a GPU; the CPU's allocator is measured below
    measured = measured_peak(g, model, monetlike.ScheduleWrapper(model, s, graph=g), x)
    assert measured == s.predicted_peak_bytes
    old = dataclasses.replace(g, ops=tuple(
        dataclasses.replace(o, impls=tuple(dataclasses.replace(im, recompute_workspace=None)
                                           for im in o.impls)) for o in g.ops))
    assert simulate(old, s).peak_bytes > measured * (1 + PEAK_TOLERANCE)


def test_recomputation_keeps_what_the_kernel_makes_anyway():
    # CPU dropout draws its noise as a tensor of the input's dtype with or without grad: a
    # recomputation makes it too (and frees it).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 256), nn.Dropout(0.5), nn.Linear(256, 1)).train()
    g = monetlike.profile(model, torch.randn(32, 8), cost="measured", repeat=1)
    drop = next(o for o in g.ops if o.kind == "Dropout")
    assert drop.impls[0].recompute_workspace == 32 * 256 * 4
