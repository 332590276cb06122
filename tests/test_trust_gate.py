"""Issue 51: nothing a file, the cache or a changed model says is trusted; every plan is
replayed by the simulator on the model's own graph before it runs (solver/verify.py).

Each case was a silent wrong run or a hang before the gate: a tampered schedule file running
above its recorded budget, a file choosing code through leaf_modules, a cache entry of another
budget returned, a cache write through a symlink or into a FIFO, an output replacing a device.
The model is a small MLP whose solved schedule recomputes, so tampering changes its peak.
"""

import json
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import monetlike
import solver
from monetlike.optimize import solve_cached
from solver.errors import OverBudgetError, ScheduleError
from solver.simulate import simulate
from solver.verify import verified


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 2))


X = torch.randn(128, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def solved():
    """(graph, the solved schedule, the store-all schedule) at a budget between the least
    feasible and the store-all peak."""
    graph = monetlike.profile(mlp(), X, cost="analytical:A100-40GB")
    store_all = solver.baselines.store_all(graph).schedule
    high = simulate(graph, store_all).peak_bytes
    low = solver.min_budget(graph)
    budget = (low + high) // 2
    schedule = solver.solve(graph, budget).schedule
    assert simulate(graph, schedule).peak_bytes <= budget < high
    return graph, schedule, store_all


def _step(wrapper):
    wrapper(X.clone()).sum().backward()


def _file(tmp_path, schedule, name="s.json", **edit):
    d = schedule.to_dict()
    d.update(edit)
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


# -- 1. one gate before any plan runs ----------------------------------------------------------
def test_store_all_decisions_under_the_solved_files_figures_are_refused(solved, tmp_path):
    graph, schedule, store_all = solved
    # The hostile edit of the issue: store-all decisions, the solved file's budget and peak.
    p = _file(tmp_path, store_all, budget_bytes=schedule.budget_bytes,
              predicted_peak_bytes=schedule.predicted_peak_bytes)
    wrapper = monetlike.ScheduleWrapper(mlp(), str(p))
    with pytest.raises(OverBudgetError) as e:
        _step(wrapper)
    peak = simulate(graph, store_all).peak_bytes
    assert f"peak at {solver.units.format_bytes(peak)} ({peak} B), above its budget" \
        in str(e.value)
    assert "it records a peak of" in str(e.value) and "s.json" in str(e.value)
    with pytest.raises(OverBudgetError):  # refused for good, not run on a second try
        _step(wrapper)


def test_a_budget_lowered_in_the_file_is_refused(solved, tmp_path):
    graph, schedule, _ = solved
    p = _file(tmp_path, schedule, budget_bytes=1024)
    with pytest.raises(OverBudgetError, match=r"above its budget of 1\.00 KiB \(1024 B\)"):
        _step(monetlike.ScheduleWrapper(mlp(), solver.Schedule.load(p)))


def test_an_impl_index_out_of_range_is_refused_by_name(solved, tmp_path):
    graph, schedule, _ = solved
    impl = list(schedule.impl)
    impl[1] = 7
    p = _file(tmp_path, schedule, impl=impl)
    with pytest.raises(ScheduleError, match=r"schedule.impl\[1\]: op .* has \d impls, got index 7"):
        _step(monetlike.ScheduleWrapper(mlp(), str(p)))


def test_the_wrapper_runs_the_simulators_figures_not_the_files(solved, tmp_path):
    graph, schedule, _ = solved
    p = _file(tmp_path, schedule, predicted_peak_bytes=5, predicted_time=1e-9)
    wrapper = monetlike.ScheduleWrapper(mlp(), str(p))
    _step(wrapper)
    ran = wrapper.schedule_for(X)
    assert ran.predicted_peak_bytes == simulate(graph, schedule).peak_bytes
    assert ran.predicted_time is None or ran.predicted_time > 1e-9


def test_verified_is_the_one_gate_for_a_solve(solved):
    graph, schedule, store_all = solved
    assert verified(graph, schedule).predicted_peak_bytes == simulate(graph, schedule).peak_bytes
    with pytest.raises(OverBudgetError, match="above the requested budget of"):
        verified(graph, store_all, budget=schedule.budget_bytes)


# -- 2. no file decides code -------------------------------------------------------------------
EVIL = """
import pathlib
pathlib.Path(__file__).with_name("RAN").write_text("a schedule file ran code")

import torch.nn as nn
class X(nn.Module):
    pass
"""


def test_leaf_modules_in_a_file_never_import(solved, tmp_path, monkeypatch):
    graph, schedule, _ = solved
    (tmp_path / "beside_the_script.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("this", None)
    meta = dict(schedule.meta, leaf_modules=["this.X", "beside_the_script.X"])
    p = _file(tmp_path, schedule, meta=meta)
    wrapper = monetlike.ScheduleWrapper(mlp(), str(p))
    _step(wrapper)
    assert not (tmp_path / "RAN").exists()
    assert "this" not in sys.modules and "beside_the_script" not in sys.modules


def test_leaf_modules_of_another_type_are_a_format_error(solved, tmp_path):
    graph, schedule, _ = solved
    p = _file(tmp_path, schedule, meta={"leaf_modules": {"os": "system"}})
    with pytest.raises(solver.errors.FormatError, match="schedule.meta.leaf_modules: expected"):
        monetlike.ScheduleWrapper(mlp(), str(p))


# -- 3. the optimize cache as untrusted input --------------------------------------------------
def _entries(cache):
    return sorted(os.listdir(cache))


def test_a_cache_entry_of_another_budget_is_not_returned(solved, tmp_path):
    graph, schedule, store_all = solved
    cache = tmp_path / "cache"
    high = simulate(graph, store_all).peak_bytes
    solve_cached(graph, high, cache_dir=cache)
    (big,) = _entries(cache)
    tight = solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    (small,) = [n for n in _entries(cache) if n != big]
    # The copy: the larger budget's entry onto the smaller budget's key.
    (cache / small).write_bytes((cache / big).read_bytes())
    with pytest.warns(UserWarning, match="it was solved for a budget of"):
        got = solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    assert got.budget_bytes == schedule.budget_bytes
    assert got.predicted_peak_bytes <= schedule.budget_bytes
    assert (got.impl, got.forward_keep, got.stages) == (tight.impl, tight.forward_keep,
                                                          tight.stages)
    # Same budget field, store-all decisions: the replay refuses it.
    d = store_all.to_dict()
    d["budget_bytes"] = schedule.budget_bytes
    (cache / small).write_text(json.dumps(d))
    with pytest.warns(UserWarning, match="above its budget of"):
        got = solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    assert got.predicted_peak_bytes <= schedule.budget_bytes


def test_a_cache_entry_that_is_a_symlink_is_replaced_not_written_through(solved, tmp_path):
    graph, schedule, _ = solved
    cache = tmp_path / "cache"
    solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    (name,) = _entries(cache)
    users_file = tmp_path / "thesis.txt"
    users_file.write_text("years of work")
    (cache / name).unlink()
    (cache / name).symlink_to(users_file)
    with pytest.warns(UserWarning, match="it is a symbolic link"):
        solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    assert users_file.read_text() == "years of work"
    assert (cache / name).is_file() and not (cache / name).is_symlink()


def test_a_cache_entry_that_is_a_fifo_does_not_hang(solved, tmp_path):
    graph, schedule, _ = solved
    cache = tmp_path / "cache"
    solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    (name,) = _entries(cache)
    (cache / name).unlink()
    os.mkfifo(cache / name)
    with pytest.warns(UserWarning, match=r"it is a FIFO \(named pipe\)"):
        got = solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    assert got.predicted_peak_bytes <= schedule.budget_bytes
    assert (cache / name).is_file()


def test_a_hostile_model_name_stays_inside_the_cache(solved, tmp_path):
    import dataclasses

    graph, schedule, _ = solved
    cache = tmp_path / "a" / "b" / "cache"
    hostile = dataclasses.replace(graph, model="../../x")
    solve_cached(hostile, schedule.budget_bytes, cache_dir=cache)
    (name,) = _entries(cache)
    assert name.startswith("x-b128-") and "/" not in name
    assert sorted(os.listdir(tmp_path / "a")) == ["b"]
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["cache"]


def test_a_cache_that_cannot_be_written_is_a_warning(solved, tmp_path):
    graph, schedule, _ = solved
    (tmp_path / "file").write_text("")
    cache = tmp_path / "file" / "cache"  # below a file: no one (root included) can create it
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = solve_cached(graph, schedule.budget_bytes, cache_dir=cache)
    assert got.predicted_peak_bytes <= schedule.budget_bytes
    (said,) = [str(w.message) for w in said]  # one warning, about the write
    assert said.startswith(f"monetlike.optimize: the schedule was solved but cannot be cached "
                           f"at '{cache}{os.sep}Sequential-b128-")
    assert "(Not a directory); it will be done again next time" in said


# -- 4. the model checked every step -----------------------------------------------------------
@pytest.mark.parametrize("change,difference", [
    (lambda m: m.__setitem__(8, nn.Linear(128, 4096)), "8.weight 4096x128"),  # same names
    # A recomputed GELU now a dropout: replayed, it would draw other masks.
    (lambda m: m.__setitem__(5, nn.Dropout(0.5)), "since an earlier step 5 was a GELU"),
    (lambda m: setattr(m[2], "weight", nn.Parameter(m[2].weight.detach().double())), "float64"),
], ids=["head-widened", "gelu-to-dropout", "parameter-dtype"])
def test_a_model_changed_after_the_first_step_is_refused_naming_the_difference(
        solved, change, difference):
    graph, schedule, _ = solved
    model = mlp()
    wrapper = monetlike.ScheduleWrapper(model, schedule)
    _step(wrapper)
    before = list(model)
    weight = model[2].weight
    change(model)
    with pytest.raises(solver.errors.ScheduleMismatchError) as e:
        _step(wrapper)
    assert difference in str(e.value), str(e.value)
    # Put back as it was, the model runs its plan again.
    for i, m in enumerate(before):
        model[i] = m
    model[2].weight = weight
    _step(wrapper)


# -- 5. two threads stepping one wrapper -------------------------------------------------------
class Meet(nn.Module):
    """A leaf where the two threads' forwards wait for each other, so that both steps are
    surely under way at once (recomputations run without grad and pass straight through)."""

    def __init__(self):
        super().__init__()
        self.barrier = None

    def forward(self, x):
        if self.barrier is not None and torch.is_grad_enabled():
            self.barrier.wait(timeout=120)
        return torch.tanh(x)


def test_two_threads_stepping_one_wrapper_both_work_and_leave_it_working():
    import threading

    def build():
        m = mlp()
        m[3] = Meet()
        return m

    graph = monetlike.profile(build(), X, cost="analytical:A100-40GB", leaf_modules=[Meet])
    high = simulate(graph, solver.baselines.store_all(graph).schedule).peak_bytes
    schedule = solver.solve(graph, (solver.min_budget(graph) + high) // 2).schedule
    assert schedule.stages and any(s.recompute for s in schedule.stages)
    model = build()
    # As a file names it: the leaf class is found among the model's own classes by its name.
    wrapper = monetlike.ScheduleWrapper(model, schedule,
                                        leaf_modules=[f"{Meet.__module__}.{Meet.__qualname__}"])
    _step(wrapper)  # the plan is built; the threads then step at once
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    errors = []
    model[3].barrier = threading.Barrier(2)

    def loop():
        try:
            for _ in range(3):
                _step(wrapper)
        except Exception as e:  # collected, asserted below in the main thread
            errors.append(e)
            model[3].barrier.abort()

    threads = [threading.Thread(target=loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for p, g in zip(model.parameters(), reference):  # six steps' gradients, accumulated
        torch.testing.assert_close(p.grad, 6 * g)
    model[3].barrier = None
    model.zero_grad(set_to_none=True)
    for _ in range(3):  # and single-threaded steps still succeed
        _step(wrapper)
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, 3 * g)


# -- 6. CLI outputs, and check saying why ------------------------------------------------------
MLP_FILE = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.Tanh(),
                         nn.Linear(128, 2))
"""


@pytest.fixture
def cli_files(solved, tmp_path):
    graph, schedule, store_all = solved
    (tmp_path / "mlp.py").write_text(MLP_FILE)
    graph.save(tmp_path / "g.json")
    return tmp_path


def _solve_to(cli_files, output, capsys):
    from cli_support import run_cli

    return run_cli(["solve", "--graph", str(cli_files / "g.json"), "--budget", "4MiB", "-o",
                    str(output)], capsys)


@pytest.mark.parametrize("kind,make", [
    ("a character device", lambda p: os.mknod(p, 0o20666, os.makedev(1, 3))),
    ("a FIFO (named pipe)", os.mkfifo),
    ("a directory", os.mkdir),
])
def test_an_output_that_is_not_a_regular_file_is_refused_before_the_solve(cli_files, capsys,
                                                                          kind, make):
    import stat

    target = cli_files / "out"
    try:
        make(target)
    except PermissionError:
        pytest.skip("making a device node needs root")
    mode = os.lstat(target).st_mode
    code, out, err = _solve_to(cli_files, target, capsys)
    assert code == 2, err
    assert f"cannot write {str(target)!r}: it is {kind}, not a regular file" in err
    assert "HiGHS" not in out + err  # refused before any solve
    assert stat.S_IFMT(os.lstat(target).st_mode) == stat.S_IFMT(mode)  # left as it was


def test_a_long_output_name_is_written_and_one_too_long_is_refused_up_front(cli_files, capsys):
    ok = cli_files / ("s" * 245 + ".json")  # 250 bytes: the old temporary name overflowed
    code, out, err = _solve_to(cli_files, ok, capsys)
    assert code == 0, err
    assert solver.Schedule.load(ok).budget_bytes == 4 * 2**20
    assert [n for n in os.listdir(cli_files) if n.startswith(".")] == []
    too_long = cli_files / ("s" * 300 + ".json")
    code, out, err = _solve_to(cli_files, too_long, capsys)
    assert code == 2 and "its name is longer than the 255 bytes" in err, err


def test_check_refuses_a_tampered_file_and_says_why(solved, cli_files, capsys):
    from cli_support import run_cli

    graph, schedule, store_all = solved
    p = _file(cli_files, store_all, budget_bytes=schedule.budget_bytes,
              predicted_peak_bytes=schedule.predicted_peak_bytes)
    code, out, err = run_cli(["check", str(p), "--model", f"{cli_files / 'mlp.py'}:build"],
                             capsys)
    assert code == 1
    assert "monetlike check: error: ScheduleWrapper: the schedule" in err
    peak = simulate(graph, store_all).peak_bytes
    assert f"peak at {solver.units.format_bytes(peak)} ({peak} B), above its budget" in err


# -- 7. the unclear cases, each one clear line -------------------------------------------------
def test_the_least_budget_is_printed_rounded_up_with_bytes_and_names_forward_hooks():
    model = mlp()
    model[1].register_forward_hook(lambda m, i, o: None)
    graph = monetlike.profile(model, X, cost="analytical:A100-40GB")
    with pytest.raises(solver.errors.InfeasibleBudgetError) as e:
        solver.solve(graph, 1000)
    text = str(e.value)
    assert "1 op(s) cannot be recomputed and stay resident" in text
    assert "module 1 (GELU) has forward hooks" in text
    least = e.value.min_budget
    printed = text.split("minimum feasible budget ")[1].split(" (")[0]  # e.g. '4.59 MiB'
    assert f"{printed} ({least} B)" in text
    typed_back = solver.units.parse_bytes(printed.replace(" ", ""))
    assert typed_back >= least
    assert solver.solve(graph, typed_back).ok


def test_budget_text_typed_back_is_never_below_the_bytes():
    from solver.units import budget_text, parse_bytes

    for n in [1, 1023, 1024, 1025, 4_806_123, 2**20 - 1, 3 * 2**30 + 7, 10**12 + 1]:
        assert parse_bytes(budget_text(n).split(" (")[0].replace(" ", "")) >= n, n


@pytest.mark.parametrize("given", ["9" * 400, 10**400, "9" * 400 + "GiB"])
def test_a_huge_budget_is_one_clear_error(given):
    with pytest.raises(solver.errors.BudgetParseError, match="is too large: expected at most"):
        solver.units.parse_bytes(given)


def test_huge_integers_in_a_file_are_a_format_error(solved, tmp_path):
    graph, schedule, _ = solved
    p = tmp_path / "s.json"
    p.write_text(json.dumps(dict(schedule.to_dict(), budget_bytes=10**400)))
    with pytest.raises(solver.errors.FormatError,
                       match=r"schedule.budget_bytes: expected an integer below 2\^63"):
        solver.Schedule.load(p)
    p.write_text(json.dumps(dict(schedule.to_dict(), budget_bytes=0)).replace(
        '"budget_bytes": 0', '"budget_bytes": ' + "9" * 5000))
    with pytest.raises(solver.errors.FormatError, match="is not valid JSON"):
        solver.Schedule.load(p)


def test_a_time_limit_that_is_not_a_number_is_one_clear_error(solved):
    graph, schedule, _ = solved
    with pytest.raises(ValueError, match=r"time_limit_s must be positive \(a number of "
                                         r"seconds\), got str '5'"):
        solver.solve(graph, schedule.budget_bytes, time_limit_s="5")


def test_an_input_shape_whose_size_overflows_is_one_clear_line(cli_files, capsys):
    from cli_support import run_cli

    code, out, err = run_cli(["profile", f"{cli_files / 'mlp.py'}:build", "--batch", "4",
                              "--input-shape", "4294967296,4294967296", "--cost",
                              "analytical:A100-40GB", "-o", str(cli_files / "g2.json")], capsys)
    assert code == 2
    assert "makes more elements than a tensor can hold (2^63 - 1)" in err
    assert err.count("\n") == 1


def test_a_ctrl_c_in_the_storage_callback_is_not_lost(solved, capsys):
    """A KeyboardInterrupt raised inside the runtime's weakref callback (where Ctrl-C lands when
    a storage dies at that moment) is not 'Exception ignored' and lost: the runtime raises it at
    its next node, and the step after runs."""
    import functools
    import weakref

    from monetlike.runtime.step_state import forget_key

    graph, schedule, _ = solved
    wrapper = monetlike.ScheduleWrapper(mlp(), schedule)
    _step(wrapper)

    class Interrupted(dict):
        def get(self, *args):
            raise KeyboardInterrupt

    class Storage:
        pass

    storage = Storage()
    ref = weakref.ref(storage, functools.partial(forget_key, Interrupted(), {}, 0, 1))
    del storage  # the callback runs here, and the interrupt lands in it
    assert ref() is None
    assert "Exception ignored" not in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        _step(wrapper)
    _step(wrapper)


def test_a_zoo_entry_edited_in_place_is_refused_by_load(solved, tmp_path, monkeypatch):
    from monetlike import zoo

    graph, schedule, store_all = solved
    entry = zoo.ZooEntry(name="mlp_128", model="mlp", batch=128, input_shape=(16,),
                         budget_bytes=schedule.budget_bytes,
                         predicted_peak_bytes=schedule.predicted_peak_bytes,
                         predicted_time=schedule.predicted_time, store_all_time=1e-6,
                         store_all_peak_bytes=simulate(graph, store_all).peak_bytes,
                         mode="full", status="optimal", mip_gap=0.0,
                         cost_provenance=schedule.cost_provenance,
                         fingerprint=schedule.fingerprint)
    (tmp_path / "index.json").write_text(json.dumps({"entries": [entry.to_dict()]}))
    monkeypatch.setenv("MONETLIKE_ZOO", str(tmp_path))
    _file(tmp_path, schedule, name="mlp_128.json", predicted_peak_bytes=1)
    loaded = zoo.load("mlp_128", mlp())  # the simulator's figures, not the file's
    assert loaded.predicted_peak_bytes == simulate(graph, schedule).peak_bytes
    # Edited in place: store-all decisions under the entry's figures.
    _file(tmp_path, store_all, name="mlp_128.json", budget_bytes=schedule.budget_bytes,
          predicted_peak_bytes=schedule.predicted_peak_bytes)
    assert zoo.pick("mlp", 128, schedule.budget_bytes).name == "mlp_128"  # the index's claim
    with pytest.raises(OverBudgetError, match="zoo schedule 'mlp_128': replayed by the "
                                              "simulator on this model's graph"):
        zoo.load("mlp_128", mlp())


def test_output_to_dev_stdout_on_a_pipe_is_refused_before_the_solve(cli_files):
    import subprocess

    run = subprocess.run([sys.executable, "-m", "monetlike.cli", "solve", "--graph",
                          str(cli_files / "g.json"), "--budget", "4MiB", "-o", "/dev/stdout"],
                         capture_output=True, text=True, cwd=cli_files,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == ("monetlike solve: error: cannot write '/dev/stdout': it is a "
                                  "FIFO (named pipe), not a regular file; choose a file path "
                                  "for -o")
