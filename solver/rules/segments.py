"""Segment checkpointing at narrow cuts: Chen's rule for graphs without articulation points.

Chen et al.'s rule (baselines.chen_sqrt_n) keeps single Values that cut the forward graph in two
(articulation Values) and recomputes each segment between them once, at its first backward
stage. Many graphs have almost none: in a Hugging Face transformer captured with torch.export,
the attention mask is made once and read by every layer, so it crosses every layer boundary and
no single Value separates two layers (GPT-2 small: 7 articulation Values in 263 ops). What
separates them is a small *set*: the residual stream plus the mask. This is what a user's
per-block checkpointing keeps.

Here a cut after op i is the set of Values made at or before i and read by an op after i (what
a recomputation of the later ops needs); its bytes are the cut's width. Cuts at a local minimum
of the width are the candidate boundaries; `cut_schedule` keeps the cuts about `length` ops
apart and recomputes each segment in between on demand, holding what it recomputed for later
stages (retain='all', as Chen's rule). The simulator decides what any such schedule costs.

`block_schedule` is the user's own rule, per-block checkpointing (`torch.utils.checkpoint`
around each layer, Hugging Face's `gradient_checkpointing_enable()`), read off the module paths
the profiler records per Op (`graph.meta["op_modules"]`): a block is a numbered child of a
container (`transformer.h.3`, `layer1.0`, `features.7`); what crosses a block boundary, or is made
outside every block, is kept; the inside of a block is recomputed at its backward.
"""

from __future__ import annotations

import re

from ..analysis import GraphFacts
from ..graph import OpGraph
from ..schedule import Schedule
from .simple import kind_in, schedule_from_keep


def cut_widths(graph: OpGraph) -> list[tuple[int, frozenset[int]]]:
    """For each op position i: (bytes, Values) of the cut after op i (Values of ops <= i read by
    an op > i). Graph inputs, parameters and buffers are fixed memory and not in any cut."""
    last_read = [-1] * len(graph.values)
    for op in graph.ops:
        for v in op.inputs:
            last_read[v] = max(last_read[v], op.id)
    out, live = [], set()
    for op in graph.ops:
        live |= {v for v in op.outputs if last_read[v] > op.id}
        live = {v for v in live if last_read[v] > op.id}
        out.append((sum(graph.values[v].bytes for v in live), frozenset(live)))
    return out


def narrow_cuts(graph: OpGraph) -> list[int]:
    """Op positions whose cut is no wider than the cuts just before and after it (a plateau of
    equal widths counts as one: its last position), skipping empty cuts (nothing to keep)."""
    widths = [w for w, _ in cut_widths(graph)]
    n = len(widths)
    chosen = []
    for i in range(n - 1):
        if widths[i] == 0:
            continue
        before = widths[i - 1] if i > 0 else float("inf")
        after = widths[i + 1]
        if widths[i] <= before and widths[i] < after:
            chosen.append(i)
    return chosen


def cut_schedule(graph: OpGraph, facts: GraphFacts, length: float, *, impl=None) -> Schedule:
    """Keep the narrow cuts about `length` ops apart; recompute each segment once, on demand."""
    cuts = cut_widths(graph)
    keep: set[int] = set()
    last = -1
    for i in narrow_cuts(graph):
        if i - last >= length:
            keep |= cuts[i][1]
            last = i
    return schedule_from_keep(graph, keep, impl=impl, retain="all", facts=facts,
                              mode="checkpoint", created_by=f"baseline:narrow_cuts/{length:g}")


_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def op_blocks(graph: OpGraph) -> list[str | None] | None:
    """Per Op, its block (the module path up to the first numbered component, e.g.
    'transformer.h.3' for 'transformer.h.3.attn.c_proj'), None outside every block; None when
    the graph records no module paths or has fewer than two blocks."""
    paths = graph.meta.get("op_modules") if isinstance(graph.meta, dict) else None
    if not isinstance(paths, list) or len(paths) != len(graph.ops):
        return None
    blocks = []
    for p in paths:
        m = _NUMBERED.match(p) if isinstance(p, str) else None
        blocks.append(m.group(1) if m else None)
    return blocks if len({b for b in blocks if b is not None}) >= 2 else None


def block_schedule(graph: OpGraph, facts: GraphFacts, *, impl=None,
                   save_kinds=frozenset()) -> Schedule | None:
    """Per-block checkpointing: keep what crosses a block boundary or is made outside every
    block (and, as selective activation checkpointing does, the outputs of Ops of `save_kinds`),
    recompute the rest of each block's inside once at its backward. None without block
    structure."""
    blocks = op_blocks(graph)
    if blocks is None:
        return None
    keep = set()
    for v in graph.values:
        if v.producer is None:
            continue
        b = blocks[v.producer]
        if (b is None or kind_in(graph.ops[v.producer].kind, save_kinds)
                or any(blocks[o.id] != b for o in graph.ops if v.id in o.inputs)):
            keep.add(v.id)
    return schedule_from_keep(graph, keep, impl=impl, retain="all", facts=facts,
                              mode="checkpoint",
                              created_by="baseline:per_block" + ("/sac" if save_kinds else ""))


def cut_lengths(graph: OpGraph) -> list[int]:
    """Segment lengths worth trying: powers of two up to the graph's size."""
    n, out, k = len(graph.ops), [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out
