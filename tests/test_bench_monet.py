"""scripts/bench_monet.py without solving: MONeT's table as the script holds it, and the report it
renders from result rows (how runs made by separate processes are joined)."""

from __future__ import annotations

import json

from script_support import load_script


def test_monet_table_has_six_points_per_model_from_large_to_small():
    bench = load_script("bench_monet")
    assert sorted(bench.MONET) == ["googlenet", "mobilenet_v2", "resnet50", "unet", "vgg16"]
    for points in bench.MONET.values():
        budgets = [gb for gb, _ in points]
        assert len(points) == 6 and budgets == sorted(budgets, reverse=True)
        overheads = [pct for _, pct in points]
        assert overheads == sorted(overheads)  # less memory never costs MONeT less time


def _row(model, gb, monet, ours, **kw):
    row = dict(model=model, batch=176, cost="analytical:P100-16GB", budget_gib=gb,
               monet_pct=monet, target_pct=max(monet, 0.0), store_all_gib=13.0,
               least_full_gib=5.5, least_full_bound_gib=5.5, least_full_proven=True,
               least_checkpoint_gib=9.5, least_checkpoint_bound_gib=9.5,
               least_checkpoint_proven=True, status="optimal", ours_pct=ours, gap_pct=0.1,
               solve_s=1.0, commit="abc1234")
    row["met"] = ours is not None and ours <= row["target_pct"] + 0.005
    row.update(kw)
    return row


def test_render_only_reports_met_points_and_least_budgets(tmp_path, capsys):
    bench = load_script("bench_monet")
    results = tmp_path / "rows.jsonl"
    rows = [_row("vgg16", 9.71, -5.3, 0.0), _row("vgg16", 5.51, 9.11, 9.2),
            _row("vgg16", 5.0, 9.5, None, status="infeasible", gap_pct=None)]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.main(["--render-only", "--results", str(results), "--no-doc"]) == 0
    out = capsys.readouterr().out
    assert "1 of 3 points at or below MONeT's overhead" in out
    assert "| vgg16 (176) | 9.71 | -5.30 | +0.00 | yes |" in out  # MONeT's -5.30% counts as 0%
    assert "| vgg16 (176) | 5.51 | +9.11 | +9.20 | no |" in out
    assert "| vgg16 (176) | 5.00 | +9.50 | infeasible | no |" in out
    assert "| vgg16 | 13.000 | 5.500 (5.500) | 9.500 (9.500) | 1.73x |" in out
