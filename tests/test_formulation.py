"""The MILP as data: its blocks match docs/formulation.md, any schedule encodes to a feasible
vector whose memory rows equal the simulator's memory, canonical schedules never cost more, and
its size stays O(n^2) on a ResNet-50-sized graph."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import random
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import simulate, store_all_schedule
from solver.canonical import canonicalize
from solver.cuts import all_support_cuts
from solver.formulation import Formulation
from solver.milp import CHECK_EVERY, BuildStopped
from solver_cases import (GraphBuilder, random_chain, random_dag, random_schedules,
                          resnet_like)

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "formulation.md"


def _doc_blocks(section: str) -> set[str]:
    text = DOC.read_text()
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", part, flags=re.M))


def _doc_methods(section: str) -> dict[str, str]:
    """Block -> the method the documentation says writes it (the table's last column)."""
    text = DOC.read_text()
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    return dict(re.findall(r"^\| `([a-z_]+)` \|.*\| `(_[a-z_]+)` \|$", part, flags=re.M))


def test_each_block_is_written_by_the_one_method_the_documentation_names():
    for section, opens in (("3. Columns", "var_block"), ("4. Rows", "row_block")):
        methods = _doc_methods(section)
        assert set(methods) == _doc_blocks(section)
        for block, name in methods.items():
            source = inspect.getsource(getattr(Formulation, name))
            assert re.findall(rf'b\.{opens}\("([a-z_]+)"\)', source) == [block], (block, name)


def _graph_with_every_block():
    """Two Impls differing in forward cost, internals, saved set and early releases (a Value a
    later backward reads), and an in-place Impl whose overwritten Value another backward saves:
    every block appears."""
    b = GraphBuilder("every_block")
    x = b.input("x", 0)
    a = b.op("op0", [x], 10, fwd=3, saved=("in0", "out0"))
    m = b.op("op1", [a], 10, impls=[
        dict(name="default", saved=("in0",), internal_bytes=0, fwd_time=1, bwd_time=1,
             early_release=("in0",)),
        dict(name="alt", saved=("out0",), internal_bytes=3, fwd_time=2, bwd_time=1,
             fwd_workspace=1)])
    c = b.op("op2", [m, a], 10, impls=[
        dict(name="default", saved=("in0",)),
        dict(name="add_inplace", saved=("in0",), overwrites="in1")])
    y = b.op("op3", [c], 1, fwd=1)
    return b.build(outputs=y, stage_grad_bytes=[1, 2, 3, 4])


def test_blocks_match_the_documentation():
    g = _graph_with_every_block()
    milp = Formulation(g, 60).milp
    peak = Formulation(g, None, objective="peak").milp
    off = Formulation(dataclasses.replace(g, host_bandwidth=1.0), 60, offload=True)
    off = Formulation(off.graph, 60, offload=True,
                      support_cuts=frozenset(all_support_cuts(off))).milp
    rows = {b.name for b in milp.row_blocks} | {b.name for b in off.row_blocks}
    cols = ({b.name for b in milp.var_blocks} | {b.name for b in peak.var_blocks}
            | {b.name for b in off.var_blocks})
    assert rows == _doc_blocks("4. Rows")
    assert cols == _doc_blocks("3. Columns")


def assert_encoding_claims_the_simulation(g, s, budget, objective="time"):
    """Encode `s` in the MILP: the vector is feasible and describes a schedule (canonical,
    dominated Impls replaced) that costs no more than s, and its memory rows and objective claim
    exactly the simulator's peak and time. Returns (formulation, that schedule's timeline)."""
    tl = simulate(g, s)
    f = Formulation(g, budget, objective=objective)
    x = f.encode(s)
    assert f.milp.violations(x) == []
    dt = simulate(g, f.decode(x))
    assert f.claimed_peak(x) == dt.peak_bytes
    assert f.seconds(x) == pytest.approx(dt.total_time, rel=1e-12)
    assert dt.peak_bytes <= tl.peak_bytes and dt.total_time <= tl.total_time + 1e-12
    return f, dt


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), n=st.integers(1, 9), kind=st.sampled_from(["chain", "dag"]))
def test_encoded_schedules_are_feasible_and_claim_the_simulated_peak(seed, n, kind):
    rng = random.Random(seed)
    g = (random_chain(rng, n, early=True) if kind == "chain"
         else random_dag(rng, n, two_impl=True, early=True))
    for s in random_schedules(g, rng):
        tl = simulate(g, s)
        f, dt = assert_encoding_claims_the_simulation(g, s, tl.peak_bytes)
        # canonical schedules never cost more than the original
        ct = simulate(g, canonicalize(g, s, f.facts))
        assert ct.peak_bytes <= tl.peak_bytes and ct.total_time <= tl.total_time + 1e-12
        # and the peak objective claims exactly the same peak
        fp = Formulation(g, None, objective="peak")
        xp = fp.encode(s)
        assert fp.milp.violations(xp) == []
        assert fp.milp.objective(xp) * fp.mem_scale == pytest.approx(dt.peak_bytes)


@pytest.mark.parametrize("seed", range(6))
def test_running_sums_and_full_sums_give_the_same_optimum(seed):
    from solver.backends.highs import HighsBackend

    rng = random.Random(seed)
    g = random_dag(rng, 8, two_impl=True)
    budget = int(simulate(g, store_all_schedule(g)).peak_bytes * 0.6)
    objs = []
    for running in (True, False):
        f = Formulation(g, budget, running_sums=running)
        if f.infeasible_points:
            objs.append(None)
            continue
        r = HighsBackend().solve(f.milp, time_limit_s=30, mip_gap=0)
        objs.append(None if r.x is None else round(f.seconds(r.x), 9))
    assert objs[0] == objs[1]


def test_size_is_quadratic_on_a_resnet50_sized_graph():
    g = resnet_like()
    f = Formulation(g, 8 * 2**30)
    n = len(g.ops)
    m = f.milp
    # The build's work is its variables, rows and nonzeros: each O(n^2) (4.7 n^2 rows, 2.1 n^2
    # variables, 14.5 n^2 nonzeros at 109 ops), so the build stays quick without timing it.
    assert m.num_vars < 3 * n * n and m.num_rows < 6 * n * n
    assert m.num_integer < 2 * n * n
    assert m.nnz < 20 * n * n
    # the O(n^3) alternative is several times larger
    assert Formulation(g, 8 * 2**30, running_sums=False).milp.nnz > 2 * m.nnz


def test_variables_past_their_horizon_do_not_exist():
    # chain where op1 saves nothing: its input a is never needed after the forward pass
    b = GraphBuilder("horizon")
    x = b.input("x", 0)
    a = b.op("op0", [x], 10)
    c = b.op("op1", [a], 10, saved=())
    y = b.op("op2", [c], 1)
    g = b.build(outputs=y)
    f = Formulation(g, 100)
    # c is read by stage 0 (op2's backward); a only feeds op1, which may be recomputed for it;
    # nothing is read after stage 0, so no column exists for stages 1 and 2
    assert set(f.S) == {(0, a), (0, c)}
    assert set(f.R) == {(0, 0), (0, 1)}
    assert f.facts.horizon[a] == 0 and f.facts.horizon[c] == 0


def test_constant_points_over_budget_are_reported():
    g = random_chain(random.Random(0), 3)
    f = Formulation(g, 0)
    assert f.infeasible_points and f.infeasible_points[0][1] > 0


def test_encode_refuses_an_impl_outside_checkpoint_mode():
    g = _graph_with_every_block()
    s = store_all_schedule(g, impl=(0, 1, 0, 0))
    f = Formulation(g, 100, mode="checkpoint")
    with pytest.raises(ValueError, match="not among the checkpoint mode's choices"):
        f.encode(s)
    assert np.all(Formulation(g, 100).encode(s) >= -1e-9)


def _with_recompute_times(g, rng: random.Random):
    """`g` with a recompute time of its own on some Impls (costs in context,
    monetlike.calibrate): a recomputation then costs other than the forward."""
    ops = []
    for op in g.ops:
        impls = tuple(dataclasses.replace(im, recompute_time=rng.choice([None, 0.0, 0.5, 3.0, 9.0]))
                      for im in op.impls)
        ops.append(dataclasses.replace(op, impls=impls))
    return dataclasses.replace(g, ops=tuple(ops))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), n=st.integers(1, 8))
def test_recompute_times_are_what_the_formulation_and_the_simulator_charge(seed, n):
    rng = random.Random(seed)
    g = _with_recompute_times(random_dag(rng, n, two_impl=True, early=True), rng)
    for s in random_schedules(g, rng):
        tl = simulate(g, s)
        expected = (sum(g.ops[j].impls[i].fwd_time for j, i in enumerate(s.impl))
                    + sum(g.ops[k].impls[s.impl[k]].bwd_time for k in g.backward_order)
                    + sum(g.ops[j].impls[s.impl[j]].rerun_time
                          for st_ in s.stages for j in st_.recompute))
        assert tl.total_time == pytest.approx(expected, rel=1e-12)
        assert_encoding_claims_the_simulation(g, s, tl.peak_bytes)


@pytest.mark.parametrize("running_sums", [True, False])
def test_a_build_asks_whether_to_stop_often_and_stops_when_told(running_sums):
    """Issue 53: the build asks its `should_stop` between blocks, once per stage in the loops
    over stages and every CHECK_EVERY columns or rows (so a stop comes within a few thousand
    rows, and the asking costs next to nothing); told to stop it raises BuildStopped, and never
    told, it builds exactly the model it builds with nothing to ask. Counted calls, no clock."""
    g = resnet_like()
    budget = int(simulate(g, store_all_schedule(g)).peak_bytes * 0.6)
    asked = []
    plain = Formulation(g, budget, running_sums=running_sums).milp
    m = Formulation(g, budget, running_sums=running_sums,
                    should_stop=lambda: asked.append(1) and False).milp
    for field in dataclasses.fields(m):
        a, b = getattr(m, field.name), getattr(plain, field.name)
        if field.name == "A":
            assert (a != b).nnz == 0 and a.shape == b.shape
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b)
        else:
            assert a == b
    # once per stage in two loops over stages, per CHECK_EVERY columns or rows, per block
    # (fewer than 40 blocks) and four times as the matrix is made
    stages = len(g.backward_order)
    assert len(asked) >= 2 * stages + m.num_vars // CHECK_EVERY + m.num_rows // CHECK_EVERY
    assert len(asked) <= 2 * stages + (m.num_vars + m.num_rows) // CHECK_EVERY + 2 + 40 + 4
    for when in (1, len(asked) // 2, len(asked)):  # told at the first ask, midway, the last
        calls = []
        with pytest.raises(BuildStopped):
            Formulation(g, budget, running_sums=running_sums,
                        should_stop=lambda: calls.append(1) or len(calls) >= when)
        assert len(calls) == when  # it stopped at once
