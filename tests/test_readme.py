"""README's one-line examples run as written (their budget had become infeasible once, unseen)."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

from monetlike.profile import profile

README = Path(__file__).resolve().parent.parent / "README.md"

pytestmark = pytest.mark.usefixtures("one_thread")


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_the_optimize_examples_run(tmp_path, monkeypatch):
    """The blocks that call monetlike.optimize, in order, in one namespace (the second reuses
    the first's model and input), with the schedule cache in a temporary directory."""
    blocks = [b for b in _python_blocks() if "monetlike.optimize(" in b]
    assert len(blocks) == 2, "README's optimize examples changed: update this test"
    monkeypatch.setenv("MONETLIKE_CACHE", str(tmp_path))
    # One timed step (pair) per Op and Impl level instead of the default five: the same timing
    # code runs, with noisier costs, and the budget's feasibility is memory alone. The two
    # ResNet-18 profiles time 28 steps instead of 84, which were most of the test's time.
    monkeypatch.setattr(sys.modules["monetlike.optimize"], "profile",
                        functools.partial(profile, repeat=1))
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["wrapped"].schedule.budget_bytes == 160 * 2**20
