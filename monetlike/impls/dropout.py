"""Dropout Impls: what the backward holds instead of the default's noise.

- dropout_regen: the backward regenerates the mask from the saved RNG state.
- dropout_mask: the backward holds a bool mask (1 byte per element).

dropout_regen:

The default holds the mask (CPU and meta: the scaled noise in the input's dtype; CUDA: a bool
mask). This one holds the generator state from just before the forward drew its numbers (CPU, and
the input's CUDA device when there is one, as torch.utils.checkpoint does) and in the backward
runs the very same dropout call on a tensor of ones laid out like the input, under that state:
the result is the scaled noise bit for bit, and grad * noise is what the default backward
computes. The current RNG state is put back afterwards.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import ImplSpec, StashedRecompute, register
from ..core.allocator import AllocatorLog


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


class DropoutMask(torch.autograd.Function):
    """Dropout holding a bool mask, 1 byte per element, where the CPU default holds the scaled
    noise in the input's dtype (4 bytes per element in fp32).

    The forward is `native_dropout`: on the CPU it draws the same numbers from the generator as
    `F.dropout` (noise = bernoulli(1 - p) / (1 - p), output = input * noise) and so returns the
    same bits, and on CUDA it is what `F.dropout` calls. The backward must also give the
    default's bits: on the CPU the default is `grad * noise`, and `(grad * mask) * s` with s the
    noise's nonzero value (1 / (1 - p) rounded in the input's dtype, as the noise computes it) is
    the same product element by element (grad * 1 is exact; a dropped element gives grad * 0,
    sign and NaN included). On CUDA the default's backward is `native_dropout_backward`.
    """

    @staticmethod
    def forward(ctx, x, p, stash=None):
        y, mask = torch.native_dropout(x, p, True)
        ctx.p = p
        ctx.save_for_backward(mask)
        # NOTE [Recomputed from the mask]: the runtime may recompute the output from the mask
        # while it is held; handed over here, let go in this backward, as autograd lets go.
        ctx.stash = stash
        if stash is not None:
            stash[0][stash[1]] = mask
        return y

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        p = ctx.p
        if ctx.stash is not None:
            ctx.stash[0].pop(ctx.stash[1], None)
        if grad.is_cuda:  # pragma: no cover - no GPU here; the default's own backward there
            return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - p)), None, None
        scale = torch.ones((), dtype=grad.dtype, device=grad.device).div_(1.0 - p)
        return (grad * mask).mul_(scale), None, None


# NOTE [Recomputed from the mask]
# A dropout run with dropout_mask holds its 1-byte mask until its own backward, after every
# consumer's (when its input requires grad; otherwise nothing holds it). A recomputation of its
# output for a consumer's stage can then apply the mask instead of drawing the numbers again:
# `x.mul(mask).mul_(1 / (1 - p))` is native_dropout's own CPU arithmetic, so its bits are the
# forward's (tests/test_dropout_recompute.py; CPU tensors in float32 and float64 only: in
# bfloat16 native_dropout rounds otherwise, and CUDA's kernel is another; there the runtime
# draws again). Nothing is drawn, so the generator state is not set either. Besides its output
# it allocates the mask cast to x's dtype (CPU kernels cast mixed operands in a temporary):
# `mask_recompute_scratch` measures that by the allocator's count, as the profile records it.
MASK_RECOMPUTE_DTYPE_NAMES = ("float32", "float64")


def mask_recomputable(dtype_name: str, requires_grad: bool) -> bool:
    """Whether a dropout_mask output of this dtype is recomputed from its mask (on the CPU):
    only a dropout with a backward holds its mask (no backward would let go of it otherwise)."""
    return requires_grad and dtype_name in MASK_RECOMPUTE_DTYPE_NAMES


def dropout_from_mask(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """The output of `native_dropout(x, p, True)` that drew `mask`, without drawing."""
    return x.mul(mask).mul_(1.0 / (1.0 - p))


@functools.lru_cache(maxsize=None)  # a model's dropouts share a few shapes
def mask_recompute_scratch(shape: tuple, dtype_name: str) -> int:
    """Bytes `dropout_from_mask` allocates on the CPU beyond its output, for an input of this
    shape and dtype, by the CPU allocator's own count (monetlike.allocator)."""

    x = torch.zeros(shape, dtype=getattr(torch, dtype_name))
    mask = torch.ones(shape, dtype=torch.bool)
    log = AllocatorLog(collect=False)
    with log:
        out = dropout_from_mask(x, mask, 0.5)
        del out
    return max(0, log.peak() - x.nbytes)


# Argument names: F.dropout's, and aten.dropout's, which torch.export keeps (a Hugging Face
# model's dropouts); both draw the same numbers (F.dropout calls it).
_FUNCTIONS = {F.dropout: ("input", "p", "training", "inplace"),
              torch.ops.aten.dropout.default: ("input", "p", "train")}


def dropout_p(gm, nodes) -> "float | None":
    """p of an Op that is one training-mode, out-of-place dropout with 0 < p < 1, else None."""
    if len(nodes) != 1:
        return None
    n = nodes[0]
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if type(mod) is not nn.Dropout or mod.inplace or not mod.training or n.kwargs \
                or len(n.args) != 1:
            return None
        p = float(mod.p)
    elif n.op == "call_function" and n.target in _FUNCTIONS:
        names = _FUNCTIONS[n.target]
        a = dict(zip(names, n.args), **n.kwargs)
        if a.get("inplace", False) is not False or a.get(names[2], True) is not True:
            return None
        p = a.get("p", 0.5)
        if not isinstance(p, (int, float)):
            return None
        p = float(p)
    else:
        return None
    if not 0.0 < p < 1.0:
        return None
    return p


def _matcher(function):
    """The `match` of an Impl that runs `function.apply(x, p)` in place of the dropout node."""

    def match(gm, nodes):
        p = dropout_p(gm, nodes)
        if p is None:
            return None

        def run(interp, node, args, kwargs):
            x = args[0] if args else kwargs["input"]
            if function is DropoutMask:  # NOTE [Recomputed from the mask]
                # Checked on the tensor too: a recomputation finding the mask applies it and
                # sets no generator state to draw again (autocast can make x bfloat16 here).
                stash = getattr(interp, "stash_for", None)
                if stash is None or x.device.type != "cpu" or not mask_recomputable(
                        str(x.dtype).removeprefix("torch."),
                        x.requires_grad and torch.is_grad_enabled()):
                    return function.apply(x, p)
                return function.apply(x, p, stash(node))
            return function.apply(x, p)

        return {nodes[0].name: run}

    return match


# Registration order is the order of an Op's extra Impls (part of the fingerprint): regen first,
# as before the mask existed, so schedules solved then keep their Impl indices.
register(ImplSpec("dropout_regen", _matcher(DropoutRegen),
                  "Dropout regenerating its mask from the saved RNG state in the backward"))
# Offered on CPU profiles only: CUDA's dropout already holds a bool mask.
register(ImplSpec("dropout_mask", _matcher(DropoutMask),
                  "Dropout holding a 1-byte bool mask instead of the noise in the input dtype",
                  devices=frozenset({"cpu"}),
                  stashed_recompute=StashedRecompute(  # NOTE [Recomputed from the mask]
                      applies=mask_recomputable, argument=dropout_p, run=dropout_from_mask,
                      scratch=mask_recompute_scratch)))
