"""The analytical profile's run on the meta device, made to save what the target GPU would save.

An analytical profile plans for a preset CUDA GPU (costs.PRESETS) but runs on the meta device,
where some functions take another kernel than CUDA would, and so save other tensors for their
backward. `GpuLike` is a TorchFunctionMode active during that run which routes them to the kernel
the GPU would run:

- `F.dropout` in training mode: CUDA's fused `native_dropout` keeps a bool mask (1 byte per
  element); the meta device (as the CPU) computes `x * bernoulli_noise` and keeps the noise in
  the input's dtype. Only `internal_bytes` differs.
- `F.scaled_dot_product_attention` (NOTE [Attention on the meta device]).

NOTE [Attention on the meta device]
The dispatcher picks SDPA's kernel by device (`torch._fused_sdp_choice`); on meta it returns the
math path, which saves the softmax matrix (batch x heads x L x S) and internal copies, so the
graph said the Op's backward needs none of q, k, v. The fused kernels CUDA picks (flash,
memory-efficient) save q, k, v, the output and a logsumexp of batch x heads x L floats, as the
CPU's fused kernel does: a schedule solved on the math path's graph dropped q, k, v and failed
at run time. Here the choice is made as PyTorch's CUDA dispatcher makes it for the preset
(the priority order and the enabled backends are read from torch's own settings, so
`torch.nn.attention.sdpa_kernel` applies; `sdpa_backend` transcribes the main checks of
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp for dense inputs: dtype by compute
capability, head dims, masks, grouped-query heads), and the fused aten op is called the way the
composite `scaled_dot_product_attention` calls it (attention.cpp: flash pads the head dim to a
multiple of 8; memory-efficient makes a bool mask additive and aligns its rows). The fused ops
have meta kernels and autograd formulas, so the run saves what the kernel's backward takes.
Where CUDA would take the math path (a dtype or shape no fused kernel supports), the call is
left alone.

Not modelled: cuDNN attention (after math in torch's default order, so never chosen by default)
and nested tensors (which do not run on meta). The flash meta kernel returns its output in the
query's layout, as CUDA does for a dense query; for a query that is a slice of a larger tensor
CUDA's output is (batch, L, heads, dim)-contiguous and the meta one is contiguous, which can add
a copy (an Op) downstream on meta that CUDA does not make.

The fused aten ops `_scaled_dot_product_{flash,efficient}_attention` are called here (checked
against torch 2.14's meta registrations); torch's SDPA priority order, which has no public getter,
is read through `torch_private.sdp_priority_order`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from ..core.torch_private import sdp_priority_order

__all__ = ["GpuLike", "sdpa_backend"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                  "enable_gqa": False}
# Both spellings a capture can record: torch.fx keeps the function, torch.export the aten op.
_SDPA_FUNCS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention,
               torch.ops.aten.scaled_dot_product_attention.default)
_HALF = (torch.float16, torch.bfloat16)


class GpuLike(TorchFunctionMode):
    """During an analytical profile, run dropout and attention with the kernels the preset GPU
    would run (see the module docstring). `compute_capability`: the GPU's (major, minor)."""

    def __init__(self, compute_capability: tuple[int, int] = (8, 0)):
        super().__init__()
        self.cc = tuple(compute_capability)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            names = ("input", "p", "training", "inplace")
            a = dict(zip(names, args), **kwargs)
            x, p = a.get("input"), a.get("p", 0.5)
            if (a.get("training", True) and not a.get("inplace", False)
                    and isinstance(x, torch.Tensor) and 0 < p < 1 and x.numel() > 0):
                return torch.native_dropout(x, p, True)[0]
        elif func in _SDPA_FUNCS:
            a = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}
            backend = sdpa_backend(self.cc, **a) if set(a) == set(_SDPA_ARGS) else "math"
            if backend == "flash":
                return _flash(**a)
            if backend == "efficient":
                return _efficient(**a)
        return func(*args, **kwargs)


def _enabled_order() -> list[str]:
    """The fused backends CUDA would try, in torch's priority order, up to math (always usable)."""
    b = SDPBackend
    enabled = {b.FLASH_ATTENTION: ("flash", torch.backends.cuda.flash_sdp_enabled()),
               b.EFFICIENT_ATTENTION: ("efficient",
                                       torch.backends.cuda.mem_efficient_sdp_enabled()),
               b.MATH: ("math", torch.backends.cuda.math_sdp_enabled())}
    out = []
    for backend in sdp_priority_order():
        name, on = enabled.get(backend, (None, False))
        if on:
            out.append(name)
        if name == "math" and on:
            break
    return out


def _dense_ok(q, k, v, enable_gqa: bool, gqa_ok: bool) -> bool:
    """sdp_utils' shape checks shared by flash and memory-efficient on dense inputs."""
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested for t in ts):
        return False
    if any(t.stride(-1) != 1 or t.size(-2) == 0 for t in ts):
        return False
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if q.size(1) == k.size(1) == v.size(1):
        return True
    # Grouped-query attention: fewer key/value heads, which only some kernels take.
    return (gqa_ok and enable_gqa and k.size(1) == v.size(1) and k.size(1) > 0
            and q.size(1) % k.size(1) == 0)


def _gemm_alignment(cc, dtype) -> int:
    """sdp_utils' minimum_gemm_alignment: the head-dim multiple memory-efficient attention
    needs (tensor cores on sm80+, and for half types on sm70)."""
    half = dtype in _HALF
    tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and half)
    align = 4 if cc[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def sdpa_backend(cc, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False) -> str:
    """'flash', 'efficient' or 'math': the kernel PyTorch's CUDA dispatcher picks for these
    inputs on a GPU of compute capability `cc`."""
    q, k, v = query, key, value
    for name in _enabled_order():
        if name == "flash":
            if (cc >= (8, 0) and attn_mask is None and _dense_ok(q, k, v, enable_gqa, True)
                    and q.dtype in _HALF and q.dtype == k.dtype == v.dtype
                    and q.size(-1) == k.size(-1) == v.size(-1) <= 256
                    and not (is_causal and q.size(-2) != k.size(-2))):
                return "flash"
        elif name == "efficient":
            dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if cc >= (8, 0) else ())
            align = _gemm_alignment(cc, q.dtype) if isinstance(q, torch.Tensor) else 1
            if (cc >= (5, 0) and _dense_ok(q, k, v, enable_gqa, False)
                    and q.dtype in dtypes and q.dtype == k.dtype == v.dtype
                    and q.size(-1) == k.size(-1) and q.size(-1) % align == 0
                    and v.size(-1) % align == 0):
                return "efficient"
        else:
            return name
    return "math"


def _flash(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """attention.cpp's flash branch on CUDA: head dim padded to a multiple of 8, the scale
    computed from the original head dim, the output sliced back."""
    d = query.size(-1)
    pad = (-d) % 8
    q, k, v = ((F.pad(t, (0, pad)) if pad else t) for t in (query, key, value))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :d] if pad else out


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """attention.cpp's memory-efficient branch: the logsumexp only when a backward will need it;
    a bool mask made additive, its rows 8-aligned, broadcast to (batch, heads, L, S)."""
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if attn_mask is not None:
        attn_mask = _efficient_mask(attn_mask, query, key)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, lse, dropout_p, is_causal, scale=scale)[0]


def _efficient_mask(mask, query, key):
    if mask.dtype == torch.bool:  # convert_boolean_attn_mask: True -> 0, False -> -inf
        mask = torch.where(mask, 0.0, torch.full((), float("-inf"), dtype=query.dtype,
                                                 device=mask.device))
    # preprocess_mask: rows padded to a multiple of 8 unless aligned, then a broadcast view.
    if any(s % 8 != 0 for s in mask.stride()[:-1]) or mask.stride(-1) != 1:
        n = mask.size(-1)
        mask = F.pad(mask, (0, 8 - n % 8))[..., :n]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))
