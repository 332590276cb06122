"""`monetlike maxbatch` and `monetlike check` (API and CLI) with keyword batches (issue 19).

A Hugging Face model is called as model(input_ids=..., attention_mask=..., labels=...). maxbatch
scales the batch dimension of every batched tensor of such a batch (the sequence length kept),
through the model's own example_inputs(batch, seq_len) when it has one; check builds the keyword
batch of the schedule's recorded shape and verifies the fingerprint. The models are tiny GPT-2s
(2 layers, d 32, 16 positions) made by monetlike.hf_models, the code behind the named shapes.
"""

import contextlib
import io
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import monetlike  # noqa: E402
import monetlike.models  # noqa: E402,F401
import solver  # noqa: E402
from monetlike.check import check_schedule  # noqa: E402
from cli_support import run_cli  # noqa: E402
from monetlike.cli import main  # noqa: E402
from monetlike.maxbatch import max_batch, scale_batch  # noqa: E402

transformers.logging.set_verbosity_error()

SEQ = 16
MODELS = f"""
from monetlike import hf_models

def gpt2():
    return hf_models.gpt2(layers=2, hidden=32, heads=2, vocab=100, positions={SEQ})

def gpt2_wide():  # another config: the same inputs, other parameter shapes
    return hf_models.gpt2(layers=2, hidden=64, heads=2, vocab=100, positions={SEQ})

def vit():
    return hf_models.vit_base(layers=2, hidden=32, heads=2, ffn=64, image=16, patch=4)

def vit10():  # ten classes
    return hf_models.vit_base(layers=2, hidden=32, heads=2, ffn=64, image=16, patch=4, classes=10)

def gpt2_bad_heads():  # 5 heads do not divide 32
    return hf_models.gpt2(layers=2, hidden=32, heads=5, vocab=100, positions={SEQ})

def gpt2_bad_name():
    return hf_models.gpt2(layer=2)

def gpt2_bad_layers():
    return hf_models.gpt2(layers=0)

def mlp():  # no example_inputs: a positional float model
    import torch.nn as nn
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("kw")
    (d / "models.py").write_text(MODELS)
    return d


def _spec(d, name):
    return f"{d / 'models.py'}:{name}"


def _tiny_gpt2():
    return monetlike.models.gpt2(layers=2, hidden=32, heads=2, vocab=100, positions=SEQ)


# -- scaling a keyword batch ---------------------------------------------------------------------
def test_scale_batch_scales_every_batched_tensor_and_keeps_the_rest():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.clone(),
                 position_ids=torch.arange(SEQ)[None], use_cache=False)
    big = scale_batch(batch, 7)
    for k in ("input_ids", "attention_mask", "labels"):
        assert big[k].shape == (7, SEQ) and big[k].dtype == torch.long
        # Rows repeated in turn: token ids, labels and masks stay valid values.
        assert torch.equal(big[k], batch[k][torch.arange(7) % 3]), k
    assert torch.equal(big["position_ids"], batch["position_ids"])  # broadcast (1, seq): kept
    assert big["use_cache"] is False
    small = scale_batch(batch, 2, "meta")
    assert small["input_ids"].device.type == "meta" and small["input_ids"].shape == (2, SEQ)
    # An image batch: pixel_values and the (batch,) labels together.
    img = dict(pixel_values=torch.randn(2, 3, 8, 8), labels=torch.tensor([1, 0]))
    five = scale_batch(img, 5)
    assert five["pixel_values"].shape == (5, 3, 8, 8) and five["labels"].tolist() == [1, 0, 1, 0, 1]
    # Positional inputs too.
    a, b = scale_batch((torch.randn(2, 4), torch.randn(2, 1)), 3)
    assert a.shape == (3, 4) and b.shape == (3, 1)
    with pytest.raises(ValueError, match="expected a tensor, a non-empty tuple"):
        scale_batch("input_ids", 2)
    with pytest.raises(ValueError, match="at least one tensor"):
        scale_batch({"use_cache": False}, 2)


# -- maxbatch ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_max_batch_of_a_keyword_gpt2_fits_and_one_more_does_not():
    # One block: the keyword batch is what is tested here, and the search's solves (most of the
    # time) go over 42 Ops instead of two blocks' 61.
    model = monetlike.models.gpt2(layers=1, hidden=32, heads=2, vocab=100, positions=SEQ)
    budget = 400 * 2**10
    r = max_batch(model, budget, (SEQ,), limit=64, time_limit_s=5)
    b = r.batch
    assert b >= 2 and r.graph.batch == b
    # Every batched tensor of the keyword batch at batch b, the sequence length kept.
    assert r.graph.summary()["input_shapes"] == [[b, SEQ]] * 3
    assert r.graph.summary()["input_dtypes"] == ["int64"] * 3
    sched = r.result.schedule
    assert sched.predicted_peak_bytes <= budget
    assert solver.simulate(r.graph, sched).peak_bytes <= budget  # replayed independently
    assert r.tried[b] == "ok" and r.tried[b + 1] != "ok"
    # And independently: at batch b+1 no schedule fits this budget.
    g1 = monetlike.profile(model, model.example_inputs(b + 1, SEQ, device="meta"),
                           cost="analytical:A100-40GB")
    assert g1.summary()["input_shapes"] == [[b + 1, SEQ]] * 3
    with pytest.raises(solver.InfeasibleBudgetError):
        solver.solve(g1, budget, time_limit_s=20)


def test_max_batch_scales_a_given_keyword_batch():
    model = _tiny_gpt2()
    example = model.example_inputs(3, 8)  # seq 8: kept, only the batch changes
    r = max_batch(model, "1GiB", example_inputs=example, limit=2, time_limit_s=20)
    assert r.batch == 2 and r.tried == {1: "ok", 2: "ok"}
    assert r.graph.summary()["input_shapes"] == [[2, 8]] * 3
    with pytest.raises(ValueError, match="input_shape or example_inputs, not both"):
        max_batch(model, "1GiB", (8,), example_inputs=example)
    with pytest.raises(ValueError, match="does not apply to GPT2LMHeadModel"):
        max_batch(model, "1GiB", (3, 224, 224))


# -- the CLI: maxbatch -o, then check --------------------------------------------------------------
@pytest.fixture(scope="module")
def planned(models):
    """`monetlike maxbatch` of the tiny GPT-2 at a budget below batch 2's store-all peak (457
    KiB), limited to batch 2: a schedule for batch 2 that recomputes, written with -o."""
    out = models / "s.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["maxbatch", _spec(models, "gpt2"), "--input-shape", str(SEQ), "--budget",
                     "420KiB", "--limit", "2", "--time-limit", "20", "-o", str(out)])
    assert code == 0
    text = printed.getvalue()
    assert "largest batch that fits: 2" in text and "GPT2LMHeadModel" in text, text
    return out


def test_cli_maxbatch_then_check_a_keyword_model(models, planned, capsys):
    saved = json.loads(planned.read_text())
    # Every batched tensor of the keyword batch at batch 2, the sequence length kept.
    assert saved["graph_summary"]["input_shapes"] == [[2, SEQ]] * 3
    assert saved["graph_summary"]["input_dtypes"] == ["int64"] * 3
    assert saved["predicted_peak_bytes"] <= saved["budget_bytes"] == 420 * 2**10
    assert sum(len(s["recompute"]) for s in saved["stages"]) > 0
    assert saved["meta"]["model_spec"] == _spec(models, "gpt2")

    # check builds the keyword batch of the schedule's recorded shape: it runs and passes.
    code, stdout, err = run_cli(["check", str(planned), "--model", _spec(models, "gpt2")], capsys)
    assert code == 0, err
    assert "max |grad diff|" in stdout and "MISMATCH" not in stdout

    # Another config with the same inputs: the fingerprint check refuses it, in one line.
    code, _, err = run_cli(["check", str(planned), "--model", _spec(models, "gpt2_wide")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "the schedule was solved for another graph" in err
    assert "transformer.wte.weight 100x32" in err and "100x64" in err

    # A model that cannot make a keyword batch: said so, with the ways out.
    code, _, err = run_cli(["check", str(planned), "--model", _spec(models, "mlp")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "was solved for 3 input(s) of shapes [[2, 16], [2, 16], [2, 16]]" in err
    assert "example_inputs(batch, seq_len, device)" in err and "check_schedule" in err

    # An image model's batch is not the schedule's: named before anything runs.
    code, _, err = run_cli(["check", str(planned), "--model", _spec(models, "vit")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "makes its example batch pixel_values [2, 3, 16, 16], labels [2]" in err
    assert "was solved for input shapes [[2, 16], [2, 16], [2, 16]]" in err

    # Longer than the model's positions, or larger than solved for: one line each.
    code, _, err = run_cli(["check", str(planned), "--model", _spec(models, "gpt2"),
                         "--input-shape", "32"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "seq_len 32 is longer than the model's 16 positions" in err
    code, _, err = run_cli(["check", str(planned), "--model", _spec(models, "gpt2"), "--batch", "3"],
                        capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "input shape [3, 16] is larger than the [2, 16] this schedule was solved for" in err


def test_check_api_takes_a_keyword_batch(planned):
    sched = solver.Schedule.load(str(planned))
    model = _tiny_gpt2()
    report = check_schedule(sched, model, model.example_inputs(2, SEQ), repeat=1)
    assert report.passed and report.grads_match and report.max_abs_grad_diff == 0.0
    assert report.predicted_peak_bytes == sched.predicted_peak_bytes
    # A schedule for another config is refused, not run.
    wide = monetlike.models.gpt2(layers=2, hidden=64, heads=2, vocab=100, positions=SEQ)
    with pytest.raises(solver.ScheduleMismatchError, match="solved for another graph"):
        check_schedule(sched, wide, wide.example_inputs(2, SEQ), repeat=1)


BAD = [
    ("maxbatch-image-shape-for-a-token-model",
     lambda d: ["maxbatch", _spec(d, "gpt2"), "--input-shape", "3,224,224", "--budget", "1GiB"],
     "--input-shape: input shape 3,224,224 does not apply to GPT2LMHeadModel: its "
     "example_inputs(batch, seq_len) makes a first input of shape [16] after the batch "
     "dimension; give one number, the sequence length, like 16"),
    ("maxbatch-sequence-too-long",
     lambda d: ["maxbatch", _spec(d, "gpt2"), "--input-shape", "17", "--budget", "1GiB"],
     "seq_len 17 is longer than the model's 16 positions; pass positions=... to the factory"),
    ("maxbatch-token-shape-for-an-image-model",
     lambda d: ["maxbatch", _spec(d, "vit"), "--input-shape", "16", "--budget", "1GiB"],
     "input shape 16 does not apply to ViTForImageClassification: its example_inputs(batch, "
     "seq_len) makes a first input of shape [3, 16, 16] after the batch dimension; give "
     "3,16,16 (its config sets it) or none"),
]


# A factory that fails (a bad override of a named shape): rc 2 and one line naming the factory,
# what was wrong and the way out.
_PROFILE = ["--batch", "2", "--cost", "analytical:A100-40GB"]
BAD += [
    ("factory-heads-do-not-divide-hidden",
     lambda d: ["profile", _spec(d, "gpt2_bad_heads"), *_PROFILE],
     "its factory gpt2_bad_heads() failed with ValueError: hf_model('gpt2') with layers=2, "
     "hidden=32, heads=5, vocab=100, positions=16: transformers' GPT2Config or GPT2LMHeadModel "
     "refused it (ValueError: `embed_dim` must be divisible by num_heads"),
    ("factory-unknown-override",
     lambda d: ["solve", _spec(d, "gpt2_bad_name"), *_PROFILE, "--budget", "1GiB"],
     "hf_model('gpt2'): unknown override(s) ['layer']; expected ffn, heads, hidden, layers, "
     "positions, vocab or a field of GPT2Config"),
    ("factory-zero-layers",
     lambda d: ["maxbatch", _spec(d, "gpt2_bad_layers"), "--budget", "1GiB"],
     "layers must be a positive integer, got 0; pass e.g. layers=2"),
]


@pytest.mark.parametrize("argv,message", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_keyword_input_is_one_clear_line(models, capsys, argv, message):
    code, out, err = run_cli(argv(models), capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err and out == ""


def test_cli_profiles_a_vit_with_its_own_number_of_classes(models, tmp_path, capsys):
    out = tmp_path / "vit10.json"
    code, stdout, err = run_cli(["profile", _spec(models, "vit10"), "--batch", "2", "--cost",
                                 "analytical:A100-40GB", "-o", str(out)], capsys)
    assert code == 0, err
    graph = solver.OpGraph.load(str(out))
    # The classifier's weight has 10 rows; the labels are the second input.
    assert ["classifier.weight", [10, 32], "float32", True] in \
        [[n, list(s), d, g] for n, s, d, g in graph.params]
    assert graph.summary()["input_shapes"] == [[2, 3, 16, 16], [2]]
