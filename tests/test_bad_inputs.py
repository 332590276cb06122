"""The bad-input catalogue (issue 23): hostile files, misuse and usage mistakes on the CLI and API.

Each case asserts the exit code, the one-line message (what was expected, what was got, how to
fix it) and that no file in the working directory changed. The model is a tiny MLP in a file, so
each case runs in well under a second after the module's one profile and solve.
"""

import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest

from cli_support import run_cli
from monetlike.cli import main

TINY = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 2))

def notamodel():
    return 42

class Pair(nn.Module):  # takes two inputs
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.a(x) + y

def pair():
    return Pair()

def tokens():  # takes token ids
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 2))
"""

# Written by the schedule's hostile model_spec if anything ever imported it.
EVIL = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("the schedule file ran code")

def build():
    raise SystemExit(0)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory with tiny.py, its graph g.json (batch 4, input 8) and a schedule s.json."""
    d = tmp_path_factory.mktemp("bad")
    (d / "tiny.py").write_text(TINY)
    (d / "evil.py").write_text(EVIL)
    model = f"{d / 'tiny.py'}:build"
    assert main(["profile", model, "--batch", "4", "--input-shape", "8", "-o",
                 str(d / "g.json")]) == 0
    assert main(["solve", "--graph", str(d / "g.json"), "--budget", "1MiB", "-o",
                 str(d / "s.json")]) == 0
    return d


def _snapshot(d):
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            st = os.lstat(p)
            with open(p, "rb") as fh:
                out[p] = (hashlib.sha256(fh.read()).hexdigest(), stat.S_IMODE(st.st_mode))
    return out


def _variant(work, name, edit):
    """A copy of s.json under another name, changed by `edit(dict)`."""
    d = json.loads((work / "s.json").read_text())
    edit(d)
    p = work / name
    p.write_text(json.dumps(d))
    return p


def _deep(work):
    p = work / "deep.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    return p


def _set(path, value):
    def edit(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return edit


TINY_ARGS = ["--batch", "4", "--input-shape", "8"]

# (id, argv builder(work) -> argv, exit code, a piece of the one-line message)
CASES = [
    ("check-needs-model-and-never-runs-meta-spec",
     lambda w: ["check", str(_variant(w, "sx.json", _set(["meta", "model_spec"], "sys:exit")))],
     2, "check needs --model MODEL (a schedule file never chooses the code to run): this "
        "schedule was made for sys:exit"),
    ("check-never-imports-a-file-named-in-the-schedule",
     lambda w: ["check", str(_variant(w, "ev.json", _set(["meta", "model_spec"],
                                                         f"{w / 'evil.py'}:build")))],
     2, "evil.py:build`"),
    ("check-batch-0", lambda w: ["check", str(w / "s.json"), "--model",
                                 f"{w / 'tiny.py'}:build", "--batch", "0"],
     2, "argument --batch: expected a positive integer, got '0'"),
    ("maxbatch-limit-0", lambda w: ["maxbatch", f"{w / 'tiny.py'}:build", "--input-shape", "8",
                                    "--budget", "1MiB", "--limit", "0"],
     2, "argument --limit: expected a positive integer, got '0'"),
    ("solve-without-batch", lambda w: ["solve", f"{w / 'tiny.py'}:build", "--input-shape", "8",
                                       "--budget", "1MiB"],
     2, "needs --batch N"),
    ("cost-fast", lambda w: ["solve", f"{w / 'tiny.py'}:build", *TINY_ARGS, "--budget", "1MiB",
                             "--cost", "fast"],
     2, "argument --cost: cost: expected 'measured' or 'analytical:<DEVICE>'"),
    ("cost-unknown-device", lambda w: ["profile", f"{w / 'tiny.py'}:build", *TINY_ARGS,
                                       "--cost", "Analytical:Z80"],
     2, "unknown device 'Z80'"),
    ("factory-returns-no-model", lambda w: ["profile", f"{w / 'tiny.py'}:notamodel", *TINY_ARGS],
     2, "returned int, expected a torch.nn.Module"),
    ("factory-missing", lambda w: ["profile", f"{w / 'tiny.py'}:nosuch", *TINY_ARGS],
     2, "has no callable 'nosuch'"),
    ("pareto-empty-budgets", lambda w: ["pareto", f"{w / 'tiny.py'}:build", *TINY_ARGS,
                                        "--budgets", ","],
     2, "expected one or more comma-separated budgets like 5GiB,6GiB, got ','"),
    ("time-limit-inf", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget", "1MiB",
                                  "--time-limit", "inf"],
     2, "expected a positive, finite number of seconds like 60, got 'inf'"),
    ("time-limit-0", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget", "1MiB",
                                "--time-limit", "0"],
     2, "got '0'"),
    ("budget-bits-Gb", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget", "8Gb"],
     2, "ambiguous budget unit in '8Gb': a lower-case 'b' means bits"),
    ("budget-bits-mb", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget", "8mb"],
     2, "e.g. '8MB' (powers of 1000) or '8MiB' (powers of 1024)"),
    ("budget-negative", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget=-1GiB"],
     2, "cannot parse budget '-1GiB'"),
    ("nan-predicted-time",
     lambda w: ["check", str(_variant(w, "nan.json", _set(["predicted_time"], float("nan")))),
                "--model", f"{w / 'tiny.py'}:build"],
     2, "predicted_time: expected a non-negative, finite number or null, got nan"),
    ("deep-json", lambda w: ["check", str(_deep(w)), "--model", f"{w / 'tiny.py'}:build"],
     2, "nests JSON arrays or objects too deeply"),
    ("summary-batch-string",
     lambda w: ["check", str(_variant(w, "b4.json", _set(["graph_summary", "batch"], "4"))),
                "--model", f"{w / 'tiny.py'}:build"],
     2, "graph_summary.batch: expected a positive integer, got '4'; pass --batch N"),
    ("solve-output-is-its-input-graph",
     lambda w: ["solve", "--graph", str(w / "g.json"), "--budget", "1MiB", "-o",
                str(w / "g.json")],
     2, "is the input file"),
    ("profile-output-is-the-model-file",
     lambda w: ["profile", f"{w / 'tiny.py'}:build", *TINY_ARGS, "-o", str(w / "tiny.py")],
     2, "would destroy the input; choose another -o"),
    ("solve-graph-with-other-batch",
     lambda w: ["solve", "--graph", str(w / "g.json"), "--batch", "8", "--budget", "1MiB"],
     2, "--batch 8 contradicts the graph"),
    ("solve-graph-with-other-shape",
     lambda w: ["solve", "--graph", str(w / "g.json"), "--input-shape", "16", "--budget", "1MiB"],
     2, "--input-shape 16 contradicts the graph"),
    ("graph-infinite-op-time",
     lambda w: ["solve", "--graph", str(_graph_variant(w, "inf.json", float("inf"))),
                "--budget", "1MiB"],
     2, "fwd_time: expected a non-negative, finite number, got inf"),
    ("schedule-is-not-json", lambda w: ["check", str(_text(w, "t.json", '{"format": ')),
                                        "--model", f"{w / 'tiny.py'}:build"],
     2, "is not valid JSON (truncated or corrupted?)"),
    ("schedule-of-another-kind", lambda w: ["check", str(w / "g.json"), "--model",
                                            f"{w / 'tiny.py'}:build"],
     2, "schedule.format: expected 'monetlike.schedule'"),
    ("zoo-pick-batch-0", lambda w: ["zoo", "pick", "--model", "resnet50", "--batch", "0",
                                    "--budget", "8GiB"],
     2, "argument --batch: expected a positive integer, got '0'"),
    ("check-larger-batch", lambda w: ["check", str(w / "s.json"), "--model",
                                      f"{w / 'tiny.py'}:build", "--batch", "8"],
     2, "input shape [8, 8] is larger than the [4, 8] this schedule was solved for"),
    ("check-another-model", lambda w: ["check", str(w / "s.json"), "--model", "resnet18"],
     2, "resnet18 failed on an input of shape [4, 8]: RuntimeError: Expected 3D (unbatched) or "
        "4D (batched) input to conv2d"),
    ("check-wrong-input-shape", lambda w: ["check", str(w / "s.json"), "--model",
                                           f"{w / 'tiny.py'}:build", "--input-shape", "9"],
     2, "failed on an input of shape [4, 9]: RuntimeError: mat1 and mat2 shapes cannot be "
        "multiplied"),
    ("profile-wrong-input-shape",
     lambda w: ["profile", f"{w / 'tiny.py'}:build", "--batch", "4", "--input-shape", "9"],
     2, "mat1 and mat2 shapes cannot be multiplied (4x9 and 8x64). The command line gave "),
    ("profile-two-input-model", lambda w: ["profile", f"{w / 'tiny.py'}:pair", *TINY_ARGS],
     2, "missing a required argument: 'y'. The command line gave"),
    ("explain-token-model", lambda w: ["explain", f"{w / 'tiny.py'}:tokens", *TINY_ARGS],
     2, "give the model your factory returns a method example_inputs(batch, seq_len, device)"),
    ("maxbatch-token-model", lambda w: ["maxbatch", f"{w / 'tiny.py'}:tokens", "--input-shape",
                                        "8", "--budget", "1MiB"],
     2, "one float32 tensor of shape (batch, 8)"),
    ("check-a-directory", lambda w: ["check", str(w), "--model", f"{w / 'tiny.py'}:build"],
     2, "cannot be read: Is a directory; pass the path of a schedule JSON file"),
    ("factory-calls-sys-exit", lambda w: ["profile", "sys:exit", *TINY_ARGS],
     2, "'sys:exit' exited (SystemExit None) instead of returning a model"),
    ("graph-missing", lambda w: ["solve", "--graph", str(w / "nosuch.json"), "--budget", "1MiB"],
     2, "nosuch.json' does not exist"),
    ("graph-is-a-schedule", lambda w: ["solve", "--graph", str(w / "s.json"), "--budget", "1MiB"],
     2, "graph.format: expected 'monetlike.graph', got 'monetlike.schedule'"),
    ("unknown-backend", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget", "1MiB",
                                   "--backend", "nosuch"],
     2, "unknown MILP backend 'nosuch'; expected one of"),
    ("offload-in-checkpoint-mode", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget",
                                              "1MiB", "--mode", "checkpoint", "--offload"],
     2, "--offload is a choice of --mode full, not of --mode checkpoint"),
    ("negative-overhead", lambda w: ["maxbatch", f"{w / 'tiny.py'}:build", "--input-shape", "8",
                                     "--budget", "1MiB", "--max-overhead=-5%"],
     2, "expected a non-negative overhead, got '-5%'"),
    ("zero-host-bandwidth", lambda w: ["profile", f"{w / 'tiny.py'}:build", *TINY_ARGS,
                                       "--host-bandwidth", "0"],
     2, "expected a positive, finite bandwidth, got '0'"),
    ("plot-in-missing-directory", lambda w: ["explain", f"{w / 'tiny.py'}:build", *TINY_ARGS,
                                             "--plot", str(w / "nodir" / "x.png")],
     2, "nodir' does not exist; create it or choose another -o"),
    ("input-shape-not-integers", lambda w: ["profile", f"{w / 'tiny.py'}:build", "--batch", "4",
                                            "--input-shape", "3,x"],
     2, "expected comma-separated integers like 3,224,224, got '3,x'"),
    ("input-shape-zero", lambda w: ["profile", f"{w / 'tiny.py'}:build", "--batch", "4",
                                    "--input-shape", "0,3"],
     2, "expected positive sizes like 3,224,224, got '0,3'"),
    ("budget-below-minimum", lambda w: ["solve", "--graph", str(w / "g.json"), "--budget",
                                        "1KiB"],
     1, "budget 1.00 KiB is below the minimum feasible"),
    ("schedule-not-utf8", lambda w: ["check", str(_bytes(w, "bin.json", b"\xff\xfe\x00")),
                                     "--model", f"{w / 'tiny.py'}:build"],
     2, "is not UTF-8 text"),
    ("schedule-empty", lambda w: ["check", str(_bytes(w, "empty.json", b"")), "--model",
                                  f"{w / 'tiny.py'}:build"],
     2, "is not valid JSON (truncated or corrupted?)"),
    ("schedule-future-version",
     lambda w: ["check", str(_variant(w, "v9.json", _set(["schema_version"], 9))), "--model",
                f"{w / 'tiny.py'}:build"],
     2, "schedule.schema_version: expected 1, got 9; re-solve with this version"),
    ("schedule-negative-impl",
     lambda w: ["check", str(_variant(w, "neg.json", _set(["impl"], [-1]))), "--model",
                f"{w / 'tiny.py'}:build"],
     2, "schedule.impl[0]: expected a non-negative integer, got -1"),
    ("schedule-stages-not-a-list",
     lambda w: ["check", str(_variant(w, "st.json", _set(["stages"], {}))), "--model",
                f"{w / 'tiny.py'}:build"],
     2, "schedule.stages: expected a list, got dict"),
    ("schedule-meta-not-an-object",
     lambda w: ["check", str(_variant(w, "meta.json", _set(["meta"], []))), "--model",
                f"{w / 'tiny.py'}:build"],
     2, "schedule.meta: expected an object, got list"),
    ("zoo-unknown-name", lambda w: ["zoo", "show", "nosuch_1_1GiB"],
     2, "no zoo schedule named 'nosuch_1_1GiB'"),
]


def _bytes(work, name, data):
    p = work / name
    p.write_bytes(data)
    return p


def _graph_variant(work, name, fwd_time):
    d = json.loads((work / "g.json").read_text())
    d["ops"][0]["impls"][0]["fwd_time"] = fwd_time
    p = work / name
    p.write_text(json.dumps(d))
    return p


def _text(work, name, text):
    p = work / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("argv,code,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(work, capsys, argv, code, message):
    argv = argv(work)  # builds any hostile file first, then the snapshot
    before = _snapshot(work)
    got, out, err = run_cli(argv, capsys)
    assert got == code, err
    assert err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in err and ".tmp-" not in err
    assert _snapshot(work) == before
    assert not (work / "RAN").exists()


def test_api_raises_the_package_errors():
    import torch

    import monetlike
    from solver.errors import BudgetParseError, MonetlikeError

    model = torch.nn.Linear(4, 2)
    for bad in (float("inf"), "8Gb", -1):
        with pytest.raises(BudgetParseError) as e:
            monetlike.optimize(model, torch.randn(2, 4), budget=bad)
        assert isinstance(e.value, MonetlikeError)
    from monetlike.profile.costs import CostSpecError

    for bad in ("fast", 3, "Analytical:", "analytical:B200"):
        with pytest.raises(CostSpecError) as e:
            monetlike.optimize(model, torch.randn(2, 4), budget="1MiB", cost=bad)
        assert isinstance(e.value, MonetlikeError)
        assert "expected 'measured'" in str(e.value) or "presets are" in str(e.value)


def test_solve_records_the_graphs_own_shape(work):
    s = json.loads((work / "s.json").read_text())
    assert s["meta"]["input_shape"] == [8] and s["graph_summary"]["batch"] == 4
    assert "model_spec" not in s["meta"]  # solved from --graph: no model was named


def test_outputs_respect_the_umask_and_write_through_symlinks(work, capsys):
    target = work / "real.json"
    target.write_text("old")
    link = work / "link.json"
    link.symlink_to(target)
    old = os.umask(0o027)
    try:
        fresh = work / "fresh.json"
        assert main(["solve", "--graph", str(work / "g.json"), "--budget", "1MiB", "-o",
                     str(fresh)]) == 0
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
        os.chmod(target, 0o604)
        assert main(["solve", "--graph", str(work / "g.json"), "--budget", "1MiB", "-o",
                     str(link)]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["format"] == "monetlike.schedule"
    assert stat.S_IMODE(target.stat().st_mode) == 0o604  # the replaced file's mode is kept
    assert not [p for p in os.listdir(work) if p.startswith(".tmp-")]


def test_ctrl_c_during_a_solve_is_one_line_rc_130_and_keeps_the_old_file(work, capsys,
                                                                         monkeypatch):
    import solver

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(solver, "solve", interrupted)
    before = _snapshot(work)
    code, out, err = run_cli(["solve", "--graph", str(work / "g.json"), "--budget", "1MiB", "-o",
                           str(work / "s.json")], capsys)
    assert code == 130
    assert err == "monetlike solve: interrupted; no output written\n"
    assert _snapshot(work) == before


def test_an_interrupted_write_leaves_the_old_file(tmp_path, monkeypatch):
    from solver.jsonio import atomic_write_text

    p = tmp_path / "a.json"
    p.write_text("old")

    def boom(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(p, "new")
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]


def test_highs_banner_is_not_on_stdout(work):
    r = subprocess.run([sys.executable, "-m", "monetlike.cli", "solve", "--graph",
                        str(work / "g.json"), "--budget", "1MiB"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    assert "HiGHS" not in r.stdout and "predicted peak" in r.stdout


def test_pareto_with_no_feasible_budget_fails(work, capsys):
    code, out, err = run_cli(["pareto", f"{work / 'tiny.py'}:build", *TINY_ARGS, "--cost",
                           "measured", "--budgets", "1KiB", "--time-limit", "5"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "no method fits any of the budgets 1.00 KiB" in err


# -- the fingerprint covers what the memory model depends on -----------------------------------
def _conv_net(k: int, dtype=None):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, k, padding=k // 2), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4))
    return net if dtype is None else net.to(dtype)


def _schedule_for(model, x):
    import solver
    from monetlike.profile import profile

    g = profile(model, x, cost="analytical:A100-40GB")
    return g, solver.store_all_schedule(g)


@pytest.mark.parametrize("change,expected", [
    ("kernel", "params[2]: schedule has '2.weight 8x8x3x3 float32 requires_grad', model has "
               "'2.weight 8x8x7x7 float32 requires_grad'"),
    ("double", "input_dtypes[0]: schedule has 'float32', model has 'float64'; params[0]: "
               "schedule has '0.weight 8x3x3x3 float32 requires_grad', model has "
               "'0.weight 8x3x3x3 float64 requires_grad'"),
    ("requires_grad", "input_requires_grad[0]: schedule has False, model has True"),
    ("frozen", "params[0]: schedule has '0.weight 8x3x3x3 float32 requires_grad', model has "
               "'0.weight 8x3x3x3 float32'"),
])
def test_a_mismatch_names_the_first_difference(change, expected):
    import torch

    import monetlike
    from solver.errors import ScheduleMismatchError

    x = torch.randn(2, 3, 8, 8)
    g, sched = _schedule_for(_conv_net(3), x)
    model = _conv_net(7 if change == "kernel" else 3,
                      torch.float64 if change == "double" else None)
    if change == "double":
        x = x.double()
    if change == "requires_grad":
        x = x.requires_grad_()
    if change == "frozen":
        model[0].weight.requires_grad_(False)
    g2, _ = _schedule_for(model, x)
    assert g2.fingerprint != g.fingerprint
    if change == "kernel":  # every activation keeps its shape: only the parameters tell
        assert [v.shape for v in g2.values] == [v.shape for v in g.values]
    w = monetlike.ScheduleWrapper(model, sched)
    with pytest.raises(ScheduleMismatchError) as e:
        w(x)
    assert expected in str(e.value)


def test_params_round_trip_and_old_graphs_keep_their_fingerprint():
    import torch

    import solver

    g, _ = _schedule_for(_conv_net(3), torch.randn(2, 3, 8, 8))
    assert g.params[2] == ("2.weight", (8, 8, 3, 3), "float32", True)
    again = solver.OpGraph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again.params == g.params and again.fingerprint == g.fingerprint
    old = g.to_dict()
    del old["params"]  # a graph profiled before parameters were recorded
    from solver.graph import fingerprint_of

    structure = g.fingerprint_structure()
    del structure["params"]
    assert solver.OpGraph.from_dict(old).fingerprint == fingerprint_of(structure)


BN_MODEL = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(4),
                         nn.Linear(4, 2))
"""


def test_maxbatch_on_batchnorm_starts_at_two(tmp_path, capsys):
    # BatchNorm1d after pooling cannot train at batch 1: the search starts at 2 instead of failing.
    (tmp_path / "bn.py").write_text(BN_MODEL)
    code, out, err = run_cli(["maxbatch", f"{tmp_path / 'bn.py'}:build", "--input-shape", "3,8,8",
                           "--budget", "1GiB", "--limit", "5", "--time-limit", "5"], capsys)
    assert code == 0, err
    assert "largest batch that fits: 5" in out
    from monetlike.maxbatch import max_batch
    from monetlike.modelspec import build_model

    r = max_batch(build_model(f"{tmp_path / 'bn.py'}:build"), "1GiB", (3, 8, 8), limit=5,
                  time_limit_s=5)
    assert r.batch == 5 and sorted(r.tried) == [1, 2, 4, 5]
    assert r.tried[1].startswith("cannot run: ") and "more than 1 value per channel" in r.tried[1]


INTERRUPTED_SOLVE = """
import os, signal, sys, time
import solver

def slow(graph, budget, **kwargs):  # Ctrl-C arrives while the solve runs on for 20 s
    if {found}:  # it has found store-all by then (bound: 0.9 of its time)
        s = solver.store_all_schedule(graph)
        kwargs["on_incumbent"](s, 0.9 * solver.simulate(graph, s).total_time)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(20)
    print("the solve returned", file=sys.stderr)  # a process that waited for it says so

solver.solve = slow
from monetlike.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_stops_a_running_solve_at_once(work, tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(INTERRUPTED_SOLVE.format(found=False))
    before = _snapshot(work)
    r = subprocess.run([sys.executable, str(script), "solve", "--graph", str(work / "g.json"),
                        "--budget", "1MiB", "-o", str(work / "s.json")], capture_output=True,
                       text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert r.returncode == 130
    # Exactly this line: not the stub's, which a process waiting for the solve would print.
    assert r.stderr == "monetlike solve: interrupted; no output written\n"
    assert _snapshot(work) == before


def test_ctrl_c_with_output_keeps_the_best_schedule_so_far(work, tmp_path):
    import solver

    script = tmp_path / "found.py"
    script.write_text(INTERRUPTED_SOLVE.format(found=True))
    out = work / "best.json"
    r = subprocess.run([sys.executable, str(script), "solve", "--graph", str(work / "g.json"),
                        "--budget", "1MiB", "-o", str(out)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=60)
    assert r.returncode == 130
    assert r.stderr == (f"monetlike solve: interrupted; best schedule so far written to {out} "
                        f"(gap 10.0%)\n")
    s = solver.Schedule.load(out)
    g = solver.OpGraph.load(work / "g.json")
    assert s.meta["interrupted"] is True and abs(s.meta["gap"] - 0.1) < 1e-12
    assert s.predicted_peak_bytes == solver.simulate(g, s).peak_bytes <= s.budget_bytes


def test_png_outputs_respect_the_umask_and_write_through_symlinks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from monetlike.plotting import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    target = tmp_path / "real.png"
    target.write_bytes(b"old")
    (tmp_path / "link.png").symlink_to(target)
    old = os.umask(0o027)
    try:
        save_figure(fig, str(tmp_path / "fresh.png"))
        save_figure(fig, str(tmp_path / "link.png"))
    finally:
        os.umask(old)
        plt.close(fig)
    assert stat.S_IMODE((tmp_path / "fresh.png").stat().st_mode) == 0o640
    assert (tmp_path / "link.png").is_symlink()
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["fresh.png", "link.png", "real.png"]
