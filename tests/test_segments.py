"""Segment checkpointing at narrow cuts (solver/rules/segments.py): known answers on a layered graph
whose mask crosses every layer (no articulation Value), and properties on generated DAGs."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from solver.analysis import GraphFacts
from solver.rules.simple import articulation_values
from solver.rules.segments import cut_lengths, cut_schedule, cut_widths, narrow_cuts
from solver.simulate import simulate, store_all_schedule
from solver_cases import GraphBuilder, random_dag

H, A, M = 8, 32, 1  # residual stream, a layer's inner activation, the shared mask (bytes)


def layered(layers: int):
    """Embedding, a mask made once, then `layers` layers: inner = f(h, mask); h = h + g(inner).
    Every op saves its inputs. The mask crosses every layer boundary."""
    b = GraphBuilder("layered")
    x = b.input("x", 4)
    h = b.op("embed", [x], H)
    mask = b.op("mask", [x], M, saved=())
    for i in range(layers):
        inner = b.op(f"attn{i}", [h, mask], A, saved=("in0", "in1"), fwd=2.0)
        h = b.op(f"res{i}", [h, inner], H, saved=("in1",), fwd=1.0)
    return b.build(outputs=h)


def test_narrow_cuts_on_a_layered_graph():
    g = layered(4)
    facts = GraphFacts(g, "full")
    # The mask is read by every layer: past it no single Value separates two layers.
    assert [g.values[v].name for v in articulation_values(g, facts)] == ["embed"]
    widths = cut_widths(g)
    # After each residual add the cut is {h, mask}; inside a layer {h, inner, mask}.
    res = [o.id for o in g.ops if o.name.startswith("res")]
    assert [widths[i][0] for i in res[:-1]] == [H + M] * 3
    attn = [o.id for o in g.ops if o.name.startswith("attn")]
    assert [widths[i][0] for i in attn] == [H + A + M] * 3 + [H + A]  # nothing reads the mask
    # after the last layer's attention
    # The last residual add has no reader after it: its cut is empty and not a candidate.
    # After 'embed' ({h}, narrower than {h, mask} after 'mask'), then each layer's end.
    assert narrow_cuts(g) == [0] + res[:-1]


def test_cut_schedule_keeps_layer_boundaries_and_recomputes_each_op_once():
    g = layered(4)
    facts = GraphFacts(g, "full")
    base = simulate(g, store_all_schedule(g))
    s = cut_schedule(g, facts, 1)  # every narrow cut: {h} after embed, then each layer's end
    t = simulate(g, s)
    recomputed = [o for st_ in s.stages for o in st_.recompute]
    # Each layer's attention output is read by its backward and not kept: recomputed exactly
    # once, at that layer's backward; nothing else is recomputed.
    assert sorted(recomputed) == [o.id for o in g.ops if o.name.startswith("attn")]
    assert t.total_time == base.total_time + 4 * 2.0
    # Two ops apart the cut after embed (position 0) is skipped: embed is recomputed too.
    s2 = cut_schedule(g, facts, 2)
    assert sorted(o for st_ in s2.stages for o in st_.recompute) == [0] + sorted(recomputed)
    assert t.peak_bytes < base.peak_bytes


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 30))
def test_generated_graphs_every_length_gives_a_valid_schedule(seed, n):
    g = random_dag(random.Random(seed), n, two_impl=True)
    facts = GraphFacts(g, "full")
    base = simulate(g, store_all_schedule(g))
    in_some_cut = set().union(*(vs for _, vs in cut_widths(g)))
    for length in cut_lengths(g) + [len(g.ops)]:
        s = cut_schedule(g, facts, length)
        t = simulate(g, s)  # raises on an invalid schedule
        assert set(s.forward_keep) <= in_some_cut  # only cut Values are kept from the forward
        assert t.total_time >= base.total_time  # recomputation only adds time


def test_per_block_rule_reads_module_paths():
    """Blocks from the profiler's module paths: what crosses a block boundary is kept, each
    block's inside is recomputed once at its backward (checkpoint around every layer)."""
    import dataclasses

    from solver.rules.segments import block_schedule, op_blocks

    g = layered(3)
    assert op_blocks(g) is None and block_schedule(g, GraphFacts(g, "full")) is None
    paths = ["embed", "mask"] + [p for i in range(3) for p in (f"h.{i}.attn", f"h.{i}")]
    g = dataclasses.replace(g, meta={**g.meta, "op_modules": paths})
    assert op_blocks(g) == [None, None] + [f"h.{i}" for i in range(3) for _ in range(2)]
    s = block_schedule(g, GraphFacts(g, "full"))
    # Kept: embed's output and the mask (made outside every block), each layer's output read by
    # the next layer; recomputed: every attention output, once.
    names = {g.values[v].name for v in s.forward_keep}
    assert names <= {"embed", "mask", "res0", "res1"} and {"res0", "res1"} <= names
    assert sorted(o for st_ in s.stages for o in st_.recompute) == [
        o.id for o in g.ops if o.name.startswith("attn")]
    base = simulate(g, store_all_schedule(g))
    assert simulate(g, s).total_time == base.total_time + 3 * 2.0


def test_per_block_rule_on_a_profiled_transformer():
    import monetlike
    from monetlike import hf_models as hf
    from solver.rules.segments import block_schedule, op_blocks

    model = hf.gpt2(layers=3, hidden=32, heads=2, vocab=64, positions=16)
    g = monetlike.profile(model, model.example_inputs(2, 8), cost="analytical:A100-40GB")
    blocks = op_blocks(g)
    assert sorted({b for b in blocks if b}) == ["transformer.h.0", "transformer.h.1",
                                                "transformer.h.2"]
    s = block_schedule(g, GraphFacts(g, "full"))
    recomputed = {o for st_ in s.stages for o in st_.recompute}
    assert recomputed and all(blocks[o] is not None for o in recomputed)  # only blocks' insides
    assert simulate(g, s).peak_bytes < simulate(g, store_all_schedule(g)).peak_bytes
