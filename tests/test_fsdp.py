"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over ScheduleWrapper on 2 CPU processes (gloo).

`fully_shard(ScheduleWrapper(model, schedule))`: the wrapper shares the model's parameter
dictionaries, so FSDP2 shards the model's own parameters and its all-gather / reshard hooks sit on
the wrapper (a hook on the wrapped model itself is refused by the wrapper: the scheduled forward
would not call it). A schedule that recomputes in every backward stage gives the same sharded
gradients, step after step, as FSDP2 over the unwrapped model. Modelled on tests/test_ddp.py.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_support import WORLD, process_group, run_workers


def _net():
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))


def _worker(rank: int, store_path: str, reshard: bool) -> None:
    import monetlike
    from monetlike import ScheduleWrapper
    from runtime_support import every, keep_schedule
    from torch.distributed.fsdp import fully_shard

    with process_group(store_path, rank):
        torch.manual_seed(0)
        model = _net()
        torch.manual_seed(100 + rank)  # each rank its own data
        x = torch.randn(8, 32)
        graph = monetlike.profile(model, x, cost="analytical:A100-40GB")
        schedule = keep_schedule(graph, every(0), "tight", hold="stage")
        assert sum(len(s.recompute) for s in schedule.stages) > 0
        ref = fully_shard(copy.deepcopy(model), reshard_after_forward=reshard)
        wrapped = fully_shard(ScheduleWrapper(copy.deepcopy(model), schedule, graph=graph),
                              reshard_after_forward=reshard)
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
        opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        for step in range(3):
            for m, opt in ((ref, opt_r), (wrapped, opt_w)):
                opt.zero_grad(set_to_none=True)
                m(x).pow(2).mean().backward()
            for (n, p), (_, q) in zip(ref.named_parameters(), wrapped.named_parameters()):
                # Sharded gradients (DTensors): each rank compares its own shard.
                torch.testing.assert_close(q.grad.to_local(), p.grad.to_local(),
                                           rtol=0, atol=0,
                                           msg=lambda msg: f"step {step} {n}: {msg}")
            opt_r.step()
            opt_w.step()
        assert len(wrapped.plans) == 1  # the scheduled forward ran (one input signature)
        dist.barrier()
        del ref, wrapped, opt_r, opt_w
        gc.collect()


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep-unsharded"])
def test_fsdp2_two_cpu_processes_same_gradients_as_unwrapped_fsdp2(tmp_path, reshard):
    passed = run_workers(_worker, (str(tmp_path / "store"), reshard), "FSDP2")
    assert passed == list(range(WORLD))  # every rank ran its checks to the end
