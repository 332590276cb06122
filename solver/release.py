"""The release rule: when a Value dropped by a backward stage is freed.

One rule, read by the simulator (solver/simulate.py) and by the runtime's plan
(monetlike/runtime/plan.py), so the runtime frees each Value exactly where the simulator does
(docs/execution-model.md section 3). For stage t, with recompute list R and drop list D:

- a Value in D is freed right after its last use in the stage: at the stage start if the stage
  does not read it, right after the last recomputation in R that reads it, or right after the
  backward if the backward reads it (its Impl saves it);
- a Value in D that a recomputation makes after that last use (nothing later in the stage reads
  it) is freed right after it is made; otherwise it would stay resident past the stage.

Values not in D are never released by the stage. The rule assumes a valid schedule (the simulator
checks residency); it only says when, not whether, a release is safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import OpGraph
from .schedule import Schedule


@dataclass(frozen=True)
class StageRelease:
    """The Values one stage releases, by position in the stage (each tuple sorted)."""

    at_start: tuple[int, ...]
    """Released at the stage start (after its fetches, before any recomputation)."""
    after_recompute: tuple[tuple[int, ...], ...]
    """Aligned with the stage's recompute list: released right after that recomputation."""
    at_end: tuple[int, ...]
    """Released right after the stage's backward."""


def stage_releases(graph: OpGraph, schedule: Schedule, t: int) -> StageRelease:
    """When stage t of `schedule` releases each Value in its drop list (module docstring)."""
    stage = schedule.stages[t]
    ops = graph.ops
    backward = len(stage.recompute)  # the backward's position, after every recomputation
    # The last position in the stage that reads each dropped Value; -1: none reads it.
    last = {v: -1 for v in stage.drop}
    for pos, j in enumerate(stage.recompute):
        for v in ops[j].inputs:
            if v in last:
                last[v] = pos
    for v in ops[stage.op].impls[schedule.impl[stage.op]].saved:
        if v in last:
            last[v] = backward
    after = []
    for pos, j in enumerate(stage.recompute):
        read_last_here = {v for v, p in last.items() if p == pos}
        made_after_last_read = {v for v in ops[j].outputs if v in last and last[v] < pos}
        after.append(tuple(sorted(read_last_here | made_after_last_read)))
    return StageRelease(at_start=tuple(sorted(v for v, p in last.items() if p == -1)),
                        after_recompute=tuple(after),
                        at_end=tuple(sorted(v for v, p in last.items() if p == backward)))
