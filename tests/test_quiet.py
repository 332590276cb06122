"""Quiet by default, informative on a terminal: one line per phase and a solve bar with the
incumbent and the bound on a terminal; nothing on stderr when it is not one."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
import torch.nn as nn

import monetlike
from solver.search.progress import Progress, phase

pytestmark = pytest.mark.usefixtures("one_thread")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_phase_is_one_line_on_a_terminal_and_nothing_elsewhere(monkeypatch):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with phase("solve", "160.00 MiB"):
        pass
    assert re.fullmatch(r"monetlike: solve \(160\.00 MiB\) \d+\.\d s\n", tty.getvalue())
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    with phase("solve"):
        pass
    assert pipe.getvalue() == ""


def test_the_solve_bar_shows_the_incumbent_the_bound_and_the_gap(monkeypatch):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    bar = Progress(sys.stderr.isatty(), 30, base_time=1.0, time_scale=1.0, desc="model 1 MiB")
    bar.update(incumbent=1.10, bound=1.05)
    bar.close()
    bar.update(incumbent=1.0)  # after close: nothing, no error (the clock's thread stopped)
    assert "overhead 10.00%, bound 5.00%, gap 4.55%" in tty.getvalue()


def test_optimize_says_nothing_when_stderr_is_not_a_terminal(tmp_path, capfd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 2))
    monetlike.optimize(model, torch.randn(4, 8), budget="min", cache_dir=tmp_path,
                       time_limit_s=5)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
