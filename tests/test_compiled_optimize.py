"""monetlike.optimize(model, x, budget=..., compile=True): the model compiled with monetlike's
backend (aot_eager), at each budget form the compiled path takes; gradients bitwise equal to eager
PyTorch, the step's measured peak within the budget and at the plan's prediction; the arguments
and budget forms it does not take refused, naming them."""

from __future__ import annotations

import math

import pytest
import torch

import monetlike
from compiled_support import Summed, compiled_step, eager_grads, mlp, run_twice, within
from solver.compiled import least_peak, predict, torch_default_saved
from solver.errors import BudgetParseError, MonetlikeError

X = (256, 256)


@pytest.fixture(scope="module")
def peaks():
    """torch's default partition's peak and the least the search reaches, on the MLP."""
    be = monetlike.backend(budget="1GiB")
    compiled_step(Summed(mlp()), torch.randn(*X), be)
    g = be.record.graph
    return {"default": predict(g, torch_default_saved(g)).peak_bytes,
            "least": least_peak(g).peak_bytes}


@pytest.mark.parametrize("form", ["bytes", "min", "share"])
def test_optimize_compiles_within_the_budget(peaks, form):
    mid = (peaks["default"] + peaks["least"]) // 2
    share = round(mid / peaks["default"], 3)
    budget = {"bytes": mid, "min": "min", "share": f"{100 * share:g}%"}[form]
    want = {"bytes": mid, "min": peaks["least"],
            "share": math.ceil(share * peaks["default"])}[form]
    assert want < peaks["default"]  # every form makes the plan recompute something
    # the loss inside the model: what the step allocates is the compiled graphs'
    model, x = Summed(mlp()), torch.randn(*X)
    torch._dynamo.reset()
    compiled = monetlike.optimize(model, x, budget=budget, compile=True)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    got, transient = run_twice(compiled, model, x)
    be = compiled.monetlike_backend
    plan, fixed = be.record.plan.prediction, be.record.graph.fixed_bytes
    assert be.budget == want and plan.recomputed
    # fixed: parameters and the input, which the step holds from start to end
    assert fixed == sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4
    assert fixed + transient <= want
    assert within(transient, plan.transient_peak_bytes)
    assert all(torch.equal(a, b) for a, b in zip(got, eager_grads(model, x)))


@pytest.mark.parametrize("kwargs, named", [
    ({"optimizer": "adam"}, "optimizer"), ({"loss_fn": torch.sum}, "loss_fn"),
    ({"max_batch": 512}, "max_batch"), ({"cost": "analytical:A100"}, "cost"),
    ({"cache_dir": "/tmp/x", "time_limit_s": 5}, "cache_dir, time_limit_s")])
def test_arguments_the_compiled_path_does_not_take_are_named(kwargs, named):
    with pytest.raises(MonetlikeError, match=f"does not take {named}: "):
        monetlike.optimize(mlp(), torch.randn(*X), budget="1GiB", compile=True, **kwargs)


def test_budget_auto_reads_a_cuda_device_and_the_backend_refuses_it():
    with pytest.raises(MonetlikeError, match="budget 'auto' reads the free memory of a CUDA"):
        monetlike.optimize(mlp(), torch.randn(*X), budget="auto", compile=True)
    with pytest.raises(BudgetParseError, match=r"optimize\(..., compile=True\), which reads it"):
        monetlike.backend(budget="auto")
    with pytest.raises(BudgetParseError):
        monetlike.backend(budget="8 gigs")
