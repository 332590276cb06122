"""explain: the breakdown adds up, and the verdicts are right for the forum CNN and for a ResNet."""

import torch
import torchvision

from monetlike.explain import explain
from script_support import load_example


def test_forum_cnn_gets_the_verdict_that_checkpointing_cannot_help(tmp_path):
    forum = load_example("why_no_savings")
    with torch.device("meta"):
        model = forum.ForumCNN()
        x = torch.randn(32, 1, 19, 22)
    ex = explain(model, x, optimizer="adam")
    assert sum(ex.breakdown.values()) == ex.store_all_peak_bytes
    assert ex.verdict.startswith("checkpointing cannot help much here")
    assert "parameters, their gradients and optimizer state" in ex.verdict
    assert ex.saving_bytes < 0.01 * ex.store_all_peak_bytes
    # Adam keeps two buffers per parameter.
    assert ex.breakdown["optimizer state"] == 2 * sum(p.numel() * 4 for p in model.parameters())
    out = tmp_path / "forum.png"
    ex.plot(str(out))
    assert out.stat().st_size > 10_000


def test_resnet_activations_dominate_and_scheduling_can_help():
    x = torch.randn(64, 3, 128, 128, device="meta")
    ex = explain(torchvision.models.resnet18(), x, time_limit_s=30)
    assert sum(ex.breakdown.values()) == ex.store_all_peak_bytes
    assert ex.breakdown["activations (kept tensors)"] > 0.5 * ex.store_all_peak_bytes
    assert ex.verdict.startswith("scheduling can help")
    assert ex.min_budget_bytes < 0.7 * ex.store_all_peak_bytes
    # The peak falls early in the backward pass, where layer4's own activations are already freed.
    assert ex.peak_phase == "backward pass"
    assert {"layer1", "layer2", "layer3"} <= set(ex.activations_by_module)
    assert "layer4" not in ex.activations_by_module
