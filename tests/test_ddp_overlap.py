"""DDP over ScheduleWrapper keeps gradient communication overlapped with the backward pass.

How it is checked: DDP with small buckets (one per layer here) and a communication hook that logs
each bucket's all-reduce as it is launched; a gradient hook on the first layer's weight logs when
the backward reaches the first layer (the last gradient computed). With overlap, buckets of later
layers are all-reduced before that point, while the backward is still running. The order of the
log is compared with DDP over the plain model: the same, under a schedule that recomputes in
every backward stage. 2 CPU processes, gloo, as tests/test_ddp.py.
"""

from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_support import WORLD, process_group, run_workers


def _net():
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _log_of(ddp, first_weight, x, steps=3):
    """The launch order of bucket all-reduces and of the first layer's gradient, last step."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    log: list = []

    def comm(state, bucket):
        log.append(f"allreduce bucket {bucket.index()}")
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(dist.group.WORLD, comm)
    first_weight.register_hook(lambda g: log.append("first layer gradient"))
    for _ in range(steps):  # DDP rebuilds its buckets after the first step
        log.clear()
        for p in ddp.parameters():
            p.grad = None
        ddp(x).pow(2).mean().backward()
    return list(log)


def _worker(rank: int, store_path: str) -> None:
    import monetlike
    from monetlike import ScheduleWrapper
    from runtime_support import every, keep_schedule

    with process_group(store_path, rank):
        torch.manual_seed(0)
        model = _net()
        x = torch.randn(8, 32)
        graph = monetlike.profile(model, x, cost="analytical:A100-40GB")
        schedule = keep_schedule(graph, every(0), "tight", hold="stage")
        assert sum(len(s.recompute) for s in schedule.stages) > 0
        # 64x64 fp32 weights are 16 KiB: a 20 KB cap makes several buckets (DDP merges some).
        cap = 20e3 / 2**20
        plain_model = copy.deepcopy(model)
        plain = nn.parallel.DistributedDataParallel(plain_model, bucket_cap_mb=cap)
        wrapped_model = copy.deepcopy(model)
        wrapped = nn.parallel.DistributedDataParallel(
            ScheduleWrapper(wrapped_model, schedule, graph=graph), bucket_cap_mb=cap)
        log_plain = _log_of(plain, plain_model[0].weight, x)
        log_wrapped = _log_of(wrapped, wrapped_model[0].weight, x)
        assert log_wrapped == log_plain, (log_plain, log_wrapped)
        first = log_wrapped.index("first layer gradient")
        assert len([e for e in log_wrapped if e.startswith("allreduce")]) >= 2, log_wrapped
        # Seen here: ['allreduce bucket 0', 'first layer gradient', 'allreduce bucket 1']: the
        # later layers' bucket was launched while the backward was still running.
        assert first >= 1 and log_wrapped[0].startswith("allreduce"), log_wrapped
        dist.barrier()
        del plain, wrapped
        gc.collect()


def test_ddp_all_reduces_buckets_during_the_backward_as_without_the_wrapper(tmp_path):
    passed = run_workers(_worker, (str(tmp_path / "store"),), "DDP")
    assert passed == list(range(WORLD))  # every rank ran its checks to the end
