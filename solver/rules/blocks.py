"""Repeated blocks: the chain of segments of a graph and the classes of identical ones.

Big models are made of repeated blocks (a transformer's 12-48 layers, a ResNet stage's
bottlenecks). `find_blocks` cuts the forward op sequence (`graph.ops`, topological order) into a
chain of contiguous segments and groups the segments that are *identical up to renaming* into
classes, so that a plan for one block can be copied to its twins (`BlockChain.mapping`,
`translate`). `merged` gives the same chain with its segments merged k by k (the chain
combination, chain.py, plans on runs of segments too). Pure functions on an OpGraph; no torch.

Identity. A segment [start, stop) is encoded relative to its own start (`_Prep.encoding`):
- per op: its *local signature* (kind, number of fx nodes, has_backward, recompute_unsafe, per
  input and output Value its bytes, shape, dtype, requires_grad, whether it is a graph input or
  a model output, and per Impl its name, costs (forward, backward, recomputation) and
  workspaces, and its saved / early-released / overwritten Values as positions among the op's
  inputs and outputs);
- its wiring: each input either (position of the producing op inside the segment, output index)
  or ("external", k) where k numbers the Values read from outside the segment (graph inputs,
  earlier segments) in order of first use;
- per output Value whether it leaves the segment (read after `stop`, or held as a model output);
- the order of the segment's backward stages (op positions sorted by stage) and the gradient
  bytes of each stage relative to the segment's first stage (`graph.stage_grad_bytes`: parameter
  gradients accumulate along the backward, so only the differences are the block's own).
Costs (seconds) are compared after rounding to `digits` significant digits (9 by default, a
relative tolerance of about 1e-9; the analytical profile gives equal layers equal costs); bytes
are compared exactly. Two segments with equal encodings have a bijection of ops and Values that
preserves every edge, size and cost: `BlockChain.mapping`. Equality is decided on the encodings
themselves (dictionary keys); `Segment.signature` is a 16-hex-digit SHA-256 of the encoding, with
the local signatures spelled out, for reports and caches only.

Finding the repetition. Every op gets an integer id for its local signature (equal ids exactly
when the signatures are equal). In a free interval of ops (at first the whole graph), for every
candidate period L (all L up to half the interval when it has at most `_ALL_PERIODS` ops; above
that the gaps between the 1st..4th next occurrence of each signature, plus every L <= 64), the
maximal runs where id[i] == id[i + L] give stretches that are periodic with period L, holding
k = len // L >= 2 copies. Their coverage k*L ranks them (ties: smaller L, then earlier). A
stretch with slack (len - k*L > 0) can be cut at several phases; its `_PHASES` phases with the
narrowest boundary cuts (the sum of the widths of the k + 1 cuts; a broadcast Value such as an
attention mask read by every layer widens each cut by the same amount and changes nothing) are
checked exactly: the k blocks are encoded and only blocks whose encoding occurs at least twice
in the stretch count. The phase covering the most ops exactly wins, then the narrowest; the
stretch covering the most ops exactly wins (branch and bound: the signature coverage bounds the
exact one, so the search stops at the first candidate whose bound cannot win, or after
`_MAX_EVALUATIONS` stretches). The winning blocks are fixed as segments; the rest of the interval
(prologue, epilogue, blocks that matched nothing) is searched again the same way. Ops in no
block form one-off segments (class None), one per maximal stretch. Finally every fixed block is
put in the class of its encoding, across the whole chain.

Cost: O(n * P) numpy comparisons for P candidate periods plus O(n) Python work per encoded
stretch, per search step; a 5,000-op graph of 240 layers takes about 0.2 s. The cut sets of the
answer are as large as they are (a graph of one-op blocks with long edges has O(n^2) in all).

Limits (docs/formulation.md, "Repeated blocks"):
- Greedy: the stretch covering the most ops is fixed first. A model whose layers alternate
  (local / global attention) is found as a chain of layer pairs; stages made of a repeated
  super-block (a few identical layers and a transition, repeated) are found at the coarser level.
- Blocks are contiguous in op order. A block whose ops the capture interleaves with another's is
  not found.
- Only truly identical blocks are grouped: DenseNet's dense layers (input width grows per layer),
  a ResNet stage's first block (downsample) and a measured profile whose equal layers got
  different costs (beyond `digits`) give no class.
- Identity is about the block itself: twins may differ in what passes over them (long-range
  Values from earlier segments read later), which the chain's cuts record.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..analysis import GraphFacts
from ..graph import OpGraph
from ..schedule import Schedule
from .simple import kind_in, schedule_from_keep

DIGITS = 9
"""Significant digits kept of every cost (seconds) before comparison."""

_ALL_PERIODS = 4096
"""Free intervals of at most this many ops try every period; larger ones try the periods that
the gaps between equal signatures suggest (plus every period up to `_SMALL_PERIODS`)."""
_SMALL_PERIODS = 64
_GAP_RANKS = 4
_MAX_EVALUATIONS = 64
"""Stretches checked exactly per search step at most (a bound on pathological graphs)."""
_PHASES = 4
"""Phases of a stretch with slack checked exactly (narrowest cuts first)."""


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """One link of the chain: ops [start, stop)."""

    start: int
    stop: int
    cls: int | None
    """Its class (an index into `BlockChain.classes`), None for a one-off segment."""
    signature: str
    """16 hex digits of SHA-256 over its encoding (equal for twins; for reports and caches)."""
    inputs: tuple[int, ...]
    """Values it reads that are made outside it (graph inputs too), in order of first use."""
    outputs: tuple[int, ...]
    """Values it makes that are read after it or are model outputs."""

    @property
    def ops(self) -> range:
        return range(self.start, self.stop)

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class BlockClass:
    """Segments identical up to renaming."""

    id: int
    members: tuple[int, ...]
    """Indices into `BlockChain.segments`, in op order (at least two)."""
    length: int
    """Ops per member."""
    signature: str
    broadcast: tuple[int, ...]
    """Values every member reads from outside as the same Value (an attention mask, positions):
    they cross every boundary between members and widen each cut by the same bytes."""


@dataclass(frozen=True)
class BlockMapping:
    """The bijection from segment `src`'s ops and Values to segment `dst`'s (twins)."""

    src: int
    dst: int
    ops: dict[int, int]
    """Op id in src -> op id in dst (every op of src)."""
    values: dict[int, int]
    """Value id -> Value id: the Values src makes, and those it reads from outside (a broadcast
    Value maps to itself)."""

    def inverse(self) -> "BlockMapping":
        return BlockMapping(self.dst, self.src, {b: a for a, b in self.ops.items()},
                            {b: a for a, b in self.values.items()})


@dataclass(frozen=True)
class BlockChain:
    """`find_blocks`' answer: the segments in op order, the cuts between them, the classes."""

    segments: tuple[Segment, ...]
    """Contiguous, covering every op, in order."""
    cuts: tuple[frozenset[int], ...]
    """cuts[i]: the scheduled Values (made by an op, not a model output) made before
    segments[i + 1] starts and read by it or later: what must be resident (or recomputable) at
    that boundary. One fewer than the segments."""
    cut_bytes: tuple[int, ...]
    classes: tuple[BlockClass, ...]
    digits: int = DIGITS
    graph: OpGraph | None = field(default=None, repr=False, compare=False)

    @property
    def blocks(self) -> tuple[Segment, ...]:
        """The segments that belong to a class."""
        return tuple(s for s in self.segments if s.cls is not None)

    def segment_of_op(self, op: int) -> int:
        """Index of the segment holding `op`."""
        lo, hi = 0, len(self.segments)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.segments[mid].start <= op:
                lo = mid
            else:
                hi = mid
        return lo

    def mapping(self, src: int, dst: int) -> BlockMapping:
        """The renaming from segment `src` to segment `dst` (two members of one class)."""
        a, b = self.segments[src], self.segments[dst]
        if a.cls is None or a.cls != b.cls:
            raise ValueError(f"segments {src} and {dst} are not members of one class")
        g = self.graph
        if g is None:
            raise ValueError("this BlockChain carries no graph")
        ops = {a.start + q: b.start + q for q in range(len(a))}
        values = dict(zip(a.inputs, b.inputs))
        for j, k in ops.items():
            values.update(zip(g.ops[j].outputs, g.ops[k].outputs))
        return BlockMapping(src, dst, ops, values)


def translate(mapping: BlockMapping, *, ops=(), values=()) -> tuple[tuple[int, ...],
                                                                    tuple[int, ...]]:
    """Op ids and Value ids of block `mapping.src` renamed to block `mapping.dst` (order kept).
    A KeyError names an id that is not the source block's."""
    try:
        return (tuple(mapping.ops[j] for j in ops), tuple(mapping.values[v] for v in values))
    except KeyError as e:
        raise KeyError(f"id {e.args[0]} is not an op or Value of segment {mapping.src}") from None


# ----------------------------------------------------------------------------------------------
# Per-graph preparation
# ----------------------------------------------------------------------------------------------
def _round(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}") if x else 0.0


class _Prep:
    """Local signatures, last reads, cut widths: computed once per graph."""

    def __init__(self, graph: OpGraph, digits: int):
        self.graph = graph
        g = graph
        n = len(g.ops)
        self.held = frozenset(g.outputs)
        self.producer = [v.producer for v in g.values]
        self.out_index = [0] * len(g.values)
        for op in g.ops:
            for k, w in enumerate(op.outputs):
                self.out_index[w] = k
        last = [-1] * len(g.values)
        for op in g.ops:
            for v in op.inputs:
                last[v] = op.id
        self.last_read = last
        self.sched = [v.producer is not None and v.id not in self.held for v in g.values]
        # Width of the cut after op i: scheduled Values made at or before i, read after i.
        delta = np.zeros(n + 1, dtype=np.int64)
        for v in g.values:
            if self.sched[v.id] and last[v.id] > v.producer:
                delta[v.producer] += v.bytes
                delta[last[v.id]] -= v.bytes
        # before[s]: width of the boundary just before op s (0 before op 0 and after the last).
        self.before = np.concatenate([[0], np.cumsum(delta[:n])])
        self.stage = g.stage_of_op
        self.local: list[tuple] = []
        ids: dict[tuple, int] = {}
        sig = np.empty(n, dtype=np.int64)
        for op in g.ops:
            t = self._local(op, digits)
            self.local.append(t)
            sig[op.id] = ids.setdefault(t, len(ids))
        self.sig = sig

    def _value(self, v: int) -> tuple:
        x = self.graph.values[v]
        return (x.bytes, x.shape, x.dtype, x.requires_grad, x.producer is None, v in self.held)

    def _local(self, op, digits: int) -> tuple:
        pos = {v: ("in", k) for k, v in enumerate(op.inputs)}
        pos.update({w: ("out", k) for k, w in enumerate(op.outputs)})
        impls = tuple(
            (i.name, tuple(pos[v] for v in i.saved), i.internal_bytes,
             _round(i.fwd_time, digits), _round(i.bwd_time, digits),
             _round(i.rerun_time, digits), i.fwd_workspace,
             i.bwd_workspace, None if i.overwrites is None else pos[i.overwrites],
             i.recompute_workspace, tuple(pos[v] for v in i.early_release))
            for i in op.impls)
        return (op.kind, len(op.nodes), op.has_backward, op.recompute_unsafe,
                tuple(self._value(v) for v in op.inputs), tuple(self._value(w) for w in op.outputs),
                impls)

    def encoding(self, start: int, stop: int, *, spelled: bool = False) -> tuple:
        """The relative-index encoding of segment [start, stop) (see the module docstring);
        `spelled` writes local signatures out instead of their ids (for the hash)."""
        g, producer, out_index, last = self.graph, self.producer, self.out_index, self.last_read
        ext: dict[int, int] = {}
        body = []
        for j in range(start, stop):
            op = g.ops[j]
            refs = []
            for v in op.inputs:
                p = producer[v]
                if p is not None and p >= start:
                    refs.append((p - start, out_index[v]))
                else:
                    refs.append((-1, ext.setdefault(v, len(ext))))
            leaves = tuple(last[w] >= stop or w in self.held for w in op.outputs)
            body.append((self.local[j] if spelled else int(self.sig[j]), tuple(refs), leaves))
        stages = sorted((self.stage[j], j - start) for j in range(start, stop)
                        if j in self.stage)
        grads = g.stage_grad_bytes
        base = grads[stages[0][0]] if stages else 0
        order = tuple((q, grads[t] - base) for t, q in stages)
        return (tuple(body), tuple(self._value(v) for v in ext), order)

    def inputs(self, start: int, stop: int) -> tuple[int, ...]:
        seen: dict[int, None] = {}
        for j in range(start, stop):
            for v in self.graph.ops[j].inputs:
                p = self.producer[v]
                if p is None or p < start:
                    seen.setdefault(v)
        return tuple(seen)

    def outputs(self, start: int, stop: int) -> tuple[int, ...]:
        return tuple(w for j in range(start, stop) for w in self.graph.ops[j].outputs
                     if self.last_read[w] >= stop or w in self.held)

    def cuts(self, starts: list[int]) -> list[frozenset[int]]:
        """For each boundary just before op s in `starts` (increasing): the scheduled Values
        made before op s and read at or after it."""
        out: list[set[int]] = [set() for _ in starts]
        for v in self.graph.values:
            if not self.sched[v.id] or self.last_read[v.id] <= v.producer:
                continue
            # boundaries s with producer < s <= last read
            i = bisect.bisect_right(starts, v.producer)
            while i < len(starts) and starts[i] <= self.last_read[v.id]:
                out[i].add(v.id)
                i += 1
        return [frozenset(c) for c in out]


# ----------------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------------
def _periods(sig: np.ndarray) -> list[int]:
    """Candidate periods for one interval's signature ids."""
    m = len(sig)
    if m <= _ALL_PERIODS:
        return list(range(1, m // 2 + 1))
    pos = np.arange(m)
    order = np.lexsort((pos, sig))
    s, p = sig[order], pos[order]
    found = set(range(1, min(_SMALL_PERIODS, m // 2) + 1))
    for r in range(1, _GAP_RANKS + 1):
        same = s[r:] == s[:-r]
        gaps = (p[r:] - p[:-r])[same]
        found.update(int(x) for x in np.unique(gaps) if x <= m // 2)
    return sorted(found)


def _stretches(sig: np.ndarray, lo: int, periods: list[int]) -> list[tuple[int, int, int, int]]:
    """(coverage, period, first op, length) of every maximal periodic stretch with >= 2
    copies of a period in `periods` inside the interval starting at op `lo`."""
    out = []
    for L in periods:
        eq = sig[:-L] == sig[L:]
        if np.count_nonzero(eq) < L:
            continue
        d = np.diff(np.concatenate([[0], eq.view(np.int8), [0]]))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
        keep = ends - starts >= L
        for a, b in zip(starts[keep], ends[keep]):
            length = int(b - a) + L
            out.append(((length // L) * L, L, lo + int(a), length))
    out.sort(key=lambda c: (-c[0], c[1], c[2]))
    return out


def _evaluate(prep: _Prep, L: int, a: int, length: int):
    """The best phase of a stretch: (exact coverage, -cut bytes, -phase, blocks, encodings)."""
    k = length // L
    slack = length - k * L
    steps = L * np.arange(k + 1)
    widths = [(int(prep.before[a + ph + steps].sum()), ph) for ph in range(slack + 1)]
    widths.sort()
    best = None
    for w, ph in widths[:_PHASES]:
        blocks = [(a + ph + i * L, a + ph + (i + 1) * L) for i in range(k)]
        encs = [prep.encoding(s, e) for s, e in blocks]
        count: dict[tuple, int] = {}
        for x in encs:
            count[x] = count.get(x, 0) + 1
        cover = L * sum(1 for x in encs if count[x] >= 2)
        key = (cover, -w, -ph)
        if best is None or key > best[0]:
            best = (key, blocks, [count[x] >= 2 for x in encs], encs)
    return best


def find_blocks(graph: OpGraph, *, digits: int = DIGITS,
                on_step: Callable[[int, int, int], None] | None = None) -> BlockChain:
    """The chain of segments of `graph` and the classes of identical ones (module docstring).
    `on_step(ops, periods, evaluated)`, when given, is called once per search step with the
    interval's number of ops, its candidate periods and the stretches encoded exactly: the work
    the module docstring's cost counts."""
    prep = _Prep(graph, digits)
    n = len(graph.ops)
    fixed: list[tuple[int, int, tuple]] = []  # (start, stop, encoding)
    work = [(0, n)]
    while work:
        lo, hi = work.pop()
        if hi - lo < 2:
            continue
        best = None
        evaluations = 0
        periods = _periods(prep.sig[lo:hi])
        for cover, L, a, length in _stretches(prep.sig[lo:hi], lo, periods):
            if (best is not None and cover <= best[0][0]) or evaluations >= _MAX_EVALUATIONS:
                break
            evaluations += 1
            res = _evaluate(prep, L, a, length)
            if res[0][0] > 0 and (best is None or res[0][0] > best[0][0]):
                best = res
        if on_step is not None:
            on_step(hi - lo, len(periods), evaluations)
        if best is None:
            continue
        _, blocks, good, encs = best
        free_from = lo
        for (s, e), ok, enc in zip(blocks, good, encs):
            if ok:
                fixed.append((s, e, enc))
                if s > free_from:
                    work.append((free_from, s))
                free_from = e
        if hi > free_from:
            work.append((free_from, hi))
    fixed.sort()
    bounds: list[tuple[int, int, bool]] = []
    pos = 0
    for s, e, _ in fixed:
        if s > pos:
            bounds.append((pos, s, False))
        bounds.append((s, e, True))
        pos = e
    if pos < n:
        bounds.append((pos, n, False))
    return _assemble(graph, prep, bounds, digits)


def merged(chain: BlockChain, phase: int, length: int = 2) -> BlockChain:
    """The chain with its segments merged `length` by `length`, from segment `phase` on
    (0 <= phase < length; the first `phase` segments merged into one, the last group may be
    shorter): the cuts inside each group are no longer boundaries. Units with equal encodings
    are twins (classes), as in find_blocks. The chain combination plans on it too (chain.py),
    where a plan may then recompute a boundary instead of keeping it."""
    graph = chain.graph
    if graph is None:
        raise ValueError("this BlockChain carries no graph")
    if not 0 <= phase < length:
        raise ValueError(f"merged: phase must be in 0..{length - 1} for groups of {length}, "
                         f"got {phase}")
    segs = chain.segments
    groups = [segs[:phase]] if phase else []
    groups += [segs[i:i + length] for i in range(phase, len(segs), length)]
    bounds = [(grp[0].start, grp[-1].stop, True) for grp in groups if grp]
    return _assemble(graph, _Prep(graph, chain.digits), bounds, chain.digits)


def _assemble(graph: OpGraph, prep: "_Prep", bounds: list[tuple[int, int, bool]],
              digits: int) -> BlockChain:
    """The chain of segments `bounds` ((start, stop, may be a twin), covering the ops in order):
    the ones that may be twins and share an encoding with another form a class, numbered in op
    order."""
    encs = [prep.encoding(s, e) if twin else None for s, e, twin in bounds]
    count: dict[tuple, int] = {}
    for enc in encs:
        if enc is not None:
            count[enc] = count.get(enc, 0) + 1
    cls_of: dict[tuple, int] = {}
    for enc in encs:
        if enc is not None and count[enc] >= 2:
            cls_of.setdefault(enc, len(cls_of))
    segments = tuple(
        Segment(s, e, cls_of.get(enc) if enc is not None else None,
                _digest(prep.encoding(s, e, spelled=True)), prep.inputs(s, e),
                prep.outputs(s, e)) for (s, e, _), enc in zip(bounds, encs))
    cuts = tuple(prep.cuts([seg.start for seg in segments[1:]]))
    cut_bytes = tuple(sum(graph.values[v].bytes for v in c) for c in cuts)
    members: dict[int, list[int]] = {}
    for i, seg in enumerate(segments):
        if seg.cls is not None:
            members.setdefault(seg.cls, []).append(i)
    classes = []
    for c in range(len(cls_of)):
        ms = members[c]
        shared = set(segments[ms[0]].inputs)
        for i in ms[1:]:
            shared &= set(segments[i].inputs)
        first = segments[ms[0]]
        broadcast = tuple(v for k, v in enumerate(first.inputs)
                          if v in shared and all(segments[i].inputs[k] == v for i in ms))
        classes.append(BlockClass(c, tuple(ms), len(first), first.signature, broadcast))
    return BlockChain(segments, cuts, cut_bytes, tuple(classes), digits, graph)


def _digest(encoding: tuple) -> str:
    return hashlib.sha256(repr(encoding).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# A rule built on it
# ----------------------------------------------------------------------------------------------
def repeated_block_checkpoint_schedule(graph: OpGraph, facts: GraphFacts, impl=None, *,
                                       chain: BlockChain | None = None,
                                       save_kinds=frozenset()) -> Schedule | None:
    """Per-block checkpointing on the repeated blocks `find_blocks` finds (torch.utils.checkpoint
    around each layer): keep the cuts at the boundaries of every block and everything made in
    the one-off segments (prologue, epilogue: not checkpointed), and, as selective activation
    checkpointing does, the outputs of Ops of `save_kinds` inside blocks; recompute the rest of
    a block's inside once, at its first backward stage that needs it (schedule_from_keep,
    retain='all'). None when the graph has no repeated blocks."""
    chain = chain if chain is not None else find_blocks(graph)
    if not chain.classes:
        return None
    keep: set[int] = set()
    for i, seg in enumerate(chain.segments):
        if seg.cls is None:
            keep.update(w for j in seg.ops for w in graph.ops[j].outputs)
        else:
            if i > 0:
                keep |= chain.cuts[i - 1]
            if i < len(chain.cuts):
                keep |= chain.cuts[i]
            keep.update(w for j in seg.ops if kind_in(graph.ops[j].kind, save_kinds)
                        for w in graph.ops[j].outputs)
    return schedule_from_keep(graph, keep, impl=impl, retain="all", facts=facts,
                              mode="checkpoint", created_by="baseline:repeated_blocks"
                              + ("/sac" if save_kinds else ""))
