"""Shared by the compiled runtime's tests: small models, gradients, and one compiled step with
its peak by the CPU allocator's own events."""

from __future__ import annotations

import torch
import torch.nn as nn

from monetlike.core.allocator import AllocatorLog

PEAK_TOLERANCE = 0.02


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 512),
                         nn.Tanh(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 10))


class Summed(nn.Module):
    """`net` with its loss, the sum of its outputs, inside: compiled, the step's whole memory is
    the compiled graphs' (a loss taken outside allocates beside them)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).sum()


def loss(out: torch.Tensor) -> torch.Tensor:
    """The sum of a model's output (the output itself when it is a scalar loss already)."""
    return out if out.dim() == 0 else out.sum()


def grads(model) -> list[torch.Tensor | None]:
    """The parameters' gradients (copies; None where none reached one), cleared on the model."""
    out = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def eager_grads(model, x, seed=1):
    torch.manual_seed(seed)
    loss(model(x)).backward()
    return grads(model)


def run_twice(compiled, model, x, seed=1):
    """(gradients of a first step of `compiled`, the transient peak of a second, by the
    allocator's events: what the step allocates above the parameters and input)."""
    torch.manual_seed(seed)
    loss(compiled(x)).backward()
    first = grads(model)
    torch.manual_seed(seed)
    with AllocatorLog() as log:
        log.mark("start")
        out = compiled(x)
        loss(out).backward()
        log.mark("end")
    del out
    grads(model)
    return first, log.peak_between("start", "end")


def compiled_step(model, x, backend, seed=1):
    """run_twice on `model` compiled with `backend` (Dynamo's caches reset first)."""
    torch._dynamo.reset()
    return run_twice(torch.compile(model, backend=backend), model, x, seed)


def within(measured: int, predicted: int) -> bool:
    return abs(measured - predicted) <= PEAK_TOLERANCE * predicted
