"""Costs in context: fit a measured profile's costs to the training step as it runs.

The profiler times each Op on its own, between marks, repeated; the step runs them back to back.
Summed, those per-Op times miss what the step adds or saves around them (a DenseNet block re-run
measured 242 ms where the per-Op sum said 317 ms), and a recomputation inside the backward runs
under no_grad on freshly allocated outputs, which the forward timing never saw. `calibrate`
measures the model itself and returns the graph with its costs fitted:

1. Plain training steps, forward (with the `zero_grad` that frees the last step's gradients)
   and backward timed apart (median of `steps`): every Impl's `fwd_time` is scaled so that
   Impl 0's forward times sum to the measured forward, every `bwd_time` likewise to the
   measured backward.
2. Steps under a schedule that recomputes every Op it can, once (nothing kept from the forward,
   each recomputed Value held to its last use), each recomputation timed as it runs
   (`ScheduleWrapper.timing_recomputations`): the median becomes the Op's `recompute_time`, for
   every Impl (a recomputation runs the Op's own nodes under no_grad whatever Impl the forward
   ran). An Op that schedule does not recompute gets its scaled forward time.
   A dropout that can run with dropout_mask is also timed recomputed from its mask (steps
   with that Impl), which is that Impl's `recompute_time`.
3. Those steps timed whole: what they take beyond the graph's prediction for them is the
   runtime's own work (saved-tensor handles, stage hooks, recorded contexts, registering the
   Values), which no Op's timing holds; an equal share per recomputation is added to every
   Impl's `recompute_time`.
4. Each Impl (by name) in context: store-all steps choosing it on every Op it applies to, each
   timed in rounds beside a store-all step of the defaults (order turned each round, so load
   from other processes cancels). What the per-Op timings predicted for it is kept where it
   lies within the middle half of those differences, else moved to the nearer quartile
   (`in_context_difference`; a saving only when every round showed one, `credited_difference`),
   spread over its Ops by the default's time; no Op's Impl is then credited a saving its name
   did not show in context.
   Per-Op timings alone mispredicted whole Impls by 5-8 points of the step (ResNet-18,
   8x3x64x64 on the CPU: conv_split +0.7% predicted, +7.6% measured), and the solver picks
   exactly the Impls whose timings came out lowest.

The graph's fingerprint does not change (costs are not part of it), so schedules solved on the
calibrated graph run on the model as before. `graph.meta["calibration"]` records the scales and
how many Ops were timed in context. The model is left as it was: parameters, their gradients,
buffers (BatchNorm statistics) and the RNG state are restored afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

from solver.graph import OpGraph, cost_kind
from solver.rules.simple import schedule_from_keep
from solver.simulate import simulate, store_all_schedule

from .capture.api import split_example
from .profile.costs import Timer, check_clock, in_context_difference
from .profile.records import loss_fn_in_use, training_loss
from .core.torch_private import tree_leaves
from .impls.registry import stashed_recompute_of
from .wrapper import ScheduleWrapper

__all__ = ["calibrate", "CalibrationError"]


class CalibrationError(ValueError):
    pass


def _loss(out) -> torch.Tensor:
    """The profiler's loss (the costs being fitted were measured with it)."""
    loss = training_loss(out)
    if loss is None:
        raise CalibrationError(f"calibrate: the model's output ({type(out).__name__}) has no "
                               f"floating-point tensor that requires grad, so there is no "
                               f"backward to time; expected a loss or logits")
    return loss


@contextlib.contextmanager
def _model_preserved(model: torch.nn.Module):
    """Put back parameters' gradients, buffers and the RNG state after the timed steps (no
    optimizer steps, so the parameters themselves do not change)."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() \
        and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name])
            for p, g in grads.items():
                p.grad = g


def calibrate(model: torch.nn.Module, example_inputs: Any, graph: OpGraph, *, steps: int = 5,
              clock: str | None = None,
              loss_fn: Callable[[Any], torch.Tensor] | None = None,
              timer: Timer | None = None) -> OpGraph:
    """`graph` (a measured profile of `model` on `example_inputs`) with its costs fitted to the
    step as it runs (module docstring). `clock`: "wall" or "thread", by default the profile's.
    `loss_fn`: the training loss of the model's output, as given to `monetlike.profile`.
    `timer`: what times the whole steps (mark, seconds, sync: profile.costs.Timer's
    interface); None: a Timer on the inputs' device by `clock`."""
    with loss_fn_in_use(loss_fn):
        return _calibrate(model, example_inputs, graph, steps, clock, timer)


def _calibrate(model, example_inputs, graph: OpGraph, steps: int, clock: str | None,
               timer: Timer | None) -> OpGraph:
    if cost_kind(graph.cost_provenance) != "measured":
        raise CalibrationError(
            f"calibrate: the graph's costs are {graph.cost_provenance!r}; calibration fits "
            f"measured costs to the device they were measured on. Profile with cost='measured' "
            f"on the device you train on, then calibrate")
    if not isinstance(steps, int) or steps < 1:
        raise CalibrationError(f"calibrate: steps: expected an integer >= 1, got {steps!r}")
    if not model.training:
        raise CalibrationError("calibrate: the model is in eval mode; a training step is timed, "
                               "call model.train() first")

    args, kwargs = split_example(model, example_inputs)
    device = next((t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    clock = check_clock(clock or graph.meta.get("clock") or "wall", device)
    timer = timer or Timer(device, clock)
    ops = graph.ops
    fwd_sum = sum(op.impls[0].fwd_time for op in ops)
    bwd_sum = sum(op.impls[0].bwd_time for op in ops)
    if fwd_sum <= 0 or bwd_sum <= 0:
        raise CalibrationError("calibrate: the graph's forward or backward times sum to zero; "
                               "nothing to fit (was it profiled with cost='measured'?)")

    with _model_preserved(model):
        fwd, bwd = [], []
        for i in range(steps + 1):  # the first step warms up and is not counted
            timer.sync()
            a = timer.mark()
            # A training step frees the last step's gradients (zero_grad): large frees unmap
            # memory, which costs time; counted with the forward.
            model.zero_grad(set_to_none=True)
            loss = _loss(model(*args, **kwargs))
            b = timer.mark()
            loss.backward()
            c = timer.mark()
            timer.sync()
            if i:
                fwd.append(timer.seconds(a, b))
                bwd.append(timer.seconds(b, c))
            del loss
        alpha = statistics.median(fwd) / fwd_sum
        beta = statistics.median(bwd) / bwd_sum

        everything = schedule_from_keep(graph, (), retain="all",
                                        created_by="monetlike.calibrate")
        tick = time.thread_time if clock == "thread" else time.perf_counter

        def recompute_steps(schedule):
            """Each recomputation's times and the whole steps' times, over `steps` steps."""
            wrapped = ScheduleWrapper(model, schedule, graph=graph)
            whole = []
            with wrapped.timing_recomputations(tick) as times:
                for i in range(steps + 1):
                    timer.sync()
                    a = timer.mark()
                    model.zero_grad(set_to_none=True)
                    if i == 1:
                        times.clear()  # the first step builds the plan and warms up
                    _loss(wrapped(*args, **kwargs)).backward()
                    b = timer.mark()
                    timer.sync()
                    if i:
                        whole.append(timer.seconds(a, b))
            model.zero_grad(set_to_none=True)
            return times, whole

        times, whole = recompute_steps(everything)

        # 2b. An Impl with a StashedRecompute (dropout_mask) is recomputed from its stash, not
        #     run again: the same steps with that Impl, timed apart.
        mask_impl = {op.id: k for op in ops for k, im in enumerate(op.impls)
                     if stashed_recompute_of(im.name) is not None}
        mask_times: dict[int, list] = {}
        if mask_impl:
            impl = tuple(mask_impl.get(op.id, 0) for op in ops)
            mask_times, _ = recompute_steps(schedule_from_keep(
                graph, (), retain="all", impl=impl, mode="full",
                created_by="monetlike.calibrate"))
        in_context = _impls_timed(model, args, kwargs, graph, timer, steps)

    rerun = {j: statistics.median(ts) for j, ts in times.items()}
    rerun_masked = {j: statistics.median(ts) for j, ts in mask_times.items() if j in mask_impl}

    def fitted(runtime: float) -> OpGraph:
        new_ops = []
        for op in ops:
            impls = tuple(dataclasses.replace(
                im, fwd_time=im.fwd_time * alpha, bwd_time=im.bwd_time * beta,
                recompute_time=(rerun_masked[op.id] if k == mask_impl.get(op.id)
                                and op.id in rerun_masked
                                else rerun.get(op.id, im.rerun_time * alpha)) + runtime)
                for k, im in enumerate(op.impls))
            new_ops.append(dataclasses.replace(op, impls=impls))
        return dataclasses.replace(graph, ops=tuple(new_ops))

    # 3. What the recompute-everything steps take beyond their prediction is the runtime's own
    #    work, which no Op's timing holds: an equal share of it is part of each recomputation.
    n_rec = sum(len(st.recompute) for st in everything.stages)
    step_s = statistics.median(whole)
    runtime = max(0.0, step_s - simulate(fitted(0.0), everything).total_time) / max(n_rec, 1)
    graph_fitted, impls_info = _fit_impls(fitted(runtime), in_context)
    meta = dict(graph.meta)
    meta["calibration"] = {
        "forward_scale": alpha, "backward_scale": beta, "steps": steps, "clock": clock,
        "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
        "recompute_timed_ops": len(rerun), "ops": len(ops),
        "recompute_step_s": step_s, "runtime_per_recompute_s": runtime,
        "mask_recompute_timed_ops": len(rerun_masked),
        "impls_in_context": impls_info,
    }
    return dataclasses.replace(graph_fitted, meta=meta)


def _step(model, schedule, graph: OpGraph, args, kwargs):
    wrapped = ScheduleWrapper(model, schedule, graph=graph)

    def step():
        model.zero_grad(set_to_none=True)
        _loss(wrapped(*args, **kwargs)).backward()
    return step


def _beside(reference, others: dict, timer, steps: int) -> dict:
    """Name -> its step's time less the reference step's in the same round, over `steps` rounds
    that each run the reference and every other step once, in an order turned each round and
    reversed every other (load from other processes hits them alike), after one round that
    builds the plans and warms up."""
    order = [None, *others]
    out: dict = {name: [] for name in others}
    for i in range(steps + 1):
        turn = order[i % len(order):] + order[:i % len(order)]
        took = {}
        for name in (turn[::-1] if i % 2 else turn):
            timer.sync()
            a = timer.mark()
            (reference if name is None else others[name])()
            b = timer.mark()
            timer.sync()
            took[name] = timer.seconds(a, b)
        for name in others if i else ():
            out[name].append(took[name] - took[None])
    return out


def _impls_timed(model, args, kwargs, graph: OpGraph, timer, steps: int) -> dict:
    """Impl name -> (the store-all schedule choosing it wherever it applies, the differences of
    its steps over the store-all steps of the defaults run beside them)."""
    chosen: dict[str, list[int]] = {}
    for j, op in enumerate(graph.ops):
        for k, im in enumerate(op.impls):
            if k:
                chosen.setdefault(im.name, [0] * len(graph.ops))[j] = k
    schedules = {name: store_all_schedule(graph, impl)  # in-place clashes back to the default
                 for name, impl in chosen.items()}
    schedules = {name: s for name, s in schedules.items() if any(s.impl)}
    if not schedules:
        return {}
    diffs = _beside(_step(model, store_all_schedule(graph), graph, args, kwargs),
                    {name: _step(model, s, graph, args, kwargs) for name, s in schedules.items()},
                    timer, steps)
    model.zero_grad(set_to_none=True)
    return {name: (s, diffs[name]) for name, s in schedules.items()}


def _fit_impls(graph: OpGraph, in_context: dict) -> tuple[OpGraph, dict]:
    """`graph` with each Impl's forward and backward times moved so that the store-all step
    choosing it predicts what it measured in context (module docstring, 4.), and no Impl
    credited a saving over its Op's default unless its name's saving was measured there."""
    base = simulate(graph, store_all_schedule(graph)).total_time
    times = {(op.id, k): (im.fwd_time, im.bwd_time) for op in graph.ops
             for k, im in enumerate(op.impls) if k}
    saving_measured: set = set()
    info = {}
    for name, (schedule, diffs) in in_context.items():
        predicted = simulate(graph, schedule).total_time - base
        credited = in_context_difference(predicted, diffs)
        on = [j for j, k in enumerate(schedule.impl) if k]
        weight = {j: graph.ops[j].impls[0].fwd_time + graph.ops[j].impls[0].bwd_time for j in on}
        total = sum(weight.values())
        for j in on:
            d = graph.ops[j].impls[0]
            share = (credited - predicted) * (weight[j] / total if total > 0 else 1 / len(on))
            ahead = d.fwd_time / weight[j] if weight[j] > 0 else 0.5
            fwd, bwd = times[(j, schedule.impl[j])]
            times[(j, schedule.impl[j])] = (fwd + share * ahead, bwd + share * (1 - ahead))
            if credited < 0:
                saving_measured.add((j, schedule.impl[j]))
        info[name] = {"ops": len(on), "predicted_s": predicted, "credited_s": credited,
                      "measured_s": statistics.median(diffs)}
    new_ops = []
    for op in graph.ops:
        d, impls = op.impls[0], list(op.impls)
        for k in range(1, len(impls)):
            fwd, bwd = times[(op.id, k)]
            if (op.id, k) not in saving_measured:
                bwd = max(bwd, d.fwd_time + d.bwd_time - fwd)  # no saving credited
            impls[k] = dataclasses.replace(impls[k], fwd_time=max(fwd, 0.0),
                                           bwd_time=max(bwd, 0.0))
        new_ops.append(dataclasses.replace(op, impls=tuple(impls)))
    return dataclasses.replace(graph, ops=tuple(new_ops)), info
