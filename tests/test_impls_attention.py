"""sdpa_mask, sdpa_probs_mask (monetlike/impls/attention.py): attention with dropout holding a
1-byte mask.

The Impls write out the CPU math path of scaled_dot_product_attention with dropout and rebuild
the noise from a bool mask in their backward (sdpa_mask recomputing the probabilities,
sdpa_probs_mask holding them). They change only what is held, so everything must be
bitwise plain PyTorch's: the output, the gradients of query, key, value and a float mask, and
the generator's state afterwards; on shapes, masks, scales, dtypes and layouts drawn by
hypothesis, the same tensor passed as query, key and value included. What they hold must be the
inputs and the mask (and the probabilities); where the call is not the composite they write
out, they run the default.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import monetlike
from monetlike.impls import registry
from monetlike.impls.attention import SdpaMask, SdpaProbsMask
from monetlike.capture.trace import trace
from test_impls import assert_same, bytes_held
from test_impls_internals import with_impl
from runtime_support import PEAK_TOLERANCE, measured_peak, weighted_step
from solver.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")
match_mask, match_probs = registry.get("sdpa_mask").match, registry.get("sdpa_probs_mask").match

NAMES = ("sdpa_mask", "sdpa_probs_mask")


def _step(fn, q, k, v, mask, seed):
    """Output, gradients (query, key, value, float mask: one leaf per distinct tensor) and the
    generator's next draw after a forward and backward of `fn` from generator seed `seed`."""
    leaves, inputs = {}, {}

    def leaf(t):
        if t is None or not t.is_floating_point():
            return t
        if id(t) not in leaves:
            leaves[id(t)] = t.detach().clone().requires_grad_()
            inputs[id(t)] = leaves[id(t)] * 1  # a non-leaf, as the Op's inputs are in a model
        return inputs[id(t)]

    args = [leaf(t) for t in (q, k, v, mask)]
    torch.manual_seed(seed)
    out = fn(*args)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                             dtype=out.dtype))
    return [out, *[t.grad for t in leaves.values()], torch.rand(4)]


def _assert_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(-1).view(torch.uint8) if x.dtype != torch.float64 else
                           x.view(-1).view(torch.int64),
                           y.view(-1).view(torch.uint8) if y.dtype != torch.float64 else
                           y.view(-1).view(torch.int64))


@st.composite
def attention_calls(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    batch = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    L, S, D, Dv = (draw(st.integers(1, 12)) for _ in range(4))
    layout = draw(st.sampled_from(["contiguous", "heads_permuted", "one_tensor"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    if layout == "one_tensor":  # self-attention on the same tensor as query, key and value
        q = k = v = torch.randn(*batch, L, D, generator=g, dtype=dtype)
        S, Dv = L, D
    elif layout == "heads_permuted":  # views of a fused projection, as a model makes them
        fused = torch.randn(*batch, max(L, S), 3, D, generator=g, dtype=dtype)
        q, k = fused[..., :L, 0, :], fused[..., :S, 1, :]
        v = fused[..., :S, 2, :]
        Dv = D
    else:
        q = torch.randn(*batch, L, D, generator=g, dtype=dtype)
        k = torch.randn(*batch, S, D, generator=g, dtype=dtype)
        v = torch.randn(*batch, S, Dv, generator=g, dtype=dtype)
    kind = draw(st.sampled_from(["none", "causal", "bool", "float"]))
    mask, causal = None, kind == "causal"
    if kind == "bool":  # some rows wholly masked: the safe softmax gives zeros there
        mask = torch.rand(L, S, generator=g) > draw(st.sampled_from([0.3, 0.9]))
    elif kind == "float":
        mask = torch.randn(*batch, L, S, generator=g, dtype=dtype)
    scale = draw(st.sampled_from([None, 0.0, 0.37, 2.0]))
    p = draw(st.sampled_from([0.1, 0.5, 0.93]))
    return q, k, v, mask, p, causal, scale


@settings(max_examples=60, deadline=None)
@given(attention_calls())
def test_bitwise_the_default(call):
    q, k, v, mask, p, causal, scale = call

    def default(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p,
                                              is_causal=causal, scale=scale)

    for fn in (SdpaMask, SdpaProbsMask):
        if fn is SdpaProbsMask and not (q.dim() >= 3 and q.shape[:-2] == k.shape[:-2]):
            continue  # not offered there (the matcher runs the default)

        def impl(q, k, v, m):
            return fn.apply(p, causal, scale, q, k, v, m)

        for seed in (0, 1):
            _assert_bits(_step(default, q, k, v, mask, seed), _step(impl, q, k, v, mask, seed))


def test_broadcast_batch_shapes():
    # key and value shared across the batch: sdpa_mask takes the product's gradient through
    # matmul; sdpa_probs_mask is not run (its formulas are bmm's, for one batch shape)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 5, 4, generator=g)
    k, v = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 3, generator=g)

    def default(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2)

    def impl(q, k, v, m):
        return SdpaMask.apply(0.2, False, None, q, k, v, m)

    _assert_bits(_step(default, q, k, v, None, 0), _step(impl, q, k, v, None, 0))
    gm = trace(Heads())
    node = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    args = tuple(t.detach().requires_grad_() for t in (q, k, v))
    out = match_probs(gm, [node])[node.name](gm, node, args, {"dropout_p": 0.2})
    assert type(out.grad_fn).__name__ != "SdpaProbsMaskBackward"  # the default's call


class Heads(nn.Module):
    def __init__(self, p=0.1, **kw):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.p, self.kw = p, kw

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, **self.kw).sum(1)


@pytest.mark.parametrize("name", NAMES)
def test_holds_inputs_and_mask(name):
    # The Op's inputs are views of one fused projection (b x t x 48 fp32) and the mask is
    # b x heads x t x t bytes (sdpa_probs_mask: and the probabilities, 4 bytes each); the
    # default holds no Value but the probabilities, the noise and the dropped probabilities
    # (b x heads x t x t fp32 each), the scaled query and key and a contiguous copy of the value.
    b, t = 3, 7
    torch.manual_seed(0)
    model = Heads().train()
    g = monetlike.profile(model, torch.randn(b, t, 16), cost="measured", repeat=1)
    (op,) = [o for o in g.ops if o.kind == "scaled_dot_product_attention"]
    default = op.impls[0]
    alt = next(im for im in op.impls if im.name == name)
    own = b * 2 * t * t * (1 if name == "sdpa_mask" else 5)
    assert [g.values[v].bytes for v in set(alt.saved)] == [4 * b * t * 48]
    assert alt.internal_bytes == own
    assert default.internal_bytes == 3 * 4 * b * 2 * t * t + 3 * 4 * b * 2 * t * 8

    gm = trace(model)
    node = next(n for n in gm.graph.nodes if n.name == op.name)
    run = (match_mask if name == "sdpa_mask" else match_probs)(gm, [node])[node.name]

    def heads(f):
        return f.unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)

    fused = torch.randn(b, t, 48, requires_grad=True)
    held = bytes_held(lambda f: run(gm, node, tuple(heads(f * 1)), {"dropout_p": 0.1}), fused)
    assert held == 4 * b * t * 48 + own
    plain = bytes_held(lambda f: F.scaled_dot_product_attention(*heads(f * 1), dropout_p=0.1),
                        fused)
    assert plain == default.internal_bytes and default.saved == ()


def test_offered_only_where_it_helps():
    x = torch.randn(2, 5, 16)
    kinds = lambda g: {im.name for o in g.ops for im in o.impls}  # noqa: E731
    names = set(NAMES)
    # No dropout: the CPU's fused kernel, which holds no probabilities.
    assert not names & kinds(monetlike.profile(Heads(p=0.0).train(), x, cost="measured",
                                               repeat=1))
    # A GPU target: its fused kernels regenerate the dropout themselves.
    assert not names & kinds(monetlike.profile(Heads().train(), x,
                                               cost="analytical:A100-40GB"))
    assert names <= kinds(monetlike.profile(Heads().train(), x, cost="measured", repeat=1))


def test_runs_the_default_where_it_does_not_fit():
    # bfloat16 (the math path computes in float32 there) and autocast: the default's call.
    gm = trace(Heads())
    node = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    cases = ((lambda: torch.autocast("cpu", torch.bfloat16), (q, k, v)),
             (torch.no_grad, (q, k, v)),
             (torch.enable_grad, tuple(t.bfloat16() for t in (q, k, v))))
    for (ctx, args), match in itertools.product(cases, (match_mask, match_probs)):
        run = match(gm, [node])[node.name]
        with ctx():
            torch.manual_seed(0)
            got = run(gm, node, args, {"dropout_p": 0.3})
            torch.manual_seed(0)
            want = F.scaled_dot_product_attention(*args, dropout_p=0.3)
        assert torch.equal(got, want)
        assert type(got.grad_fn).__name__ not in ("SdpaMaskBackward", "SdpaProbsMaskBackward")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(scale=0.5)])
def test_exact_through_runtime_with_measured_peak(kw, name):
    torch.manual_seed(0)
    model = Heads(p=0.2, **kw).train()
    x = torch.randn(4, 9, 16).requires_grad_()
    graph = monetlike.profile(model, x, cost="measured", repeat=1)
    schedule, picked = with_impl(graph, name)
    assert picked
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule)
    for seed in (1, 2):  # dropout draws differ between the steps; the masks must match in each
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))
    predicted = simulate(graph, schedule).peak_bytes
    measured = measured_peak(graph, model, wrapped, x)
    assert abs(measured - predicted) <= predicted * PEAK_TOLERANCE, (measured, predicted)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_transformers_models_bitwise(family):
    # Hugging Face models captured by torch.export (aten.scaled_dot_product_attention with
    # dropout: GPT-2's causal attention, Llama's grouped heads, BERT's padding mask), every
    # attention Op on each Impl, two steps: logits and every gradient bit for bit.
    pytest.importorskip("transformers")
    from test_hf_models import hf_batch, hf_loss, hf_model

    torch.manual_seed(0)
    model = hf_model(family).train()
    batch = hf_batch(family, torch.Generator().manual_seed(1))
    graph = monetlike.profile(model, batch, cost="measured", repeat=1)
    for name in NAMES:
        schedule, picked = with_impl(graph, name)
        assert len(picked) == 2  # both layers' attention
        ref, copied = copy.deepcopy(model), copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(copied, schedule, graph=graph)
        for seed in (1, 2):
            for m in (ref, copied):
                m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            want = ref(**batch)
            hf_loss(want).backward()
            torch.manual_seed(seed)
            got = wrapped(**batch)
            hf_loss(got).backward()
            assert torch.equal(got.logits, want.logits)
            for (n, p), (_, q) in zip(copied.named_parameters(), ref.named_parameters()):
                assert (p.grad is None) == (q.grad is None), n
                assert p.grad is None or torch.equal(p.grad, q.grad), n
