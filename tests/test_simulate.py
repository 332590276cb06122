"""The simulator on tiny graphs whose memory timeline is derived by hand."""

import dataclasses

import pytest

from solver import ScheduleError, ScheduleMismatchError, StageSchedule, simulate, store_all_schedule
from toy_graphs import chain


def test_store_all_chain_peak_and_time_by_hand():
    g = chain((100, 200, 300), internal=5, bwd_ws=7, grads=(300, 200, 100))
    s = store_all_schedule(g)
    # Values 1 and 2 are saved by ops 1 and 2; value 3 is the output (held by the caller).
    assert s.forward_keep == (1, 2)
    assert [st.drop for st in s.stages] == [(2,), (1,), ()]
    tl = simulate(g, s)
    fixed = 1010
    # forward: op0 peak = fixed + 100 + 5 (internal); op1 = fixed + 100 + 5 + 200 + 5; ...
    assert [p.bytes for p in tl.points[:3]] == [fixed + 105, fixed + 310, fixed + 615]
    # stage 0 (op2): fixed + grad 300 + values 100+200+300 + internals 15 + ws 7
    assert tl.points[3].bytes == fixed + 300 + 600 + 15 + 7
    # stage 1 (op1): value 2 dropped after stage 0, internals 10 left
    assert tl.points[4].bytes == fixed + 200 + 400 + 10 + 7
    # stage 2 (op0): it saves the graph input; only the output (300) is resident
    assert tl.points[5].bytes == fixed + 100 + 300 + 5 + 7
    assert tl.points[-1].bytes == fixed + 300  # end: only the output is resident
    assert tl.peak_bytes == fixed + 922
    assert tl.total_time == 3 * 1.0 + 3 * 2.0


def test_recompute_schedule_by_hand():
    g = chain((100, 200, 300))
    base = store_all_schedule(g)
    # Keep only value 1; recompute value 2 (op1) just before the stage of op2.
    s = dataclasses.replace(base, forward_keep=(1,), stages=(
        StageSchedule(op=2, recompute=(1,), drop=(2,)),
        StageSchedule(op=1, drop=(1,)),
        StageSchedule(op=0)))
    tl = simulate(g, s)
    fixed = 1010
    fwd = [p.bytes for p in tl.points if p.phase == "forward"]
    # value 2 is freed after op2 reads it: op2's peak holds 100 + 200 + 300
    assert fwd == [fixed + 100, fixed + 300, fixed + 600]
    rec = [p for p in tl.points if p.phase == "recompute"]
    assert len(rec) == 1 and rec[0].bytes == fixed + 100 + 300 + 200
    assert tl.total_time == 3 + 1 + 6
    assert tl.peak_bytes == fixed + 600


def test_missing_value_names_the_stage():
    g = chain((100, 200, 300))
    s = dataclasses.replace(store_all_schedule(g), forward_keep=(1,), stages=(
        StageSchedule(op=2), StageSchedule(op=1, drop=(1,)), StageSchedule(op=0)))
    with pytest.raises(ScheduleError, match=r"stage 0 \(backward of op 2 op2\).*values \[2\]"):
        simulate(g, s)


def test_unsafe_op_is_never_recomputed():
    g = chain((100, 200, 300))
    ops = list(g.ops)
    ops[1] = dataclasses.replace(ops[1], recompute_unsafe="calls aten::nonzero (data-dependent)")
    g = dataclasses.replace(g, ops=tuple(ops))
    s = dataclasses.replace(store_all_schedule(g), forward_keep=(1,), stages=(
        StageSchedule(op=2, recompute=(1,), drop=(2,)), StageSchedule(op=1, drop=(1,)),
        StageSchedule(op=0)))
    with pytest.raises(ScheduleError, match="must never be recomputed: calls aten::nonzero"):
        simulate(g, s)


def test_schedule_for_another_batch_is_refused_with_the_difference():
    g = chain((100, 200, 300))
    other = dataclasses.replace(g, batch=32)
    with pytest.raises(ScheduleMismatchError, match="batch: schedule has 32, model has 1"):
        simulate(g, store_all_schedule(other))


def test_an_early_release_held_past_its_stage_counts_at_the_backward():
    """Impl.early_release: a saved Value the backward frees before its peak is not in its
    workspace, so it costs nothing at a stage where it is released, and its bytes where the
    schedule holds it past the stage (a later backward reads it)."""
    from solver_cases import GraphBuilder

    def graph(early_op2):
        b = GraphBuilder("early")
        x = b.input("x", 8)
        a = b.op("op0", [x], 100, saved=("in0",))
        h = b.op("op1", [a], 200, saved=("in0",), early=("in0",))
        y = b.op("op2", [h, a], 300, saved=("in0", "in1"), early=early_op2, bwd_ws=7)
        return b.build(outputs=y, stage_grad_bytes=[10, 20, 30])

    plain, early = graph(()), graph(("in0", "in1"))
    s = store_all_schedule(plain)
    assert [st.op for st in s.stages] == [2, 1, 0]
    before = [p.bytes for p in simulate(plain, s).points if p.phase == "backward"]
    after = [p.bytes for p in simulate(early, dataclasses.replace(
        s, fingerprint=early.fingerprint)).points if p.phase == "backward"]
    # stage 0 (op2): h (200) is released there, a (100) is held for op1's backward
    assert after[0] == before[0] + 100
    # stage 1 (op1): a is released there; stage 2 has no early release
    assert after[1:] == before[1:]
