"""sdpa_mask: attention with dropout on the CPU holding its inputs and a 1-byte dropout mask.

`scaled_dot_product_attention` with dropout takes the math path on the CPU (the CPU's fused
kernel has no dropout), a composite of aten ops whose autograd nodes hold the probabilities, the
dropout noise (in the input's dtype) and the dropped probabilities: three batch x heads x L x S
tensors. recompute_internals drops all three and runs the whole call again in the backward,
drawing the noise again from the replayed generator state, which on the CPU costs more than the
matmuls (bernoulli_ is not vectorised).

This Impl runs the math path's own ops in their order (so its output is the default's bits and
the generator advances as the default's does), keeps the inputs and the noise as a bool mask,
and at its backward stage rebuilds the probabilities from the inputs and the noise from the mask
(bernoulli gives 0 and 1 exactly, so `mask.to(dtype).div_(1 - p)` is the noise bit for bit), then
backpropagates through the same ops: the default's gradients, bit for bit, with no random draw.

It applies only where that composite is what the default runs: CPU tensors of one float32 or
float64 dtype, dropout_p a constant in (0, 1), no grouped-query expansion, a non-negative or
default scale, and no autocast (which would cast the inputs before the composite). A call that
does not fit at run time runs the default.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .internals import _detach, _hidden_hooks
from .registry import ImplSpec, register

_ATEN = torch.ops.aten
FUNCTIONS = (F.scaled_dot_product_attention, _ATEN.scaled_dot_product_attention.default)
_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
_DTYPES = (torch.float32, torch.float64)


def _bind(args, kwargs) -> dict:
    bound = dict(_DEFAULTS)
    bound.update(zip(_ARGS, args))
    bound.update(kwargs)
    return bound


def _constant_dropout(node) -> bool:
    p = _bind(node.args, node.kwargs).get("dropout_p")
    return isinstance(p, numbers.Real) and not isinstance(p, bool) and 0.0 < p < 1.0


def _fits(a: dict) -> bool:
    """Whether this call runs the CPU math path with dropout that `_attention` writes out."""
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.is_nested:
        return False
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if any(t.device.type != "cpu" for t in (q, k, v)) or torch.is_autocast_enabled("cpu"):
        return False
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.device.type == "cpu"
                                 and mask.dtype in (torch.bool, q.dtype) and not a["is_causal"]):
        return False
    p, scale = a["dropout_p"], a["scale"]
    return (isinstance(p, numbers.Real) and 0.0 < p < 1.0 and not a["enable_gqa"]
            and (scale is None or scale >= 0) and q.dim() >= 2 and torch.is_grad_enabled())


def _attention(q, k, v, mask, p, is_causal, scale, keep=None):
    """The CPU math path of scaled_dot_product_attention with dropout, op for op (aten's
    _scaled_dot_product_attention_math): with `keep` None the noise is drawn as it draws it;
    otherwise it is rebuilt from `keep`. Returns (output, keep); with `v` None, the dropped
    probabilities instead of the output."""
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), dtype=q.dtype),
                           torch.full((), -math.inf, dtype=q.dtype))
    attn = torch.matmul(q * factor, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn = attn.add(mask)
    attn = _ATEN._safe_softmax(attn, -1)
    if keep is None:
        noise = torch.empty_like(attn).bernoulli_(1 - p)
        keep = noise.bool()
    else:
        noise = keep.to(attn.dtype)
    noise.div_(1 - p)
    dropped = attn * noise
    return (dropped if v is None else torch.matmul(dropped, v)), keep


def _value_matmul_roots(dropped, v, grad):
    """Roots and gradients to backpropagate `matmul(dropped, v)` from without computing it.

    The backward needs the product's gradients, not the product: where both operands have the
    same batch shape, matmul is expand, reshape to 3-d, bmm; the roots are the 3-d operands and
    their gradients bmm's backward formulas (derivatives.yaml), on the same tensors, so the
    same bits. Otherwise the product is computed and backpropagated."""
    if dropped.dim() < 3 or dropped.shape[:-2] != v.shape[:-2]:
        out = torch.matmul(dropped, v)
        return [out], [grad]
    d3 = dropped.expand(dropped.shape).reshape(-1, *dropped.shape[-2:])
    v3 = v.expand(v.shape).reshape(-1, *v.shape[-2:])
    g3 = grad.reshape(-1, *grad.shape[-2:])
    pairs = [(d3, lambda: g3.bmm(v3.transpose(1, 2))), (v3, lambda: d3.transpose(1, 2).bmm(g3))]
    roots = [t for t, _ in pairs if t.requires_grad]
    return roots, [g() for t, g in pairs if t.requires_grad]


class SdpaMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, is_causal, scale, query, key, value, attn_mask):
        tensors = (query, key, value, attn_mask)
        out, keep = _attention(*tensors, p, is_causal, scale)
        # As in recompute_internals: one saved tensor per distinct input, so that the backward
        # sees the same tensor where the forward did and autograd sums its gradients in the
        # default's order.
        first: dict[int, int] = {}
        ctx.same = [first.setdefault(id(t), i) if t is not None else i
                    for i, t in enumerate(tensors)]
        ctx.none = [t is None for t in tensors]
        ctx.args = (p, is_causal, scale)
        ctx.save_for_backward(*[t for i, t in enumerate(tensors)
                                if t is not None and ctx.same[i] == i], keep)
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 7
        *distinct, keep = ctx.saved_tensors
        it = iter(distinct)
        inputs = [None] * 4
        for i in range(4):
            if not ctx.none[i]:
                inputs[i] = next(it) if ctx.same[i] == i else inputs[ctx.same[i]]
        need = ctx.needs_input_grad[3:]
        with torch.enable_grad(), _hidden_hooks():
            det = _detach([t if t is not None else torch.empty(0) for t in inputs], need,
                          ctx.same)
            det = [None if ctx.none[i] else t for i, t in enumerate(det)]
            q, k, v, mask = det
            dropped, _ = _attention(q, k, None, mask, *ctx.args, keep=keep)
            roots, grads = _value_matmul_roots(dropped, v, grad)
        pos = [i for i in range(4) if need[i] and ctx.same[i] == i]
        got = torch.autograd.grad(roots, [det[i] for i in pos], grads, allow_unused=True) \
            if pos and roots else [None] * len(pos)
        result = [None] * 4
        for i, g in zip(pos, got):
            result[i] = g
        return (None, None, None, *result)


def _match(gm, nodes):
    if len(nodes) != 1:
        return None
    n = nodes[0]
    if not (n.op == "call_function" and n.target in FUNCTIONS and _constant_dropout(n)):
        return None

    def run(interp, node, args, kwargs):
        a = _bind(args, kwargs)
        if not _fits(a):
            return node.target(*args, **kwargs)
        return SdpaMask.apply(a["dropout_p"], bool(a["is_causal"]), a["scale"], a["query"],
                              a["key"], a["value"], a["attn_mask"])

    return {n.name: run}


register(ImplSpec("sdpa_mask", _match,
                  "scaled_dot_product_attention with dropout on the CPU holds its inputs and a "
                  "1-byte dropout mask; its backward recomputes the probabilities and rebuilds "
                  "the noise from the mask, drawing nothing", devices=frozenset({"cpu"}),
                  needs_internals=True))
