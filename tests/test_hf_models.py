"""Hugging Face transformers models (tiny configs, random init, no hub) captured with torch.export.

For GPT-2, Llama, BERT, ViT and T5: profile through export (keyword batch with labels, so the
loss computed inside the model is part of the graph), solve at two budgets (the sqrt(n)
checkpointing baseline's peak, and half-way from it to store-all's), wrap, three AdamW steps: losses, logits, gradients and parameters equal
plain PyTorch (fp32 CPU, assert_close defaults; the same seed, so dropout masks are the same), and
the step's measured peak stays within the budget.
"""

import copy
import functools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import monetlike  # noqa: E402
import monetlike.models  # noqa: E402,F401
import monetlike.capture.trace  # noqa: E402,F401
import solver  # noqa: E402
from solver.baselines import chen_sqrt_n, store_all  # noqa: E402
from script_support import load_example  # noqa: E402

transformers.logging.set_verbosity_error()
T = transformers
B, S = 4, 16


def hf_batch(name: str, g: torch.Generator) -> dict:
    ids = torch.randint(0, 100, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 12:] = 0  # padding: the mask is a real input of the graph
    if name == "vit":
        return dict(pixel_values=torch.randn(B, 3, 16, 16, generator=g),
                    labels=torch.tensor([1, 3, 0, 2]))
    if name == "t5":
        return dict(input_ids=ids, attention_mask=mask, use_cache=False,
                    labels=torch.randint(0, 100, (B, 6), generator=g))
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.clone())
    if name in ("gpt2", "llama"):
        batch["use_cache"] = False
    return batch


def hf_model(name: str) -> torch.nn.Module:
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=S, vocab_size=100)
        return T.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                            max_position_embeddings=S, attention_dropout=0.1)
        return T.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = T.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, vocab_size=100, max_position_embeddings=S)
        return T.BertForMaskedLM(cfg)
    if name == "vit":
        cfg = T.ViTConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                          num_attention_heads=2, image_size=16, patch_size=4, num_labels=5)
        return T.ViTForImageClassification(cfg)
    if name == "t5":
        cfg = T.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2,
                         d_kv=16, vocab_size=100, decoder_start_token_id=0, pad_token_id=0)
        return T.T5ForConditionalGeneration(cfg)
    raise AssertionError(name)


@functools.cache
def _exported(name: str):
    """A `name` model (seed 0) and its measured profile without Impls, shared by the tests that
    train copies of it (a profile through export is most of a test's time)."""
    torch.manual_seed(0)
    model = hf_model(name).train()
    batch = hf_batch(name, torch.Generator().manual_seed(1))
    return model, monetlike.profile(model, batch, cost="measured", repeat=1, impls=False)


def hf_loss(out) -> torch.Tensor:
    # The profiler's step: every floating output summed (loss and logits here).
    return sum(t.float().sum() for t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "t5"])
def test_export_schedule_trains_like_pytorch(name):
    model, graph = _exported(name)
    batch = hf_batch(name, torch.Generator().manual_seed(1))
    assert graph.meta["capture"] == "export"  # fx cannot trace these models
    kinds = {op.kind for op in graph.ops}
    assert "scaled_dot_product_attention.default" in kinds  # attention is fine-grained
    full = store_all(graph).predicted_peak_bytes
    lo = chen_sqrt_n(graph).predicted_peak_bytes
    assert lo < full
    for budget in ((lo + full) // 2, lo):
        # Any schedule within the budget will do here (exactness, not optimality, is tested).
        result = solver.solve(graph, budget, time_limit_s=4, mip_gap=0.1)
        assert result.ok, result.message
        assert sum(len(s.recompute) for s in result.schedule.stages) > 0
        model_b = copy.deepcopy(model)
        ref = copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(model_b, result.schedule, graph=graph)
        # The wrapper's parameters are the model's: an optimizer built on either works.
        assert [id(p) for p in wrapped.parameters()] == [id(p) for p in model_b.parameters()]
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            torch.manual_seed(10 + step)
            out = wrapped(**batch)
            hf_loss(out).backward()
            torch.manual_seed(10 + step)
            out_ref = ref(**batch)
            hf_loss(out_ref).backward()
            assert type(out) is type(out_ref)
            torch.testing.assert_close(out.loss, out_ref.loss)
            torch.testing.assert_close(out.logits, out_ref.logits)
            for (n, p), (_, q) in zip(model_b.named_parameters(), ref.named_parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=f"{name} grad {n}")
            opt.step()
            opt_ref.step()
            opt.zero_grad()
            opt_ref.zero_grad()
        for (n, p), (_, q) in zip(model_b.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, msg=f"{name} param {n}")
        # Measured peak of one step within the budget (storage count, fixed memory added).
        for p in model_b.parameters():
            p.grad = None

        def step_fn():
            hf_loss(wrapped(**batch)).backward()

        m = monetlike.measure_step(step_fn, warmup=0, repeat=1)
        assert m.peak_bytes - m.start_bytes + graph.fixed_bytes <= budget


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "vit"])
def test_export_graphs_split_their_linear_layers(name):
    """torch.export keeps nn.Linear as aten.linear: linear_split applies to those nodes. With it
    on every such Op, storing all and recomputing all: outputs and gradients as plain PyTorch's
    (fp32 defaults: the split computes the two gradients with separate kernels), and the step's
    allocator-measured peak equal to the prediction within 1%."""
    from runtime_support import PEAK_TOLERANCE, impl_schedules
    from solver.simulate import simulate

    torch.manual_seed(0)
    model = hf_model(name).train()
    batch = hf_batch(name, torch.Generator().manual_seed(1))
    graph = monetlike.profile(model, batch, cost="measured", repeat=1)
    assert graph.meta["capture"] == "export"
    picked, schedules = impl_schedules(graph, "linear_split")
    assert len(picked) >= 8, picked  # q, k, v, o and the MLP's layers of both blocks at least
    for schedule in schedules:
        ref, mine = copy.deepcopy(model), copy.deepcopy(model)
        wrapped = monetlike.ScheduleWrapper(mine, schedule, graph=graph)
        torch.manual_seed(5)
        out = wrapped(**batch)
        hf_loss(out).backward()
        torch.manual_seed(5)
        out_ref = ref(**batch)
        hf_loss(out_ref).backward()
        torch.testing.assert_close(out.logits, out_ref.logits)
        for (n, p), (_, q) in zip(mine.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=f"{name} grad {n}")
        for p in mine.parameters():
            p.grad = None

        def step_fn():
            out = wrapped(**batch)  # held through the backward, as a training loop holds it
            hf_loss(out).backward()

        torch.manual_seed(5)
        m = monetlike.measure_step(step_fn, warmup=0, repeat=1)
        measured = m.peak_bytes - m.start_bytes + graph.fixed_bytes
        predicted = simulate(graph, schedule).peak_bytes
        assert abs(measured - predicted) <= predicted * PEAK_TOLERANCE, (measured, predicted)


@pytest.mark.parametrize("name, params", [
    # Published parameter counts (tied embeddings counted once).
    ("gpt2", 124_439_808), ("gpt2_medium", 354_823_168), ("llama_1b", 1_235_814_400),
    ("llama3_8b", 8_030_261_248), ("llama_70b", 70_553_706_496),
    ("bert_base", 109_514_298), ("vit_base", 86_567_656)])
def test_named_shapes_have_their_published_sizes(name, params):
    with torch.device("meta"):  # no memory, no init time
        model = getattr(monetlike.models, name)()
    assert sum(p.numel() for p in model.parameters()) == params


def test_named_shape_with_overrides_profiles_through_export():
    model = monetlike.models.llama_1b(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128,
                                      vocab=100)
    assert (model.config.num_hidden_layers, model.config.head_dim) == (2, 16)
    batch = model.example_inputs(2, 16)
    assert sorted(batch) == ["attention_mask", "input_ids", "labels", "use_cache"]
    assert batch["input_ids"].shape == (2, 16) and batch["use_cache"] is False
    graph = monetlike.profile(model, batch, cost="analytical:A100-40GB")
    assert graph.meta["capture"] == "export" and graph.batch == 2
    assert sum(op.kind == "scaled_dot_product_attention.default" for op in graph.ops) == 2
    with pytest.raises(ValueError, match=r"hf_model\('gpt2'\): unknown override\(s\) \['bogus'\]"):
        monetlike.models.gpt2(bogus=3)


def test_causal_lm_example_runs_three_ways_with_the_same_losses(capsys):
    rows = load_example("hf_causal_lm").main(["--layers", "2", "--hidden", "32", "--heads", "2",
                                              "--vocab", "100", "--batch", "2", "--seq", "16",
                                              "--steps", "1", "--time-limit", "5",
                                              "--budget", "1MiB"])
    assert [r["run"] for r in rows] == ["plain PyTorch", "HF gradient checkpointing",
                                        "monetlike at 1.00 MiB"]
    # Same initial weights, batch and seeds, exact gradients: the same loss after the same steps.
    assert rows[0]["loss"] == rows[1]["loss"] == rows[2]["loss"]
    assert rows[2]["peak_bytes"] <= 2**20
    assert "capture export" in capsys.readouterr().out


def test_cache_in_outputs_is_refused_with_the_way_out():
    model = hf_model("gpt2").train()
    batch = {**hf_batch("gpt2", torch.Generator().manual_seed(1)), "use_cache": True}
    with pytest.raises(monetlike.capture.trace.TraceError) as e:
        monetlike.profile(model, batch, cost="analytical:A100-40GB")
    msg = str(e.value)
    assert "could not capture GPT2LMHeadModel" in msg and "DynamicCache" in msg
    assert ("The construct: a key-value cache object in the outputs. Way out: call the model "
            "with use_cache=False") in msg


def test_shorter_sequences_run_the_same_decisions_exactly():
    base, graph = _exported("gpt2")
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    batch = hf_batch("gpt2", torch.Generator().manual_seed(1))
    result = solver.solve(graph, chen_sqrt_n(graph).predicted_peak_bytes, time_limit_s=10)
    wrapped = monetlike.ScheduleWrapper(model, result.schedule, graph=graph)
    # Captured again at the shorter shape (an exported graph is shape-specialised); the
    # schedule's decisions rebound and proven within its budget by the simulator.
    small = {k: (v[:2, :8] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    assert wrapped.schedule_for(**small).predicted_peak_bytes <= result.schedule.budget_bytes
    torch.manual_seed(0)
    wrapped(**small).loss.backward()
    torch.manual_seed(0)
    ref(**small).loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_cli_profiles_a_named_transformers_shape(tmp_path, capsys):
    from monetlike.cli import main

    out = tmp_path / "g.json"
    # --input-shape SEQ is the sequence length of a named transformers shape's token batch.
    assert main(["profile", "gpt2", "--batch", "1", "--input-shape", "32",
                 "--cost", "analytical:A100-40GB", "-o", str(out)]) == 0
    graph = solver.OpGraph.load(str(out))
    assert graph.meta["capture"] == "export" and graph.model == "GPT2LMHeadModel"
    assert graph.summary()["input_shapes"] == [[1, 32], [1, 32], [1, 32]]
    assert "profiled gpt2 batch 1" in capsys.readouterr().out


@pytest.mark.parametrize("override", ["classes", "num_labels"])
def test_vit_base_takes_a_number_of_classes(override):
    model = monetlike.models.vit_base(layers=1, hidden=32, heads=2, ffn=64, image=16, patch=4,
                                      **{override: 7})
    assert model.config.num_labels == 7 and model.classifier.out_features == 7
    batch = model.example_inputs(3)
    assert batch["pixel_values"].shape == (3, 3, 16, 16)
    assert int(batch["labels"].max()) < 7
    assert model(**batch).logits.shape == (3, 7)


@pytest.mark.parametrize("name, overrides, message", [
    ("gpt2", dict(layers=-1), "hf_model('gpt2'): layers must be a positive integer, got -1; "
                              "pass e.g. layers=2"),
    ("bert_base", dict(layers="x"), "layers must be a positive integer, got 'x'"),
    ("vit_base", dict(classes=0), "classes must be a positive integer, got 0"),
    ("gpt2", dict(n_layer=True), "n_layer must be a positive integer, got True"),
    ("gpt2", dict(hidden=30, heads=4), "hf_model('gpt2') with hidden=30, heads=4: transformers' "
                                       "GPT2Config or GPT2LMHeadModel refused it (ValueError: "
                                       "`embed_dim` must be divisible by num_heads"),
    ("llama_1b", dict(hidden=64, heads=5), "The hidden size (64) is not a multiple of the number "
                                           "of attention heads (5)"),
    ("gpt2", dict(attn_pdrop="x"), "Field 'attn_pdrop' with value 'x'"),
    ("vit_base", dict(bogus=1), "hf_model('vit_base'): unknown override(s) ['bogus']; expected "
                                "classes, ffn, heads, hidden, image, layers, patch or a field of "
                                "ViTConfig"),
])
def test_bad_override_is_one_clear_line(name, overrides, message):
    with torch.device("meta"), pytest.raises(ValueError) as e:
        getattr(monetlike.models, name)(**overrides)
    text = str(e.value)
    assert message in text and "\n" not in text, text
