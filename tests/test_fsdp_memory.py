"""One rank's memory under FSDP2, predicted by `profile(..., fsdp=FSDPConfig(...))`, against the
CPU allocator's own events on 2 gloo ranks (monetlike.measure_step), on a small Llama-style model.

- The root unit alone, `fully_shard(ScheduleWrapper(model, schedule))` (what the wrapper runs
  under FSDP2 today): store-all and two solved budgets, each rank's measured peak within 2% of the
  simulator's (they agree to the byte here), the schedules within their budgets, and the sharded
  gradients bitwise equal to `fully_shard(model)` without the wrapper.
- Each block its own unit (`fully_shard(layers[i])`, then the root), plain FSDP2: the
  store-all prediction against the measured step (the wrapper does not run inside per-block
  units yet: tests/test_fsdp.py's wrapper is the root unit).

The step holds the model's output until its backward is done, as the profile assumes; the
measured peak counts what the step allocates above its start, plus the graph's fixed memory
(the sharded parameters), as tests/runtime_support.py measures a wrapped step.
"""

from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist

from dist_support import WORLD, process_group, run_workers

LAYERS = 3


def _measured(model, x) -> int:
    import monetlike

    def step():
        out = model(x)
        out.sum().backward()
        del out

    step()  # warm-up: the wrapper builds its plan, FSDP2 its lazy state
    for p in model.parameters():
        p.grad = None
    m = monetlike.measure_step(step, warmup=0, repeat=0)
    return m.peak_bytes - m.start_bytes


def _worker(rank: int, store_path: str) -> None:
    import monetlike
    import solver
    from monetlike.llama_tiny import llama_tiny
    from solver.simulate import simulate, store_all_schedule
    from torch.distributed.fsdp import fully_shard

    with process_group(store_path, rank):
        torch.manual_seed(0)
        base = llama_tiny(layers=LAYERS, dim=64, hidden=176)
        torch.manual_seed(100 + rank)  # each rank its own data
        x = torch.randint(0, 256, (4, 32))

        # -- the root unit: the wrapper under FSDP2, store-all and two solved budgets ----------
        config = monetlike.FSDPConfig(world_size=WORLD, backend="gloo")
        graph = monetlike.profile(base, x, repeat=1, fsdp=config)
        store_all = store_all_schedule(graph)
        peak = simulate(graph, store_all).peak_bytes
        # the sharded fixed memory and the unsharded parameters are both in the prediction
        full = sum(p.numel() * p.element_size() for p in base.parameters())
        assert graph.param_bytes * WORLD == full  # every dim 0 here is a multiple of WORLD
        schedules = [store_all]
        for budget in (int(peak * 0.9), int(peak * 0.82)):
            res = solver.solve(graph, budget, mode="checkpoint", time_limit_s=10)
            assert res.status in ("optimal", "feasible-at-time-limit"), res.status
            assert simulate(graph, res.schedule).peak_bytes <= budget
            assert sum(len(s.recompute) for s in res.schedule.stages) > 0
            schedules.append(res.schedule)
        ref = fully_shard(copy.deepcopy(base))
        ref(x).sum().backward()
        for schedule in schedules:
            predicted = simulate(graph, schedule).peak_bytes
            wrapped = fully_shard(monetlike.ScheduleWrapper(copy.deepcopy(base), schedule,
                                                            graph=graph))
            measured = _measured(wrapped, x) + graph.fixed_bytes
            assert abs(measured - predicted) <= 0.02 * predicted, \
                f"rank {rank} {schedule.mode}: measured {measured}, predicted {predicted}"
            for (n, p), (_, q) in zip(ref.named_parameters(), wrapped.named_parameters()):
                torch.testing.assert_close(q.grad.to_local(), p.grad.to_local(), rtol=0, atol=0,
                                           msg=lambda msg: f"{schedule.mode} {n}: {msg}")
            del wrapped
            gc.collect()

        # -- each block a unit, plain FSDP2: the store-all prediction ---------------------------
        units = tuple(f"layers.{i}" for i in range(LAYERS))
        blocks = monetlike.profile(base, x, repeat=1, fsdp=monetlike.FSDPConfig(
            world_size=WORLD, units=units, backend="gloo"))
        predicted = simulate(blocks, store_all_schedule(blocks)).peak_bytes
        model = copy.deepcopy(base)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        measured = _measured(model, x) + blocks.fixed_bytes
        assert abs(measured - predicted) <= 0.02 * predicted, \
            f"rank {rank} per-block units: measured {measured}, predicted {predicted}"
        assert predicted < peak  # resharding each block after its forward pays here
        dist.barrier()


def test_fsdp2_per_rank_peak_matches_the_allocator_on_two_gloo_ranks(tmp_path):
    passed = run_workers(_worker, (str(tmp_path / "store"),), "FSDP2 memory")
    assert passed == list(range(WORLD))
