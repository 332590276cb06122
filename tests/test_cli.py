"""The command line: its surface is fixed (it only grows on purpose) and bad input fails cleanly."""

import argparse
import os
import subprocess
import sys

import pytest

from monetlike.cli import build_parser, main

# The whole surface: subcommand -> its options. Change this only on purpose.
SURFACE = {
    "profile": ["--batch", "--cost", "--input-shape", "--optimizer", "-o/--output"],
    "solve": ["--backend", "--batch", "--budget", "--cost", "--graph", "--input-shape", "--mode",
              "--optimizer", "--time-limit", "--verbose", "-o/--output"],
    "backends": [],
    "check": ["--batch", "--input-shape", "--model"],
    "zoo": [],
    "explain": ["--batch", "--cost", "--input-shape", "--optimizer", "--plot"],
    "pareto": ["--backend", "--batch", "--budgets", "--cost", "--input-shape", "--optimizer",
               "--plot", "--time-limit"],
    "maxbatch": ["--budget", "--cost", "--input-shape", "--limit", "--max-overhead",
                 "--optimizer", "--time-limit", "-o/--output"],
}
ZOO_SURFACE = {"list": [], "show": [], "pick": ["--batch", "--budget", "--model", "-o/--output"]}


def _options(parser):
    out = []
    for a in parser._actions:
        if a.option_strings and not isinstance(a, argparse._HelpAction):
            out.append("/".join(sorted(a.option_strings, key=len)))
    return sorted(out)


def _subparsers(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return {}


def test_surface_is_fixed_and_every_flag_has_help():
    parser = build_parser()
    subs = _subparsers(parser)
    assert sorted(subs) == sorted(SURFACE)
    for name, sub in subs.items():
        assert _options(sub) == sorted(SURFACE[name]), name
        for a in sub._actions:
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                assert a.help, f"{name} {a.option_strings or a.dest} has no help"
    zoo = _subparsers(subs["zoo"])
    assert {k: _options(v) for k, v in zoo.items()} == {k: sorted(v) for k, v in ZOO_SURFACE.items()}


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_unknown_model_is_a_usage_error(capsys, tmp_path):
    out = tmp_path / "g.json"
    code, _, err = _run(["profile", "nosuch.models:build", "--batch", "2", "-o", str(out)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "cannot import 'nosuch.models'" in err
    assert "expected an importable factory" in err
    assert not out.exists()


def test_missing_model_file_is_a_usage_error(capsys, tmp_path):
    code, _, err = _run(["profile", str(tmp_path / "m.py") + ":build", "--batch", "2"], capsys)
    assert code == 2 and "does not exist" in err


def test_malformed_budget_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["solve", "resnet18", "--batch", "2", "--budget", "8 giga"])
    assert e.value.code == 2
    assert "cannot parse budget '8 giga'" in capsys.readouterr().err


def test_unwritable_output_fails_before_any_work(capsys, tmp_path):
    code, _, err = _run(["profile", "resnet18", "--batch", "2", "-o",
                         str(tmp_path / "missing" / "g.json")], capsys)
    assert code == 2 and "does not exist; create it or choose another -o" in err
    assert list(tmp_path.iterdir()) == []


def test_unknown_zoo_name(capsys):
    code, _, err = _run(["zoo", "show", "nosuch_1_1GiB"], capsys)
    assert code == 2 and "no zoo schedule named 'nosuch_1_1GiB'" in err


def test_no_traceback_without_debug_and_traceback_with_it():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "monetlike.cli", "profile", "nosuch.x", "--batch",
                        "1"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "monetlike.cli", "--debug", "profile", "nosuch.x",
                        "--batch", "1"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "Traceback" in r.stderr
