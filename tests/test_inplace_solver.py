"""In-place Impls (`Impl.overwrites`) on the solver side: the IR's checks, the simulator's rules,
the MILP's rows against the simulator and an exhaustive search, and the repairs of rule-built
schedules. Torch-free. The hand-derived catalogue cases are in tests/test_impls_catalogue.py.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver
from solver import FormatError, ScheduleError, simulate, store_all_schedule
from solver.analysis import GraphFacts, allowed_impls
from solver.backends import available
from solver.rules.simple import schedule_from_keep
from solver.canonical import canonicalize
from solver.graph import OpGraph
from solver.schedule import Schedule, StageSchedule
from solver_cases import GraphBuilder, random_inplace_dag, random_schedules
from solver_reference import exact_optimum
from test_formulation import assert_encoding_claims_the_simulation


def _relu_chain(stage_grads=(10, 10, 0)):
    """x -> op0 a (40) -> op1 ReLU r (40, default / relu_inplace over a) -> op2 y (1)."""
    b = GraphBuilder("relu_chain")
    x = b.input("x", 0)
    a = b.op("op0", [x], 40, saved=("in0",))
    b.op("op1", [a], 40, impls=[dict(name="default", saved=("out0",)),
                                 dict(name="relu_inplace", saved=("out0",), overwrites="in0")])
    b.op("op2", [len(b.values) - 1], 1, saved=())
    return b.build(outputs=[len(b.values) - 1], stage_grad_bytes=list(stage_grads))


def _with(graph, impl, **changes):
    base = store_all_schedule(graph)
    return dataclasses.replace(base, impl=tuple(impl), **changes)


# -- the IR -------------------------------------------------------------------------------------
def test_overwrites_round_trips_and_old_json_still_loads():
    g = _relu_chain()
    d = g.to_dict()
    assert d["ops"][1]["impls"][1]["overwrites"] == 1
    assert "overwrites" not in d["ops"][1]["impls"][0]  # absent when None: old files unchanged
    g2 = OpGraph.from_dict(json.loads(json.dumps(d)))
    assert g2 == g and g2.fingerprint == g.fingerprint
    # An Impl without the field (every graph written before it existed) reads as allocating.
    plain = GraphBuilder("p")
    plain.op("op0", [plain.input("x", 0)], 4)
    pg = plain.build(outputs=[1])
    assert OpGraph.from_dict(pg.to_dict()).ops[0].impls[0].overwrites is None


def test_fingerprint_of_graphs_without_inplace_impls_is_unchanged():
    # The fingerprint lists [name, saved] per Impl, with the overwritten Value appended only
    # for in-place ones, so committed schedules of graphs without them still match.
    g = _relu_chain()
    no_inplace = dataclasses.replace(
        g, ops=tuple(dataclasses.replace(o, impls=o.impls[:1]) for o in g.ops))
    import hashlib
    structure = {
        "schema": no_inplace.schema_version, "batch": no_inplace.batch,
        "values": [[v.name, v.index, list(v.shape), v.dtype, v.bytes, v.producer,
                    v.requires_grad] for v in no_inplace.values],
        "ops": [[o.name, o.kind, list(o.nodes), list(o.inputs), list(o.outputs), o.has_backward,
                 o.recompute_unsafe, [[i.name, list(i.saved)] for i in o.impls]]
                for o in no_inplace.ops],
        "backward_order": list(no_inplace.backward_order), "outputs": list(no_inplace.outputs)}
    blob = json.dumps(structure, sort_keys=True, separators=(",", ":")).encode()
    assert no_inplace.fingerprint == hashlib.sha256(blob).hexdigest()[:16]
    assert g.fingerprint != no_inplace.fingerprint


@pytest.mark.parametrize("bad, message", [
    (dict(overwrites=3), "not an input"),
    (dict(overwrites=0), "graph input or a model output"),
    (dict(saved=[1], overwrites=1), "saves value 1"),
])
def test_bad_overwrites_are_refused(bad, message):
    d = _relu_chain().to_dict()
    d["ops"][1]["impls"][1].update(bad)
    if bad.get("overwrites") == 0:
        d["ops"][1]["inputs"] = [0, 1]
    with pytest.raises(FormatError, match=message):
        OpGraph.from_dict(d)


def test_overwriting_a_value_read_later_is_refused():
    b = GraphBuilder("later")
    x = b.input("x", 0)
    a = b.op("op0", [x], 4)
    r = b.op("op1", [a], 4, impls=[dict(name="default"),
                                    dict(name="inplace", saved=(), overwrites="in0")])
    b.op("op2", [r, a], 1)
    with pytest.raises(FormatError, match=r"read value 1 \(op0\) after op 1"):
        b.build(outputs=[3])


# -- the simulator ------------------------------------------------------------------------------
def test_forward_point_is_lower_by_the_output_bytes():
    g = _relu_chain()
    default = simulate(g, store_all_schedule(g))
    inplace = simulate(g, store_all_schedule(g, (0, 1, 0)))
    fwd = lambda tl: [p.bytes for p in tl.points if p.phase == "forward"]  # noqa: E731
    assert fwd(default) == [40, 80, 41] and fwd(inplace) == [40, 40, 41]
    assert default.peak_bytes == 80 and inplace.peak_bytes == 51


def test_recomputation_point_is_lower_by_the_output_bytes():
    g = _relu_chain(stage_grads=(10, 10, 0))
    # Keep nothing: stage op1 recomputes op0 then op1 (in place over the recomputed a).
    stages = (StageSchedule(op=2, recompute=(), drop=()),
              StageSchedule(op=1, recompute=(0, 1), drop=(1, 2)),
              StageSchedule(op=0, recompute=(), drop=()))
    for impl, point in (((0, 0, 0), 10 + 1 + 40 + 40), ((0, 1, 0), 10 + 1 + 40)):
        s = _with(g, impl, forward_keep=(), stages=stages)
        tl = simulate(g, s)
        rec = [p for p in tl.points if p.phase == "recompute" and p.op == 1]
        assert [p.bytes for p in rec] == [point]
        assert 1 not in rec[0].resident  # a is gone (dropped at its last use)


@pytest.mark.parametrize("schedule_change, message", [
    (dict(forward_keep=(1, 2)), "keeps or offloads value 1"),
    (dict(stages=(StageSchedule(op=2, recompute=(0,), drop=()),
                  StageSchedule(op=1, recompute=(), drop=(1, 2)),
                  StageSchedule(op=0, recompute=(), drop=())), forward_keep=(2,)),
     "value 1 .* is held entering this stage"),
])
def test_simulator_refuses_holding_the_overwritten_value(schedule_change, message):
    g = _relu_chain()
    with pytest.raises(ScheduleError, match=message):
        simulate(g, _with(g, (0, 1, 0), **schedule_change))


def test_simulator_refuses_a_backward_that_reads_the_overwritten_value():
    from test_impls_catalogue import inplace_saved_graph

    g = inplace_saved_graph()
    with pytest.raises(ScheduleError, match="reads value 1"):
        simulate(g, _with(g, (0, 0, 1, 0), forward_keep=(), stages=(
            StageSchedule(op=3, recompute=(), drop=()),
            StageSchedule(op=2, recompute=(), drop=(3,)),
            StageSchedule(op=1, recompute=(0,), drop=(1,)),
            StageSchedule(op=0, recompute=(), drop=()))))


# -- dominance and repairs ----------------------------------------------------------------------
def test_an_inplace_impl_equal_in_saved_and_costs_is_not_pruned():
    g = _relu_chain()
    assert allowed_impls(g, "full")[1] == (0, 1)
    assert allowed_impls(g, "checkpoint")[1] == (0,)


def test_rule_built_schedules_revert_an_inplace_impl_that_cannot_run():
    from test_impls_catalogue import inplace_saved_graph

    g = inplace_saved_graph()
    facts = GraphFacts(g, "full")
    # op1 saves a, which op2's relu_inplace overwrites: store-all and keep-sets revert op2.
    assert store_all_schedule(g, (0, 0, 1, 0)).impl == (0, 0, 0, 0)
    s = schedule_from_keep(g, (1,), impl=(0, 0, 1, 0), facts=facts)
    assert s.impl[2] == 0
    simulate(g, s)
    # Where nothing reads a after it, the in-place Impl stays unless the schedule holds a.
    g2 = _relu_chain()
    f2 = GraphFacts(g2, "full")
    assert schedule_from_keep(g2, (), impl=(0, 1, 0), facts=f2, retain="none").impl == (0, 1, 0)
    held = canonicalize(g2, _with(g2, (0, 1, 0), forward_keep=(1, 2)), f2)
    assert held.impl == (0, 0, 0)


# -- the MILP against the simulator and an exhaustive search --------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), n=st.integers(1, 8))
def test_encoded_inplace_schedules_claim_the_simulated_peak_and_time(seed, n):
    rng = random.Random(seed)
    g = random_inplace_dag(rng, n)
    for s in random_schedules(g, rng, random_impls=True):
        tl = simulate(g, s)
        for objective, budget in (("time", tl.peak_bytes), ("peak", None)):
            assert_encoding_claims_the_simulation(g, s, budget, objective)


@pytest.mark.parametrize("seed", [4, 7, 11, 14, 31, 37])  # graphs with two in-place Impls
def test_inplace_dags_every_backend_agrees_with_exhaustive_search(seed, full_search):
    g = random_inplace_dag(random.Random(seed), 5)
    assert sum(im.overwrites is not None for op in g.ops for im in op.impls) >= 2
    top = simulate(g, store_all_schedule(g)).peak_bytes
    low = solver.min_budget(g, "full")
    for budget in sorted({low, (low + top) // 2}):
        ref = exact_optimum(g, budget)
        assert ref is not None
        for backend in available():
            r = solver.solve(g, budget, mode="full", backend=backend, time_limit_s=30, mip_gap=0)
            assert r.status == "optimal", backend
            assert r.objective == pytest.approx(ref[0], abs=1e-9), backend
            tl = simulate(g, r.schedule)
            assert tl.peak_bytes <= budget and tl.total_time == pytest.approx(ref[0])


def test_min_budget_counts_the_inplace_forward_point():
    assert solver.min_budget(_relu_chain(), "full") == 51
    assert solver.min_budget(_relu_chain(), "checkpoint") == 80


def test_schedule_json_with_inplace_impl_round_trips(tmp_path):
    g = _relu_chain()
    r = solver.solve(g, 60, mode="full", time_limit_s=30)
    assert g.ops[1].impls[r.schedule.impl[1]].name == "relu_inplace"
    r.schedule.save(tmp_path / "s.json")
    s = Schedule.load(tmp_path / "s.json")
    assert simulate(g, s).peak_bytes == simulate(g, r.schedule).peak_bytes <= 60
