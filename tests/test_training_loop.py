"""The real training loop (issue 23): a last partial batch and shorter sequences just work.

A wrapper solved for one shape runs any smaller batch or sequence length: the schedule's
decisions are rebound to the smaller graph and proven within budget by the simulator (NOTE
[Smaller shapes] in monetlike/wrapper.py). Gradients equal plain PyTorch at every shape;
a larger shape is refused with the way out.
"""

import copy

import pytest
import torch

import monetlike
import solver
from monetlike.models import transformer_block
from monetlike.profile import profile
from script_support import load_example
from solver.errors import ScheduleMismatchError


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


def _tight(model, x):
    """A budget that makes the solver recompute: the midpoint between store-all and the least
    budget `min_budget` certifies."""
    g = profile(model, x, cost="analytical:A100-40GB")
    top = solver.simulate(g, solver.store_all_schedule(g)).peak_bytes
    low = solver.min_budget(g)
    return (top + low) // 2


def _step(module, x, seed=0):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    out = module(x)
    (out * out.detach().sign()).sum().backward()
    return out.detach(), x.grad


def _assert_same_step(model, wrapped, x):
    plain = copy.deepcopy(model)
    for p in (*plain.parameters(), *model.parameters()):
        p.grad = None
    out_p, gx_p = _step(plain, x)
    out_w, gx_w = _step(wrapped, x)
    assert torch.equal(out_p, out_w) and torch.equal(gx_p, gx_w)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(plain.buffers(), model.buffers()):
        assert torch.equal(a, b)  # BatchNorm running statistics updated once, alike


def test_last_partial_batch_runs_within_budget_with_exact_gradients(tmp_path):
    model = _cnn()
    x8 = torch.randn(8, 3, 16, 16).requires_grad_()
    budget = _tight(model, x8)
    w = monetlike.optimize(model, x8, budget=budget, cost="analytical:A100-40GB",
                           cache_dir=tmp_path, time_limit_s=30)
    solved = w.schedule
    assert any(s.recompute for s in solved.stages)  # the budget forces recomputation
    for batch in (8, 5, 1 + 1):  # BatchNorm needs more than one sample in training
        x = torch.randn(batch, 3, 16, 16)
        _assert_same_step(model, w, x)
        sched = w.schedule_for(x.requires_grad_())
        assert sched.budget_bytes == budget
        assert sched.predicted_peak_bytes <= budget
        # The same decisions, rebound: only the fingerprint and predictions change.
        assert (sched.impl, sched.forward_keep, sched.stages) == \
            (solved.impl, solved.forward_keep, solved.stages)
        g = w.graph_for(x)
        assert g.batch == batch
        assert solver.simulate(g, sched).peak_bytes == sched.predicted_peak_bytes
    assert w.schedule_for(torch.randn(5, 3, 16, 16).requires_grad_()).predicted_peak_bytes < \
        w.schedule_for(x8).predicted_peak_bytes


def test_a_graph_profiled_without_impls_runs_smaller_batches():
    """A schedule solved on a graph profiled with impls=False, given to the wrapper with that
    graph: the structure profiles at smaller batches leave the Impls out too (the CNN offers
    several), so the schedule rebinds instead of being refused as another graph's."""
    model = _cnn()
    x8 = torch.randn(8, 3, 16, 16).requires_grad_()
    g = profile(model, x8, cost="analytical:A100-40GB", impls=False)
    assert all(len(op.impls) == 1 for op in g.ops)
    assert any(len(op.impls) > 1 for op in profile(model, x8, cost="analytical:A100-40GB").ops)
    top = solver.simulate(g, solver.store_all_schedule(g)).peak_bytes
    budget = (top + solver.min_budget(g)) // 2
    w = monetlike.ScheduleWrapper(model, solver.solve(g, budget, time_limit_s=20).schedule,
                                  graph=g)
    x = torch.randn(5, 3, 16, 16)
    _assert_same_step(model, w, x)
    assert w.schedule_for(x.requires_grad_()).predicted_peak_bytes <= budget


def test_a_larger_batch_is_refused_with_the_way_out(tmp_path):
    model = _cnn()
    x8 = torch.randn(8, 3, 16, 16).requires_grad_()
    w = monetlike.optimize(model, x8, budget=_tight(model, x8), cost="analytical:A100-40GB",
                           cache_dir=tmp_path, time_limit_s=30)
    with pytest.raises(ScheduleMismatchError) as e:
        w(torch.randn(9, 3, 16, 16).requires_grad_())
    msg = str(e.value)
    assert "input shape [9, 3, 16, 16] is larger than the [8, 3, 16, 16] this schedule was " \
           "solved for" in msg
    assert "monetlike.optimize" in msg and "monetlike maxbatch" in msg


def test_shorter_sequences_run_with_exact_gradients(tmp_path):
    torch.manual_seed(0)
    model = transformer_block(dim=32, heads=2, dropout=0.0)
    x = torch.randn(4, 16, 32).requires_grad_()
    w = monetlike.optimize(model, x, budget=_tight(model, x), cost="analytical:A100-40GB",
                           cache_dir=tmp_path, time_limit_s=30)
    for shape in ((4, 9, 32), (3, 16, 32), (2, 5, 32)):
        xs = torch.randn(*shape)
        _assert_same_step(model, w, xs)
        assert w.schedule_for(xs.requires_grad_()).predicted_peak_bytes <= w.schedule.budget_bytes
    with pytest.raises(ScheduleMismatchError, match="is larger than"):
        w(torch.randn(4, 17, 32).requires_grad_())


def test_training_example_runs_an_epoch_with_a_partial_last_batch(capsys):
    out = load_example("training").main(["--model", "resnet18", "--batch", "8", "--samples", "20",
                                         "--image-size", "32", "--budget", "200MiB"])
    assert out["batches"] == [8, 8, 4]
    assert all(p <= 200 * 2**20 for p in out["predicted"])
    assert out["predicted"][2] < out["predicted"][1]
    printed = capsys.readouterr().out
    assert "step 2: batch   4" in printed and "measured peak" in printed


class _Sdpa(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v))


def test_the_step_by_step_path_runs_its_own_schedule_on_attention():
    # profile (measured costs) -> solver.solve -> ScheduleWrapper: the wrapper's meta-device
    # structure profile captures another graph for scaled_dot_product_attention than the CPU
    # does; it asks the CPU before refusing (issue 23, case 8).
    torch.manual_seed(0)
    model = _Sdpa()
    x = torch.randn(2, 8, 16).requires_grad_()  # as _step calls it
    g = monetlike.profile(model, x)
    meta = profile(model, x, cost="analytical:A100-40GB")
    assert meta.fingerprint != g.fingerprint  # the case this test is about
    w = monetlike.ScheduleWrapper(model, solver.solve(g, budget=10**9).schedule)
    _assert_same_step(model, w, x)
    _assert_same_step(model, w, torch.randn(2, 5, 16))  # and a shorter sequence


# -- generated models: every smaller batch runs exactly, within the solved peak -------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _cnn_cases(draw):
    blocks = draw(st.lists(st.tuples(st.sampled_from([2, 4, 8]), st.sampled_from([1, 3]),
                                     st.booleans(), st.booleans()), min_size=1, max_size=3))
    batch = draw(st.integers(3, 6))
    smaller = draw(st.integers(2, batch - 1))
    keep_every = draw(st.sampled_from([0, 2]))
    return blocks, batch, smaller, keep_every


def _generated(blocks):
    layers, c = [], 3
    for width, k, bn, inplace in blocks:
        layers += [torch.nn.Conv2d(c, width, k, padding=k // 2)]
        layers += [torch.nn.BatchNorm2d(width)] if bn else []
        layers += [torch.nn.ReLU(inplace=inplace)]
        c = width
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(c, 3)]
    return torch.nn.Sequential(*layers)


@settings(max_examples=8, deadline=None)
@given(_cnn_cases())
def test_generated_models_run_every_smaller_batch_exactly_within_the_solved_peak(case):
    from runtime_support import compare_step, every, keep_schedule

    blocks, batch, smaller, keep_every = case
    torch.manual_seed(0)
    model = _generated(blocks)
    x = torch.randn(batch, 3, 6, 6)
    graph = profile(model, x, cost="analytical:A100-40GB")
    sched = keep_schedule(graph, every(keep_every), "tight", hold="stage")
    xs = torch.randn(smaller, 3, 6, 6)
    w = compare_step(model, lambda m: monetlike.ScheduleWrapper(m, sched), (xs,), steps=2,
                     exact=True)
    rebound = w.schedule_for(xs)
    assert rebound.fingerprint != sched.fingerprint  # it did run rebound, not the solved graph
    assert rebound.predicted_peak_bytes <= sched.predicted_peak_bytes
    assert (rebound.impl, rebound.stages) == (sched.impl, sched.stages)
