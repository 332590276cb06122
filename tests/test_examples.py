"""Every example runs, at small sizes on the CPU."""

import math

import pytest
import torch
import torchvision

import solver
from monetlike.profile import profile
from script_support import load_example


def test_training_example_trains_within_budget(capsys):
    out = load_example("training").main(["--model", "resnet18", "--batch", "16", "--image-size",
                                         "32", "--budget", "200MiB", "--steps", "2"])
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])
    assert "step 1: batch  16" in capsys.readouterr().out  # one line per step, with its peak


def test_imagenet_example_runs_plain_and_with_a_schedule(tmp_path):
    mod = load_example("imagenet")
    plain = mod.main(["-a", "resnet18", "--batch-size", "4", "--image-size", "32", "--steps", "1"])
    g = profile(torchvision.models.resnet18(), torch.randn(4, 3, 32, 32),
                cost="analytical:A100-40GB")
    base = solver.simulate(g, solver.store_all_schedule(g)).peak_bytes
    budget = (solver.min_budget(g) + base) // 2
    path = tmp_path / "s.json"
    solver.solve(g, budget, time_limit_s=20).schedule.save(path)
    scheduled = mod.main(["-a", "resnet18", "--batch-size", "4", "--image-size", "32",
                          "--steps", "1", "--schedule", str(path)])
    # Same seed, same data, same weights: the scheduled step gives the same loss.
    assert scheduled["losses"] == pytest.approx(plain["losses"], rel=1e-5)


def test_densenet_efficient_example_table():
    table = load_example("densenet_efficient").main(["--batch", "2", "--image-size", "32",
                                                     "--repeat", "1", "--time-limit", "10"])
    assert list(table["variant"]) == ["plain PyTorch",
                                      "torch.utils.checkpoint (memory_efficient=True)",
                                      "ours at the checkpoint peak (gradients checked)"]


def test_why_no_savings_example_gives_the_verdict(tmp_path):
    ex = load_example("why_no_savings").main(["--batch", "8", "--hidden", "1024",
                                              "--plot", str(tmp_path / "w.png")])
    assert ex.verdict.startswith("checkpointing cannot help much here")
    assert (tmp_path / "w.png").stat().st_size > 10_000
