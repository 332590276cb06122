"""scripts/bench_peers.py end to end on one tiny model (--quick): every peer row is there with
numbers, ours ran only after its gradients matched plain PyTorch, and a wrong gradient stops the
report instead of producing a row."""

from __future__ import annotations

import pytest
import torch

from script_support import load_script

PEER_ROWS = ["ckpt-block", "ckpt-seq", "sac", "compile@0.25", "compile@0.5", "compile@0.75"]


def _rows(md: str, model: str) -> dict[str, dict[str, str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[1:]:
        cells = dict(zip(header, (c.strip() for c in ln.strip("|").split("|"))))
        if cells.get("model") == model:
            rows[cells["peer"]] = cells
    return rows


def _number(s: str) -> float:
    return float(s)  # raises on "" or text: a row without numbers fails here


def _quick_argv(tmp_path, out) -> list[str]:
    """The quick run on the transformer, every count at its least: one timed step per Op in the
    profile too (the rows and gradient checks do not depend on how steady the costs are)."""
    return ["--quick", "--models", "transformer", "--out", str(out), "--img-dir",
            str(tmp_path / "img"), "--rounds", "1", "--repeat", "1", "--profile-repeat", "1",
            "--sweep", "0.5", "--time-limit", "2"]


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_peers")


@pytest.mark.slow
def test_quick_run_has_every_peer_row_and_checked_gradients(bench, tmp_path, monkeypatch):
    calls = []
    real = torch.testing.assert_close

    def spy(actual, expected, *a, **kw):
        calls.append(1)
        return real(actual, expected, *a, **kw)
    monkeypatch.setattr(torch.testing, "assert_close", spy)
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\n<!-- other:start -->\nkeep me\n<!-- other:end -->\n")
    rc = bench.main(_quick_argv(tmp_path, out))
    assert rc == 0
    md = out.read_text()
    assert "keep me" in md, "another script's section was overwritten"
    assert md.count("<!-- peers:start -->") == 1 and md.count("<!-- peers:end -->") == 1
    rows = _rows(md, "transformer")
    assert sorted(rows) == sorted(PEER_ROWS)
    with_ours = 0
    for name, r in rows.items():
        assert _number(r["peer_peak_MiB"]) > 0, name
        _number(r["peer_ovh_%"])
        if r["verdict"] == "no schedule":
            continue
        with_ours += 1
        assert r["ours_grads"] == "equal", name
        assert _number(r["ours_peak_MiB"]) > 0, name
        _number(r["ours_ovh_%"])
    assert with_ours >= 1, "ours produced no schedule at any peer's memory"
    # Every row with ours numbers passed assert_close on outputs and gradients first.
    checked = int(md.split("gradient checks passed: ")[1].split(".")[0])
    assert checked >= with_ours
    assert len(calls) >= 2 * checked
    assert (tmp_path / "img" / "peers_transformer.png").stat().st_size > 0


def test_wrong_gradients_stop_the_report(bench, tmp_path, monkeypatch):
    real_cls = bench.wrapper_class()

    class Skewed(real_cls):
        def forward(self, *args, **kw):
            return super().forward(*args, **kw) * 1.001

    monkeypatch.setattr(bench, "wrapper_class", lambda: Skewed)
    out = tmp_path / "BENCH.md"
    rc = bench.main(_quick_argv(tmp_path, out))
    assert rc == 1
    assert not out.exists() or not _rows(out.read_text(), "transformer")


def test_gpt2_adapter_runs_the_models_computation(bench):
    # The peers of the GPT-2 row call transformers' blocks themselves: the adapter's forward and
    # its chain must compute what the model computes (the bench checks this too before it
    # measures; here without the measuring), and checkpointing per block keeps the gradients.
    pytest.importorskip("transformers")
    import peers
    spec = peers.SPECS["quick"]["gpt2"]
    torch.manual_seed(0)
    model = spec.build().eval()
    ids = spec.example_input(seed=1)
    assert ids.dtype == torch.long and int(ids.max()) < spec.vocab
    ad = peers.adapter_for(spec)
    want = model(ids)
    torch.testing.assert_close(ad.forward(model, ids), want)
    torch.testing.assert_close(torch.nn.Sequential(*ad.chain(model))(ids), want)
    assert ad.n_blocks(model) == 2
    model.train()
    grads = []
    for peer in peers.PEERS:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(3)
        peer.build(model, ad)(ids).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(3)
    model(ids).float().pow(2).mean().backward()
    for got in grads:
        torch.testing.assert_close(got, [p.grad for p in model.parameters()])
