"""`check_schedule`: run a schedule here and compare it with plain PyTorch (`monetlike check`).

What MONeT's `--run_bs`, `--check_runtime` and `--check_diff` did, in one report: the measured
peak memory and step time of the scheduled step and of the plain step, the time overhead, the
simulator's predicted peak, and the largest absolute difference between the two steps' outputs,
input gradients and parameter gradients (same parameters, same seed). A saving is only reported
together with a passed gradient check (shared/REFERENCE.md: a "48 GB saving" that was gradients
never computed).

The user's model is not modified: both steps run on deep copies.

`example_inputs` is what `monetlike.profile` takes: a tensor, a tuple of positional inputs, or a
mapping of keyword inputs (a Hugging Face batch: input_ids, attention_mask, labels; its
non-tensor entries such as use_cache=False are passed as they are). Input gradients are compared
for the floating-point inputs that require grad; integer inputs (token ids, labels) have none.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from solver.errors import ScheduleMismatchError
from solver.schedule import Schedule
from solver.simulate import simulate
from solver.units import format_bytes

from .capture.api import split_example
from .measure import measure_step
from .profile.records import training_loss
from .wrapper import ScheduleWrapper
from .core.torch_private import tensors_in
from .measure import Measurement
from .profile.api import profile

__all__ = ["CheckReport", "check_schedule"]

# fp32 on one device with the same kernels: recomputation is bitwise identical, so any
# difference above rounding noise in the loss reduction is a bug.
GRAD_ATOL = 1e-5
GRAD_RTOL = 1.3e-6
# Allocator slack allowed over the prediction (docs/execution-model.md).
PEAK_SLACK = (1.02, 2**20)


@dataclass(frozen=True)
class CheckReport:
    peak_bytes: int
    """Measured peak of one scheduled training step (forward and backward)."""
    plain_peak_bytes: int
    step_time_s: float
    plain_step_time_s: float
    overhead: float
    """step_time_s / plain_step_time_s - 1."""
    max_abs_grad_diff: float
    """Largest absolute difference over outputs, input gradients and parameter gradients."""
    grads_match: bool
    predicted_peak_bytes: int | None
    budget_bytes: int | None
    within_budget: bool | None
    """Measured peak <= budget * 1.02 + 1 MiB (None without a budget)."""
    within_prediction: bool | None
    device: str
    fingerprint: str
    cost_provenance: str

    @property
    def passed(self) -> bool:
        return self.grads_match and self.within_budget is not False

    @property
    def failure(self) -> str:
        """Why the check failed, in one line ('' when it passed)."""
        why = []
        if not self.grads_match:
            why.append(f"the scheduled step's outputs or gradients differ from plain PyTorch's "
                       f"by up to {self.max_abs_grad_diff:.3g} (tolerance {GRAD_ATOL:g} absolute, "
                       f"{GRAD_RTOL:g} relative)")
        if self.within_budget is False:
            why.append(f"the measured peak {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} B) "
                       f"is above the budget {format_bytes(self.budget_bytes)} "
                       f"({self.budget_bytes:,} B) with the allowed allocator slack")
        return "; ".join(why)

    def table(self):
        import pandas as pd

        def b(n):
            return "-" if n is None else format_bytes(n)

        rows = [
            ("peak memory", b(self.plain_peak_bytes), b(self.peak_bytes),
             f"predicted {b(self.predicted_peak_bytes)}, budget {b(self.budget_bytes)}"),
            ("step time", f"{self.plain_step_time_s * 1e3:.1f} ms",
             f"{self.step_time_s * 1e3:.1f} ms", f"overhead {100 * self.overhead:+.1f}%"),
            ("max |grad diff|", "", f"{self.max_abs_grad_diff:.3g}",
             "ok" if self.grads_match else "MISMATCH"),
        ]
        return pd.DataFrame(rows, columns=["", "plain PyTorch", "schedule", "note"])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def __str__(self) -> str:
        return self.table().to_string(index=False)


def _tensors(out) -> list:
    """The tensors of an output or input structure (a tensor, tuples, lists, dicts, dataclasses
    and Hugging Face ModelOutputs)."""
    return tensors_in(out)


def _loss(out) -> torch.Tensor:
    leaves = [o for o in _tensors(out) if o.is_floating_point() and o.requires_grad]
    if not leaves:
        raise ValueError(f"check: the model's output ({type(out).__name__}) has no floating-point "
                         f"tensor that requires grad, so there is no backward to check; expected "
                         f"a loss or logits")
    return sum((o.float() * o.float().detach().sign()).sum() for o in leaves)


def _fresh(x):
    return (x.detach().clone().requires_grad_(x.requires_grad and x.is_floating_point())
            if isinstance(x, torch.Tensor) else x)


def _one_step(module, args: tuple, kwargs: dict, seed: int, loss_fn=_loss):
    torch.manual_seed(seed)
    xs = tuple(_fresh(x) for x in args)
    kw = {k: _fresh(v) for k, v in kwargs.items()}
    out = module(*xs, **kw)
    loss_fn(out).backward()
    return ([o.detach() for o in _tensors(out)],
            [x.grad for x in (*xs, *kw.values()) if isinstance(x, torch.Tensor)])


def _max_diff(a, b) -> tuple[float, bool]:
    worst, ok = 0.0, True
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf"), False
            continue
        d = (x.double() - y.double()).abs()
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
        ok = ok and bool(torch.allclose(y, x, atol=GRAD_ATOL, rtol=GRAD_RTOL))
    return worst, ok


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen.setdefault(s._cdata, s.nbytes())
    return sum(seen.values())


def _measure(module, model, args, kwargs, repeat, loss_fn=_loss):
    """Peak of one step of `module` counted like the simulator: this model's parameters,
    buffers and inputs plus what the step allocates (other copies alive in this process, such as
    the plain model, are not counted), and its median time."""

    def step():
        out = module(*args, **kwargs)
        loss_fn(out).backward()

    step()  # warm-up (the first scheduled call builds its plan)
    for p in model.parameters():
        p.grad = None  # a step starts from zero_grad(set_to_none=True)
    m = measure_step(step, warmup=0, repeat=repeat)
    own = _unique_bytes([*model.parameters(), *model.buffers(), *_tensors((args, kwargs))])
    return Measurement(peak_bytes=m.peak_bytes - m.start_bytes + own, seconds=m.seconds,
                       start_bytes=own, device=m.device)


def _predicted_here(model, example_inputs, schedule: Schedule, loss_fn, fallback) -> int:
    """The simulator's peak for the schedule the wrapper runs: on a
    profile of the model measured here, by the allocator, under the loss the peaks are measured
    with. `fallback`, the wrapper's own graph (a structure profile on the meta device, where no
    kernel allocates scratch), only when the measured profile is of another graph."""

    graph = profile(copy.deepcopy(model).train(), example_inputs, repeat=1, loss_fn=loss_fn)
    try:
        return simulate(graph, schedule).peak_bytes
    except ScheduleMismatchError:
        return simulate(fallback, schedule).peak_bytes


def check_schedule(schedule: "Schedule | str | os.PathLike", model: torch.nn.Module,
                   example_inputs: Any, *, repeat: int = 3, seed: int = 0,
                   loss_fn=None) -> CheckReport:
    """Run `schedule` on `model` with `example_inputs` (a tensor, a tuple of positional inputs or
    a mapping of keyword inputs) here; compare with plain PyTorch. `loss_fn`: the loss the
    schedule was profiled with (monetlike.profile). Without one, gradients are compared under a
    signed sum of the outputs (their gradient is then not all ones) and peaks are measured under
    the profiler's own default (the sum of the outputs, `training_loss`), whose backward holds
    no output-sized tensor: the signed sum's two would count against a schedule profiled without
    them."""
    grad_loss = loss_fn or _loss
    peak_loss = loss_fn or training_loss
    if not isinstance(schedule, Schedule):
        schedule = Schedule.load(schedule)
    args, kwargs = split_example(model, example_inputs)
    plain = copy.deepcopy(model).train()
    mine = copy.deepcopy(model).train()
    wrapped = ScheduleWrapper(mine, schedule)

    # Gradients first (the first scheduled call also checks the fingerprint and raises
    # ScheduleMismatchError for a schedule made for another model or batch).
    out_p, gx_p = _one_step(plain, args, kwargs, seed, grad_loss)
    out_w, gx_w = _one_step(wrapped, args, kwargs, seed, grad_loss)
    grads_p = [p.grad for p in plain.parameters()]
    grads_w = [p.grad for p in mine.parameters()]
    worst, ok = 0.0, True
    for a, b in ((out_p, out_w), (gx_p, gx_w), (grads_p, grads_w)):
        d, good = _max_diff(a, b)
        worst, ok = max(worst, d), ok and good

    m_plain = _measure(plain, plain, args, kwargs, repeat, peak_loss)
    m_mine = _measure(wrapped, mine, args, kwargs, repeat, peak_loss)

    # The simulator's figure, never the file's (solver/verify.py): the decisions the wrapper
    # runs, replayed on a profile measured here under the loss, as the measured peak is (the
    # wrapper's structure profile on the meta device has no loss and allocates no scratch).
    predicted = _predicted_here(model, example_inputs, wrapped.schedule_for(*args, **kwargs),
                                loss_fn, wrapped.graph_for(*args, **kwargs))
    slack_mul, slack_add = PEAK_SLACK
    budget = schedule.budget_bytes
    return CheckReport(
        peak_bytes=m_mine.peak_bytes, plain_peak_bytes=m_plain.peak_bytes,
        step_time_s=m_mine.seconds, plain_step_time_s=m_plain.seconds,
        overhead=m_mine.seconds / m_plain.seconds - 1.0 if m_plain.seconds > 0 else 0.0,
        max_abs_grad_diff=worst, grads_match=ok, predicted_peak_bytes=predicted,
        budget_bytes=budget,
        within_budget=None if budget is None else m_mine.peak_bytes <= budget * slack_mul + slack_add,
        within_prediction=m_mine.peak_bytes <= predicted * slack_mul + slack_add,
        device=m_mine.device, fingerprint=schedule.fingerprint,
        cost_provenance=schedule.cost_provenance)
