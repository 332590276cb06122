"""DistributedDataParallel over ScheduleWrapper on 2 CPU processes (gloo): the same gradients as
DDP over the unwrapped model, with a shared (tied) weight, with find_unused_parameters and with
static_graph, and never the "Expected to mark a variable ready only once" error that reentrant
checkpointing raises under DDP (recomputation here runs under no_grad, never a nested backward).
"""

from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from dist_support import WORLD, process_group, run_workers
CONFIGS = [
    ("plain", {}, False),
    ("find_unused_parameters", {"find_unused_parameters": True}, True),
    ("static_graph", {"static_graph": True}, False),
    # recompute_internals returns parameter gradients from inside its own autograd Function: DDP
    # must see them arrive as from any other node.
    ("recompute_internals", {}, False),
]


class AttnNet(nn.Module):
    """Linear -> nn.MultiheadAttention (dropout) -> Linear, for the recompute_internals Impl."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(32, 32)
        self.mha = nn.MultiheadAttention(32, 4, dropout=0.5, batch_first=True)
        self.dec = nn.Linear(32, 32)

    def forward(self, x):
        h = self.enc(x).unflatten(0, (2, 4))
        return self.dec(self.mha(h, h, h)[0]).flatten(0, 1)


class TiedNet(nn.Module):
    """Encoder and decoder share one weight; optionally a module the forward never uses."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.enc = nn.Linear(32, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Dropout(0.5),
                                  nn.Linear(64, 32), nn.Tanh())
        self.dec = nn.Linear(32, 32)
        self.dec.weight = self.enc.weight  # tied
        self.unused = nn.Linear(32, 32) if unused else None

    def forward(self, x):
        return self.dec(self.body(torch.relu(self.enc(x))))


def _worker(rank: int, store_path: str) -> None:
    import monetlike
    from monetlike import ScheduleWrapper
    from runtime_support import every, keep_schedule

    with process_group(store_path, rank):
        for name, kwargs, unused in CONFIGS:
            torch.manual_seed(0)
            model = AttnNet() if name == "recompute_internals" else TiedNet(unused)
            torch.manual_seed(100 + rank)  # each rank its own data
            x = torch.randn(8, 32)
            graph = monetlike.profile(model, x, cost="analytical:A100-40GB")
            if name == "recompute_internals":
                from test_impls_internals import with_impl

                schedule, picked = with_impl(graph, name)
                assert picked
            else:
                schedule = keep_schedule(graph, every(0), "tight", hold="stage")
                assert sum(len(s.recompute) for s in schedule.stages) > 0
            ref_model = copy.deepcopy(model)
            ref = nn.parallel.DistributedDataParallel(ref_model, **kwargs)
            wrapped = nn.parallel.DistributedDataParallel(
                ScheduleWrapper(copy.deepcopy(model), schedule, graph=graph), **kwargs)
            opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
            opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.05)
            for step in range(3):
                for ddp, opt in ((ref, opt_r), (wrapped, opt_w)):
                    opt.zero_grad(set_to_none=True)
                    torch.manual_seed(1000 * step + rank)  # dropout masks per rank and step
                    ddp(x).pow(2).mean().backward()
                for (n, p), (_, q) in zip(ref.named_parameters(), wrapped.named_parameters()):
                    if p.grad is None:
                        assert q.grad is None, f"{name} step {step}: {n}"
                        continue
                    torch.testing.assert_close(q.grad, p.grad,
                                               msg=lambda m: f"{name} step {step} {n}: {m}")
                opt_r.step()
                opt_w.step()
            # The replicas agree with each other too (DDP averaged the same gradients).
            flat = torch.cat([p.detach().flatten() for p in wrapped.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(WORLD)]
            dist.all_gather(gathered, flat)
            assert torch.equal(gathered[0], gathered[1]), name
            dist.barrier()
            # Drop the DDP reducers (they hold the process group) before destroying it.
            del ref, wrapped, opt_r, opt_w
            gc.collect()


def test_ddp_two_cpu_processes_same_gradients_as_unwrapped_ddp(tmp_path):
    passed = run_workers(_worker, (str(tmp_path / "store"),), "DDP")
    assert passed == list(range(WORLD))  # every rank ran its checks to the end
