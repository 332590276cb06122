"""Helpers for the runtime tests: schedules at three budgets, plain-PyTorch reference steps.

`keep_schedule(graph, keep)` builds a valid schedule that keeps the Values `keep` selects from the
forward pass and recomputes every other Value a backward needs, just before the stage that needs
it, from the kept ones (or from the graph inputs). Recomputed Values are released at the end of
their stage; kept ones after their last use. Outputs of recompute-unsafe Ops are always kept.
- keep everything: store-all (plain PyTorch's memory);
- keep every other needed Value: a middle budget;
- keep nothing: the tightest schedule of this family (each stage recomputes from the inputs).
The simulator validates every schedule made here (with_predictions).
"""

from __future__ import annotations

import copy

import torch

import monetlike
from monetlike.core.torch_private import tensors_in
from solver.graph import OpGraph
from solver.schedule import Schedule, StageSchedule
from solver.simulate import simulate, store_all_schedule, with_predictions


def keep_schedule(graph: OpGraph, keep, mode: str = "test", *, hold: str = "stage") -> Schedule:
    """Keep the Values `keep(v)` selects from the forward pass; recompute the others on demand.

    hold="stage": a recomputed Value is released at the end of the stage that needed it (the
        next stage recomputes again: tight memory, quadratic recomputation).
    hold="last_use": a recomputed Value stays until its last use (each Op recomputed at most
        once: checkpointing by segments).
    """
    ops, values = graph.ops, graph.values
    impl = (0,) * len(ops)
    is_input = [v.producer is None for v in values]
    outputs = set(graph.outputs)
    stage_needs = [[v for v in ops[o].impls[0].saved if not is_input[v]]
                   for o in graph.backward_order]
    needed = {v for n in stage_needs for v in n}
    kept = {v for v in needed if keep(v)}

    def plan_stages() -> list[list[int]]:
        carried: set[int] = set()
        out = []
        for need in stage_needs:
            have = set(kept) | outputs | carried
            todo: set[int] = set()

            def want(v: int):
                if is_input[v] or v in have:
                    return
                j = values[v].producer
                if ops[j].recompute_unsafe:
                    kept.add(v)  # cannot be recomputed: keep it from the forward pass
                    have.add(v)
                    return
                if j in todo:
                    return
                todo.add(j)
                for u in ops[j].inputs:
                    want(u)

            for v in need:
                want(v)
            out.append(sorted(todo))
            if hold == "last_use":
                carried |= {v for j in todo for v in ops[j].outputs}
        return out

    recomputes = plan_stages()
    recomputes = plan_stages()  # again: keeping unsafe outputs may change earlier stages
    last_use: dict[int, int] = {}
    for t, (need, rec) in enumerate(zip(stage_needs, recomputes)):
        for v in need:
            last_use[v] = t
        for j in rec:
            for u in ops[j].inputs:
                if not is_input[u]:
                    last_use[u] = t
    stages = []
    made_so_far: set[int] = set()
    for t, (op_id, rec) in enumerate(zip(graph.backward_order, recomputes)):
        made = {v for j in rec for v in ops[j].outputs}
        made_so_far |= made
        if hold == "stage":
            drop = {v for v in made if v not in outputs and v not in kept}
            drop |= {v for v in kept if last_use.get(v) == t and v not in outputs
                     and v not in made}
        else:
            drop = {v for v in (kept | made_so_far) if v not in outputs
                    and last_use.get(v, t) == t}
            drop |= {v for v in made if v not in outputs and last_use.get(v, -1) < t}
            made_so_far -= drop
        stages.append(StageSchedule(op=op_id, recompute=tuple(rec), drop=tuple(sorted(drop))))
    forward_keep = tuple(sorted(v for v in kept if v in last_use and v not in outputs))
    sched = Schedule(fingerprint=graph.fingerprint, graph_summary=graph.summary(), impl=impl,
                     forward_keep=forward_keep, stages=tuple(stages), mode=mode,
                     created_by=f"tests:{mode}", cost_provenance=graph.cost_provenance)
    return with_predictions(graph, sched)


def every(k: int):
    """A keep predicate selecting every k-th Value it is asked about (k = 0: none)."""
    count = {"i": 0}

    def keep(v: int) -> bool:
        count["i"] += 1
        return k > 0 and count["i"] % k == 0

    return keep


def three_schedules(graph: OpGraph, *, quadratic_limit: int = 40) -> dict[str, Schedule]:
    """store-all; middle (every other needed Value kept, segments recomputed once); tight
    (nothing kept, each stage recomputes from the inputs, for graphs of up to
    `quadratic_limit` ops; else every fourth Value kept, segments recomputed once)."""
    store = with_predictions(graph, store_all_schedule(graph))
    middle = keep_schedule(graph, every(2), "middle", hold="last_use")
    if len(graph.ops) <= quadratic_limit:
        tight = keep_schedule(graph, every(0), "tight", hold="stage")
    else:
        tight = keep_schedule(graph, every(4), "tight", hold="last_use")
    return {"store_all": store, "middle": middle, "tight": tight}


def recomputed_op_count(schedule: Schedule) -> int:
    return sum(len(s.recompute) for s in schedule.stages)


# ----------------------------------------------------------------------------------------------
# Reference steps
# ----------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """torch.manual_seed where CUDA is up; the CPU generator alone otherwise: without CUDA,
    torch.manual_seed queues a lazy seeding per device kind, each with a formatted stack (5 ms
    a call here, 7% of the fuzzer's time)."""
    if torch.cuda.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def step(module, inputs, seed: int, loss_fn=None):
    """One forward and backward with a fixed seed; returns (output, input grads)."""
    seed_everything(seed)
    xs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
    out = module(*xs)
    leaves = tensors_in(out)
    if loss_fn is None:
        loss = sum((o.float() * torch.linspace(0.5, 1.5, o.numel()).view_as(o)).sum()
                   for o in leaves)
    else:
        loss = loss_fn(out)
    loss.backward()
    return [o.detach() for o in leaves], [x.grad for x in xs]


def compare_step(model, wrapped_factory, inputs, seed: int = 0, steps: int = 1, loss_fn=None,
                 exact: bool = False):
    """Run `steps` training steps (SGD) on a copy with plain PyTorch and on a copy wrapped by
    `wrapped_factory(copy)`; assert outputs, input grads, parameter grads and buffers equal."""
    ref = copy.deepcopy(model)
    tst = copy.deepcopy(model)
    wrapped = wrapped_factory(tst)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.01)
    opt_t = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    check = torch.equal if exact else None
    for s in range(steps):
        opt_r.zero_grad(set_to_none=True)
        opt_t.zero_grad(set_to_none=True)
        out_r, gx_r = step(ref, inputs, seed + s, loss_fn)
        out_t, gx_t = step(wrapped, inputs, seed + s, loss_fn)
        _same(out_r, out_t, "output", check)
        _same(gx_r, gx_t, "input grad", check)
        for (n, p), (_, q) in zip(ref.named_parameters(), tst.named_parameters()):
            _same([p.grad], [q.grad], f"grad of {n}", check)
        for (n, b), (_, c) in zip(ref.named_buffers(), tst.named_buffers()):
            _same([b], [c], f"buffer {n}", check)
        opt_r.step()
        opt_t.step()
    return wrapped


def profiled_case(factory, shape, cost: str, **kw):
    """`factory()` in training mode (seed 0), an input of `shape` that asks for its gradient (so
    that it is compared too), and their profile (`monetlike.profile`'s keywords in `kw`)."""
    torch.manual_seed(0)
    model = factory().train()
    x = torch.randn(*shape).requires_grad_()
    return model, x, monetlike.profile(model, x, cost=cost, **kw)


def profiled_impl_case(cases: dict, case: str, cost: str):
    """`profiled_case` for `cases[case]`, a (factory, shape, Impl name): (model, x, graph, name)."""
    factory, shape, name = cases[case]
    return (*profiled_case(factory, shape, cost), name)


def compare_schedule(model, schedule: Schedule, inputs, graph: OpGraph | None = None, **kw):
    """compare_step with the copy wrapped by ScheduleWrapper at `schedule`."""
    return compare_step(model, lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph),
                        inputs, **kw)


def _same(a, b, what, check):
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None, f"{what}: one is None ({x is None}, {y is None})"
            continue
        if check is not None:
            assert check(x, y), f"{what}: not bitwise equal, max diff {(x - y).abs().max()}"
        else:
            torch.testing.assert_close(y, x, msg=lambda m: f"{what}: {m}")


def peak_of(graph: OpGraph, schedule: Schedule) -> int:
    return simulate(graph, schedule).peak_bytes


def impl_schedules(graph: OpGraph, name: str) -> tuple[list[int], list[Schedule]]:
    """(the Ops that run Impl `name`, [store-all, keep-nothing]) with that Impl on every Op that
    has it; keep-nothing recomputes, in its backward stages, every Value they read (the Impl's
    Op included)."""
    from solver.analysis import GraphFacts
    from solver.rules.simple import schedule_from_keep

    impl = tuple(next((i for i, im in enumerate(op.impls) if im.name == name), 0)
                 for op in graph.ops)
    picked = [j for j, i in enumerate(impl) if i]
    facts = GraphFacts(graph, "full")
    store = store_all_schedule(graph, impl)
    nothing = schedule_from_keep(graph, (), impl=impl, retain="none", facts=facts)
    return picked, [with_predictions(graph, s, mode="full") for s in (store, nothing)]


def weighted_step(module, x, seed):
    """One training step on a copy of `x` with a loss weighting each output element differently
    (so no gradient is uniform): (output, input gradient, parameter gradients (None where a
    parameter got none), buffers), detached copies."""
    for p in module.parameters():
        p.grad = None
    xx = x.detach().clone().requires_grad_()
    seed_everything(seed)
    out = module(xx)
    (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum().backward()
    return (out.detach(), xx.grad,
            [None if p.grad is None else p.grad.clone() for p in module.parameters()],
            [b.clone() for b in module.buffers()])


# Measured against simulated peak on the CPU, where storages are counted exactly (no allocator
# rounding): the largest difference seen is 0.6% below the simulator (workspace as measured in
# the profile vs at run time).
PEAK_TOLERANCE = 0.01


def measured_peak(graph: OpGraph, model, wrapped, inputs, seed: int = 3, loss_fn=None) -> int:
    """Peak of one training step as the simulator counts it: the model's fixed memory plus
    everything the step allocates (memory held by other objects of the test process excluded).

    The step holds the model's outputs until its backward is done, as a training loop does
    (`out = model(x); loss_fn(out).backward()`) and as the simulator assumes; a step that
    dropped them before the backward (`model(x).sum().backward()`) measures less by their
    bytes. A warm-up step builds the runtime's plan; both steps draw the same random numbers.
    `loss_fn` (of the outputs) replaces the sum, as `monetlike.profile(loss_fn=...)` does.
    """
    inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)

    def step():
        out = wrapped(*inputs)
        if loss_fn is not None:
            loss_fn(out).backward()
            return
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        sum(o.float().sum() for o in leaves).backward()

    seed_everything(seed)
    step()
    for p in model.parameters():
        p.grad = None
    for x in inputs:
        x.grad = None
    seed_everything(seed)
    m = monetlike.measure_step(step, warmup=0, repeat=0)  # the peak only: no timed runs
    return m.peak_bytes - m.start_bytes + graph.fixed_bytes
