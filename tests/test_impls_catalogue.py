"""Tiny graphs where an operator implementation (monetlike.impls) is the optimal choice.

Torch-free: each graph mimics one Impl family with hand-picked sizes and costs (fixed memory 0),
and the comments derive the optimum by the rules of docs/execution-model.md. Every installed
backend must find it in mode full; mode checkpoint (Impl 0 only) must either be infeasible or
pick only defaults; the exhaustive reference search must agree with the hand derivation.

Common shape: x (graph input, 0 bytes) -> op0 "conv" (saves x) -> a (40) -> op1 (the Impl's op)
-> ... -> op2 "sum" (saves nothing) -> y (1, model output). Backward order op2, op1, op0 with
stage gradient bytes 50, 50, 0 (gradients in flight), so the backward is where memory binds
unless the forward's transient does. Forward and backward times are 1 unless stated.
"""

from __future__ import annotations

import pytest

import solver
from solver import InfeasibleBudgetError, simulate, store_all_schedule
from solver.backends import available
from solver_cases import GraphBuilder
from solver_reference import exact_min_peak, exact_optimum


def _graph(name, op1_out, impls, grads=(50, 50, 0)):
    b = GraphBuilder(name)
    x = b.input("x", 0)
    a = b.op("op0", [x], 40, saved=("in0",))
    m = b.op("op1", [a], op1_out, impls=impls)
    b.op("op2", [m], 1, saved=())
    return b.build(outputs=[len(b.values) - 1], stage_grad_bytes=list(grads))


def relu_graph():
    # op1 = ReLU (out-of-place) r (40). default saves r; relu_mask saves nothing, holds a mask of
    # 10 (a quarter), forward 1.2.
    # default: forward op1 a+r = 80; after the forward r (saved) + y = 41; stages op2/op1:
    #   41 + 50 = 91 -> peak 91, time 6.
    # relu_mask: forward op1 a+r+mask = 90; r dropped after op2; stages: y + mask + 50 = 61 ->
    #   peak 90, time 6.2.
    # checkpoint below 91: r must be resident at stage op1; recomputing it needs a, i.e. op0
    #   from x at stage op1: 1 + 50 + a 40 = 91. So checkpoint's minimum is 91, full's 90.
    return _graph("relu", 40, [
        dict(name="default", saved=("out0",)),
        dict(name="relu_mask", saved=(), internal_bytes=10, fwd_time=1.2),
    ])


def bn_relu_graph():
    # op1 = BatchNorm + in-place ReLU, r (40); stats 2 bytes.
    # default: saves a, r; internal 2. relu_mask: saves a; internal 2 + 10; forward 1.2.
    # bn_relu_lean: saves a; internal 0; backward 2 (recomputes the pre-activation).
    # After the forward (y 1): default a+r+y+2 = 83 -> stages 133; mask a+y+12 = 53 -> 103
    # (forward op2: a+r+y+12 = 93); lean a+y = 41 -> 91 (forward op1: 80).
    # Checkpoint: recomputing r at stage op1 costs r + its stats on top of 93 or, dropping a
    # too, 53 + a + r + 2 = 135: never below store-all's 133.
    # Times: default 6, mask 6.2, lean 7. Minimum budgets: full 91, checkpoint 133.
    return _graph("bn_relu", 40, [
        dict(name="default", saved=("in0", "out0"), internal_bytes=2),
        dict(name="relu_mask", saved=("in0",), internal_bytes=12, fwd_time=1.2),
        dict(name="bn_relu_lean", saved=("in0",), internal_bytes=0, bwd_time=2.0),
    ])


def hardtanh_graph():
    # op1 = ReLU6 (out-of-place) h (40). Unlike ReLU, hardtanh's default backward reads its
    # *input*: default saves a; hardtanh_mask saves nothing, holds a mask of 10, forward 1.2.
    # default: forward op2 a+h+y = 81; after the forward a (saved) + y = 41; stages 41 + 50 = 91
    #   -> peak 91, time 6.
    # hardtanh_mask: forward op1 a+h+mask = 90 (a freed after op1); after the forward y + mask =
    #   11 -> stages 61; peak 90, time 6.2.
    # checkpoint below 91: a must be resident at stage op1; recomputing it there from x: 50 + y +
    #   a 40 = 91. So checkpoint's minimum is 91, full's 90.
    return _graph("hardtanh", 40, [
        dict(name="default", saved=("in0",)),
        dict(name="hardtanh_mask", saved=(), internal_bytes=10, fwd_time=1.2),
    ])


def bn_hardtanh_graph():
    # op1 = BatchNorm + in-place ReLU6, r (40); stats 2 bytes. The in-place hardtanh's default
    # backward holds autograd's clone of the pre-activation (40), a storage of no Value: internal,
    # so no schedule can drop it. default: saves a; internal 2 + 40. hardtanh_mask: saves a;
    # internal 2 + 10; forward 1.2. bn_hardtanh_lean: saves a; internal 0; backward 2.
    # Forward op1: a+r+internal = 122 / 92 / 80; op2 (+y): 123 / 93 / 81. After the forward
    # (r freed: nothing saves it) a+y+internal = 83 / 53 / 41 -> stages (+50) 133 / 103 / 91.
    # Dropping a and recomputing it at stage op1 gives 50 + y + internal + a: no lower.
    # Peaks: default 133, mask 103, lean 91; times 6, 6.2, 7. Checkpoint: 133 at least (the
    # forward's 123 and the internal at the stages do not depend on the schedule).
    return _graph("bn_hardtanh", 40, [
        dict(name="default", saved=("in0",), internal_bytes=42),
        dict(name="hardtanh_mask", saved=("in0",), internal_bytes=12, fwd_time=1.2),
        dict(name="bn_hardtanh_lean", saved=("in0",), internal_bytes=0, bwd_time=2.0),
    ])


def maxpool_graph():
    # op1 = MaxPool, p (8); default saves a and int64 indices (16); maxpool_compact saves nothing
    # and an int8 argmax (2); forward 1.5, backward 1.2.
    # default: forward op2 a+p+y+16 = 65; after the forward a+y+16 = 57 -> stages 107. Recomputing
    #   a at stage op1 from x: 50 + y + 16 + a = 107 as well: checkpoint's minimum is 107.
    # compact: forward op1 a+p+2 = 50; after the forward y+2 = 3 -> stages 53. Time 6.7.
    return _graph("maxpool", 8, [
        dict(name="default", saved=("in0",), internal_bytes=16),
        dict(name="maxpool_compact", saved=(), internal_bytes=2, fwd_time=1.5, bwd_time=1.2),
    ])


def dropout_graph():
    # op1 = Dropout, d (40); default holds a bool mask (10); dropout_regen holds the RNG state
    # (1), forward 1.1, backward 1.5 (regenerates the mask).
    # The forward transient binds: op1 a+d+mask = 90 (default) or 81 (regen); stages 61 / 52.
    # No recomputation lowers a forward transient: checkpoint's minimum is 90, full's 81.
    # Time with regen: 3.1 + 3.5 = 6.6.
    return _graph("dropout", 40, [
        dict(name="default", saved=(), internal_bytes=10),
        dict(name="dropout_regen", saved=(), internal_bytes=1, fwd_time=1.1, bwd_time=1.5),
    ])


def relu_inplace_graph():
    # op1 = ReLU written out of place, r (40); stage gradients 10, 10, 0 (smaller than above, so
    # the forward transient binds). default and relu_inplace both save r (ReLU's backward reads
    # its result); relu_inplace writes r into a's storage (overwrites a), so its forward point
    # does not allocate r.
    # default: forward op1 a+r = 80 (a is op1's input: live there whatever the schedule), op2
    #   r+y = 41; stages 10 + r + y = 51. Peak 80, time 6. No schedule lowers the forward point
    #   op1: checkpoint's minimum is 80.
    # relu_inplace: forward op1 a = 40 (r takes a's storage), op2 41; stages 51 (recomputing r
    #   at stage op1 instead: op0 from x, 10 + y + a = 51, no lower). Peak 51, time 6.
    return _graph("relu_inplace", 40, [
        dict(name="default", saved=("out0",)),
        dict(name="relu_inplace", saved=("out0",), overwrites="in0"),
    ], grads=(10, 10, 0))


def inplace_saved_graph():
    # x -> op0 a (40, saves x) -> op1 "conv" c (4, saves a) ; op2 = ReLU of a, out of place,
    # r (40): default saves r, relu_inplace saves r and overwrites a ; op3 "add" of r and c -> y
    # (1, saves nothing). Stage gradients 10 each (op3, op2, op1), 0 for op0.
    # op1's backward reads a, so relu_inplace cannot be chosen (row inplace_saved): the
    # in-place forward point op2 would be a + c = 44, and full mode's minimum would be 51.
    # default: forward op2 a+c+r = 84 (constant: a and c are read later); after op2, keeping a
    #   for op1 makes op3 a+c+r+y = 85; not keeping it, op3 45 and stage op1 recomputes op0
    #   (10 + y + a = 51). Stages op3/op2 10 + r + y = 51 (+a if kept: 91).
    #   At 84: a recomputed, time 4 + 4 + 1 = 9. Minimum 84 in both modes. Keeping a instead
    #   (time 8) needs 91 (stages op3/op2: 10 + a + r + y).
    b = GraphBuilder("inplace_saved")
    x = b.input("x", 0)
    a = b.op("op0", [x], 40, saved=("in0",))
    c = b.op("op1", [a], 4, saved=("in0",))
    r = b.op("op2", [a], 40, impls=[
        dict(name="default", saved=("out0",)),
        dict(name="relu_inplace", saved=("out0",), overwrites="in0")])
    b.op("op3", [r, c], 1, saved=())
    return b.build(outputs=[len(b.values) - 1], stage_grad_bytes=[10, 10, 10, 0])


def _split_graph(name, op0_saves):
    # op1 = a convolution reading a (40), m (40); its backward's input gradient is 40. default
    # saves a, workspace 40 (the input gradient, allocated while a is held). conv_split saves a
    # too, but lets it go after the weight gradient (early release), workspace 5 (the weight
    # gradient), backward 1.1; if a schedule holds a past the stage, its 40 bytes come back.
    b = GraphBuilder(name)
    x = b.input("x", 0)
    a = b.op("op0", [x], 40, saved=op0_saves)
    m = b.op("op1", [a], 40, impls=[
        dict(name="default", saved=("in0",), bwd_workspace=40),
        dict(name="conv_split", saved=("in0",), bwd_workspace=5, early_release=("in0",),
             bwd_time=1.1)])
    b.op("op2", [m], 1, saved=())
    return b.build(outputs=[len(b.values) - 1], stage_grad_bytes=[50, 50, 0])


def split_graph():
    # op0 saves x, so nothing after op1's stage reads a.
    # Forward: op1 a+m = 80, op2 m+y+a = 81. Stage op2: 50+a+y = 91.
    # default: stage op1 50+a+y+40 = 131 whatever the schedule (a must be there for it):
    #   checkpoint's minimum is 131.
    # conv_split: stage op1 50+a+y+5 = 96 (a goes in the stage) -> peak 96, time 6.1.
    return _split_graph("conv_split", ("in0",))


def split_held_graph():
    # op0 saves its output a, so op0's stage reads it again. default: 131 as above.
    # conv_split holding a past stage op1: 96 + 40 = 136. Dropping it there and recomputing op0
    # at its own stage (from x: stage gradients 0, y+a = 41): 96, time 6.1 + 1 = 7.1.
    return _split_graph("conv_split_held", ("out0",))


# (name, graph factory, budget, {mode: optimal time or None}, Impl picked by full mode)
CASES = [
    ("relu_mask/wins", relu_graph, 90, {"full": 6.2, "checkpoint": None}, "relu_mask"),
    ("relu_mask/default_wins", relu_graph, 91, {"full": 6.0, "checkpoint": 6.0}, None),
    ("bn_relu/mask_wins", bn_relu_graph, 110, {"full": 6.2, "checkpoint": None}, "relu_mask"),
    ("bn_relu/lean_wins", bn_relu_graph, 95, {"full": 7.0, "checkpoint": None}, "bn_relu_lean"),
    ("bn_relu/default_wins", bn_relu_graph, 133, {"full": 6.0, "checkpoint": 6.0}, None),
    ("hardtanh_mask/wins", hardtanh_graph, 90, {"full": 6.2, "checkpoint": None},
     "hardtanh_mask"),
    ("hardtanh_mask/default_wins", hardtanh_graph, 91, {"full": 6.0, "checkpoint": 6.0}, None),
    ("bn_hardtanh/mask_wins", bn_hardtanh_graph, 110, {"full": 6.2, "checkpoint": None},
     "hardtanh_mask"),
    ("bn_hardtanh/lean_wins", bn_hardtanh_graph, 95, {"full": 7.0, "checkpoint": None},
     "bn_hardtanh_lean"),
    ("bn_hardtanh/default_wins", bn_hardtanh_graph, 133, {"full": 6.0, "checkpoint": 6.0}, None),
    ("maxpool/compact_wins", maxpool_graph, 80, {"full": 6.7, "checkpoint": None},
     "maxpool_compact"),
    ("maxpool/default_wins", maxpool_graph, 107, {"full": 6.0, "checkpoint": 6.0}, None),
    ("dropout/regen_wins", dropout_graph, 85, {"full": 6.6, "checkpoint": None}, "dropout_regen"),
    ("dropout/default_wins", dropout_graph, 90, {"full": 6.0, "checkpoint": 6.0}, None),
    ("relu_inplace/wins", relu_inplace_graph, 60, {"full": 6.0, "checkpoint": None},
     "relu_inplace"),
    ("conv_split/wins", split_graph, 100, {"full": 6.1, "checkpoint": None}, "conv_split"),
    ("conv_split/default_wins", split_graph, 131, {"full": 6.0, "checkpoint": 6.0}, None),
    ("conv_split/recomputes_instead_of_holding", split_held_graph, 100,
     {"full": 7.1, "checkpoint": None}, "conv_split"),
    ("conv_split/held_default_wins", split_held_graph, 136, {"full": 6.0, "checkpoint": 6.0},
     None),
    ("relu_inplace/illegal", inplace_saved_graph, 84, {"full": 9.0, "checkpoint": 9.0}, None),
    ("relu_inplace/illegal_keeps", inplace_saved_graph, 91, {"full": 8.0, "checkpoint": 8.0},
     None),
]
MIN_BUDGETS = {relu_graph: (90, 91), bn_relu_graph: (91, 133), hardtanh_graph: (90, 91),
               bn_hardtanh_graph: (91, 133), maxpool_graph: (53, 107), dropout_graph: (81, 90),
               relu_inplace_graph: (51, 80), inplace_saved_graph: (84, 84),
               split_graph: (96, 131), split_held_graph: (96, 131)}
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("mode", ["full", "checkpoint"])
def test_reference_search_agrees(case, mode):
    _, factory, budget, times, _ = case
    ref = exact_optimum(factory(), budget, mode=mode)
    if times[mode] is None:
        assert ref is None
    else:
        assert ref is not None and ref[0] == pytest.approx(times[mode])


@pytest.mark.parametrize("factory", list(MIN_BUDGETS), ids=lambda f: f.__name__)
def test_min_budgets(factory):
    g = factory()
    full, ckpt = MIN_BUDGETS[factory]
    hi = simulate(g, store_all_schedule(g)).peak_bytes
    assert exact_min_peak(g, mode="full", hi=hi) == full
    assert exact_min_peak(g, mode="checkpoint", hi=hi) == ckpt
    assert solver.min_budget(g, "full") == full
    assert solver.min_budget(g, "checkpoint") == ckpt


@pytest.mark.parametrize("backend", available())
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_backend_picks_the_impl(case, backend, full_search):
    _, factory, budget, times, picked = case
    g = factory()
    r = solver.solve(g, budget, mode="full", backend=backend, time_limit_s=30, mip_gap=0)
    assert r.status == "optimal"
    assert r.objective == pytest.approx(times["full"], abs=1e-9)
    tl = simulate(g, r.schedule)
    assert tl.peak_bytes <= budget and tl.total_time == pytest.approx(times["full"])
    names = {g.ops[j].impls[i].name for j, i in enumerate(r.schedule.impl) if i}
    assert names == ({picked} if picked else set())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_checkpoint_mode_never_picks_it(case):
    _, factory, budget, times, _ = case
    g = factory()
    if times["checkpoint"] is None:
        with pytest.raises(InfeasibleBudgetError):
            solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
        return
    r = solver.solve(g, budget, mode="checkpoint", time_limit_s=30, mip_gap=0)
    assert set(r.schedule.impl) == {0}
    assert r.objective == pytest.approx(times["checkpoint"], abs=1e-9)
