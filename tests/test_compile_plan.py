"""scripts/compile_plan.py reads torch.compile's activation-memory plan off its partitioned graphs:
what the backward keeps (by the op that made it) and what it runs again."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import compile_plan  # noqa: E402
from peers import SPECS  # noqa: E402


def test_a_smaller_budget_keeps_less_and_recomputes_forward_ops():
    spec = SPECS["quick"]["transformer"]
    kept_all, again_all = compile_plan.plan(*compile_plan.capture(spec, 1.0))
    kept_low, again_low = compile_plan.plan(*compile_plan.capture(spec, 0.1))
    assert not again_all  # nothing recomputed when everything fits
    # Everything kept: the dropout masks (native_dropout's second result) and the softmax.
    assert "aten.native_dropout.default[1]" in kept_all
    assert "aten._softmax.default" in kept_all
    assert sum(b for _, b in kept_low.values()) < sum(b for _, b in kept_all.values())
    assert again_low, "a budget of 0.1 must recompute forward ops in the backward"
    assert all(not op.startswith("aten.view") for op in again_low)  # views are not counted
