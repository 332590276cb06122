"""The torch.export capture front end (monetlike.capture.api): choice of capture, keyword calls,
constants, aliased inputs, clear errors, and the runtime on the user's live parameters."""

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monetlike
import solver
from monetlike.capture.api import call_spec, capture
from monetlike.capture.trace import TraceError
from solver.baselines import chen_sqrt_n, store_all

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class KwNet(nn.Module):
    """A model with the Hugging Face calling convention: keyword inputs, a dict result with the
    loss computed inside, a non-tensor flag, and a Python branch on a tensor value that fx cannot
    trace (`if`), so capture='auto' falls back to export."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=True):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        h = h + F.dropout(F.gelu(self.fc2(F.gelu(self.fc1(h)))), 0.2, self.training)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out if return_dict else tuple(out.values())


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (4, 6), generator=g)
    mask = torch.ones(4, 6)
    mask[0, 4:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 20, (4, 6),
                                                                         generator=g))


def test_auto_falls_back_to_export_and_says_so():
    model = KwNet().train()
    batch = _batch()
    with pytest.raises(TraceError, match="torch.fx.symbolic_trace could not trace KwNet"):
        capture(model, (), batch, mode="fx")
    gm, flat = capture(model, (), batch, mode="auto")
    assert gm.meta["capture"] == "export"
    assert [t is batch[k] for t, k in zip(flat, ("input_ids", "attention_mask", "labels"))] == \
        [True, True, True]
    graph = monetlike.profile(model, batch, cost="analytical:A100-40GB")
    assert graph.meta["capture"] == "export"
    kinds = [op.kind for op in graph.ops]
    # ATen granularity: the MLP's matmuls, gelu and dropout are ops of their own.
    assert kinds.count("linear.default") == 3 and kinds.count("gelu.default") == 2
    assert "dropout.default" in kinds and "cross_entropy_loss.default" in kinds


def test_fx_models_keep_fx_and_export_can_be_forced():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    assert monetlike.profile(model, x, cost="analytical:A100-40GB").meta["capture"] == "fx"
    g = monetlike.profile(model, x, cost="analytical:A100-40GB", capture="export")
    assert g.meta["capture"] == "export"
    assert [op.kind for op in g.ops] == ["linear.default", "relu.default", "linear.default"]
    with pytest.raises(ValueError, match="capture: expected one of 'auto', 'fx', 'export', got "
                                         "'dynamo'"):
        monetlike.profile(model, x, capture="dynamo")


def test_keyword_order_and_positional_give_one_graph():
    model = KwNet().train()
    b = _batch()
    a = monetlike.profile(model, b, cost="analytical:A100-40GB")
    swapped = {k: b[k] for k in ("labels", "attention_mask", "input_ids")}
    assert monetlike.profile(model, swapped, cost="analytical:A100-40GB").fingerprint == \
        a.fingerprint
    flat_kw = call_spec(model, (), swapped)
    flat_pos = call_spec(model, (b["input_ids"], b["attention_mask"], b["labels"]), {})
    assert flat_kw.spec.key == flat_pos.spec.key
    assert all(x is y for x, y in zip(flat_kw, flat_pos))
    # A constant is part of the call: another value is another graph.
    assert call_spec(model, (), {**b, "return_dict": False}).spec.key != flat_kw.spec.key


def test_same_tensor_twice_is_captured_as_two_inputs():
    model = KwNet().train()
    ids = _batch()["input_ids"]
    gm, flat = capture(model, (), dict(input_ids=ids, labels=ids))
    assert len(flat) == 2
    other = torch.randint(0, 20, ids.shape, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    got = gm(ids, other)
    torch.manual_seed(0)
    want = model(input_ids=ids, labels=other)
    torch.testing.assert_close(got["loss"], want["loss"])


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # a branch on a tensor's value
            return y.relu()
        return y


def test_uncapturable_model_names_the_construct_and_the_way_out():
    # On meta tensors (an analytical profile's) the value is not known: refused. Real tensors
    # are captured for the example's branch (tests/test_capture_custom.py).
    with pytest.raises(TraceError) as e:
        capture(DataDependent().to("meta"), (torch.randn(2, 4, device="meta"),), mode="export")
    msg = str(e.value)
    assert "torch.export.export(strict=False) could not capture DataDependent" in msg
    assert "The construct: Python control flow or a shape that depends on tensor values" in msg
    assert "Way out: profile with measured costs on the real example (cost='measured'" in msg
    assert "or write it without the branch (torch.where" in msg
    # The line, found in the error torch.export raised it from (it was only in that chained
    # exception: Hugging Face DeBERTa-v2's own loss, `if label_index.size(0) > 0`).
    assert f"At {__file__}:" in msg and "in forward: `if y.sum() > 0:" in msg


def test_leaf_modules_with_export_is_refused():
    with pytest.raises(ValueError, match="leaves are a torch.fx notion"):
        capture(KwNet(), (), _batch(), mode="export", leaf_modules=["fc1"])


def test_schedule_runs_on_live_parameters_like_pytorch(tmp_path):
    torch.manual_seed(0)
    model = KwNet().train()
    ref = copy.deepcopy(model)
    batch = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # built before wrapping
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    graph = monetlike.profile(model, batch, cost="measured", repeat=1, impls=False)
    lo = chen_sqrt_n(graph).predicted_peak_bytes
    assert lo < store_all(graph).predicted_peak_bytes
    result = solver.solve(graph, lo, time_limit_s=10)
    assert sum(len(s.recompute) for s in result.schedule.stages) > 0
    wrapped = monetlike.ScheduleWrapper(model, result.schedule, graph=graph)
    assert len(list(wrapped.parameters())) == 5  # tied head and embedding: one parameter
    assert wrapped.head.weight is wrapped.emb.weight
    for step in range(3):
        torch.manual_seed(step)
        out = wrapped(**batch)
        (out["loss"] + out["logits"].sum()).backward()
        torch.manual_seed(step)
        out_ref = ref(**batch)
        (out_ref["loss"] + out_ref["logits"].sum()).backward()
        torch.testing.assert_close(out["loss"], out_ref["loss"])
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    # state_dict round-trips through the wrapper with the model's own keys.
    sd = wrapped.state_dict()
    assert list(sd) == list(model.state_dict())
    fresh = KwNet()
    fresh.load_state_dict(sd)
    torch.testing.assert_close(fresh.emb.weight, model.emb.weight)
    # The keyword batch in a new order is the same call; a new constant is refused by name.
    torch.manual_seed(7)
    out = wrapped(labels=batch["labels"], input_ids=batch["input_ids"],
                  attention_mask=batch["attention_mask"])
    torch.manual_seed(7)
    torch.testing.assert_close(out["loss"], ref(**batch)["loss"])


def test_optimize_accepts_keyword_batches(tmp_path):
    torch.manual_seed(0)
    model = KwNet().train()
    ref = copy.deepcopy(model)
    batch = _batch()
    graph = monetlike.profile(model, batch, cost="measured", repeat=1)
    budget = chen_sqrt_n(graph).predicted_peak_bytes
    wrapped = monetlike.optimize(model, batch, budget=budget, cache_dir=tmp_path,
                                 time_limit_s=10)
    torch.manual_seed(1)
    wrapped(**batch)["loss"].backward()
    torch.manual_seed(1)
    ref(**batch)["loss"].backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_export_recomputes_batchnorm_without_updating_running_statistics_twice():
    from runtime_support import every, keep_schedule, recomputed_op_count

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    graph = monetlike.profile(model, x, cost="measured", repeat=1, impls=False,
                              capture="export")
    assert [op.kind for op in graph.ops].count("batch_norm.default") == 2
    schedule = keep_schedule(graph, every(0), "tight", hold="stage")  # recompute everything
    assert recomputed_op_count(schedule) > 0
    wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)
    for seed in range(2):
        torch.manual_seed(seed)
        wrapped(x).sum().backward()
        torch.manual_seed(seed)
        ref(x).sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, msg=n)  # running stats and num_batches_tracked


def test_keyword_inputs_without_a_tensor_are_refused():
    with pytest.raises(ValueError, match=r"example_inputs: the keyword inputs \['return_dict'\] "
                                         r"hold no tensor; expected at least one"):
        monetlike.profile(KwNet(), {"return_dict": True})


class _Contig(nn.Module):
    def forward(self, x):
        a = x.contiguous() * 2  # already contiguous: a no-op, still recorded
        b = x.t().contiguous() * 3  # a copy
        return a.sum() + b.sum()


def test_contiguous_is_recorded_whatever_the_strides():
    # NOTE [Contiguous is always recorded]: a trace on any device has one node per call.
    graphs = []
    for dev in ("cpu", "meta"):
        x = torch.randn(3, 4, device=dev, requires_grad=True)
        gm, _ = capture(_Contig().to(dev), (x,), mode="export")
        graphs.append([(n.name, str(n.target)) for n in gm.graph.nodes
                       if n.op == "call_function"])
    assert graphs[0] == graphs[1]
    assert [t for _, t in graphs[0]].count("aten.contiguous.default") == 2
    # The no-op call returns its input on the CPU: no copy, the same values.
    x = torch.randn(3, 4, requires_grad=True)
    gm, xs = capture(_Contig(), (x,), mode="export")
    torch.testing.assert_close(gm(*xs), _Contig()(x))


def _tiny_vit():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                 num_attention_heads=2, image_size=16, patch_size=4,
                                 num_labels=5)
    g = torch.Generator().manual_seed(1)
    batch = dict(pixel_values=torch.randn(4, 3, 16, 16, generator=g),
                 labels=torch.tensor([1, 3, 0, 2]))
    return transformers.ViTForImageClassification(cfg).train(), batch


def test_vit_schedule_from_an_analytical_profile_checks_on_the_cpu():
    """Issue 19 regression: the meta device runs scaled_dot_product_attention's math path
    (a plain contiguous output), the CPU its fused kernel (the query's layout), so HF's
    `attn_output.transpose(1, 2).contiguous()` copied on meta and was a no-op on the CPU; the
    trace kept the call only on meta, and `check` refused the schedule ("names fx node
    'contiguous', which the traced model does not have")."""
    from monetlike.check import check_schedule
    from monetlike.profile.api import meta_copy

    model, batch = _tiny_vit()
    meta = {k: torch.empty_like(v, device="meta") for k, v in batch.items()}
    nodes = []
    for m, b in ((model, batch), (meta_copy(model), meta)):
        gm, _ = capture(m, (), b, mode="export")
        nodes.append([(n.name, str(n.target)) for n in gm.graph.nodes])
    assert nodes[0] == nodes[1]
    graph = monetlike.profile(model, batch, cost="analytical:A100-40GB")
    # The analytical run now takes the A100's fused kernel (memory-efficient for float32), whose
    # output is in the query's layout as on the CPU: the call copies on neither, so is no Op.
    assert sum(op.kind.startswith("contiguous") for op in graph.ops) == 0
    lo = chen_sqrt_n(graph).predicted_peak_bytes
    hi = store_all(graph).predicted_peak_bytes
    result = solver.solve(graph, (lo + hi) // 2, time_limit_s=10)
    report = check_schedule(result.schedule, model, batch, repeat=1)
    assert report.passed and report.grads_match and report.max_abs_grad_diff == 0.0


def test_vit_analytical_schedule_that_drops_the_attention_inputs():
    from runtime_support import keep_schedule

    from monetlike.check import check_schedule

    model, batch = _tiny_vit()
    graph = monetlike.profile(model, batch, cost="analytical:A100-40GB")
    sched = keep_schedule(graph, lambda v: False, hold="last_use")
    assert check_schedule(sched, model, batch, repeat=1).passed


class _SelfAttention(nn.Module):
    """One attention layer on packed q/k/v projections (slices of one Linear's output)."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d)).square().mean()


@pytest.mark.parametrize("capture_mode,dtype", [("fx", torch.float32), ("export", torch.float32),
                                                ("fx", torch.bfloat16)])
def test_analytical_attention_saves_what_the_fused_kernel_saves(capture_mode, dtype):
    """Issue 19: on meta, scaled_dot_product_attention runs the kernel the preset GPU would
    (memory-efficient for float32 on an A100, flash for bfloat16), which saves q, k, v, the
    output and a logsumexp, as the CPU's fused kernel does; not the math path's L x L softmax."""
    torch.manual_seed(0)
    b, n, dim, heads = 2, 512, 32, 2
    model = _SelfAttention(dim, heads).to(dtype)
    x = torch.randn(b, n, dim, dtype=dtype)
    graphs = {cost: monetlike.profile(model, x, cost=cost, repeat=1, impls=False,
                                      capture=capture_mode)
              for cost in ("measured", "analytical:A100-40GB")}
    ops = {cost: [op for op in g.ops if "scaled_dot_product" in op.kind]
           for cost, g in graphs.items()}
    assert len(ops["measured"]) == len(ops["analytical:A100-40GB"]) == 1
    cpu, meta = ops["measured"][0].impls[0], ops["analytical:A100-40GB"][0].impls[0]
    assert meta.saved == cpu.saved and len(cpu.saved) == 2  # the packed q/k/v and the output
    assert graphs["measured"].fingerprint == graphs["analytical:A100-40GB"].fingerprint
    g = graphs["analytical:A100-40GB"]
    saved_bytes = sum(g.values[t].bytes for t in meta.saved) + meta.internal_bytes
    attention_matrix = b * heads * n * n * dtype.itemsize
    assert saved_bytes < attention_matrix / 4
    # The logsumexp (batch x heads x L floats) and the flash kernel's few bytes of RNG state.
    assert b * heads * n * 4 <= meta.internal_bytes <= b * heads * n * 4 + 64
    assert abs(meta.internal_bytes - cpu.internal_bytes) <= 64


@pytest.mark.parametrize("cc,dtype,mask,head_dim,expected", [
    ((8, 0), torch.bfloat16, False, 32, "flash"),
    ((8, 0), torch.float32, False, 32, "efficient"),  # flash takes half types only
    ((8, 0), torch.float16, True, 32, "efficient"),  # flash takes no mask
    ((6, 0), torch.bfloat16, False, 32, "math"),  # bfloat16 needs sm80 for either fused kernel
    ((8, 0), torch.float32, False, 6, "math"),  # memory-efficient needs head dims of 4k in fp32
])
def test_sdpa_backend_is_cudas_choice(cc, dtype, mask, head_dim, expected):
    from monetlike.profile.gpu_like import sdpa_backend

    q = torch.empty(2, 4, 64, head_dim, device="meta", dtype=dtype)
    m = torch.ones(64, 64, dtype=torch.bool, device="meta") if mask else None
    assert sdpa_backend(cc, q, q, q, m) == expected
    # torch's own switches are honoured: with flash and memory-efficient off, CUDA runs math.
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert sdpa_backend(cc, q, q, q, m) == "math"


class StarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, *args):
        x, y = args
        return (self.b(torch.relu(self.a(x))) * y).sum(-1)


def test_a_star_args_forward_runs_a_smaller_batch():
    """A new batch size is profiled again from the call's own inputs; for a `forward(*args)`
    model captured by export that raised NotImplementedError saying to pass graph=, which had
    been passed."""
    from runtime_support import compare_step, three_schedules

    torch.manual_seed(0)
    model = StarArgs().train()
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    graph = monetlike.profile(model, (x, y), repeat=1, capture="export")
    schedule = three_schedules(graph)["tight"]
    compare_step(model, lambda m: monetlike.ScheduleWrapper(m, schedule, graph=graph),
                 (x[:2], y[:2]), steps=2, exact=True)
