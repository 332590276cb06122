"""How people train, found wrong by a hunt on training-loop patterns (not on model architectures).

Each case runs a small CNN (BatchNorm, dropout) or a small transformer wrapped at a solver schedule
between Chen's sqrt(n) peak and store-all's, and at the keep-nothing schedule of runtime_support,
beside plain PyTorch on a copy with the same seeds, and compares outputs, input and parameter
gradients and buffers over 2-3 optimizer steps.

Found wrong:
- A graph given to ScheduleWrapper was trusted for the first call after checking only the input
  shapes and dtypes: a layer frozen (or an input made to require grad, or a submodule put in eval
  mode) between profiling and the first step ran the schedule on a graph that was not the
  call's, then failed after the forward with "created no autograd node" or ran on unchecked. Now
  the given graph is trusted only when the call's requires_grad and train/eval flags are its
  own; otherwise the call is profiled and matched like any other (refused with the difference).
- torch.compile(wrapper) traced the scheduled forward: inductor's dropout drew other random
  numbers than the eager recomputation in the backward (other masks: wrong gradients, silently)
  and recompiled at every node. The scheduled step now runs eagerly under torch.compile.
- A forward taking a dict or a tuple of tensors: fx traced the container as one input and the
  profiler failed with "'NoneType' object has no attribute '_cdata'". capture="auto" now takes
  such a model to torch.export (which flattens the container); capture="fx" is refused with the
  way out; a dict given positionally to profile names the argument and the way out.

Refused more clearly: a last batch of one for the transformer changes its graph (a matmul's
reshape becomes a view, so the op saves its input instead of a copy): the refusal now says that a
smaller shape runs only when the graph keeps its structure, and names DataLoader(drop_last=True).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn

import monetlike
import solver
from monetlike.models import transformer
from monetlike.capture.trace import TraceError
from runtime_support import PEAK_TOLERANCE, every, keep_schedule, measured_peak, peak_of
from solver.baselines import chen_sqrt_n
from solver.errors import ScheduleMismatchError
from solver.simulate import simulate, store_all_schedule

pytestmark = pytest.mark.usefixtures("one_thread")


def cnn(dropout: float = 0.3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Flatten(), nn.Dropout(dropout), nn.Linear(8 * 8 * 8, 10))


def _x(batch: int = 8) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _tokens() -> torch.Tensor:
    return torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))


def _schedules(graph):
    """{"tight": keep nothing, "solver": solved halfway between Chen's sqrt(n) and store-all}."""
    store = simulate(graph, store_all_schedule(graph)).peak_bytes
    budget = (store + chen_sqrt_n(graph).predicted_peak_bytes) // 2
    return {"tight": keep_schedule(graph, every(0), "tight", hold="stage"),
            "solver": solver.solve(graph, budget, time_limit_s=10).schedule}


@functools.cache
def _planned(name: str):
    """(model, input, graph, schedules) of the CNN or the 2-block transformer, profiled and
    solved once for the tests that train copies of it (each profile times its Impls, and the
    graph and schedules are only read)."""
    model, x = (cnn(), _x()) if name == "cnn" else (transformer(depth=2, dim=32, heads=2),
                                                    _tokens())
    graph = monetlike.profile(model, x, repeat=1)
    return model, x, graph, _schedules(graph)


def _wloss(out):
    out = out.float()
    return (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum()


def _snap(model):
    return ([None if p.grad is None else p.grad.clone() for p in model.parameters()]
            + [b.clone() for b in model.buffers()])


def assert_same_records(a, b, exact):
    assert a, "nothing was recorded to compare"
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, i
        elif exact:
            assert torch.equal(x, y), f"record {i}: max diff {(x.float() - y.float()).abs().max()}"
        else:
            torch.testing.assert_close(y, x, msg=lambda m: f"record {i}: {m}")


def assert_trains_like_pytorch(model, x, schedule, graph, loop, exact=True):
    """`loop(module, model, x)` on a plain copy and on a wrapped copy; the records equal."""
    ref, tst = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(tst, schedule, graph=graph)
    assert_same_records(loop(ref, ref, x), loop(wrapped, tst, x), exact)
    return wrapped


# ----------------------------------------------------------------------------------------------
# Loop shapes
# ----------------------------------------------------------------------------------------------
def accumulate(module, model, x):
    """Three forward/backward pairs per optimizer step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = []
    for s in range(2):
        opt.zero_grad()
        for k in range(3):
            torch.manual_seed(10 * s + k)
            out = module(x[: 8 - 2 * k])  # micro-batches of 8, 6, 4
            _wloss(out).backward()
            rec.append(out.detach())
        rec += _snap(model)
        opt.step()
    return rec + [p.detach().clone() for p in model.parameters()]


def zero_grad_keeping_tensors(module, model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rec = []
    for s in range(3):
        opt.zero_grad(set_to_none=False)
        torch.manual_seed(s)
        out = module(x)
        _wloss(out).backward()
        rec += [out.detach()] + _snap(model)
        opt.step()
    return rec


def two_forwards_one_backward(module, model, x):
    torch.manual_seed(0)
    loss = _wloss(module(x)) + 2 * _wloss(module(x.flip(0).clone()))
    loss.backward()
    return [loss.detach()] + _snap(model)


def two_backwards_in_reverse_order(module, model, x):
    torch.manual_seed(0)
    a, b = _wloss(module(x)), _wloss(module(x * 0.5))
    b.backward()
    a.backward()
    return _snap(model)


def validation_between_steps(module, model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = []
    for s in range(3):
        opt.zero_grad()
        torch.manual_seed(s)
        _wloss(module(x)).backward()
        rec += _snap(model)
        opt.step()
        with torch.no_grad():
            torch.manual_seed(100 + s)
            rec.append(module(x))  # no_grad in train mode: dropout draws
        module.eval()
        with torch.no_grad():
            rec.append(module(x))
        rec.append(module(x).detach())  # eval with grad enabled
        module.train()
    return rec


def smaller_last_batch(module, model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = []
    for s, b in enumerate([8, 8, 3, 8]):
        opt.zero_grad()
        torch.manual_seed(s)
        out = module(x[:b])
        _wloss(out).backward()
        rec += [out.detach()] + _snap(model)
        opt.step()
    return rec


LOOPS = [accumulate, zero_grad_keeping_tensors, two_forwards_one_backward,
         two_backwards_in_reverse_order, validation_between_steps, smaller_last_batch]


@pytest.mark.parametrize("loop", LOOPS, ids=lambda f: f.__name__)
def test_loop_shapes_train_like_pytorch(loop):
    for name in ("cnn", "transformer"):
        model, x, graph, schedules = _planned(name)
        for schedule in schedules.values():
            assert_trains_like_pytorch(model, x, schedule, graph, loop)


def test_state_dict_into_a_fresh_wrapper_mid_training_and_an_optimizer_built_before():
    model, x, graph, schedules = _planned("cnn")
    for schedule in schedules.values():
        ref, tst = copy.deepcopy(model), copy.deepcopy(model)
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        opt_t = torch.optim.SGD(tst.parameters(), lr=0.1, momentum=0.9)  # before wrapping
        w = monetlike.ScheduleWrapper(tst, schedule, graph=graph)
        for step in range(3):
            if step == 2:  # a checkpoint loaded into a new model and a new wrapper
                state, opt_state = copy.deepcopy(w.state_dict()), copy.deepcopy(opt_t.state_dict())
                tst = cnn()
                w = monetlike.ScheduleWrapper(tst, schedule)
                w.load_state_dict(state)
                opt_t = torch.optim.SGD(w.parameters(), lr=0.1, momentum=0.9)
                opt_t.load_state_dict(opt_state)
            for module, opt in ((ref, opt_r), (w, opt_t)):
                opt.zero_grad()
                torch.manual_seed(step)
                _wloss(module(x)).backward()
                opt.step()
            assert_same_records([*ref.parameters(), *ref.buffers()],
                                [*tst.parameters(), *tst.buffers()], exact=True)


# ----------------------------------------------------------------------------------------------
# Frozen and partial training
# ----------------------------------------------------------------------------------------------
def _train_steps(module, model, x):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    rec = []
    for s in range(2):
        opt.zero_grad()
        torch.manual_seed(s)
        xx = x.detach().clone().requires_grad_(x.requires_grad)
        out = module(xx)
        _wloss(out).backward()
        rec += [out.detach(), xx.grad] + _snap(model)
        opt.step()
    return rec


def _frozen_first_layer():
    model = cnn()
    for p in [*model[0].parameters(), *model[1].parameters()]:
        p.requires_grad_(False)
    return model


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora_transformer():
    torch.manual_seed(0)
    model = transformer(depth=2, dim=32, heads=2)
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.qkv = LoRALinear(block.attn.qkv)
        block.mlp[0] = LoRALinear(block.mlp[0])
    return model


def assert_exact_with_the_predicted_peak(model, x, graph):
    """Each schedule of `_schedules` trains like plain PyTorch and peaks where predicted."""
    for name, schedule in _schedules(graph).items():
        assert_trains_like_pytorch(model, x, schedule, graph, _train_steps)
        tst = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(tst, schedule, graph=graph)
        measured, predicted = measured_peak(graph, tst, wrapped, (x,)), peak_of(graph, schedule)
        assert abs(measured - predicted) <= predicted * PEAK_TOLERANCE, (name, measured, predicted)


@pytest.mark.parametrize("make, x", [
    (_frozen_first_layer, _x()),
    (_lora_transformer, _tokens()),
    (cnn, _x().requires_grad_())], ids=["frozen_first_layer", "lora", "input_grad"])
def test_partial_training_profiled_as_trained(make, x):
    model = make()
    graph = monetlike.profile(model, x, repeat=1)
    assert_exact_with_the_predicted_peak(model, x, graph)


@pytest.mark.parametrize("change, difference", [
    (lambda m, x: m[0].requires_grad_(False),
     "params[0]: schedule has '0.weight 8x3x3x3 float32 requires_grad', "
     "model has '0.weight 8x3x3x3 float32'"),
    (lambda m, x: x.requires_grad_(),
     "input_requires_grad[0]: schedule has False, model has True"),
    (lambda m, x: (m[1].eval(), m[7].eval()), "num_ops: schedule has 8, model has 7")],
    ids=["frozen_after_profiling", "input_grad_after_profiling", "submodule_eval"])
def test_a_given_graph_is_not_trusted_once_the_model_changed(change, difference):
    """Frozen, made to require grad or put in eval mode between profiling and the first step:
    the wrapper profiles the call and refuses the schedule with the difference and the way out
    (it ran the schedule on the given graph before, and failed after the forward or not at all);
    after the change is undone the same wrapper runs the schedule exactly."""
    model, x = cnn(), _x()  # changed below: not the shared copy, the same weights and input
    _, _, graph, schedules = _planned("cnn")
    schedule = schedules["tight"]
    w = monetlike.ScheduleWrapper(model, schedule, graph=graph)
    change(model, x)
    with pytest.raises(ScheduleMismatchError) as e:
        w(x)
    msg = str(e.value)
    assert "the schedule was solved for another graph" in msg and difference in msg, msg
    assert "depends on which inputs and parameters require grad, train/eval mode" in msg
    assert "solve a schedule for this model, batch and input shape" in msg
    model.requires_grad_(True)
    model.train()
    x.requires_grad_(False)
    ref = copy.deepcopy(model)
    torch.manual_seed(0)
    out = w(x)
    _wloss(out).backward()
    torch.manual_seed(0)
    expected = ref(x)
    _wloss(expected).backward()
    assert_same_records([expected] + _snap(ref), [out.detach()] + _snap(model), exact=True)


# ----------------------------------------------------------------------------------------------
# Memory formats and dtypes
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("convert", [
    lambda t: t.to(memory_format=torch.channels_last), lambda t: t.double(),
    lambda t: t.bfloat16(), lambda t: t.half()],
    ids=["channels_last", "float64", "bfloat16", "float16"])
def test_memory_formats_and_dtypes(convert):
    model, x = convert(cnn()), convert(_x())
    graph = monetlike.profile(model, x, repeat=1)
    assert_exact_with_the_predicted_peak(model, x, graph)


# ----------------------------------------------------------------------------------------------
# torch.compile and copies
# ----------------------------------------------------------------------------------------------
def test_torch_compile_of_the_wrapper_runs_the_schedule_exactly():
    """Compiled, the scheduled forward's dropout drew inductor's random numbers and the
    backward's eager recomputation others: wrong gradients, silently. It runs eagerly now."""
    model, x, graph, schedules = _planned("cnn")
    schedule = schedules["tight"]
    ref, tst = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(tst, schedule, graph=graph)
    compiled = torch.compile(wrapped)
    for step in range(2):
        for m in (ref, tst):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        expected = ref(x)
        _wloss(expected).backward()
        torch.manual_seed(step)
        with wrapped.timing_recomputations() as log:
            out = compiled(x)
            _wloss(out).backward()
        assert log, "the schedule's recomputations ran"
        assert_same_records([expected] + _snap(ref), [out.detach()] + _snap(tst), exact=True)
    copied = copy.deepcopy(wrapped)  # a copy of a trained wrapper trains on its own
    ref2 = copy.deepcopy(ref)
    for module, m in ((ref2, ref2), (copied, copied.model)):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        _wloss(module(x)).backward()
    assert_same_records(_snap(ref2), _snap(copied.model), exact=True)


# ----------------------------------------------------------------------------------------------
# Inputs inside a dict or a tuple
# ----------------------------------------------------------------------------------------------
class DictInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = cnn()

    def forward(self, batch):
        return self.net(batch["image"]) * batch["scale"]


class TupleInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = cnn()

    def forward(self, pair):
        a, b = pair
        return self.net(a) + self.net(b)


@pytest.mark.parametrize("cls, kwargs", [
    (DictInput, {"batch": {"image": _x(), "scale": torch.tensor(2.0)}}),
    (TupleInput, {"pair": (_x(), _x().flip(0).clone())})], ids=["dict", "tuple"])
def test_inputs_inside_a_dict_or_a_tuple(cls, kwargs):
    model = cls()
    (name, value), = kwargs.items()
    with pytest.raises(ValueError) as e:
        monetlike.profile(model, (value,), repeat=1)
    msg = str(e.value)
    assert f"example_inputs[0]: expected a tensor, got {type(value).__name__}" in msg, msg
    assert "from a mapping of its arguments by name" in msg
    with pytest.raises(TraceError) as e:
        monetlike.profile(model, kwargs, repeat=1, capture="fx")
    msg = str(e.value)
    assert f"its input '{name}' (a {type(value).__name__}) hold tensors inside a container" \
        in msg, msg
    assert "capture it with torch.export (capture='export' or 'auto'" in msg
    graph = monetlike.profile(model, kwargs, repeat=1)
    assert graph.meta["capture"] == "export"
    schedule = keep_schedule(graph, every(0), "tight", hold="stage")
    ref, tst = copy.deepcopy(model), copy.deepcopy(model)
    w = monetlike.ScheduleWrapper(tst, schedule, graph=graph)
    for step in range(2):
        for module, m in ((ref, ref), (w, tst)):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = module(**kwargs) if step == 0 else module(value)  # by keyword, by position
            _wloss(out).backward()
        assert_same_records(_snap(ref), _snap(tst), exact=True)
    # Without the graph (a schedule loaded from a file): the wrapper captures as the profile did.
    bare = copy.deepcopy(ref)
    w = monetlike.ScheduleWrapper(bare, schedule)
    for module, m in ((ref, ref), (w, bare)):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        _wloss(module(value)).backward()
    assert_same_records(_snap(ref), _snap(bare), exact=True)


def test_a_last_batch_of_one_that_changes_the_graph_is_refused_with_the_way_out():
    model, x = transformer(depth=1, dim=32, heads=2), _tokens()
    graph = monetlike.profile(model, x, repeat=1)
    w = monetlike.ScheduleWrapper(model, _schedules(graph)["tight"], graph=graph)
    _wloss(w(x[:3])).backward()  # a smaller batch with the same structure runs
    with pytest.raises(ScheduleMismatchError) as e:
        w(x[:1])
    msg = str(e.value)
    assert "batch: schedule has 4, model has 1" in msg, msg
    assert "a smaller shape runs the schedule when the model's graph keeps its structure, and " \
           "at this shape it does not" in msg
    assert "DataLoader(drop_last=True)" in msg and "solve a schedule for this model" in msg
