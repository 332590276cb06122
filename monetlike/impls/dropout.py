"""dropout_regen: Dropout whose backward regenerates its mask from the saved RNG state.

The default holds the mask (CPU and meta: the scaled noise in the input's dtype; CUDA: a bool
mask). This one holds the generator state from just before the forward drew its numbers (CPU, and
the input's CUDA device when there is one, as torch.utils.checkpoint does) and in the backward
runs the very same dropout call on a tensor of ones laid out like the input, under that state:
the result is the scaled noise bit for bit, and grad * noise is what the default backward
computes. The current RNG state is put back afterwards.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import ImplSpec, register


class DropoutRegen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p):
        states = [torch.get_rng_state()]
        if x.is_cuda:
            states.append(torch.cuda.get_rng_state(x.device))
        y = F.dropout(x, p, True, False)
        ctx.geom = (tuple(x.shape), tuple(x.stride()), x.dtype, x.device, p)
        ctx.save_for_backward(*states)
        return y

    @staticmethod
    def backward(ctx, grad):
        states = ctx.saved_tensors
        shape, stride, dtype, device, p = ctx.geom
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(states[0])
            if devices:
                torch.cuda.set_rng_state(states[1], device)
            ones = torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(1)
            noise = F.dropout(ones, p, True, False)
        del ones
        return grad * noise, None


def _match(gm, nodes):
    if len(nodes) != 1:
        return None
    n = nodes[0]
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is not nn.Dropout or mod.inplace or not mod.training or n.kwargs \
                or len(n.args) != 1:
            return None
        p = float(mod.p)
    elif n.op == "call_function" and n.target is F.dropout:
        names = ("input", "p", "training", "inplace")
        a = dict(zip(names, n.args), **n.kwargs)
        if a.get("inplace", False) is not False or a.get("training", True) is not True:
            return None
        p = a.get("p", 0.5)
        if not isinstance(p, (int, float)):
            return None
        p = float(p)
    else:
        return None
    if not 0.0 < p < 1.0:
        return None

    def run(interp, node, args, kwargs):
        x = args[0] if args else kwargs["input"]
        return DropoutRegen.apply(x, p)

    return {n.name: run}


register(ImplSpec("dropout_regen", _match,
                  "Dropout regenerating its mask from the saved RNG state in the backward"))
