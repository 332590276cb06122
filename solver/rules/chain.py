"""Chain combination: one plan per segment of the chain of blocks, chosen together by dynamic
programming (in the manner of Rotor and Rockmate).

`blocks.find_blocks` cuts a graph into a chain of segments (repeated blocks, one-off stretches).
Here every boundary Value between segments (the chain's cuts: a transformer's residual stream,
a broadcast mask) is kept from the forward pass, so a segment is only ever rebuilt from its own
inputs, and a segment's plan is a set of its own Values kept besides: an *option*. A segment's
options are every subset of its Values when it has few, else the prefixes of its Values ranked
by recomputation seconds per byte (the ranked rule's order, per segment; at most MAX_OPTIONS,
evenly spaced) and each prefix with one more Value of the next ADDITIONS. Measured by the
simulator, each option has:
- `extra`: what it holds beyond its segment's first option after the segment's forward, until
  its backward: over every point of the segments after it (their forward runs later and their
  backward earlier);
- `peak`: the highest point of the segment's own forward, recomputations and backward;
- `time`: the step's recomputation seconds beyond the first options'.
The step's peak is then the largest, over segments b, of b's `peak` plus the `extra` of the
segments before b, and its time the sum of the `time`s. `combine` finds the fastest choice of
links covering the chain and one option per link under a budget exactly, by a Pareto front of
(bytes held, seconds) at each boundary (docs/formulation.md, "Chain combination", says where
the model is exact and where it errs on the safe side).

Each option is replayed once, alone (`measure`); twins share their options, replayed on one
member: a 48-layer transformer's options take 213 replays, not one per layer and option
(6,517). The answer is replayed too: where the chain's model is wrong, the replay's peak exceeds
the budget, the budget is lowered by the excess and the combination tried again (ROUNDS times at
most).

The links need not be single segments: with `longest` L, every run of up to L consecutive
segments is a link too (blocks.merged groups them), whose inner boundaries are candidates like
any other Value, which a plan may drop and recompute from the boundary before the run. Every
link's options are measured against the same base (every boundary kept, nothing else), its
first option keeping its inner boundaries, so links of any length combine: the programme
chooses the runs (which boundaries are kept) and an option for each at once.

Limits: the boundaries between links are kept (a plan that recomputes across more than L
segments, Chen's, is left to the other rules and the MILP); one Impl per op (the caller's); a
large link's options are prefixes of one ranking and single additions to them, not every
subset.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ..analysis import GraphFacts
from ..graph import OpGraph
from ..schedule import Schedule
from ..simulate import simulate
from .blocks import BlockChain, find_blocks, merged
from .simple import ranked_values, schedule_from_keep

MAX_OPTIONS = 32
"""Options per segment at most (prefix lengths evenly spaced when a segment has more Values)."""
ALL_SUBSETS_UP_TO = 5
"""A segment with at most this many Values to choose from has every subset as an option (32 at
most), not only the prefixes of its ranking."""
SUBSET_WORK = 8192
"""Or with more, while its subsets times the graph's ops (what their replays cost) stay within
this: a 15-op graph's links have every subset up to 9 Values, an 800-op transformer's up to 5."""
ADDITIONS = 16
"""Single additions per prefix: the prefix plus one of this many next positions of the ranking
(a transformer layer's 17 Values give 18 prefixes and 136 additions)."""
ROUNDS = 4
"""Combinations tried at lowered budgets when the answer's replay exceeds the budget."""


@dataclass(frozen=True)
class Option:
    """One plan of one segment: what it keeps besides the boundaries, and what that costs."""

    keep: frozenset[int]
    extra: int
    """Bytes held beyond the segment's first option, over the later segments' points."""
    peak: int
    """The highest point of the segment's own part of the step (other segments at their first
    options)."""
    time: float
    """The step's recomputation seconds beyond the first options'."""


def prefix_lengths(n: int, limit: int = MAX_OPTIONS) -> list[int]:
    """0..n, or `limit` of them evenly spaced (0 and n included)."""
    if n + 1 <= limit:
        return list(range(n + 1))
    return sorted({round(i * n / (limit - 1)) for i in range(limit)})


def option_positions(n: int, ops: int = 0) -> tuple[list[frozenset[int]], int]:
    """The options of a segment with n Values to choose from, as sets of positions in its
    ranking, the empty one first; and how many of them come first as the main ones (every
    subset when n is small or its replays on a graph of `ops` ops are cheap, else the prefixes)
    before the single additions (a prefix and one of the next ADDITIONS positions after it: a
    Value past the prefix is often small or live away from the peak, as `rules.keep_more` finds
    on whole plans)."""
    if n <= ALL_SUBSETS_UP_TO or 2 ** n * ops <= SUBSET_WORK:
        return [frozenset(c) for k in range(n + 1) for c in itertools.combinations(range(n), k)], \
            2 ** n
    lengths = prefix_lengths(n)
    main = [frozenset(range(k)) for k in lengths]
    added = [frozenset(range(k)) | {i}
             for k in lengths for i in range(k + 1, min(n, k + 1 + ADDITIONS))]
    return main + added, len(main)


def segment_keeps(graph: OpGraph, facts: GraphFacts, chain: BlockChain, impl, forced,
                  inner: list[frozenset[int]] | None = None
                  ) -> tuple[list[list[frozenset[int]]], list[int]]:
    """Per segment, the keep sets of its options (`option_positions` over its ranking; twins
    rank their Values in the same order, so their options correspond), and how many are main.
    With `inner` (per segment, the boundaries inside it that the base keeps), that set is the
    first option, the reference the others are measured from."""
    keeps, main = [], []
    for b, seg in enumerate(chain.segments):
        made = (w for j in seg.ops for w in graph.ops[j].outputs)
        order = ranked_values(graph, facts, made, impl, exclude=forced)
        positions, m = option_positions(len(order), len(graph.ops))
        sets = [frozenset(order[i] for i in pos) for pos in positions]
        if inner is not None and inner[b]:
            sets, m = [inner[b]] + sets, m + 1
        keeps.append(sets)
        main.append(m)
    return keeps, main


def measure(graph: OpGraph, facts: GraphFacts, chain: BlockChain, impl, forced,
            keeps: list[list[frozenset[int]]], main: list[int], deadline: float | None = None,
            skip: frozenset[int] = frozenset()) -> list[list[Option] | None] | None:
    """Each option's extra bytes, own peak and seconds, replayed with its segment at the option
    and every other segment at its first; dominated options left out (`undominated`). Main
    options first, for every segment, then the additions: past `deadline` (a
    time.perf_counter() value) None while main options are missing, else without the
    additions not yet replayed. The one-off segments in `skip` are not measured (None).

    An option's effect reaches beyond its own Values: keeping a Value can make a boundary
    Value before it needless, which the canonical schedule then drops. So its `extra` is read
    off the replay (the most any point of a later segment's part of the step grows), not
    summed from its Values' bytes; its `time` is the step's recomputation seconds beyond the
    first options'. A class's options are replayed on one member and carried to its twins
    point by point: at the point of each op's forward and at each backward stage (its
    recomputations and backward), a twin's bytes under an option are its own under the first
    option plus the change the option made at the renamed point of the replayed member. What
    differs between twins there (the gradients made so far, other segments' Values) does not
    depend on the option, except for a Value from outside that a member is the last to read:
    its option decides when that Value is freed (the first of a transformer's layers is the
    last to read the attention mask). So twins are carried only from a member that reads the
    same of its outside Values last (`_representatives`); the others are replayed themselves.
    Its `extra` is the change of what is held after its last forward op, or more where a later
    point grows more."""
    S = len(chain.segments)
    n = len(graph.ops)
    nbytes = [v.bytes for v in graph.values]
    rep_of = _representatives(graph, chain)
    reps = sorted({rep_of[b] for b in range(S) if b not in skip})
    last_ops = {chain.segments[rep].stop - 1 for rep in reps}

    def replay(choice):
        """Per op, the bytes at its forward point and the most at its backward stage (the
        stage's recomputations and backward; -1 for an op without one); the bytes held after
        the forward of each representative's last op; the bytes at the end of the step; the
        step's recomputation seconds."""
        keep = set(forced).union(*(keeps[b][i] for b, i in enumerate(choice)))
        tl = simulate(graph, _plan(graph, keep, impl, facts))
        fwd, bwd, end, held = [0] * n, [-1] * n, 0, {}
        for p in tl.points:
            if p.phase == "forward":
                fwd[p.op] = p.bytes
                if p.op in last_ops:
                    held[p.op] = sum(nbytes[v] for v in p.resident)
            elif p.stage is not None:
                k = graph.backward_order[p.stage]
                bwd[k] = max(bwd[k], p.bytes)
            else:
                end = p.bytes  # nothing any segment keeps is held any more
        return fwd, bwd, held, end, tl.recompute_time

    first = [0] * S
    began = time.perf_counter()
    base_fwd, base_bwd, base_held, base_end, base_time = replay(first)
    if deadline is not None:
        # The main options take a replay each, as long as this one: none is measured when
        # they cannot all be by the deadline (Llama-70B's 3,236 ops: about a second each).
        now = time.perf_counter()
        if now + (now - began) * sum(main[rep] - 1 for rep in reps) > deadline:
            return None
    # Per representative, per option: its ops' bytes at their two points, extra, seconds.
    measured: dict[int, list[tuple[list[int], list[int], int, float]]] = {}
    for rep in reps:
        ops = chain.segments[rep].ops
        measured[rep] = [([base_fwd[j] for j in ops], [base_bwd[j] for j in ops], 0, 0.0)]
    for main_pass in (True, False):
        for rep in reps:
            ops = chain.segments[rep].ops
            last = chain.segments[rep].stop - 1
            later = range(last + 1, n)
            for i in (range(1, main[rep]) if main_pass else range(main[rep], len(keeps[rep]))):
                if deadline is not None and time.perf_counter() > deadline:
                    if main_pass:
                        return None
                    break  # the additions measured so far are options; the rest are not
                fwd, bwd, held, _, seconds = replay(first[:rep] + [i] + first[rep + 1:])
                extra = max([held[last] - base_held[last]]
                            + [max(fwd[j] - base_fwd[j], bwd[j] - base_bwd[j]) for j in later])
                measured[rep].append(([fwd[j] for j in ops], [bwd[j] for j in ops], extra,
                                      seconds - base_time))
    options = []
    for b, seg in enumerate(chain.segments):
        if b in skip:
            options.append(None)
            continue
        rep = rep_of[b]
        rep_ops = chain.segments[rep].ops
        own = [chain.mapping(rep, b).ops[j] for j in rep_ops] if rep != b else list(rep_ops)
        fwd0, bwd0 = measured[rep][0][0], measured[rep][0][1]
        opts = []
        for keep, (fwd, bwd, extra, seconds) in zip(keeps[b], measured[rep]):
            peak = base_end if b == 0 else 0
            for q, j in enumerate(own):
                peak = max(peak, base_fwd[j] + fwd[q] - fwd0[q])
                if bwd[q] >= 0:
                    peak = max(peak, base_bwd[j] + bwd[q] - bwd0[q])
            opts.append(Option(keep, extra, peak, seconds))
        options.append(undominated(opts))
    return options


def _representatives(graph: OpGraph, chain: BlockChain) -> list[int]:
    """Per segment, the segment whose replays give its options: itself, or the last member of
    its class that reads its outside Values the same way: for each, whether an op before the
    segment reads it too (so that it may still be needed after the segment's backward)."""
    first_read: dict[int, int] = {}
    for op in graph.ops:
        for v in op.inputs:
            first_read.setdefault(v, op.id)
    rep_of = list(range(len(chain.segments)))
    for c in chain.classes:
        reads = {m: tuple(first_read[v] < chain.segments[m].start
                          for v in chain.segments[m].inputs) for m in c.members}
        last = {reads[m]: m for m in c.members}
        for m in c.members:
            rep_of[m] = last[reads[m]]
    return rep_of


def _plan(graph: OpGraph, keep, impl, facts: GraphFacts) -> Schedule:
    """The family's schedule of a kept set: the rest recomputed on demand, recomputed Values
    held while a later backward reads them."""
    return schedule_from_keep(graph, keep, impl=impl, retain="saved", facts=facts,
                              mode="checkpoint", created_by="baseline:chain")


def undominated(options: list[Option]) -> list[Option]:
    """The options no other beats or equals in extra, peak and time at once (the first of equal
    ones stays); the empty option, first, always stays."""
    out: list[Option] = []
    for o in sorted(options[1:], key=lambda o: (o.time, o.extra, o.peak)):
        if not any(q.extra <= o.extra and q.peak <= o.peak for q in out):
            out.append(o)
    first = options[0]
    return [first] + [o for o in out if not (first.extra <= o.extra and first.peak <= o.peak
                                             and first.time <= o.time)]


@dataclass(frozen=True)
class Link:
    """A run of the chain's segments [start, stop) planned as one, and its options."""

    start: int
    stop: int
    options: list[Option]


def chain_links(graph: OpGraph, facts: GraphFacts, chain: BlockChain, impl, longest: int = 1,
                deadline: float | None = None) -> list[Link] | None:
    """Every run of 1..`longest` consecutive segments as a link with its measured options, the
    single segments first, then longer runs (blocks.merged, every phase); None when the single
    segments' main options are not measured by `deadline`, and without the longer runs not
    measured by then. A run already measured (the short groups at a grouping's ends) is not
    measured again unless it is a twin."""
    S = len(chain.segments)
    first_of = {seg.start: i for i, seg in enumerate(chain.segments)}
    links: list[Link] = []
    seen: set[tuple[int, int]] = set()
    for length in range(1, longest + 1):
        for phase in range(length):
            if length > 1 and deadline is not None and time.perf_counter() > deadline:
                return links
            grouping = chain if length == 1 else merged(chain, phase, length)
            spans = [(first_of[seg.start], first_of.get(seg.stop, S)) for seg in grouping.segments]
            forced = frozenset().union(*grouping.cuts)
            inner = [frozenset().union(*chain.cuts[a:c - 1]) - forced for a, c in spans]
            skip = frozenset(b for b, span in enumerate(spans)
                             if span in seen and grouping.segments[b].cls is None)
            keeps, main = segment_keeps(graph, facts, grouping, impl, forced, inner)
            options = measure(graph, facts, grouping, impl, forced, keeps, main, deadline, skip)
            if options is None:
                return None if length == 1 else links
            for (a, c), opts in zip(spans, options):
                if opts is not None and (a, c) not in seen:
                    seen.add((a, c))
                    links.append(Link(a, c, opts))
    return links


def combine(links: list[Link], segments: int, budget: int) -> list[tuple[int, int]] | None:
    """The fastest choice of links covering segments 0..`segments` - 1 end to end and of one
    option per link whose peak, by the chain's model (module docstring), fits `budget`, as
    (link, option) index pairs; None if none does. Exact: the front at each boundary holds every
    (bytes held, seconds) pair not beaten in both by another partial choice ending there."""
    fronts: list[list[tuple[int, float, tuple]]] = [[] for _ in range(segments + 1)]
    fronts[0] = [(0, 0.0, ())]
    by_start: dict[int, list[int]] = {}
    for li, link in enumerate(links):
        by_start.setdefault(link.start, []).append(li)
    for a in range(segments + 1):
        grown = sorted(fronts[a], key=lambda s: (s[0], s[1]))
        front = []
        for s in grown:
            if not front or s[1] < front[-1][1]:
                front.append(s)
        fronts[a] = front
        if a == segments:
            break
        for li in by_start.get(a, ()):
            link = links[li]
            fronts[link.stop].extend(
                (held + o.extra, seconds + o.time, picked + ((li, oi),))
                for held, seconds, picked in front
                for oi, o in enumerate(link.options) if held + o.peak <= budget)
    if not fronts[segments]:
        return None
    return list(min(fronts[segments], key=lambda s: s[1])[2])


def picked_keep(chain: BlockChain, links: list[Link], picked: list[tuple[int, int]]
                ) -> set[int]:
    """The Values a choice keeps: the boundaries between its links and its options' sets."""
    keep: set[int] = set()
    for li, oi in picked:
        link = links[li]
        if link.start > 0:
            keep |= chain.cuts[link.start - 1]
        keep |= link.options[oi].keep
    return keep


def chain_schedule(graph: OpGraph, budget: int, facts: GraphFacts, *, impl=None,
                   chain: BlockChain | None = None, deadline: float | None = None,
                   longest: int = 1) -> Schedule | None:
    """The fastest schedule of the chain's family (module docstring) that fits `budget`, checked
    by the simulator; None when the graph has no repeated blocks or nothing of the family fits.
    `longest`: the most segments one link may span (1: every boundary kept)."""
    chain = chain if chain is not None else find_blocks(graph)
    if not chain.classes:
        return None
    impl = tuple(impl) if impl is not None else (0,) * len(graph.ops)
    links = chain_links(graph, facts, chain, impl, longest, deadline)
    if links is None:
        return None
    target = budget
    for _ in range(ROUNDS):
        picked = combine(links, len(chain.segments), target)
        if picked is None:
            return None
        s = _plan(graph, picked_keep(chain, links, picked), impl, facts)
        peak = simulate(graph, s).peak_bytes
        if peak <= budget:
            return s
        target -= peak - budget
    return None
