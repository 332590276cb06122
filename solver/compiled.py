"""The compiled execution model: which values of AOTAutograd's joint graph the forward saves.

Under `torch.compile` the training step is one joint forward+backward graph that AOTAutograd
cuts in two. The decision is the saved set S (forward values handed to the backward); the
backward graph recomputes every other forward value it needs, from S and the primals, just
before its first use. This module is torch-free: the torch side (monetlike/runtime/compiled/)
describes the joint graph as `JointNode`s, and this module predicts the peak of a saved set
(`predict`) and searches for the cheapest saved set under a byte budget (`plan_saved`).

The memory model (docs/execution-model.md, "The compiled execution model"), as torch 2.14's
`default_partition` and the fx code it generates behave under an eager-kernel compiler:
- primals (parameters, buffers, inputs) are fixed memory, held for the whole step;
- the forward graph runs the forward nodes the outputs and S need, in joint order; a storage is
  freed after the last node that reads any value on it, unless a graph output holds it;
- the forward's user outputs are held by the caller until the backward ends; saved values are
  held from their producer to their last use in the backward;
- the backward's tangents (the gradients of the forward's outputs) arrive with it and are held
  until it returns (autograd's engine holds the gradients it passes in; counted at the outputs'
  own strides: exact where they arrive so, as a scalar loss's seed does; where AOTAutograd
  restrides one, an expanded gradient of `.sum()`, the copy is counted and held instead of the
  smaller original: over by the difference after the copy's last use); it runs its nodes in
  the order `reordering_to_mimic_autograd_engine` gives (each recomputed node just before its
  first user, a fresh copy; a value saved from the same op stays the forward's); its outputs
  (gradients) stay; a recomputed random op saves the RNG state in the
  forward, and its replay holds a copy of the current state while it runs.
An op allocates its outputs, and briefly its kernel's scratch, while its inputs are live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import math

from .errors import BudgetParseError, InfeasibleBudgetError
from .units import BudgetSpec, format_bytes, parse_budget

__all__ = ["JointNode", "JointGraph", "Prediction", "CompiledPlan", "predict", "plan_saved",
           "torch_default_saved", "forward_sources", "cut_saved", "valley_saved", "least_peak",
           "least_alternatives",
           "resolve_budget", "search_starts", "GreedyPath", "AUTO_REFUSED"]

PHASES = ("primal", "tangent", "forward", "backward")
# Where an op's time was not measured, a roofline at nominal CPU rates prices it: its FLOPs at
# 100 GFLOP/s plus its output bytes at 10 GB/s (an unfused pointwise op is one pass over memory).
NOMINAL_FLOPS = 1e11
NOMINAL_BYTES = 1e10
# Gains per second of added recomputation are compared with this floor on the seconds, so that
# free moves (views) rank by their gain.
MIN_SECONDS = 1e-7


@dataclass(frozen=True)
class JointNode:
    """One node of the joint graph, as the model needs it."""

    name: str
    """The fx node's name (unique in its graph)."""
    phase: str
    """'primal' (a parameter, buffer or input), 'tangent', 'forward' or 'backward'."""
    inputs: tuple[str, ...] = ()
    """Names of the nodes it reads, in order, without repeats."""
    out_bytes: tuple[int, ...] = ()
    """Bytes of each fresh storage it allocates: one per output of a multi-output op, none for a
    view, a getitem or a primal (counted by `fixed_bytes`); a tangent's, at the output's strides."""
    alias: tuple[str, int] | None = None
    """(node, output index) of the storage this value lives on when it is not its own: a view's
    base storage, a getitem's output of its multi-output op (a split, whose outputs are views,
    has no storages of its own: its base's). None: its own storage 0."""
    scratch: int = 0
    """Bytes the kernel allocates beyond its outputs while it runs (measured on the device)."""
    flops: int = 0
    """Floating-point operations of one run (matmuls, convolutions); 0 for other ops."""
    seconds: float | None = None
    """Measured time of one run of its kernel on the device (None: not measured)."""
    candidate: bool = False
    """Whether it may be saved: a forward value that is one tensor (not a multi-output tuple)."""
    rng: bool = False
    """A random op: recomputing it replays the forward's RNG state, saved by the forward."""
    pinned: bool = False
    """Saved whenever the backward needs it, never recomputed: a random op whose replay the
    compiler does not reproduce (Inductor's seeds: saving the seed recomputes the same draw)."""
    multi: int = 0
    """Number of outputs of a multi-output op (read through getitems); 0 otherwise."""

    @property
    def cost(self) -> float:
        """Seconds one recomputation costs: measured, or the nominal roofline; views cost 0."""
        if self.seconds is not None:
            return self.seconds
        return self.flops / NOMINAL_FLOPS + sum(self.out_bytes) / NOMINAL_BYTES


@dataclass(frozen=True)
class JointGraph:
    """The joint graph in its topological (joint) order."""

    nodes: tuple[JointNode, ...]
    forward_outputs: tuple[str, ...]
    """The values the forward returns to its caller (held until the backward ends)."""
    backward_outputs: tuple[str, ...]
    """The gradients the backward returns (held to the end of the step)."""
    fixed_bytes: int = 0
    """Bytes of the primals: parameters, buffers and inputs."""
    rng_state_bytes: int = 0
    """Bytes of one saved RNG state (what a recomputed random op makes the forward save)."""
    start: frozenset[str] | None = None
    """The saved set the search starts from: the partition the compiler would make on its own
    (Inductor's min-cut: fused pointwise recomputations the op-by-op model overprices); None:
    torch's default partition (save everything the backward reads)."""

    @cached_property
    def by_name(self) -> dict[str, JointNode]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def order(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    @cached_property
    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return out

    def storage(self, name: str) -> tuple[str, int] | None:
        """The storage a value lives on; None for a primal's (fixed) storage."""
        node = self.by_name[name]
        while node.alias is not None:
            base, k = node.alias
            node = self.by_name[base]
            if node.multi and node.out_bytes:
                return (base, k)
        if node.phase == "primal" or not node.out_bytes:
            return None
        return (node.name, 0)

    @cached_property
    def _storages(self) -> dict[str, tuple[tuple[str, int], ...]]:
        out = {}
        for node in self.nodes:
            if node.multi and node.out_bytes:
                out[node.name] = tuple((node.name, k) for k in range(node.multi))
            else:
                s = self.storage(node.name)
                out[node.name] = () if s is None else (s,)
        return out

    @cached_property
    def storage_forms(self) -> dict[str, tuple[tuple[str, ...], tuple, tuple]]:
        """Name -> (the value and every base it views, its storages, the same storages as a
        recomputation's own copies): what `_storages_in` picks from."""
        out = {}
        for node in self.nodes:
            chain, n = [node.name], node
            while n.alias is not None:
                n = self.by_name[n.alias[0]]
                chain.append(n.name)
            plain = self.storages_of(node.name)
            out[node.name] = (tuple(chain), plain, tuple(("re:" + b, k) for b, k in plain))
        return out

    @cached_property
    def tangent_readers(self) -> frozenset[str]:
        """The nodes that read a tangent (where the backward's own work begins)."""
        tangents = {n.name for n in self.nodes if n.phase == "tangent"}
        return frozenset(n.name for n in self.nodes if tangents.intersection(n.inputs))

    @cached_property
    def search_memo(self) -> dict:
        """What the saved-set search made on this graph (its starts, its greedy paths), kept
        for the next budget asked of the same graph."""
        return {}

    def storages_of(self, name: str) -> tuple[tuple[str, int], ...]:
        """Every storage a value keeps alive (all outputs of a multi-output tuple)."""
        return self._storages[name]

    def bytes_of(self, storage: tuple[str, int]) -> int:
        return self.by_name[storage[0]].out_bytes[storage[1]]


@dataclass(frozen=True)
class Prediction:
    """What a saved set gives: the step's peak and what the backward recomputes."""

    saved: frozenset[str]
    """The forward values the backward reads (S, pruned to those it uses)."""
    recomputed: tuple[str, ...]
    """Forward nodes the backward runs again, in joint order."""
    peak_bytes: int
    """Fixed bytes plus the highest level of everything else, over the step."""
    transient_peak_bytes: int
    """The peak above the fixed bytes (what the allocator sees the step allocate)."""
    recompute_cost: float
    """Sum of the recomputed nodes' costs, seconds."""
    where: str
    """The node at which the peak falls ('forward:<name>' or 'backward:<name>')."""


@dataclass(frozen=True)
class CompiledPlan:
    """A searched saved set and its prediction, with torch's default partition beside it."""

    prediction: Prediction
    budget: int
    default: Prediction
    """torch's default partition (save every forward value the backward reads)."""
    steps: int = 0
    """Moves the search made."""
    trail: tuple[int, ...] = field(default=(), repr=False)
    """The peak after each move (for the least peak found)."""

    @property
    def saved(self) -> frozenset[str]:
        return self.prediction.saved


def _needed_backward(g: JointGraph, saved: frozenset[str]) -> tuple[list[str], list[str]]:
    """(backward graph nodes in joint order, recomputed forward nodes in joint order)."""
    need: set[str] = set()
    stack = [o for o in g.backward_outputs]
    while stack:
        name = stack.pop()
        if name in need:
            continue
        node = g.by_name[name]
        if node.phase in ("primal", "tangent") or (node.phase == "forward" and name in saved):
            need.add(name)  # an input of the backward graph
            continue
        need.add(name)
        stack.extend(node.inputs)
    body = [n.name for n in g.nodes if n.name in need and n.phase in ("forward", "backward")
            and not (n.phase == "forward" and n.name in saved)]
    recomputed = [n for n in body if g.by_name[n].phase == "forward"]
    return body, recomputed


def _backward_order(g: JointGraph, body: list[str], reorder: bool) -> list[str]:
    """The order of torch's reordering_to_mimic_autograd_engine: from the first user of a
    tangent on, each node after the nodes it needs that have not run yet (in joint order)."""
    if not reorder:
        return _raise_getitems(g, body)
    members = set(body)
    pos = {n: i for i, n in enumerate(body)}
    readers = g.tangent_readers
    first = min((pos[n] for n in body if n in readers), default=None)
    if first is None:
        return _raise_getitems(g, body)
    done: set[str] = set()
    out: list[str] = []
    for name in body[first:]:
        pending, stack = set(), [name]
        while stack:
            n = stack.pop()
            if n in pending or n in done or n not in members:
                continue
            pending.add(n)
            stack.extend(g.by_name[n].inputs)
        for n in sorted(pending, key=pos.__getitem__):
            out.append(n)
            done.add(n)
    return _raise_getitems(g, out)


def _raise_getitems(g: JointGraph, order: list[str]) -> list[str]:
    """torch's raise_getitems: each getitem of a multi-output op right after the op."""
    items: dict[str, list[str]] = {}
    for n in order:
        a = g.by_name[n].alias
        if a is not None and g.by_name[a[0]].multi:
            items.setdefault(a[0], []).append(n)
    moved = {n for v in items.values() for n in v}
    out = []
    for n in order:
        if n not in moved:
            out.append(n)
            out.extend(items.get(n, ()))
    return out


def _storages_in(g: JointGraph, name: str, fresh: set[str]) -> tuple[tuple[str, int], ...]:
    """The storages `name` keeps alive in a graph that computes the nodes `fresh`: this graph's
    own copies ('re:') where the value and every base it views were computed here; the
    forward's where any of them came in saved (a saved getitem of a recomputed BatchNorm)."""
    chain, plain, renamed = g.storage_forms[name]
    if not fresh:
        return plain
    if len(chain) == 1:  # most values: not a view
        return renamed if name in fresh else plain
    return renamed if all(x in fresh for x in chain) else plain


def _run(g: JointGraph, order: list[str], level: int, live: dict[tuple[str, int], int],
         keep: set[tuple[str, int]], phase: str, fresh: set[str],
         states: dict[str, tuple[str, int]]) -> tuple[int, str, int]:
    """Replay one graph: each node allocates its outputs (and briefly its scratch), then every
    storage whose last reader it was is freed unless `keep` holds it. A node in `fresh` is
    computed again here (a recomputation): its storages are this graph's own copies
    (`_storages_in`). `states` maps a random op to its saved RNG state: made by the forward,
    read by the backward's recomputation. `live` maps live storages to bytes (updated).
    Returns (peak, where, level after)."""
    known: dict[str, tuple[tuple[str, int], ...]] = {}  # each value's, made once per replay

    def storages(name: str) -> tuple[tuple[str, int], ...]:
        got = known[name] = _storages_in(g, name, fresh)
        return got

    nodes = [g.by_name[name] for name in order]
    own = [storages(name) for name in order]  # a node's outputs, in `out_bytes` order
    last: dict[tuple[str, int], int] = {}
    for i, node in enumerate(nodes):
        for s in own[i]:
            last.setdefault(s, i)
        for inp in node.inputs:
            got = known.get(inp)
            for s in (storages(inp) if got is None else got):
                last[s] = i
        if node.name in states:
            last[states[node.name]] = i
    frees: dict[int, list[tuple[str, int]]] = {}
    for s, i in last.items():
        if s not in keep:
            frees.setdefault(i, []).append(s)
    peak, where = level, f"{phase}:start"
    for s in [s for s in live if s not in last and s not in keep]:
        level -= live.pop(s)  # nothing in this graph reads it: freed as the graph starts
    for i, node in enumerate(nodes):
        name = node.name
        for st, b in zip(own[i], node.out_bytes):
            live[st] = b
            level += b
        scratch = node.scratch
        if name in states:
            if states[name] not in live:  # the forward saves the state it draws from
                live[states[name]] = g.rng_state_bytes
                level += g.rng_state_bytes
            else:  # the replay keeps a copy of the current state while it runs
                scratch += g.rng_state_bytes
        if level + scratch > peak:
            peak, where = level + scratch, f"{phase}:{name}"
        for s in frees.get(i, ()):
            if s in live:
                level -= live.pop(s)
    return peak, where, level


def predict(g: JointGraph, saved: "frozenset[str] | set[str]") -> Prediction:
    """The peak and recomputation of the partition that saves `saved` (pruned to what the
    backward reads)."""
    bad = [s for s in saved if s not in g.by_name or not g.by_name[s].candidate]
    if bad:
        raise ValueError(f"saved set names values that are not savable forward values: "
                         f"{sorted(bad)[:5]}; expected names of forward tensor values")
    saved = frozenset(saved)
    body, recomputed = _needed_backward(g, saved)
    reads = {i for n in body for i in g.by_name[n].inputs}
    saved = frozenset(s for s in saved if s in reads)
    reorder = any(n.candidate and n.name not in saved for n in g.nodes)
    rng = [n for n in recomputed if g.by_name[n].rng]
    # forward: the nodes its outputs and the saved values need, in joint order
    need: set[str] = set()
    stack = list(g.forward_outputs) + sorted(saved) + rng
    while stack:
        n = stack.pop()
        if n not in need and g.by_name[n].phase == "forward":
            need.add(n)
            stack.extend(g.by_name[n].inputs)
    forward = [n.name for n in g.nodes if n.name in need]
    outs = {s for n in g.forward_outputs for s in g.storages_of(n)}
    states = {n: ("rng:" + n, 0) for n in rng}
    keep = outs | {s for n in saved for s in g.storages_of(n)} | set(states.values())
    live: dict[tuple[str, int], int] = {}
    f_peak, f_where, level = _run(g, forward, 0, live, keep, "forward", set(), states)
    # backward: tangents arrive, saved values are read and freed at their last use
    for t in g.nodes:
        if t.phase == "tangent" and t.out_bytes:
            live[(t.name, 0)] = t.out_bytes[0]
            level += t.out_bytes[0]
    order = _backward_order(g, body, reorder)
    fresh = set(body)
    grads = {s for n in g.backward_outputs for s in _storages_in(g, n, fresh)}
    tangents = {(t.name, 0) for t in g.nodes if t.phase == "tangent" and t.out_bytes}
    b_peak, b_where, _ = _run(g, order, level, live, grads | outs | tangents, "backward", fresh,
                              states)
    peak, where = (f_peak, f_where) if f_peak >= b_peak else (b_peak, b_where)
    cost = sum(g.by_name[n].cost for n in recomputed)
    return Prediction(saved=saved, recomputed=tuple(recomputed), peak_bytes=g.fixed_bytes + peak,
                      transient_peak_bytes=peak, recompute_cost=cost, where=where)


def torch_default_saved(g: JointGraph) -> frozenset[str]:
    """What torch's default partition saves: every forward value a backward node reads."""
    return frozenset(i for n in g.nodes if n.phase == "backward" for i in n.inputs
                     if g.by_name[i].candidate)


def forward_sources(g: JointGraph, names) -> frozenset[str]:
    """The savable forward values that a compiler's saved list stands for. Inductor's min-cut
    also saves backward nodes that read no tangent, computed in its forward (a matmul input's
    transpose, a LayerNorm's rsqrt / N): each stands for the forward values it reads (the same
    storage for a view). Dropped instead, the backward recomputed most of the forward (GPT-2
    under Inductor: 21 of min-cut's 55 saved values; 3.85 MiB where min-cut's step took 3.38)."""
    out: set[str] = set()
    seen: set[str] = set()
    stack = [n for n in names if n in g.by_name]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = g.by_name[name]
        if node.candidate:
            out.add(name)
        elif node.phase == "backward":
            stack.extend(node.inputs)
    return frozenset(out)


def _forward_live(g: JointGraph) -> list[tuple[JointNode, frozenset[tuple[str, int]]]]:
    """Each forward node, in joint order, with the storages live just after it that a later
    forward node reads (primals aside): what carries the forward on from there."""
    forward = [n for n in g.nodes if n.phase == "forward"]
    position = {n.name: i for i, n in enumerate(forward)}
    last_read: dict[tuple[str, int], int] = {}  # storage -> the last forward node reading it
    for i, n in enumerate(forward):
        for name in n.inputs:
            if name in position:
                for st in g.storages_of(name):
                    last_read[st] = i
    ends: dict[int, list] = {}
    for st, i in last_read.items():
        ends.setdefault(i, []).append(st)
    live: set[tuple[str, int]] = set()
    out = []
    for i, n in enumerate(forward):
        live.difference_update(ends.get(i, ()))
        live.update(st for st in g.storages_of(n.name) if last_read.get(st, -1) > i)
        out.append((n, frozenset(live)))
    return out


def cut_saved(g: JointGraph) -> frozenset[str]:
    """The forward values that alone carry the forward on (no other value made before one is
    read after it, primals aside: block boundaries): saved alone, the backward recomputes each
    block from its input just before its gradients, as per-block checkpointing does."""
    return frozenset(n.name for n, live in _forward_live(g)
                     if n.candidate and len(live) == 1 and set(g.storages_of(n.name)) == live)


def valley_saved(g: JointGraph, through_getitems: bool = False) -> frozenset[str]:
    """The values live across the forward's valleys: nodes after which the bytes carried on
    drop below the node before's and do not rise at the next (a dense layer's new features
    beside the earlier ones, where no single value is a boundary: DenseNet). Saved alone, the
    backward recomputes each layer from them, as per-layer checkpointing does. A storage of a
    multi-output op (a BatchNorm's output) is left out, or with `through_getitems` saved
    through the first getitem reading it."""
    levels = _forward_live(g)
    size = [sum(g.bytes_of(st) for st in live) for _, live in levels]
    savable: dict[tuple[str, int], str] = {}  # storage -> the value saved for it
    for n, _ in levels:
        if n.candidate or not through_getitems:
            for st in g.storages_of(n.name):
                savable.setdefault(st, n.name)
    out = set()
    for i in range(1, len(levels) - 1):
        if size[i - 1] > size[i] <= size[i + 1]:
            out.update(savable[st] for st in levels[i][1]
                       if st in savable and g.by_name[savable[st]].candidate)
    return frozenset(out)


def search_starts(g: JointGraph) -> list[Prediction]:
    """The search's starts: `g.start` (the compiler's own partition) where there is one, then
    torch's default partition, then the block boundaries alone (`cut_saved`: where the greedy
    from the others stops above per-block checkpointing's peak, MobileNetV2 under Inductor), then
    the valleys' values (`valley_saved`: DenseNet, where the others stopped 19% above the knob's
    least), then those with the BatchNorms' outputs saved too (DenseNet-121's least by the model
    36.01 MiB against 41.01), each with the pinned values saved too (kept wherever a
    recomputation reads them)."""
    if "starts" in g.search_memo:
        return g.search_memo["starts"]
    pinned = {n.name for n in g.nodes if n.pinned}
    bases = ([] if g.start is None else [g.start]) + [torch_default_saved(g), cut_saved(g),
                                                      valley_saved(g), valley_saved(g, True)]
    starts = g.search_memo["starts"] = [predict(g, base | pinned) for base in bases]
    return starts


def _moves(g: JointGraph, current: Prediction, width: int) -> list[list[str]]:
    """Saved values worth trying to recompute, in shortlists to simulate one after another: the
    `width` that free the most bytes of their own, and the `width` that do among those without
    FLOPs (pointwise: nearly free to recompute), then the rest in chunks."""
    held: dict[tuple[str, int], int] = {}
    for s in current.saved:
        for st in g.storages_of(s):
            held[st] = held.get(st, 0) + 1

    def own(name: str) -> int:
        return sum(g.bytes_of(st) for st in g.storages_of(name) if held[st] == 1)

    ranked = sorted((n for n in current.saved if own(n) > 0 and not g.by_name[n].pinned),
                    key=lambda n: (-own(n), g.by_name[n].cost, g.order[n]))
    cheap = [n for n in ranked if g.by_name[n].flops == 0]
    first = list(dict.fromkeys(ranked[:width] + cheap[:width]))
    rest = [n for n in ranked if n not in set(first)]
    return [first] + [rest[i:i + 4 * width] for i in range(0, len(rest), 4 * width)]


class GreedyPath:
    """The greedy from one start: recompute the saved value whose removal lowers the peak most
    per unit of added cost (by_cost=False: most, whatever it costs), until no removal lowers it.
    The moves do not depend on the budget, only where they stop: the path is walked as far as a
    budget needs and kept with its graph, so later budgets (each of Inductor's compiles, 'min'
    then its plan) start where it ended."""

    def __init__(self, g: JointGraph, start: Prediction, width: int, by_cost: bool) -> None:
        self.g, self.width, self.by_cost = g, width, by_cost
        self.steps = [start]
        self.ended = False

    def walk(self, budget: int) -> tuple[Prediction, list[int]]:
        """The first step whose peak fits `budget`, else the path's end; with the peaks so far."""
        i = 0
        while self.steps[i].peak_bytes > budget:
            if i + 1 == len(self.steps) and not self._extend():
                break
            i += 1
        return self.steps[i], [p.peak_bytes for p in self.steps[:i + 1]]

    def _extend(self) -> bool:
        if self.ended:
            return False
        g, cur = self.g, self.steps[-1]
        best, best_key = None, None
        for shortlist in _moves(g, cur, self.width):
            for name in shortlist:
                p = predict(g, cur.saved - {name})
                gain = cur.peak_bytes - p.peak_bytes
                if gain <= 0:
                    continue
                added = max(MIN_SECONDS, p.recompute_cost - cur.recompute_cost)
                key = gain / added if self.by_cost else (gain, -added)
                if best_key is None or key > best_key:
                    best, best_key = p, key
            if best is not None:
                break  # widen the search only when a shortlist has nothing that helps
        if best is None:
            self.ended = True
            return False
        self.steps.append(best)
        return True


def _path(g: JointGraph, start: int, width: int, by_cost: bool) -> GreedyPath:
    """The greedy path from `search_starts(g)[start]`, kept with the graph."""
    key = ("path", start, width, by_cost)
    if key not in g.search_memo:
        g.search_memo[key] = GreedyPath(g, search_starts(g)[start], width, by_cost)
    return g.search_memo[key]


def _polish(g: JointGraph, budget: int, cur: Prediction) -> Prediction:
    """Save again, most expensive first, whatever still fits the budget (lowers the cost)."""
    for name in sorted(cur.recomputed, key=lambda n: -g.by_name[n].cost):
        node = g.by_name[name]
        if not node.candidate or name in cur.saved or node.cost <= 0:
            continue
        p = predict(g, cur.saved | {name})
        if p.peak_bytes <= budget and p.recompute_cost < cur.recompute_cost:
            cur = p
    return cur


def _descents(g: JointGraph, budget: int, width: int):
    """The greedy by gain per cost; where it stops above `budget`, the greedy by gain alone
    (a path that does not depend on the measured times, which ranked some moves that led
    nowhere first), if it goes lower. From `g.start` first, then, where that does not reach the
    budget, from torch's default partition (GPT-2 under Inductor: from min-cut's saved set the
    greedy stopped at 2.38 MiB by the model, from save-all it reached 2.07). Returns
    (prediction, trail): the first that fits, else the lowest."""
    best = None
    for start in range(len(search_starts(g))):
        cur, trail = _path(g, start, width, True).walk(budget)
        if cur.peak_bytes > budget:
            alt, alt_trail = _path(g, start, width, False).walk(budget)
            if alt.peak_bytes < cur.peak_bytes:
                cur, trail = alt, alt_trail
        if cur.peak_bytes <= budget:
            return cur, trail
        if best is None or cur.peak_bytes < best[0].peak_bytes:
            best = (cur, trail)
    return best


def least_peak(g: JointGraph, width: int = 8) -> Prediction:
    """The least peak the search reaches (the search run with no budget to stop it)."""
    low, trail = _descents(g, -1, width)
    return low


def least_alternatives(g: JointGraph, width: int = 8) -> list[Prediction]:
    """Where each greedy path ends (every start, by gain per cost and by gain alone), distinct
    saved sets, lowest peak first (then cheapest): near-least plans by this model whose
    compiled code may peak lower than the least's, since the model does not see the compiler's
    fusion (transformer stack under Inductor: ends within 5% of the least peak by the model
    compiled to 1.23-2.08 MiB)."""
    ends: dict[frozenset[str], Prediction] = {}
    for start in range(len(search_starts(g))):
        for by_cost in (True, False):
            end, _ = _path(g, start, width, by_cost).walk(-1)
            ends.setdefault(end.saved, end)
    return sorted(ends.values(), key=lambda p: (p.peak_bytes, p.recompute_cost))


def plan_saved(g: JointGraph, budget: int, width: int = 8) -> CompiledPlan:
    """The cheapest saved set the search finds whose predicted peak fits `budget`, starting from
    `g.start` (taken as it is where it fits: Inductor's min-cut, whose fused recomputations the
    op-by-op model overprices) or torch's default partition. Raises InfeasibleBudgetError with
    the least peak it found."""
    default = predict(g, torch_default_saved(g))
    if g.start is not None:
        start = search_starts(g)[0]
        if start.peak_bytes <= budget:  # the compiler's own partition fits: its choice stands
            return CompiledPlan(prediction=start, budget=budget, default=default,
                                trail=(start.peak_bytes,))
    cur, trail = _descents(g, budget, width)
    if cur.peak_bytes > budget:
        raise InfeasibleBudgetError(
            f"budget {format_bytes(budget)} is below the least peak the compiled plan's search "
            f"reaches, "
            f"{format_bytes(cur.peak_bytes)} ({cur.peak_bytes} bytes: fixed "
            f"{format_bytes(g.fixed_bytes)} for parameters and inputs, peak at {cur.where}); "
            f"raise the budget to at least that, or lower the batch",
            budget=budget, min_budget=cur.peak_bytes)
    cur = _polish(g, budget, cur)
    # the plan runs only after the model has replayed it within its budget
    check = predict(g, cur.saved)
    assert check.peak_bytes <= budget and check.saved == cur.saved
    return CompiledPlan(prediction=check, budget=budget, default=default, steps=len(trail) - 1,
                        trail=tuple(trail))


AUTO_REFUSED = ("budget 'auto' is the free memory of the CUDA device the model trains on, which "
                "the compiled plan does not read; pass it to monetlike.optimize(..., "
                "compile=True), which reads it, or give bytes")


def resolve_budget(g: JointGraph, budget: "int | str | BudgetSpec", width: int = 8) -> int:
    """Bytes for a budget form on the joint graph: bytes as given; 'min' the least peak the
    search reaches; '90%' that share of torch's default partition's peak (the compiled step's
    store-all: it saves everything the backward reads), rounded up to a byte. 'auto' (a CUDA
    device's free memory) is read by monetlike.optimize, not here: it raises."""
    spec = parse_budget(budget)
    if spec.kind == "bytes":
        return int(spec.value)
    if spec.kind == "min":
        return least_peak(g, width).peak_bytes
    if spec.kind == "share":
        return int(math.ceil(spec.value * predict(g, torch_default_saved(g)).peak_bytes))
    raise BudgetParseError(AUTO_REFUSED)
