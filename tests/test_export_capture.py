"""The torch.export capture front end (monetlike.capture): choice of capture, keyword calls,
constants, aliased inputs, clear errors, and the runtime on the user's live parameters."""

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import monetlike
import solver
from monetlike.capture import call_spec, capture
from monetlike.trace import TraceError
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
    with pytest.raises(TraceError) as e:
        capture(DataDependent(), (torch.randn(2, 4),), mode="export")
    msg = str(e.value)
    assert "torch.export.export(strict=False) could not capture DataDependent" in msg
    assert "The construct: Python control flow or a shape that depends on tensor values" in msg
    assert "Way out: write it without the branch (torch.where" in msg


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
