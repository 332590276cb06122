"""Chain combination: one plan per segment of the chain of blocks, chosen together by dynamic
programming (in the manner of Rotor and Rockmate).

`blocks.find_blocks` cuts a graph into a chain of segments (repeated blocks, one-off stretches).
Here every boundary Value between segments (the chain's cuts: a transformer's residual stream,
a broadcast mask) is kept from the forward pass, so a segment is only ever rebuilt from its own
inputs, and a segment's plan is a set of its own Values kept besides: an *option*. A segment's
options are the prefixes of its Values ranked by recomputation seconds per byte (the ranked
rule's order, per segment), at most MAX_OPTIONS of them, evenly spaced. Measured by the
simulator, each option has:
- `extra`: the bytes it keeps beyond its segment's first option. They are held from the
  segment's forward to its backward, so over every point of the segments after it (their
  forward runs later and their backward earlier);
- `peak`: the highest point of the segment's own forward, recomputations and backward, less
  the other segments' extra bytes held there;
- `time`: the seconds of the segment's recomputations.
The step's peak is then the largest, over segments b, of b's `peak` plus the `extra` of the
segments before b, and its time the sum of the `time`s. `combine` finds the fastest choice of
one option per segment under a budget exactly, by a Pareto front of (bytes held, seconds) over
the prefixes of the chain (docs/formulation.md, "Chain combination").

Each option is replayed once, alone (`measure`); twins share their options, replayed on one
member: a 48-layer transformer's options take about 30 replays, not one per layer and option
(850). The answer is replayed too: where the chain's model is wrong (a
segment's Values held where it says they are not), the replay's peak exceeds the budget, the
budget is lowered by the excess and the combination tried again (ROUNDS times at most).

Limits: boundaries are always kept (plans that drop the residual stream and recompute two
layers at once, Chen's, are left to the other rules and the MILP); one Impl per op (the
caller's); an option is a prefix of one ranking, not any subset of a segment's Values.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from .analysis import GraphFacts
from .blocks import BlockChain, find_blocks
from .graph import OpGraph
from .rules import schedule_from_keep
from .schedule import Schedule
from .simulate import simulate

MAX_OPTIONS = 32
"""Options per segment at most (prefix lengths evenly spaced when a segment has more Values)."""
ALL_SUBSETS_UP_TO = 5
"""A segment with at most this many Values to choose from has every subset as an option (32 at
most), not only the prefixes of its ranking."""
ROUNDS = 4
"""Combinations tried at lowered budgets when the answer's replay exceeds the budget."""


@dataclass(frozen=True)
class Option:
    """One plan of one segment: what it keeps besides the boundaries, and what that costs."""

    keep: frozenset[int]
    extra: int
    """Bytes kept beyond the segment's first option, held over the later segments' points."""
    peak: int
    """The highest point of the segment's own part of the step, without other segments' extra."""
    time: float
    """Seconds of the segment's recomputations."""


def ranked_values(graph: OpGraph, facts: GraphFacts, ops, impl, forced) -> list[int]:
    """The Values made by `ops` that a plan may keep, dearest to recompute per byte first."""
    g_ops, values = graph.ops, graph.values
    cands = [w for j in ops for w in g_ops[j].outputs
             if facts.scheduled[w] and facts.horizon[w] >= 0 and w not in forced
             and g_ops[j].recompute_unsafe is None]

    def seconds_per_byte(v: int) -> float:
        p = values[v].producer
        return g_ops[p].impls[impl[p]].rerun_time / max(values[v].bytes, 1)

    return sorted(cands, key=lambda v: (-seconds_per_byte(v), v))


def prefix_lengths(n: int, limit: int = MAX_OPTIONS) -> list[int]:
    """0..n, or `limit` of them evenly spaced (0 and n included)."""
    if n + 1 <= limit:
        return list(range(n + 1))
    return sorted({round(i * n / (limit - 1)) for i in range(limit)})


def segment_keeps(graph: OpGraph, facts: GraphFacts, chain: BlockChain, impl,
                  forced) -> list[list[frozenset[int]]]:
    """Per segment, the keep sets of its options (the first empty): every subset of its Values
    when they are few, else the prefixes of its ranking."""
    out = []
    for seg in chain.segments:
        order = ranked_values(graph, facts, seg.ops, impl, forced)
        if len(order) <= ALL_SUBSETS_UP_TO:
            out.append([frozenset(c) for k in range(len(order) + 1)
                        for c in itertools.combinations(order, k)])
        else:
            out.append([frozenset(order[:k]) for k in prefix_lengths(len(order))])
    return out


def measure(graph: OpGraph, facts: GraphFacts, chain: BlockChain, impl, forced,
            keeps: list[list[frozenset[int]]], deadline: float | None = None
            ) -> list[list[Option]] | None:
    """Each option's extra bytes, own peak and seconds, replayed with its segment at the option
    and every other segment at its first (None past `deadline`, a time.perf_counter() value).

    An option's effect reaches beyond its own Values: keeping a Value can make a boundary
    Value before it needless, which the canonical schedule then drops. So its `extra` is read
    off the replay (the most any later segment's part of the step grows), not summed from its
    Values' bytes; its `time` is the step's recomputation seconds beyond the first options'.
    A class's options are replayed on one member (its first) and carried to its twins, whose
    forward and backward parts of the step differ from the first's by constants (the other
    segments' Values, the gradients made so far): per part, a twin's peak under an option is
    its own peak under the first option plus the change the option made on the first member."""
    S = len(chain.segments)
    seg_of_op = [0] * len(graph.ops)
    for b, seg in enumerate(chain.segments):
        for j in seg.ops:
            seg_of_op[j] = b

    def replay(choice):
        """Per segment, the peak of its forward part and of its recomputations and backward;
        and the step's recomputation seconds."""
        keep = set(forced).union(*(keeps[b][i] for b, i in enumerate(choice)))
        tl = simulate(graph, schedule_from_keep(graph, keep, impl=impl, retain="saved",
                                                facts=facts, mode="checkpoint"))
        fwd, bwd = [0] * S, [0] * S
        for p in tl.points:
            if p.phase == "forward":
                fwd[seg_of_op[p.op]] = max(fwd[seg_of_op[p.op]], p.bytes)
            else:  # the end of the step counts with the first segment: nothing kept is held
                b = seg_of_op[graph.backward_order[p.stage]] if p.stage is not None else 0
                bwd[b] = max(bwd[b], p.bytes)
        return fwd, bwd, tl.recompute_time

    first = [0] * S
    base_fwd, base_bwd, base_time = replay(first)
    # Per segment, per option: (change of its forward peak, of its backward peak, extra, time).
    effect: list[list[tuple[int, int, int, float]] | None] = [None] * S
    for b, seg in enumerate(chain.segments):
        rep = b if seg.cls is None else chain.classes[seg.cls].members[0]
        if effect[rep] is None:
            row = [(0, 0, 0, 0.0)]
            for i in range(1, len(keeps[rep])):
                if deadline is not None and time.perf_counter() > deadline:
                    return None
                fwd, bwd, seconds = replay(first[:rep] + [i] + first[rep + 1:])
                extra = max((max(fwd[j] - base_fwd[j], bwd[j] - base_bwd[j])
                             for j in range(rep + 1, S)), default=0)
                row.append((fwd[rep] - base_fwd[rep], bwd[rep] - base_bwd[rep], extra,
                            seconds - base_time))
            effect[rep] = row
        effect[b] = effect[rep]
    return [[Option(keep, extra, max(base_fwd[b] + df, base_bwd[b] + db), seconds)
             for keep, (df, db, extra, seconds) in zip(keeps[b], effect[b])]
            for b in range(S)]


def combine(options: list[list[Option]], budget: int) -> tuple[int, ...] | None:
    """The fastest choice of one option per segment whose peak, by the chain's model (module
    docstring), fits `budget`; None if none does. Exact: the front after each segment holds
    every (bytes held, seconds) pair not beaten in both by another partial choice."""
    front: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for opts in options:
        grown = [(held + o.extra, seconds + o.time, picked + (i,))
                 for held, seconds, picked in front
                 for i, o in enumerate(opts) if held + o.peak <= budget]
        if not grown:
            return None
        grown.sort(key=lambda s: (s[0], s[1]))
        front = []
        for s in grown:
            if not front or s[1] < front[-1][1]:
                front.append(s)
    return min(front, key=lambda s: s[1])[2]


def chain_schedule(graph: OpGraph, budget: int, facts: GraphFacts, *, impl=None,
                   chain: BlockChain | None = None,
                   deadline: float | None = None) -> Schedule | None:
    """The fastest schedule of the chain's family (module docstring) that fits `budget`, checked
    by the simulator; None when the graph has no repeated blocks or nothing of the family fits."""
    chain = chain if chain is not None else find_blocks(graph)
    if not chain.classes:
        return None
    impl = tuple(impl) if impl is not None else (0,) * len(graph.ops)
    forced = frozenset().union(*chain.cuts)
    keeps = segment_keeps(graph, facts, chain, impl, forced)
    options = measure(graph, facts, chain, impl, forced, keeps, deadline)
    if options is None:
        return None
    target = budget
    for _ in range(ROUNDS):
        picked = combine(options, target)
        if picked is None:
            return None
        keep = set(forced).union(*(opts[i].keep for opts, i in zip(options, picked)))
        s = schedule_from_keep(graph, keep, impl=impl, retain="saved", facts=facts,
                               mode="checkpoint", created_by="baseline:chain")
        peak = simulate(graph, s).peak_bytes
        if peak <= budget:
            return s
        target -= peak - budget
    return None
