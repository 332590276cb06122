"""scripts/bench_solver.py on its smallest model (VGG-16 on the meta device): an infeasible
budget is reported with the computed minimum, a feasible one with a schedule and a gap, and a
second run with --resume renders the same rows from the results file without profiling again
(how the parts of a run made by separate processes are joined)."""

from __future__ import annotations

import json

import pytest

from script_support import load_script


def test_bench_solver_rows_and_resume(tmp_path, monkeypatch, capsys):
    bench = load_script("bench_solver")
    results = tmp_path / "rows.jsonl"
    # Each search proves its answer in 2-3 s here; the limit is far above that so that a loaded
    # machine does not stop one early (at 20 s, a run beside two others returned 5.66 GiB for
    # the minimum where the infeasible row's own search found 5.49)
    argv = ["--models", "vgg16", "--budgets", "5,9", "--time-limit", "600",
            "--results", str(results), "--no-write"]
    assert bench.main(argv) == 0
    first = capsys.readouterr().out
    records = [json.loads(line) for line in results.read_text().splitlines()]
    model = [r for r in records if r.get("kind") == "model"]
    rows = {r["budget"]: r for r in records if r.get("kind") != "model"}
    assert len(model) == 1 and model[0]["ops"] > 0
    assert rows["5 GiB"]["status"] == "infeasible"
    assert rows["5 GiB"]["note"] == f"min {model[0]['min_budget']}"
    ok = rows["9 GiB"]
    assert ok["status"] in ("optimal", "feasible-at-time-limit")
    assert 0 <= ok["gap_pct"] and ok["overhead_pct"] >= 0 and ok["variables"] > 0
    # every row says which code produced it, and the table shows it
    # (the tree may change while the test runs: another checkout user; so compare HEAD only)
    version = rows["9 GiB"]["commit"]
    assert version.split("+")[0] == bench.code_version().split("+")[0]
    assert version in (version.split("+")[0], version.split("+")[0] + "+dirty")
    assert all(r["commit"] == version for r in rows.values())
    assert 0 < ok["cpu_pct"] <= 100.5
    assert all(f"| {version} |" in ln for ln in first.splitlines() if ln.startswith("| vgg16"))

    def no_profiling(*a, **k):
        raise AssertionError("--resume profiled a model whose rows were all there")
    monkeypatch.setattr(bench, "profile", no_profiling)
    assert bench.main(argv + ["--resume"]) == 0
    again = capsys.readouterr().out
    table = [ln for ln in first.splitlines() if ln.startswith("| vgg16")]
    assert len(table) == 2 and table == [ln for ln in again.splitlines()
                                         if ln.startswith("| vgg16")]


def test_bench_solver_rejects_unknown_model():
    with pytest.raises(SystemExit):
        load_script("bench_solver").main(["--models", "alexnet", "--no-write"])


def test_code_version_marks_uncommitted_solver_changes(tmp_path):
    import subprocess

    bench = load_script("bench_solver")
    assert bench.code_version(str(tmp_path)) == "unknown"  # not a checkout

    def git(*a):
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)
    git("init", "-q")
    (tmp_path / "solver").mkdir()
    (tmp_path / "solver" / "a.py").write_text("x = 1\n")
    (tmp_path / "other.txt").write_text("a\n")
    git("add", "solver/a.py", "other.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert bench.code_version(str(tmp_path)) == head
    (tmp_path / "other.txt").write_text("b\n")  # outside solver/ and monetlike/: still clean
    assert bench.code_version(str(tmp_path)) == head
    (tmp_path / "solver" / "a.py").write_text("x = 2\n")
    assert bench.code_version(str(tmp_path)) == head + "+dirty"
    git("checkout", "solver/a.py")
    (tmp_path / "monetlike").mkdir()
    (tmp_path / "monetlike" / "new.py").write_text("y = 1\n")  # untracked code counts too
    assert bench.code_version(str(tmp_path)) == head + "+dirty"
