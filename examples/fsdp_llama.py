"""FSDP2 over a ScheduleWrapper: one rank's memory predicted, then measured, on a Llama-style model.

    torchrun --nproc-per-node 2 examples/fsdp_llama.py
    torchrun --nproc-per-node 2 examples/fsdp_llama.py --layers 4 --budget-fraction 0.8
    torchrun --nproc-per-node 2 examples/fsdp_llama.py --bf16    # MixedPrecisionPolicy(bfloat16)

gloo on the CPU. Each rank profiles the unsharded model with `fsdp=FSDPConfig(world_size=N)`: the
graph's memory is then one rank's (parameters, gradients and optimizer state sharded at 1/N, the
all-gathered parameters and FSDP2's collective buffers where they live), so the budget is a
per-rank peak. The schedule is solved for a fraction of the store-all per-rank peak and run as
`fully_shard(ScheduleWrapper(model, schedule))` (the wrapper as FSDP2's root unit). Each rank
prints its predicted and measured peak (the CPU allocator's own events, monetlike.measure_step)
and then compares its sharded gradients with FSDP2 over the unwrapped model.

Also printed: the prediction for each block a unit of its own (`fully_shard(layers[i])`), as
torchtitan shards a Llama, measured with plain FSDP2 (the wrapper does not run inside per-block
units yet).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import monetlike
import solver
from monetlike.llama_tiny import llama_tiny
from solver.simulate import simulate, store_all_schedule


def measured_peak(model, x) -> int:
    """Peak bytes of one step above its start (the step keeps its output until the backward)."""

    def step():
        out = model(x)
        out.sum().backward()
        del out

    step()  # warm-up: the wrapper's plan, FSDP2's lazy state
    for p in model.parameters():
        p.grad = None
    m = monetlike.measure_step(step, warmup=0, repeat=0)
    return m.peak_bytes - m.start_bytes


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model on every rank
    base = llama_tiny(layers=args.layers, dim=args.dim, hidden=args.hidden)
    torch.manual_seed(100 + rank)  # each rank its own tokens
    x = torch.randint(0, 256, (args.batch, args.tokens))
    mib = 2 ** 20

    dtype = torch.bfloat16 if args.bf16 else None
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype)} if dtype else {}
    config = monetlike.FSDPConfig(world_size=world, backend="gloo", param_dtype=dtype)
    graph = monetlike.profile(base, x, repeat=1, fsdp=config)
    plain = simulate(graph, store_all_schedule(graph))
    store_all = plain.peak_bytes
    budget = int(store_all * args.budget_fraction)
    result = solver.solve(graph, budget, mode="checkpoint", time_limit_s=args.time_limit)
    schedule = result.schedule
    timeline = simulate(graph, schedule)
    predicted = timeline.peak_bytes
    wrapped = fully_shard(monetlike.ScheduleWrapper(copy.deepcopy(base), schedule, graph=graph),
                          **mp)
    measured = measured_peak(wrapped, x) + graph.fixed_bytes
    ref = fully_shard(copy.deepcopy(base), **mp)
    ref(x).sum().backward()
    diff = max((q.grad.to_local() - p.grad.to_local()).abs().max().item()
               for p, q in zip(ref.parameters(), wrapped.parameters()))
    print(f"rank {rank}: root unit, budget {budget / mib:.3f} MiB per rank (store-all "
          f"{store_all / mib:.3f}): predicted peak {predicted / mib:.3f} MiB, measured "
          f"{measured / mib:.3f} MiB ({(measured - predicted) / predicted:+.2%}), overhead "
          f"{timeline.total_time / plain.total_time - 1:+.1%} of a step, max gradient "
          f"difference vs FSDP2 {diff}", flush=True)

    units = tuple(f"layers.{i}" for i in range(args.layers))
    blocks = monetlike.profile(base, x, repeat=1, fsdp=monetlike.FSDPConfig(
        world_size=world, units=units, backend="gloo", param_dtype=dtype))
    predicted = simulate(blocks, store_all_schedule(blocks)).peak_bytes
    model = copy.deepcopy(base)
    for layer in model.layers:
        fully_shard(layer, **mp)
    fully_shard(model, **mp)
    measured = measured_peak(model, x) + blocks.fixed_bytes
    print(f"rank {rank}: per-block units, store-all (plain FSDP2): predicted peak "
          f"{predicted / mib:.3f} MiB, measured {measured / mib:.3f} MiB "
          f"({(measured - predicted) / predicted:+.2%})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=3, help="transformer blocks")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--hidden", type=int, default=176, help="SwiGLU hidden width")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--tokens", type=int, default=32, help="tokens per sequence")
    p.add_argument("--budget-fraction", type=float, default=0.85,
                   help="the per-rank budget as a fraction of the store-all per-rank peak")
    p.add_argument("--time-limit", type=float, default=20, help="solver seconds")
    p.add_argument("--bf16", action="store_true",
                   help="FSDP2 mixed precision with bfloat16 parameters (float32 shards)")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(parse_args())
