"""DistributedDataParallel over a ScheduleWrapper: each process trains its shard under a schedule.

    torchrun --nproc_per_node 2 examples/dist_training.py --model resnet18 --batch 16 --steps 3
    torchrun --nproc_per_node 2 examples/dist_training.py --budget 120MiB --check

gloo on the CPU, NCCL on GPUs (one process per GPU). Rank 0 profiles the model and makes the
schedule (solved for `--budget` with measured costs, or Chen's sqrt(n) checkpointing without
one) and broadcasts it, so every rank runs the same schedule. The order matters: wrap first, then
DDP (`DistributedDataParallel(ScheduleWrapper(model, schedule))`): gradients flow through ordinary
autograd, so DDP's hooks fire as each gradient becomes ready and overlap is kept.

With `--check`, each step also runs DDP over the unwrapped model from the same parameters and
rank 0 prints the largest gradient difference (expected 0).
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import monetlike
import solver
from monetlike.modelspec import build_model


def make_schedule(model, x, budget, cache_dir) -> solver.Schedule:
    """Rank 0's schedule for this model and per-rank batch."""
    graph = monetlike.profile(model, x, cost="measured", optimizer="sgd")
    if budget:
        from monetlike.optimize import solve_cached

        return solve_cached(graph, budget, cache_dir=cache_dir)
    try:
        from solver.baselines import chen_sqrt_n
    except ImportError:  # pragma: no cover - only before the baselines existed
        return solver.store_all_schedule(graph)
    return chen_sqrt_n(graph).schedule


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet18", help="model factory, e.g. resnet18")
    ap.add_argument("--batch", type=int, default=8, help="batch size per process")
    ap.add_argument("--image-size", type=int, default=64, help="input height and width")
    ap.add_argument("--classes", type=int, default=10, help="number of classes")
    ap.add_argument("--budget", default=None,
                    help="memory budget per process, e.g. 120MiB (default: sqrt(n) checkpoints)")
    ap.add_argument("--steps", type=int, default=3, help="training steps")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    ap.add_argument("--cache-dir", default=None, help="schedule cache (default ~/.cache/monetlike)")
    ap.add_argument("--check", action="store_true",
                    help="also run unwrapped DDP and print the largest gradient difference")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        torch.manual_seed(0)  # the same initial parameters on every rank
        model = build_model(args.model, num_classes=args.classes).to(device)
        g = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of data
        x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device)
        y = torch.randint(0, args.classes, (args.batch,), generator=g).to(device)

        box = [make_schedule(model, x, args.budget, args.cache_dir).to_dict()
               if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # plain JSON-able dict, never a pickled object
        schedule = solver.Schedule.from_dict(box[0])

        reference = copy.deepcopy(model) if args.check else None
        net = DDP(monetlike.ScheduleWrapper(model, schedule),
                  device_ids=[local] if cuda else None)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        if reference is not None:
            ref = DDP(reference, device_ids=[local] if cuda else None)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
        losses, diffs = [], []
        for step in range(args.steps):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(1000 * step + rank)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            if reference is not None:
                ref_opt.zero_grad(set_to_none=True)
                torch.manual_seed(1000 * step + rank)
                F.cross_entropy(ref(x), y).backward()
                diff = max(float((p.grad - q.grad).abs().max())
                           for p, q in zip(ref.parameters(), net.parameters())
                           if p.grad is not None)
                diffs.append(diff)
                ref_opt.step()
            opt.step()
            losses.append(loss.item())
            if rank == 0:
                extra = f", max |grad diff| vs unwrapped DDP {diffs[-1]:.3g}" if diffs else ""
                print(f"step {step}: loss {loss.item():.4f} (rank 0 of {world}){extra}",
                      flush=True)
        return {"losses": losses, "grad_diffs": diffs, "mode": schedule.mode}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
