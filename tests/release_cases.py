"""Seeded graphs and valid schedules for the release-rule tests (tests/test_release.py), no torch.

`random_valid_schedule` builds a schedule valid by construction that exercises every branch of the
release rule: drops unused in a stage, drops read by a recomputation, drops saved by the backward,
recomputed outputs that nothing later reads (extra recomputations), duplicates of resident
Values, and fetches of offloaded Values. `cases(seed)` is one graph with its schedules.

Run `python tests/release_cases.py` to print the regression table of tests/test_release.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

from solver.graph import OpGraph
from solver.schedule import Schedule, StageSchedule
from solver.simulate import Timeline, simulate
from solver_cases import random_dag, random_schedules

SEEDS = range(60)


def random_valid_schedule(g: OpGraph, rng: random.Random) -> Schedule:
    ops, values = g.ops, g.values
    produced = lambda v: values[v].producer is not None  # noqa: E731
    outputs = set(g.outputs)
    impl = tuple(rng.randrange(len(op.impls)) for op in ops)
    candidates = [v.id for v in values if produced(v.id) and v.id not in outputs]
    keep = {v for v in candidates if rng.random() < 0.5}
    offload = ({v for v in candidates if v not in keep and rng.random() < 0.4}
               if g.host_bandwidth else set())
    # After the forward pass: the kept Values and the caller's outputs.
    resident = keep | outputs
    stages = []
    for k in g.backward_order:
        avail = set(resident)
        recompute: set[int] = set()
        fetch: set[int] = set()

        def require(v: int) -> None:
            if not produced(v) or v in avail:
                return
            if v in offload and rng.random() < 0.5:
                fetch.add(v)
                avail.add(v)
                return
            p = values[v].producer
            recompute.add(p)
            for u in ops[p].inputs:
                require(u)
            avail.update(ops[p].outputs)

        for v in sorted(ops[k].impls[impl[k]].saved):
            require(v)
        # Extra work a real schedule would not do, so that recomputed outputs read by nothing
        # later in the stage (and duplicates of resident Values) occur.
        for j, op in enumerate(ops):
            if (j not in recompute and rng.random() < 0.15
                    and all(not produced(u) or u in avail for u in op.inputs)):
                recompute.add(j)
                avail.update(op.outputs)
        for v in sorted(offload - avail):
            if rng.random() < 0.2:
                fetch.add(v)
                avail.add(v)
        made = {v for j in recompute for v in ops[j].outputs}
        fetch -= made  # a Value recomputed in a stage is not also fetched in it
        drop = {v for v in avail - outputs if rng.random() < 0.5}
        stages.append(StageSchedule(op=k, recompute=tuple(sorted(recompute)),
                                    drop=tuple(sorted(drop)), fetch=tuple(sorted(fetch))))
        resident = avail - drop
    return Schedule(fingerprint=g.fingerprint, graph_summary=g.summary(), impl=impl,
                    forward_keep=tuple(sorted(keep)), stages=tuple(stages),
                    offload=tuple(sorted(offload)), created_by="test:random_valid")


def cases(seed: int) -> tuple[OpGraph, list[Schedule]]:
    """A random DAG (with a host link for odd seeds) and ten schedules: the rule-based ones of
    solver_cases.random_schedules and four from random_valid_schedule."""
    rng = random.Random(seed)
    g = random_dag(rng, rng.randint(3, 10), two_impl=True)
    if seed % 2:
        g = dataclasses.replace(g, host_bandwidth=1000.0)
    schedules = random_schedules(g, rng) + [random_valid_schedule(g, rng) for _ in range(4)]
    return g, schedules


def digest(timelines: list[Timeline]) -> str:
    """A short hash of every point (phase, stage, op, bytes, resident set) of the timelines."""
    rows = [(p.phase, p.stage, p.op, p.bytes, p.resident) for tl in timelines for p in tl.points]
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def table() -> dict[int, tuple[tuple[int, ...], str]]:
    out = {}
    for seed in SEEDS:
        g, schedules = cases(seed)
        tls = [simulate(g, s) for s in schedules]
        out[seed] = (tuple(tl.peak_bytes for tl in tls), digest(tls))
    return out


if __name__ == "__main__":
    for seed, (peaks, dig) in table().items():
        print(f"    {seed}: ({peaks}, {dig!r}),")
