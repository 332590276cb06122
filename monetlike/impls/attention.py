"""Attention with dropout on the CPU holding a 1-byte dropout mask instead of the noise.

- sdpa_mask: holds the inputs and the mask; the backward recomputes the probabilities.
- sdpa_probs_mask: holds the inputs, the probabilities and the mask; the backward recomputes
  nothing but the noise (from the mask), and takes each gradient by autograd's own formulas.

`scaled_dot_product_attention` with dropout takes the math path on the CPU (the CPU's fused
kernel has no dropout), a composite of aten ops whose autograd nodes hold the probabilities, the
dropout noise (in the input's dtype) and the dropped probabilities: three batch x heads x L x S
tensors. recompute_internals drops all three and runs the whole call again in the backward,
drawing the noise again from the replayed generator state, which on the CPU costs more than the
matmuls (bernoulli_ is not vectorised).

Both run the math path's own ops in their order (so the output is the default's bits and the
generator advances as the default's does) and keep the inputs and the noise as a bool mask.
At its backward stage sdpa_mask rebuilds the probabilities from the inputs and the noise from
the mask (bernoulli gives 0 and 1 exactly, so `mask.to(dtype).div_(1 - p)` is the noise bit for
bit), then backpropagates through the same ops: the default's gradients, bit for bit, with no
random draw. sdpa_probs_mask also keeps the probabilities (one of the default's three
batch x heads x L x S tensors) and so skips their recomputation: its backward applies the
formulas autograd applies to the default's nodes (bmm's, mul's, _safe_softmax's, in
derivatives.yaml) to the same tensors, and leaves to autograd only the scaling and reshaping
of the inputs, rebuilt cheaply, so the gradients reach the inputs in the default's order and
bits.

They apply only where that composite is what the default runs: CPU tensors of one float32 or
float64 dtype, dropout_p a constant in (0, 1), no grouped-query expansion, a non-negative or
default scale, and no autocast (which would cast the inputs before the composite). A call that
does not fit at run time runs the default.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from ..core.torch_private import SAFE_SOFTMAX, SOFTMAX_BACKWARD_DATA
from .internals import _detach, _hidden_hooks, distinct_inputs, first_positions, inputs_from
from .registry import ImplSpec, register

FUNCTIONS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
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


def _same_batch(a: dict) -> bool:
    """Query, key and value of one batch shape, 3-d or more: matmul is then expand, reshape to
    3-d and bmm, whose gradients sdpa_probs_mask takes by bmm's formulas."""
    q, k, v = a["query"], a["key"], a["value"]
    return q.dim() >= 3 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]


def _factor(q, scale) -> float:
    """The math path scales query and key each by the square root of the softmax scale."""
    return math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))


def _as_3d(t):
    """matmul's batched operand: expanded to the batch shape (here its own), then 3-d."""
    return t.expand(t.shape).reshape(-1, *t.shape[-2:])


def _noise(keep, p, dtype):
    """The dropout noise rebuilt from its mask: bernoulli_ gives exactly 0 and 1, then /(1-p)."""
    return keep.to(dtype).div_(1 - p)


def _attention(q, k, v, mask, p, is_causal, scale, keep=None):
    """The CPU math path of scaled_dot_product_attention with dropout, op for op (aten's
    _scaled_dot_product_attention_math): with `keep` None the noise is drawn as it draws it;
    otherwise it is rebuilt from `keep`. Returns (output, keep, probabilities); with `v` None,
    the dropped probabilities instead of the output."""
    factor = _factor(q, scale)
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, torch.zeros((), dtype=q.dtype),
                           torch.full((), -math.inf, dtype=q.dtype))
    attn = torch.matmul(q * factor, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn = attn.add(mask)
    probs = SAFE_SOFTMAX(attn, -1)
    if keep is None:
        noise = torch.empty_like(probs).bernoulli_(1 - p)
        keep = noise.bool()
        noise.div_(1 - p)
    else:
        noise = _noise(keep, p, probs.dtype)
    dropped = probs * noise
    return (dropped if v is None else torch.matmul(dropped, v)), keep, probs


def _value_matmul_roots(dropped, v, grad):
    """Roots and gradients to backpropagate `matmul(dropped, v)` from without computing it.

    The backward needs the product's gradients, not the product: where both operands have the
    same batch shape, matmul is expand, reshape to 3-d, bmm; the roots are the 3-d operands and
    their gradients bmm's backward formulas (derivatives.yaml), on the same tensors, so the
    same bits. Otherwise the product is computed and backpropagated."""
    if dropped.dim() < 3 or dropped.shape[:-2] != v.shape[:-2]:
        out = torch.matmul(dropped, v)
        return [out], [grad]
    d3, v3 = _as_3d(dropped), _as_3d(v)
    g3 = grad.reshape(-1, *grad.shape[-2:])
    pairs = [(d3, lambda: g3.bmm(v3.transpose(1, 2))), (v3, lambda: d3.transpose(1, 2).bmm(g3))]
    roots = [t for t, _ in pairs if t.requires_grad]
    return roots, [g() for t, g in pairs if t.requires_grad]


def _save(ctx, inputs, *extra) -> None:
    """Save each distinct input once (`ctx.same`), then `extra`; no zero-filled gradients."""
    ctx.same = first_positions(inputs)
    ctx.save_for_backward(*distinct_inputs(inputs, ctx.same), *extra)
    ctx.set_materialize_grads(False)


def _gradients(roots, grads, det, need, same):
    """Backpropagate `grads` from `roots` to the positions of `det` that need a gradient (each
    distinct tensor at its first position)."""
    pos = [i for i in range(len(det)) if need[i] and same[i] == i]
    got = torch.autograd.grad(roots, [det[i] for i in pos], grads, allow_unused=True) \
        if pos and roots else [None] * len(pos)
    result = [None] * len(det)
    for i, g in zip(pos, got):
        result[i] = g
    return result


class SdpaMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, is_causal, scale, query, key, value, attn_mask):
        tensors = (query, key, value, attn_mask)
        out, keep, _ = _attention(*tensors, p, is_causal, scale)
        ctx.args = (p, is_causal, scale)
        _save(ctx, tensors, keep)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 7
        *distinct, keep = ctx.saved_tensors
        need = ctx.needs_input_grad[3:]
        with torch.enable_grad(), _hidden_hooks():
            det = _detach(inputs_from(distinct, ctx.same), need, ctx.same)
            q, k, v, mask = det
            dropped, _, _ = _attention(q, k, None, mask, *ctx.args, keep=keep)
            roots, grads = _value_matmul_roots(dropped, v, grad)
        return (None, None, None, *_gradients(roots, grads, det, need, ctx.same))


class SdpaProbsMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, is_causal, scale, query, key, value, attn_mask):
        out, keep, probs = _attention(query, key, value, attn_mask, p, is_causal, scale)
        ctx.args = (p, scale)
        # The mask itself is not needed again, only the shape its gradient is summed to.
        ctx.mask_shape = None if attn_mask is None else attn_mask.shape
        _save(ctx, (query, key, value), probs, keep)
        return out

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * 7
        *distinct, probs, keep = ctx.saved_tensors
        p, scale = ctx.args
        need = ctx.needs_input_grad[3:]
        with torch.enable_grad(), _hidden_hooks():
            det = _detach(inputs_from(distinct, ctx.same), need[:3], ctx.same)
            q, k, v = det
            factor = _factor(q, scale)
            q3, kt3, v3 = _as_3d(q * factor), _as_3d(k.transpose(-2, -1) * factor), _as_3d(v)
        with torch.no_grad():
            # The default's backward nodes, last first: out = bmm(dropped, v) (as 3-d),
            # dropped = probs * noise, probs = _safe_softmax(scores), scores = bmm(q, kt) + mask.
            g3 = grad.reshape(-1, *grad.shape[-2:])
            noise = _noise(keep, p, probs.dtype)
            g_v3 = _as_3d(probs * noise).transpose(1, 2).bmm(g3)
            g_probs = g3.bmm(v3.transpose(1, 2)).reshape(probs.shape) * noise
            del noise
            g_scores = SOFTMAX_BACKWARD_DATA(g_probs, probs, -1, probs.dtype)
            del g_probs
            g_mask = g_scores.sum_to_size(ctx.mask_shape) if need[3] else None
            gs3 = g_scores.reshape(-1, *g_scores.shape[-2:])
            g_q3 = gs3.bmm(kt3.transpose(1, 2))
            g_kt3 = q3.transpose(1, 2).bmm(gs3)
        pairs = [(r, g) for r, g in ((q3, g_q3), (kt3, g_kt3), (v3, g_v3)) if r.requires_grad]
        result = _gradients([r for r, _ in pairs], [g for _, g in pairs], det, need[:3],
                            ctx.same)
        return (None, None, None, *result, g_mask)


def _matcher(function, fits):
    def match(gm, nodes):
        if len(nodes) != 1:
            return None
        n = nodes[0]
        if not (n.op == "call_function" and n.target in FUNCTIONS and _constant_dropout(n)):
            return None

        def run(interp, node, args, kwargs):
            a = _bind(args, kwargs)
            if not fits(a):
                return node.target(*args, **kwargs)
            return function.apply(a["dropout_p"], bool(a["is_causal"]), a["scale"], a["query"],
                                  a["key"], a["value"], a["attn_mask"])

        return {n.name: run}
    return match


_match = _matcher(SdpaMask, _fits)
_match_probs = _matcher(SdpaProbsMask, lambda a: _fits(a) and _same_batch(a))

register(ImplSpec("sdpa_mask", _match,
                  "scaled_dot_product_attention with dropout on the CPU holds its inputs and a "
                  "1-byte dropout mask; its backward recomputes the probabilities and rebuilds "
                  "the noise from the mask, drawing nothing", devices=frozenset({"cpu"}),
                  needs_internals=True))
register(ImplSpec("sdpa_probs_mask", _match_probs,
                  "scaled_dot_product_attention with dropout on the CPU holds its inputs, the "
                  "probabilities and a 1-byte dropout mask; its backward rebuilds only the noise",
                  devices=frozenset({"cpu"}), needs_internals=True))
