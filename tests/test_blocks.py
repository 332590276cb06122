"""Repeated blocks (solver/rules/blocks.py): known answers on hand-built chains of blocks, an
independent check that class members are identical up to renaming, generated chains of a random
block (hypothesis), the per-block checkpointing rule, and profiled ResNet-18 and GPT-2."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver.analysis import GraphFacts
from solver.rules.blocks import find_blocks, merged, repeated_block_checkpoint_schedule, translate
from solver.graph import OpGraph
from solver.simulate import simulate, store_all_schedule
from solver_cases import GraphBuilder, random_dag, resnet_like
from toy_graphs import chain as toy_chain

H, M = 8, 1  # residual stream and mask bytes


def block(b: GraphBuilder, h: int, tag: str, *, sizes=(32, 16), fwd=2.0, mask=None,
          kinds=("A", "B"), saved_b=("in0",)) -> int:
    """inner = A(h[, mask]); t = B(inner); h' = add(h, t): the residual h is the only Value
    that leaves (the mask is read from outside)."""
    ins = [h] if mask is None else [h, mask]
    inner = b.op(f"{tag}.a", ins, sizes[0], saved=tuple(f"in{i}" for i in range(len(ins))),
                 fwd=fwd, kind=kinds[0])
    t = b.op(f"{tag}.b", [inner], sizes[1], saved=saved_b, kind=kinds[1])
    return b.op(f"{tag}.add", [h, t], H, saved=(), kind="add")


def stacked(k: int, *, mask: bool = False, tweak=None) -> tuple[OpGraph, int, int]:
    """Prologue (2 ops), k blocks of 3 ops, epilogue (2 ops). `tweak(i)` gives keyword
    overrides for block i. Returns the graph, the first block's op and the mask Value."""
    b = GraphBuilder("stacked")
    x = b.input("x", 4)
    h = b.op("embed", [x], H, kind="Embedding")
    m = b.op("mask", [x], M, saved=(), kind="mask") if mask else None
    if m is None:
        h = b.op("drop", [h], H, kind="Dropout")
    first = len(b.ops)
    for i in range(k):
        h = block(b, h, f"h{i}", mask=m, **(tweak(i) if tweak else {}))
    h = b.op("norm", [h], H, kind="LayerNorm")
    out = b.op("loss", [h], 4, kind="Loss")
    return b.build(outputs=out), first, m


def cut_before(g: OpGraph, s: int) -> frozenset[int]:
    """Independently: scheduled Values made before op s and read at or after it."""
    return frozenset(v.id for v in g.values
                     if v.producer is not None and v.producer < s and v.id not in g.outputs
                     and any(o.id >= s for o in g.ops if v.id in o.inputs))


def check_chain(g: OpGraph, ch) -> None:
    """The chain's invariants, checked without the finder's encoding."""
    segs = ch.segments
    assert segs[0].start == 0 and segs[-1].stop == len(g.ops)
    assert all(a.stop == b.start and a.start < a.stop for a, b in zip(segs, segs[1:]))
    assert len(ch.cuts) == len(segs) - 1 == len(ch.cut_bytes)
    for s, cut, w in zip(segs[1:], ch.cuts, ch.cut_bytes):
        assert cut == cut_before(g, s.start)
        assert w == sum(g.values[v].bytes for v in cut)
    for c in ch.classes:
        assert len(c.members) >= 2
        assert all(segs[i].cls == c.id and len(segs[i]) == c.length for i in c.members)
        assert len({segs[i].signature for i in c.members}) == 1
        for i in c.members[1:]:
            assert_twins(g, ch, c.members[0], i)
            assert_twins(g, ch, i, c.members[0])
    assert sum(len(c.members) for c in ch.classes) == sum(s.cls is not None for s in segs)


def assert_twins(g: OpGraph, ch, a: int, b: int) -> None:
    """Segments a and b are identical up to renaming, checked op by op through the mapping:
    same kinds, sizes and costs, every edge (input, output, saved Value) mapped onto an edge,
    producers inside map to producers inside, and the same Values leave."""
    A, B = ch.segments[a], ch.segments[b]
    m = ch.mapping(a, b)
    assert translate(m, ops=A.ops)[0] == tuple(B.ops)
    assert translate(m.inverse(), ops=B.ops)[0] == tuple(A.ops)
    assert len(set(m.values.values())) == len(m.values)  # a bijection
    # The same order of backward stages, with the same gradient bytes relative to the first.
    stages = g.stage_of_op

    def order(seg):
        ts = sorted(stages[j] for j in seg.ops if j in stages)
        return [(g.backward_order[t] - seg.start, g.stage_grad_bytes[t] - g.stage_grad_bytes[ts[0]])
                for t in ts]

    assert order(A) == order(B)
    last = {}
    for o in g.ops:
        for v in o.inputs:
            last[v] = o.id
    for j in A.ops:
        oa, ob = g.ops[j], g.ops[m.ops[j]]
        assert (oa.kind, oa.has_backward, oa.recompute_unsafe, len(oa.impls)) == \
            (ob.kind, ob.has_backward, ob.recompute_unsafe, len(ob.impls))
        assert translate(m, values=oa.inputs)[1] == ob.inputs  # every in-edge
        assert translate(m, values=oa.outputs)[1] == ob.outputs  # every out-edge
        for v in oa.inputs + oa.outputs:
            va, vb = g.values[v], g.values[m.values[v]]
            assert (va.bytes, va.shape, va.dtype, va.requires_grad) == \
                (vb.bytes, vb.shape, vb.dtype, vb.requires_grad)
            inside_a = va.producer is not None and va.producer in A.ops
            inside_b = vb.producer is not None and vb.producer in B.ops
            assert inside_a == inside_b
            if inside_a:
                assert m.ops[va.producer] == vb.producer
            assert (va.producer is None) == (vb.producer is None)
        for w in oa.outputs:
            assert (last.get(w, -1) >= A.stop or w in g.outputs) == \
                (last.get(m.values[w], -1) >= B.stop or m.values[w] in g.outputs)
        for ia, ib in zip(oa.impls, ob.impls):
            assert translate(m, values=ia.saved)[1] == ib.saved
            assert translate(m, values=ia.early_release)[1] == ib.early_release
            assert (ia.overwrites is None and ib.overwrites is None) or \
                m.values[ia.overwrites] == ib.overwrites
            for f in ("fwd_time", "bwd_time"):
                assert math.isclose(getattr(ia, f), getattr(ib, f), rel_tol=1e-8)
            for f in ("internal_bytes", "fwd_workspace", "bwd_workspace", "recompute_workspace"):
                assert getattr(ia, f) == getattr(ib, f)


def members(ch, c: int = 0) -> list[tuple[int, int]]:
    return [(ch.segments[i].start, ch.segments[i].stop) for i in ch.classes[c].members]


# ----------------------------------------------------------------------------------------------
# Known answers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3, 7])
def test_a_chain_of_identical_blocks_with_prologue_and_epilogue(k):
    g, first, _ = stacked(k)
    ch = find_blocks(g)
    check_chain(g, ch)
    assert len(ch.classes) == 1
    assert members(ch) == [(first + 3 * i, first + 3 * i + 3) for i in range(k)]
    # Prologue and epilogue are one-off segments; the cut between two blocks is the stream.
    assert [(s.start, s.stop, s.cls) for s in ch.segments] == \
        [(0, first, None)] + [(s, e, 0) for s, e in members(ch)] + \
        [(first + 3 * k, len(g.ops), None)]
    for i in ch.classes[0].members[1:]:
        assert [g.values[v].name for v in ch.cuts[i - 1]] == [f"h{i - 2}.add"]
    assert ch.classes[0].broadcast == ()
    # The block's own Values: what enters, what leaves.
    seg = ch.segments[2]
    assert [g.values[v].name for v in seg.inputs] == ["h0.add"]
    assert [g.values[v].name for v in seg.outputs] == ["h1.add"]


def test_two_stages_of_different_blocks_give_two_classes():
    b = GraphBuilder("stages")
    h = b.op("stem", [b.input("x", 4)], H, kind="Conv")
    for i in range(3):
        h = block(b, h, f"s1.{i}", sizes=(32, 16))
    h = b.op("down", [h], H, kind="Downsample")
    for i in range(4):
        h = block(b, h, f"s2.{i}", sizes=(64, 24), kinds=("A", "C"))
    g = b.build(outputs=b.op("head", [h], 2, kind="Head"))
    ch = find_blocks(g)
    check_chain(g, ch)
    assert [(c.length, len(c.members)) for c in ch.classes] == [(3, 3), (3, 4)]
    assert members(ch, 0) == [(1, 4), (4, 7), (7, 10)]
    assert members(ch, 1) == [(11, 14), (14, 17), (17, 20), (20, 23)]
    assert ch.segments[ch.classes[0].members[-1] + 1].start == 10  # 'down' is a one-off


def test_a_broadcast_value_read_by_every_block():
    g, first, mask = stacked(5, mask=True)
    ch = find_blocks(g)
    check_chain(g, ch)
    assert len(ch.classes) == 1
    assert members(ch) == [(first + 3 * i, first + 3 * i + 3) for i in range(5)]
    assert ch.classes[0].broadcast == (mask,)
    for i in ch.classes[0].members[1:]:  # the mask widens every boundary by its bytes
        assert mask in ch.cuts[i - 1] and ch.cut_bytes[i - 1] == H + M
    # The mapping sends the mask to itself and the stream to the next block's stream.
    m = ch.mapping(ch.classes[0].members[0], ch.classes[0].members[1])
    assert m.values[mask] == mask


@pytest.mark.parametrize("what", ["cost", "size", "kind", "saved"])
def test_blocks_that_differ_in_one_cost_or_size_are_not_grouped(what):
    odd = 2

    def tweak(i):
        if i != odd:
            return {}
        return {"cost": {"fwd": 2.5}, "size": {"sizes": (32, 17)},
                "kind": {"kinds": ("A", "B2")}, "saved": {"saved_b": ("out0",)}}[what]

    g, first, _ = stacked(4, tweak=tweak)
    ch = find_blocks(g)
    check_chain(g, ch)
    odd_ops = set(range(first + 3 * odd, first + 3 * odd + 3))
    for c in ch.classes:
        for s, e in members(ch, c.id):
            assert not odd_ops & set(range(s, e))
    # Blocks 0 and 1 still are twins (block 3, alone after the odd one, is not searched for
    # twins elsewhere: a limit of the contiguous search).
    assert members(ch, 0)[:2] == [(first, first + 3), (first + 3, first + 6)]


def wired(pattern: str, *, leak: int | None = None, backward=None, grads=None):
    """Blocks of 4 ops with equal local signatures: a = A(h); b = B(a); c = C(x); h' = add(c, a)
    where x is h ('h') or a ('a') per block, both 8 bytes. `leak`: that block's `a` is also read
    by the epilogue. `backward(order, blocks)` may reorder the backward stages."""
    b = GraphBuilder("wired")
    h = b.op("embed", [b.input("x", 4)], H, kind="Embedding")
    first = len(b.ops)
    inner = []
    for i, w in enumerate(pattern):
        a = b.op(f"b{i}.a", [h], H, kind="A")
        b.op(f"b{i}.b", [a], 16, kind="B")
        c = b.op(f"b{i}.c", [h if w == "h" else a], H, kind="C")
        h = b.op(f"b{i}.add", [c, a], H, saved=(), kind="add")
        inner.append(a)
    ins = [h] + ([inner[leak]] if leak is not None else [])
    out = b.op("head", ins, 2, kind="Head")
    order = [o.id for o in reversed(b.ops)]
    if backward:
        order = backward(order, [list(range(first + 4 * i, first + 4 * i + 4))
                                 for i in range(len(pattern))])
    return b.build(outputs=out, backward_order=order, stage_grad_bytes=grads), first


def test_same_ops_wired_differently_are_not_twins():
    g, first = wired("hhah")
    ch = find_blocks(g)
    check_chain(g, ch)
    assert members(ch) == [(first, first + 4), (first + 4, first + 8), (first + 12, first + 16)]
    assert ch.segments[3].cls is None and ch.segments[3].start == first + 8


def test_a_value_leaving_one_block_makes_it_differ():
    g, first = wired("hhhh", leak=1)
    ch = find_blocks(g)
    check_chain(g, ch)
    assert members(ch) == [(first, first + 4), (first + 8, first + 12), (first + 12, first + 16)]
    assert ch.segments[2].cls is None


def test_a_different_backward_stage_order_or_gradient_pattern_makes_a_block_differ():
    def swap(order, blocks):  # block 2's a and b stages the other way round
        a, b = blocks[2][0], blocks[2][1]
        i, j = order.index(a), order.index(b)
        order[i], order[j] = order[j], order[i]
        return order

    g, first = wired("hhhh", backward=swap)
    ch = find_blocks(g)
    check_chain(g, ch)
    assert members(ch) == [(first, first + 4), (first + 4, first + 8), (first + 12, first + 16)]
    # Parameter gradients accumulate along the backward: only the bytes relative to a block's
    # first stage count. Block 1 adds 3 bytes at its 'c' stage that the others do not.
    n = len(g.ops)
    grads = [10 * (n - t) for t in range(n)]  # stage t of op n-1-t (reverse order)
    grads_odd = list(grads)
    stage_c1 = n - 1 - (first + 4 + 2)
    grads_odd[stage_c1] += 3
    for gr, expect in ((grads, [(first + 4 * i, first + 4 * i + 4) for i in range(4)]),
                       (grads_odd, [(first, first + 4), (first + 8, first + 12),
                                    (first + 12, first + 16)])):
        g, first = wired("hhhh", grads=gr)
        ch = find_blocks(g)
        check_chain(g, ch)
        assert members(ch) == expect


def test_which_output_and_which_outside_value_a_block_reads():
    # Each block: (s0, s1) = S(h) (two outputs of equal size); c = C(s_i, m_j);
    # h' = add(c, h, m1). i and j per block; m1 and m2 are two equal-sized outside Values.
    for pattern, odd in (("00,00,10,00", 2), ("00,00,01,00", 2), ("01,01,01,01", None)):
        b = GraphBuilder("outputs")
        x = b.input("x", 4)
        h = b.op("embed", [x], H, kind="Embedding")
        ms = (b.op("m1", [x], M, saved=(), kind="mask"), b.op("m2", [x], M, saved=(), kind="mask"))
        first = len(b.ops)
        for i, (o, m) in enumerate(pattern.split(",")):
            outs = b.op(f"b{i}.s", [h], (H, H), kind="S")
            c = b.op(f"b{i}.c", [outs[int(o)], ms[int(m)]], H, saved=("in0",), kind="C")
            h = b.op(f"b{i}.add", [c, h, ms[0]], H, saved=(), kind="add")
        g = b.build(outputs=b.op("head", [h], 2, kind="Head"))
        ch = find_blocks(g)
        check_chain(g, ch)
        expect = [(first + 3 * i, first + 3 * i + 3) for i in range(4) if i != odd]
        assert members(ch, ch.segments[ch.segment_of_op(first + 3)].cls) == expect, pattern
        # m1 and m2 are twins too where both are read after them (m2 unread: its Value does
        # not leave its segment).
        assert (members(ch, 0) == [(1, 2), (2, 3)]) == (pattern[1::3] != "0000")


def test_the_phase_with_the_narrowest_cuts():
    # The epilogue starts with an op like each block's first ('A' reading the stream): the
    # periodic stretch could also be cut one op later, where the cuts hold the stream and 'a'.
    b = GraphBuilder("phase")
    h = b.op("embed", [b.input("x", 4)], H, kind="Embedding")
    for i in range(3):
        a = b.op(f"b{i}.a", [h], H, kind="A")
        t = b.op(f"b{i}.b", [a], 16, kind="B")
        h = b.op(f"b{i}.add", [h, t], H, saved=(), kind="add")
    a = b.op("tail.a", [h], H, kind="A")
    g = b.build(outputs=b.op("head", [a], 2, kind="Head"))
    ch = find_blocks(g)
    check_chain(g, ch)
    assert members(ch) == [(1, 4), (4, 7), (7, 10)]
    assert ch.cut_bytes[:3] == (H, H, H)


def test_costs_within_the_tolerance_are_equal_and_beyond_are_not():
    g, first, _ = stacked(3, tweak=lambda i: {"fwd": 2.0 * (1 + 1e-12 * i)})
    assert len(find_blocks(g).classes[0].members) == 3
    g, first, _ = stacked(3, tweak=lambda i: {"fwd": 2.0 * (1 + 1e-6 * (i == 1))})
    ch = find_blocks(g)
    assert all(first + 3 not in range(s, e) for c in ch.classes for s, e in members(ch, c.id))
    assert len(find_blocks(g, digits=5).classes[0].members) == 3  # a coarser tolerance


def test_a_graph_without_repetition_has_no_class():
    b = GraphBuilder("distinct")
    v = b.input("x", 4)
    for i in range(12):
        v = b.op(f"op{i}", [v], 1 + i, kind=f"K{i}")
    g = b.build(outputs=v)
    ch = find_blocks(g)
    check_chain(g, ch)
    assert ch.classes == () and [(s.start, s.stop, s.cls) for s in ch.segments] == [(0, 12, None)]
    assert ch.cuts == ()
    assert repeated_block_checkpoint_schedule(g, GraphFacts(g, "checkpoint")) is None
    one = b.build(outputs=v)  # a one-op graph
    assert find_blocks(OpGraph.from_dict({**one.to_dict(), "ops": one.to_dict()["ops"][:1],
                                          "values": one.to_dict()["values"][:2],
                                          "outputs": [1], "backward_order": [0],
                                          "stage_grad_bytes": [0]})).classes == ()


def test_single_op_blocks():
    # x -> op0 -> ... -> op5: op0 reads the graph input, op5 makes the model output, ops 1..4
    # are identical one-op blocks.
    g = toy_chain((100,) * 6)
    ch = find_blocks(g)
    check_chain(g, ch)
    assert [(s.start, s.stop, s.cls) for s in ch.segments] == \
        [(0, 1, None), (1, 2, 0), (2, 3, 0), (3, 4, 0), (4, 5, 0), (5, 6, None)]


def test_resnet_like_stages_repeat_only_their_identical_bottlenecks():
    g = resnet_like((3, 4, 6, 3), batch=8)
    ch = find_blocks(g)
    check_chain(g, ch)
    stages = [c for c in ch.classes if c.length == 6]
    assert [len(c.members) for c in stages] == [2, 3, 5, 2]
    for c, (stage, n) in zip(stages, [(1, 3), (2, 4), (3, 6), (4, 3)]):
        firsts = [g.ops[ch.segments[i].start].name for i in c.members]
        assert firsts == [f"layer{stage}.{blk}.conv1" for blk in range(1, n)]


def test_a_random_dag_gives_a_valid_chain():
    for seed in range(20):
        g = random_dag(random.Random(seed), 40)
        check_chain(g, find_blocks(g))


def _searched(graph):
    """find_blocks' chain and its search steps: (ops, candidate periods, stretches encoded)."""
    steps = []
    ch = find_blocks(graph, on_step=lambda *step: steps.append(step))
    return ch, steps


def test_five_thousand_ops_in_few_search_steps():
    b = GraphBuilder("deep")
    h = b.op("embed", [b.input("x", 4)], H, kind="E")
    mask = b.op("mask", [b.values[0].id], M, saved=(), kind="M")
    rng = random.Random(0)
    shape = [(rng.randint(1, 9), rng.randint(0, 2)) for _ in range(20)]
    for i in range(240):
        vals = [h]
        for q, (size, back) in enumerate(shape):
            ins = list(dict.fromkeys([vals[-1], vals[max(0, len(vals) - 1 - back)]]))
            vals.append(b.op(f"l{i}.{q}", ins + ([mask] if q == 3 else []), size, kind=f"k{q % 5}"))
        h = b.op(f"res{i}", [h, vals[-1]], H, kind="add")
    g = b.build(outputs=b.op("head", [h], 3, kind="H"))
    assert len(g.ops) > 5000
    ch, steps = _searched(g)
    # What "well under a second" stood for (the module docstring's cost): one step over the whole
    # graph and one over what is left, each comparing against a bounded set of candidate periods
    # (not every period up to n / 2) and encoding one stretch exactly.
    assert len(steps) == 2 and steps[0][0] == len(g.ops)
    assert max(periods for _, periods, _ in steps) <= 2 * 64
    assert sum(evaluated for *_, evaluated in steps) == 1
    assert [(c.length, len(c.members)) for c in ch.classes] == [(21, 240)]
    assert ch.classes[0].broadcast == (mask,)


# ----------------------------------------------------------------------------------------------
# translate
# ----------------------------------------------------------------------------------------------
def test_translate_maps_a_block_onto_its_twin_and_back():
    g, first, mask = stacked(3, mask=True)
    ch = find_blocks(g)
    a, b = ch.classes[0].members[0], ch.classes[0].members[2]
    m = ch.mapping(a, b)
    A, B = ch.segments[a], ch.segments[b]
    ops, values = translate(m, ops=A.ops, values=A.outputs + A.inputs)
    assert ops == tuple(B.ops)
    assert values == B.outputs + B.inputs
    assert translate(m.inverse(), ops=ops, values=values) == (tuple(A.ops), A.outputs + A.inputs)
    with pytest.raises(KeyError, match="not an op or Value of segment"):
        translate(m, ops=[B.start])
    with pytest.raises(ValueError, match="not members of one class"):
        ch.mapping(0, a)


# ----------------------------------------------------------------------------------------------
# Generated chains of a random block
# ----------------------------------------------------------------------------------------------
def generated(seed: int, k: int, m: int, pro: int, epi: int, bcast: bool):
    """A random block of m ops (a small DAG: each op reads the stream entering the block or
    earlier ops of the block, one op may read a broadcast Value), repeated k times, between a
    prologue of `pro` and an epilogue of `epi` ops of kinds no block op has."""
    rng = random.Random(seed)
    b = GraphBuilder("generated")
    x = b.input("x", 4)
    shared = b.op("bcast", [x], 2, saved=(), kind="P") if bcast else None
    template = []
    for q in range(m):
        n_in = rng.randint(1, min(2, q + 1))
        srcs = sorted(rng.sample(range(-1, q), n_in)) if q else [-1]  # -1: the stream
        if q == 0 and -1 not in srcs:
            srcs = [-1]
        template.append(dict(
            srcs=srcs, bc=bcast and rng.random() < 0.4, size=rng.randint(1, 4),
            kind=rng.choice("AB"), fwd=float(rng.randint(1, 3)), bwd=float(rng.randint(1, 3)),
            saved=rng.choice([(), ("in0",), ("out0",), ("in0", "out0")]),
            ws=rng.choice([0, 0, 1])))
    v = x
    for i in range(pro):  # the stream entering the first block is like the one a block makes
        v = b.op(f"pro{i}", [v], template[-1]["size"] if i == pro - 1 else rng.randint(1, 3),
                 kind="P")
    start = len(b.ops)
    for i in range(k):
        outs = []
        for q, t in enumerate(template):
            ins = [v if s == -1 else outs[s] for s in t["srcs"]] + ([shared] if t["bc"] else [])
            outs.append(b.op(f"b{i}.{q}", ins, t["size"], kind=t["kind"], fwd=t["fwd"],
                             bwd=t["bwd"], saved=t["saved"], bwd_ws=t["ws"]))
        v = outs[-1]
    stop = len(b.ops)
    for i in range(epi):
        v = b.op(f"epi{i}", [v], rng.randint(1, 3), kind="E")
    return b.build(outputs=v), start, stop


@settings(max_examples=150, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), k=st.integers(2, 6), m=st.integers(1, 6),
       pro=st.integers(1, 3), epi=st.integers(1, 3), bcast=st.booleans())
def test_generated_repetitions_are_recovered(seed, k, m, pro, epi, bcast):
    g, start, stop = generated(seed, k, m, pro, epi, bcast)
    ch = find_blocks(g)
    check_chain(g, ch)  # every class member is identical to its classmates
    # The repeated region is covered exactly by blocks of one length L* <= m (the block, or a
    # finer period when the block itself repeats), at least k of them, none straddling it.
    inside = [ch.segments[i] for c in ch.classes for i in c.members
              if start <= ch.segments[i].start < stop]
    assert all(s.stop <= stop for s in inside)
    assert sorted(j for s in inside for j in s.ops) == list(range(start, stop))
    lengths = {len(s) for s in inside}
    assert len(lengths) == 1 and lengths.pop() <= m and len(inside) >= k
    for c in ch.classes:  # no class mixes the region and the prologue or epilogue
        assert len({start <= ch.segments[i].start < stop for i in c.members}) == 1
    # The rule on top of it gives a schedule the simulator accepts.
    s = repeated_block_checkpoint_schedule(g, GraphFacts(g, "checkpoint"))
    assert s is not None
    simulate(g, s)


# ----------------------------------------------------------------------------------------------
# Per-block checkpointing on the blocks found
# ----------------------------------------------------------------------------------------------
def test_repeated_block_checkpoint_schedule_recomputes_only_block_interiors():
    g, first, mask = stacked(6, mask=True)
    facts = GraphFacts(g, "checkpoint")
    ch = find_blocks(g)
    s = repeated_block_checkpoint_schedule(g, facts, chain=ch)
    base = simulate(g, store_all_schedule(g))
    t = simulate(g, s)  # raises on an invalid schedule
    assert t.peak_bytes < base.peak_bytes
    recomputed = sorted(o for st_ in s.stages for o in st_.recompute)
    # Each block's first op (its output is read by the block's backward and not kept) is
    # recomputed exactly once; nothing outside a block, nothing that leaves a block.
    assert recomputed == [first + 3 * i for i in range(6)]
    assert t.total_time == base.total_time + 6 * 2.0
    kept = set(s.forward_keep)
    for i in ch.classes[0].members:
        seg = ch.segments[i]
        assert not kept & {w for j in seg.ops for w in g.ops[j].outputs} - set(seg.outputs)
    assert s.created_by == "baseline:repeated_blocks"
    assert repeated_block_checkpoint_schedule(g, facts).to_dict() == s.to_dict()


# ----------------------------------------------------------------------------------------------
# Profiled models (meta device, analytical costs)
# ----------------------------------------------------------------------------------------------
def test_profiled_resnet18_repeats_only_identical_basic_blocks():
    torch = pytest.importorskip("torch")
    tv = pytest.importorskip("torchvision.models")
    import monetlike

    g = monetlike.profile(tv.resnet18(), torch.empty(2, 3, 64, 64, device="meta"),
                          cost="analytical:A100-40GB")
    ch, steps = _searched(g)
    check_chain(g, ch)
    # What "under half a second" stood for: the bound stops each step after its first exact
    # encoding, and what is left after the blocks takes a few more steps.
    assert sum(evaluated for *_, evaluated in steps) <= 2 and len(steps) <= 3
    mods = g.meta["op_modules"]
    # Each later stage's first BasicBlock has a downsample: only layer1's two blocks are twins.
    assert [[mods[ch.segments[i].start] for i in c.members] for c in ch.classes] == \
        [["layer1.0.conv1", "layer1.1.conv1"]]
    for i in ch.classes[0].members:
        seg = ch.segments[i]
        assert {mods[j].split(".")[:2] == mods[seg.start].split(".")[:2] for j in seg.ops} == {True}
    s = repeated_block_checkpoint_schedule(g, GraphFacts(g, "checkpoint"), chain=ch)
    assert simulate(g, s).peak_bytes <= simulate(g, store_all_schedule(g)).peak_bytes


def test_profiled_gpt2_has_its_layers_as_one_class():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import monetlike

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, n_positions=16, vocab_size=100)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 100, (2, 16))
    batch = dict(input_ids=ids, attention_mask=torch.ones(2, 16, dtype=torch.long),
                 labels=ids.clone(), use_cache=False)
    g = monetlike.profile(model, batch, cost="analytical:A100-40GB")
    ch, steps = _searched(g)
    check_chain(g, ch)
    # What "under half a second" stood for: the bound stops each step after its first exact
    # encoding, and what is left after the blocks takes a few more steps.
    assert sum(evaluated for *_, evaluated in steps) <= 2 and len(steps) <= 5
    mods = g.meta["op_modules"]
    layers = [c for c in ch.classes if len(c.members) == 4]
    assert len(layers) == 1
    for n, i in enumerate(layers[0].members):
        seg = ch.segments[i]
        assert {mods[j].startswith(f"transformer.h.{n}") for j in seg.ops} == {True}
    # Every layer op is in a member: the layers are exactly the blocks.
    in_layers = {j for i in layers[0].members for j in ch.segments[i].ops}
    assert in_layers == {j for j, p in enumerate(mods) if p.startswith("transformer.h.")}
    # The attention mask is made once and read by every layer.
    assert len(layers[0].broadcast) == 1
    s = repeated_block_checkpoint_schedule(g, GraphFacts(g, "checkpoint"), chain=ch)
    assert simulate(g, s).peak_bytes < simulate(g, store_all_schedule(g)).peak_bytes


@pytest.mark.parametrize("phase", [0, 1])
def test_merged_pairs_keep_the_chain_invariants(phase):
    """blocks.merged: segments two by two from `phase` on; equal pairs are twins; the cuts are
    those of the kept boundaries, as an independent count gives them."""
    g, first, _ = stacked(6)
    ch = find_blocks(g)
    m = merged(ch, phase)
    check_chain(g, m)
    starts = [s.start for s in ch.segments]
    assert [s.start for s in m.segments] == starts[:phase] + starts[phase::2]
    # 8 segments (prologue, 6 blocks of 3 ops, epilogue): from the first, (prologue, block 0),
    # two pairs of blocks, (block 5, epilogue); from the second, the prologue, three pairs, the
    # epilogue alone. The pairs of blocks are twins.
    lengths = [len(s) for s in m.segments]
    assert lengths == ([first + 3, 6, 6, 3 + 2] if phase == 0 else [first, 6, 6, 6, 2])
    assert [[len(m.segments[i]) for i in c.members] for c in m.classes] == \
        [[6] * (2 if phase == 0 else 3)]


def test_merged_runs_of_three_and_bad_phase():
    """blocks.merged by three from the second segment: the prologue alone, two runs of three
    blocks (twins), the epilogue alone; a phase outside 0..length-1 is refused."""
    g, first, _ = stacked(6)
    ch = find_blocks(g)
    m = merged(ch, 1, 3)
    check_chain(g, m)
    assert [len(s) for s in m.segments] == [first, 9, 9, 2]
    assert [list(c.members) for c in m.classes] == [[1, 2]]
    with pytest.raises(ValueError, match="phase must be in 0..2"):
        merged(ch, 3, 3)
