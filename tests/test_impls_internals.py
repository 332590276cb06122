"""recompute_internals (monetlike/impls/internals.py): exact results, declared bytes, the optimum.

Ops whose backward holds large internal tensors (attention probabilities, RNN gates, a whole
Transformer layer kept by fx as one leaf) may instead hold only their inputs and run their
forward again at their backward stage. Outputs must be bitwise plain PyTorch's and gradients
equal to it, dropout included (the RNG state is replayed); what the backward holds must be the
inputs plus the saved RNG state; and on a tiny hand-derived graph the solver must pick it exactly
where it is the optimum.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monetlike
from monetlike.impls import registry
import solver
from solver import InfeasibleBudgetError, simulate, store_all_schedule
from solver.backends import available
from solver_cases import GraphBuilder
from solver_reference import exact_min_peak, exact_optimum
from runtime_support import profiled_case, weighted_step
from test_impls import assert_same, bytes_held

pytestmark = pytest.mark.usefixtures("one_thread")

A100 = "analytical:A100-40GB"
NAME = "recompute_internals"


def with_impl(graph, name: str):
    """Store-all schedule (for the Impls chosen) with Impl `name` on every Op that has it: this
    Impl saves the Op's inputs, which the default may not, so store-all must keep them."""
    from dataclasses import replace

    from solver.simulate import with_predictions

    impl = tuple(next((i for i, im in enumerate(op.impls) if im.name == name), 0)
                 for op in graph.ops)
    s = replace(store_all_schedule(graph, impl), mode="full", created_by="tests:impl")
    return with_predictions(graph, s), [j for j, i in enumerate(impl) if i]


class Attn(nn.Module):
    """Linear -> nn.MultiheadAttention (self-attention) -> Linear; the weights are used too."""

    def __init__(self, dropout=0.1, need_weights=True, batch_first=True):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.mha = nn.MultiheadAttention(32, 4, dropout=dropout, batch_first=batch_first)
        self.out = nn.Linear(32, 8)
        self.need_weights = need_weights

    def forward(self, x):
        h = self.inp(x)
        a, w = self.mha(h, h, h, need_weights=self.need_weights)
        y = self.out(a)
        # a constant branch: fx traces through it (`w is None` would be a traced Proxy test)
        return y + w.square().mean() if self.need_weights else y


class Sdpa(nn.Module):
    def __init__(self, dropout_p=0.1):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.p = dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p).sum(1)


class HandAttn(nn.Module):
    """Attention written by hand, as nanoGPT does: the matmuls reshape their permuted operands
    into contiguous copies, which their backwards hold (internals, not Values)."""

    def __init__(self, method=False):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.method = method

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        if self.method:
            att = torch.matmul(q, k.transpose(-2, -1)).softmax(-1)
            y = F.dropout(att, 0.1, self.training).matmul(v)
        else:
            att = (q @ k.transpose(-2, -1)).softmax(-1)
            y = torch.einsum("bhts,bhsd->bhtd", F.dropout(att, 0.1, self.training), v)
        return y.sum(1)


class Rnn(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = kind(16, 12, num_layers=2, dropout=0.2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1,
                                                batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.layer(x))


X_SEQ = (3, 7, 16)
CASES = {
    "mha_weights_dropout": (lambda: Attn(), X_SEQ),
    "mha_no_weights_no_dropout": (lambda: Attn(dropout=0.0, need_weights=False), X_SEQ),
    "mha_seq_first": (lambda: Attn(batch_first=False), X_SEQ),
    "sdpa_dropout": (lambda: Sdpa(), X_SEQ),
    "hand_attention": (lambda: HandAttn(), X_SEQ),
    "hand_attention_methods": (lambda: HandAttn(method=True), X_SEQ),
    "lstm": (lambda: Rnn(nn.LSTM), X_SEQ),
    "gru": (lambda: Rnn(nn.GRU), X_SEQ),
    "transformer_encoder_layer": (lambda: Encoder(), X_SEQ),
}


# RNNs with measured CPU costs too: oneDNN saves other tensors than the meta device's
# decomposition, and the wrapper then takes the structure from a CPU profile
# (tests/test_unseen_models.py); this Impl reruns them with grad, so bit for bit.
RUNS = [(c, cost) for c in CASES for cost in ("measured", A100)]


@pytest.mark.parametrize("case,cost", RUNS)
def test_exact_through_runtime(case, cost):
    factory, shape = CASES[case]
    model, x, graph = profiled_case(factory, shape, cost,
                                    **({"repeat": 1} if cost == "measured" else {}))
    schedule, picked = with_impl(graph, NAME)
    assert picked, f"{NAME} did not apply to {case}"
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule)
    for seed in (1, 2):  # dropout draws differ between the steps; the masks must match in each
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


class ExportedAttention(nn.Module):
    """Attention and dropout as a Hugging Face model writes them, captured with torch.export:
    the graph holds aten.scaled_dot_product_attention (dropout inside, so its CPU math path
    holds the probabilities and the noise) and aten.dropout nodes, not the functionals."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
        return self.out(F.dropout(y.transpose(1, 2).flatten(2), 0.3, self.training))


@pytest.mark.parametrize("name", [NAME, "sdpa_mask", "sdpa_probs_mask", "dropout_regen",
                                  "dropout_mask"])
def test_exported_attention_and_dropout_get_their_impls(name):
    torch.manual_seed(0)
    model = ExportedAttention().train()
    x = torch.randn(*X_SEQ).requires_grad_()
    graph = monetlike.profile(model, x, cost="measured", repeat=1, capture="export")
    assert graph.meta["capture"] == "export"
    kinds = {op.kind: [im.name for im in op.impls] for op in graph.ops}
    assert {NAME, "sdpa_mask", "sdpa_probs_mask"} <= set(
        kinds["scaled_dot_product_attention.default"])
    assert {"dropout_regen", "dropout_mask"} <= set(kinds["dropout.default"])
    sdpa = next(op for op in graph.ops if op.kind == "scaled_dot_product_attention.default")
    alt = next(im for im in sdpa.impls if im.name == NAME)
    assert alt.internal_bytes < sdpa.impls[0].internal_bytes
    schedule, picked = with_impl(graph, name)
    assert picked
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
    for seed in (1, 2):  # dropout draws differ between the steps; the masks must match in each
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))
    from runtime_support import PEAK_TOLERANCE, measured_peak
    predicted = simulate(graph, schedule).peak_bytes
    measured = measured_peak(graph, model, wrapped, x)
    assert abs(measured - predicted) <= predicted * PEAK_TOLERANCE, (measured, predicted)


def test_exact_when_its_input_is_recomputed():
    # The Op's input h is not kept from the forward pass: the schedule recomputes its producer
    # just before the Op's stage, and the Impl's saved input is reached through a handle to the
    # recomputed Value (bitwise the forward's).
    from dataclasses import replace

    from runtime_support import keep_schedule
    from solver.simulate import with_predictions

    torch.manual_seed(0)
    model = Attn().train()
    x = torch.randn(*X_SEQ).requires_grad_()
    graph = monetlike.profile(model, x, cost=A100)
    mha = next(o for o in graph.ops if o.kind == "MultiheadAttention")
    (h,) = set(mha.inputs)
    producer = graph.values[h].producer
    k = next(i for i, im in enumerate(mha.impls) if im.name == NAME)
    assert graph.ops[mha.id].impls[k].saved == (h,)
    base = keep_schedule(graph, keep=lambda v: v != h, mode="full")
    assert h not in base.forward_keep
    stages = tuple(replace(st, recompute=tuple(sorted({*st.recompute, producer})),
                           drop=tuple(sorted({*st.drop, h})))
                   if st.op == mha.id else st for st in base.stages)
    s = with_predictions(graph, replace(base, stages=stages, impl=tuple(
        k if j == mha.id else 0 for j in range(len(graph.ops)))))
    assert any(producer in st.recompute for st in s.stages)
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, s)
    for seed in (1, 2):
        assert_same(weighted_step(ref_model, x, seed), weighted_step(wrapped, x, seed))


def test_declared_bytes():
    torch.manual_seed(0)
    model = Attn(dropout=0.1).train()
    b, l, e, heads = 3, 7, 32, 4
    x = torch.randn(b, l, 16)
    g = monetlike.profile(model, x, cost="measured", repeat=1)
    mha = next(o for o in g.ops if o.kind == "MultiheadAttention")
    default, alt = mha.impls
    assert alt.name == NAME
    rng = torch.get_rng_state().numel()  # the CPU generator state, bytes (uint8)
    # It holds the Op's input Value (h, b x l x e fp32: the same tensor as query, key and value)
    # and the RNG state, nothing else.
    assert alt.saved == mha.inputs[:1] and g.values[alt.saved[0]].bytes == 4 * b * l * e
    assert alt.internal_bytes == rng
    # The default holds at least the attention probabilities and their dropout noise
    # (b x heads x l x l fp32 each); whatever else it holds, the alternative holds less.
    assert default.internal_bytes >= 2 * 4 * b * heads * l * l
    # The same, counted directly from autograd's saved tensors: the Function holds h and the
    # RNG state; the plain module far more.
    h = torch.randn(b, l, e, requires_grad=True)
    mod = model.mha
    match = registry.get("recompute_internals").match
    from monetlike.capture.trace import trace

    # The replacement the registry gives the runtime for this Op, called as the runtime calls it.
    gm = trace(model)
    node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "mha")
    run = match(gm, [node])[node.name]

    def with_impl(t):
        u = t * 1  # a fresh tensor, so that the Function's saved input is not the leaf
        return run(gm, node, (u, u, u), {})[0]

    params = tuple(mod.parameters())
    held = bytes_held(with_impl, h, fixed=params)
    assert held == 4 * b * l * e + rng
    plain = bytes_held(lambda t: mod(t * 1, t * 1, t * 1)[0], h, fixed=params)
    assert plain >= 2 * 4 * b * heads * l * l + 4 * b * l * e


def test_declared_bytes_hand_written_matmul():
    # q @ k^T on permuted heads: the default's backward holds contiguous copies of q and k (two
    # b x h x t x d fp32 tensors, internals); the Impl holds the fused projection (the Value the
    # heads are views of) and nothing else. Both counted from autograd's saved tensors too.
    torch.manual_seed(0)
    model = HandAttn().train()
    b, t = X_SEQ[:2]
    g = monetlike.profile(model, torch.randn(*X_SEQ), cost="measured", repeat=1)
    mm = next(o for o in g.ops if o.kind == "matmul")
    default, alt = mm.impls
    assert alt.name == NAME and alt.internal_bytes == 0
    assert [g.values[v].bytes for v in alt.saved] == [4 * b * t * 48]
    assert default.saved == () and default.internal_bytes == 2 * 4 * b * 2 * t * 8

    match = registry.get("recompute_internals").match
    from monetlike.capture.trace import trace

    gm = trace(model)
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.name == mm.name)
    run = match(gm, [node])[node.name]

    def heads(fused):
        q, k, _ = fused.unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
        return q, k.transpose(-2, -1)

    fused = torch.randn(b, t, 48, requires_grad=True)
    held = bytes_held(lambda f: run(gm, node, heads(f * 1), {}), fused)
    assert held == 4 * b * t * 48
    plain = bytes_held(lambda f: torch.matmul(*heads(f * 1)), fused)
    assert plain == default.internal_bytes
    # Where the operands are contiguous nothing is held besides them: the Impl is not offered.
    class Contiguous(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return (x.tanh() @ self.w).sum(-1)

    g2 = monetlike.profile(Contiguous(), torch.randn(*X_SEQ), cost=A100)
    (mm2,) = [o for o in g2.ops if o.kind == "matmul"]
    assert [im.name for im in mm2.impls] == ["default"] and mm2.impls[0].internal_bytes == 0


def test_matching_refuses_what_it_cannot_do():
    match = registry.get("recompute_internals").match
    from monetlike.capture.trace import trace

    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 4)
            self.rnn.register_buffer("steps", torch.zeros(()))  # state it might update

        def forward(self, x):
            return self.rnn(x)[0]

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(4, 1)
            self.mha.register_forward_hook(lambda m, i, o: None)  # must not run twice

        def forward(self, x):
            return self.mha(x, x, x)[0]

    for m in (WithBuffer(), Hooked(), nn.Sequential(nn.Linear(4, 4))):
        gm = trace(m)
        for n in gm.graph.nodes:
            if n.op in ("call_module", "call_function"):
                assert match(gm, [n]) is None, n.format_node()


# ----------------------------------------------------------------------------------------------
# The hand-derived optimum (torch-free, as tests/test_impls_catalogue.py)
# ----------------------------------------------------------------------------------------------
def attention_graph():
    # x (input, 0) -> op0 (saves x) -> a (40) -> op1 "attention" -> o (40) -> op2 (saves nothing,
    # backward workspace 70) -> y (1, output). Stage gradient bytes 50, 50, 0; times 1.
    # op1 default: saves a, holds internals 60. recompute_internals: saves a, holds 1 (the RNG
    # state); its forward builds the internals and lets go (forward workspace 60); its backward
    # rebuilds them (backward workspace 60) and costs 2 (forward again + backward).
    # default: forward op1 a+o+60 = 140, op2 a+o+y+60 = 141; after the forward (o saved by
    #   nobody) a+y+60 = 101; stage op2 101+50+70 = 221; stage op1 151. Peak 221, time 6.
    # recompute_internals: forward op1 a+o+1+60 = 141, op2 a+o+y+1 = 82; after a+y+1 = 42;
    #   stage op2 42+50+70 = 162; stage op1 42+50+60 = 152. Peak 162, time 7.
    #   Dropping a and recomputing it (op0 from x) at stage op1: stage op2 2+50+70 = 122, stage
    #   op1 2+a+50+60 = 152, forward 141: peak 152, time 8 (the least memory in full mode).
    # Checkpoint (default only): the 60 are held from the forward to stage op1 whatever is
    #   dropped; dropping a: stage op2 y+60+50+70 = 181, stage op1 y+60+50+a = 151: least 181.
    b = GraphBuilder("attention")
    x = b.input("x", 0)
    a = b.op("op0", [x], 40, saved=("in0",))
    o = b.op("op1", [a], 40, impls=[
        dict(name="default", saved=("in0",), internal_bytes=60),
        dict(name=NAME, saved=("in0",), internal_bytes=1, fwd_workspace=60, bwd_workspace=60,
             bwd_time=2.0),
    ])
    b.op("op2", [o], 1, saved=(), bwd_ws=70)
    return b.build(outputs=[len(b.values) - 1], stage_grad_bytes=[50, 50, 0])


# (budget, {mode: optimal time or None}, Impl picked by full mode)
OPTIMA = [(170, {"full": 7.0, "checkpoint": None}, NAME),
          (152, {"full": 8.0, "checkpoint": None}, NAME),
          (221, {"full": 6.0, "checkpoint": 6.0}, None)]


def test_min_budgets():
    g = attention_graph()
    hi = simulate(g, store_all_schedule(g)).peak_bytes
    assert hi == 221
    assert exact_min_peak(g, mode="full", hi=hi) == 152 == solver.min_budget(g, "full")
    assert exact_min_peak(g, mode="checkpoint", hi=hi) == 181 == solver.min_budget(g, "checkpoint")


@pytest.mark.parametrize("case", OPTIMA, ids=lambda c: str(c[0]))
@pytest.mark.parametrize("mode", ["full", "checkpoint"])
def test_reference_search_agrees(case, mode):
    budget, times, _ = case
    ref = exact_optimum(attention_graph(), budget, mode=mode)
    if times[mode] is None:
        assert ref is None
    else:
        assert ref is not None and ref[0] == pytest.approx(times[mode])


@pytest.mark.parametrize("backend", available())
@pytest.mark.parametrize("case", OPTIMA, ids=lambda c: str(c[0]))
def test_every_backend_picks_it(case, backend):
    budget, times, picked = case
    g = attention_graph()
    r = solver.solve(g, budget, mode="full", backend=backend, time_limit_s=30, mip_gap=0)
    assert r.status == "optimal" and r.objective == pytest.approx(times["full"], abs=1e-9)
    tl = simulate(g, r.schedule)
    assert tl.peak_bytes <= budget and tl.total_time == pytest.approx(times["full"])
    names = {g.ops[j].impls[i].name for j, i in enumerate(r.schedule.impl) if i}
    assert names == ({picked} if picked else set())
    if times["checkpoint"] is None:
        with pytest.raises(InfeasibleBudgetError):
            solver.solve(g, budget, mode="checkpoint", backend=backend, time_limit_s=30)


def test_autocast_bf16():
    # Under autocast the rerun in the backward must cast as the forward did (pytorch#141896):
    # the Impl replays the forward's autocast state, so outputs and gradients equal a plain
    # autocast step.
    torch.manual_seed(0)
    model = Encoder().train()
    x = torch.randn(*X_SEQ, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        graph = monetlike.profile(model, (x,), cost="measured", repeat=1)
    schedule, picked = with_impl(graph, NAME)
    assert picked
    ref_model = copy.deepcopy(model)
    wrapped = monetlike.ScheduleWrapper(model, schedule)

    def step(module, seed):
        for p in module.parameters():
            p.grad = None
        torch.manual_seed(seed)
        xx = x.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(xx)
            loss = out.float().pow(2).mean()
        loss.backward()
        return out.detach(), xx.grad, [p.grad for p in module.parameters()]

    for seed in (1, 2):
        (oa, ga, pa), (ob, gb, pb) = step(ref_model, seed), step(wrapped, seed)
        assert ob.dtype == torch.bfloat16 and torch.equal(oa, ob)
        torch.testing.assert_close(gb, ga, rtol=0, atol=0)
        for p, q in zip(pa, pb):
            torch.testing.assert_close(q, p, rtol=0, atol=0)


class EncoderStack(nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True)
                                     for _ in range(depth)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_end_to_end_full_mode_below_checkpoints_least_peak():
    # fx keeps each TransformerEncoderLayer whole, so checkpoint mode cannot go below store-all
    # by much; full mode picks recompute_internals and goes far lower, with exact gradients and
    # the runtime's measured peak where the simulator puts it.
    from runtime_support import PEAK_TOLERANCE, measured_peak

    torch.manual_seed(0)
    model = EncoderStack().train()
    x = torch.randn(4, 64, 32).requires_grad_()
    g = monetlike.profile(model, x, cost="measured", repeat=1)
    low_ckpt = solver.min_budget(g, "checkpoint", time_limit_s=30)
    low_full = solver.min_budget(g, "full", time_limit_s=30)
    assert low_full < 0.7 * low_ckpt, (low_full, low_ckpt)
    for budget in (low_full, (low_full + low_ckpt) // 2):
        r = solver.solve(g, budget, mode="full", time_limit_s=30)
        s = r.schedule
        picked = {g.ops[j].impls[k].name for j, k in enumerate(s.impl) if k}
        assert NAME in picked
        predicted = simulate(g, s).peak_bytes
        assert predicted <= budget
        ref = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(model, s)
        assert_same(weighted_step(ref, x, 5), weighted_step(wrapped, x, 5))
        measured = measured_peak(g, model, wrapped, x)
        assert measured <= predicted * (1 + PEAK_TOLERANCE), (measured, predicted)
        if all(g.ops[j].impls[k].name == NAME for j, k in enumerate(s.impl)
               if g.ops[j].kind == "TransformerEncoderLayer"):
            # Known, safe-side, not fixed: a layer left on its default Impl holds 1.38 MB of
            # internals that its own backward frees node by node, while the simulator holds
            # them to the end of its stage and adds the stage's gradient peak on top (a 30 s
            # solve under load picked such a schedule: 2.18 MB predicted, 1.73 MB measured).
            # With every layer on recompute_internals the peak is where the simulator puts it.
            assert measured >= predicted * (1 - PEAK_TOLERANCE), (measured, predicted)
