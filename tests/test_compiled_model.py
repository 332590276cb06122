"""solver/compiled.py, the compiled execution model, on hand-built joint graphs with known peaks.

The numbers are worked by hand in the comments (docs/execution-model.md, "The compiled
execution model"); the measured side is tests/test_compiled_runtime.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from solver.compiled import GreedyPath, JointGraph, JointNode, cut_saved, forward_sources, \
    least_alternatives, least_peak, plan_saved, predict, search_starts, torch_default_saved, \
    valley_saved
from solver.errors import InfeasibleBudgetError

K = 1000


def chain() -> JointGraph:
    """x -> a1 -> a2 -> a3 -> out (1000 bytes each but out, 10), pointwise; the backward reads
    each a_i once, last-in first-out, as autograd would: g3(t, a3), g2(g3, a2), g1(g2, a1)."""
    n = [JointNode("x", "primal"), JointNode("w", "primal"),
         JointNode("a1", "forward", ("x",), (K,), candidate=True),
         JointNode("a2", "forward", ("a1",), (K,), candidate=True),
         JointNode("a3", "forward", ("a2", "w"), (K,), candidate=True, flops=10**6),
         JointNode("out", "forward", ("a3",), (10,), candidate=True),
         JointNode("t", "tangent", out_bytes=(10,)),
         JointNode("g3", "backward", ("t", "a3"), (K,)),
         JointNode("g2", "backward", ("g3", "a2"), (K,)),
         JointNode("g1", "backward", ("g2", "a1"), (K,)),
         JointNode("gw", "backward", ("g1", "x"), (100,))]
    return JointGraph(nodes=tuple(n), forward_outputs=("out",), backward_outputs=("gw",),
                      fixed_bytes=200)


def test_default_partition_saves_what_the_backward_reads():
    g = chain()
    assert torch_default_saved(g) == {"a1", "a2", "a3"}
    p = predict(g, torch_default_saved(g))
    # forward: a1, a2, a3 held, out: 3010. backward: tangent 10 -> 3020; g3 +1000 = 4020 (peak),
    # then a3 is freed at its last use.
    assert (p.transient_peak_bytes, p.peak_bytes, p.where) == (4020, 4220, "backward:g3")
    assert p.recomputed == () and p.recompute_cost == 0


def test_recomputing_a_value_moves_it_to_its_first_use():
    g = chain()
    p = predict(g, {"a2", "a3"})
    # a1 is freed after a2 ran (forward peak 2000); the backward runs g3 at 2000 + 10 + 10 +
    # 1000 = 3020 (peak) and recomputes a1 just before g1: a2 is gone by then (1000 + g2 + a1 +
    # g1 = ... < 3020).
    assert (p.transient_peak_bytes, p.where) == (3020, "backward:g3")
    # unmeasured: the nominal roofline, 1000 bytes at 10 GB/s
    assert p.recomputed == ("a1",) and p.recompute_cost == pytest.approx(K / 1e10)


def test_a_measured_time_is_the_cost():
    n = [x if x.name != "a3" else JointNode("a3", "forward", ("a2", "w"), (K,), candidate=True,
                                           flops=10**6, seconds=0.5) for x in chain().nodes]
    g = JointGraph(nodes=tuple(n), forward_outputs=("out",), backward_outputs=("gw",))
    assert predict(g, {"a1", "a2"}).recompute_cost == 0.5


def test_a_matmul_costs_its_flops():
    g = chain()
    p = predict(g, {"a1", "a2"})   # a3 recomputed from a2 (saved) and w (a primal)
    assert p.recomputed == ("a3",) and p.recompute_cost == pytest.approx(10**6 / 1e11 + K / 1e10)


def test_a_view_saves_its_base_storage():
    n = list(chain().nodes)
    n.insert(3, JointNode("v1", "forward", ("a1",), (), alias=("a1", 0), candidate=True))
    n[n.index(next(x for x in n if x.name == "g1"))] = JointNode("g1", "backward", ("g2", "v1"),
                                                                 (K,))
    g = JointGraph(nodes=tuple(n), forward_outputs=("out",), backward_outputs=("gw",),
                   fixed_bytes=200)
    assert torch_default_saved(g) == {"v1", "a2", "a3"}
    # saving the view keeps a1's 1000 bytes, as saving a1 would
    assert predict(g, {"v1", "a2", "a3"}).transient_peak_bytes == 4020


def test_search_meets_the_budget_at_the_least_cost():
    g = chain()
    plan = plan_saved(g, 3220)
    assert plan.prediction.peak_bytes <= 3220
    assert plan.default.peak_bytes == 4220
    # recomputing a1 alone (0.1 us) meets 3220; a3 would cost its FLOPs too (10 us)
    assert plan.prediction.recomputed == ("a1",)
    assert plan_saved(g, 4220).prediction.recomputed == ()


def test_a_budget_below_the_least_raises_with_the_least():
    g = chain()
    least = least_peak(g).peak_bytes
    with pytest.raises(InfeasibleBudgetError) as e:
        plan_saved(g, least - 1)
    assert e.value.min_budget == least and e.value.budget == least - 1
    assert "raise the budget to at least that" in str(e.value)
    assert plan_saved(g, least).prediction.peak_bytes == least


def test_a_saved_set_must_name_forward_values():
    with pytest.raises(ValueError, match="not savable forward values"):
        predict(chain(), {"g3"})


def test_the_least_is_the_lower_of_the_two_greedy_paths_and_a_plan_fits_it():
    g = chain()
    by_cost, _ = GreedyPath(g, search_starts(g)[0], 8, True).walk(-1)
    by_gain, _ = GreedyPath(g, search_starts(g)[0], 8, False).walk(-1)
    least = least_peak(g).peak_bytes
    assert least == min(by_cost.peak_bytes, by_gain.peak_bytes)
    assert plan_saved(g, least).prediction.peak_bytes <= least


def test_the_search_starts_from_the_compilers_own_partition_where_given():
    g = chain()
    # from torch's default partition, meeting 3220 takes one move (recompute a1)
    assert plan_saved(g, 3220).steps == 1
    # from a start that already recomputes a1 (Inductor's min-cut, say), none
    started = dataclasses.replace(g, start=frozenset({"a2", "a3"}))
    assert search_starts(started)[0].recomputed == ("a1",)
    plan = plan_saved(started, 3220)
    assert plan.steps == 0 and plan.prediction.recomputed == ("a1",)


def test_where_the_compilers_start_stops_above_the_budget_the_search_starts_from_save_all():
    g = chain()
    # saving a3 alone, a1 and a2 are recomputed in the backward beside a3 (4220); the greedy
    # only stops saving values, so from there it stays at 4220
    stuck = dataclasses.replace(g, start=frozenset({"a3"}))
    cur, _ = GreedyPath(stuck, search_starts(stuck)[0], 8, True).walk(-1)
    assert (cur.peak_bytes, cur.saved) == (4220, {"a3"})
    # from torch's default partition it reaches 3220 (recompute a1), and a plan fits that
    assert least_peak(stuck).peak_bytes == least_peak(g).peak_bytes == 3220
    assert plan_saved(stuck, 3220).prediction.recomputed == ("a1",)


def test_the_near_least_plans_are_where_every_path_ends_lowest_first():
    stuck = dataclasses.replace(chain(), start=frozenset({"a3"}))
    ends = {GreedyPath(stuck, s, 8, by_cost).walk(-1)[0].saved
            for s in search_starts(stuck) for by_cost in (True, False)}
    alts = least_alternatives(stuck)
    assert len(alts) == len(ends) > 1 and {p.saved for p in alts} == ends
    assert [p.peak_bytes for p in alts] == sorted(p.peak_bytes for p in alts)
    assert alts[0].peak_bytes == least_peak(stuck).peak_bytes == 3220
    assert {"a3"} in [p.saved for p in alts if p.peak_bytes == 4220]  # min-cut's stuck end


def dense_block() -> JointGraph:
    """A dense block of three layers: layer k concatenates every feature before it (catk, 100k
    bytes), widens it (hk, 1000, a matmul) and makes its feature fk (100). The backward reads
    each layer's hk and catk, last layer first."""
    n = [JointNode("x", "primal"), JointNode("w", "primal"),
         JointNode("f0", "forward", ("x",), (100,), candidate=True)]
    for k in (1, 2, 3):
        n += [JointNode(f"cat{k}", "forward", tuple(f"f{i}" for i in range(k)), (100 * k,),
                        candidate=True),
              JointNode(f"h{k}", "forward", (f"cat{k}", "w"), (K,), candidate=True, flops=10**6),
              JointNode(f"f{k}", "forward", (f"h{k}",), (100,), candidate=True)]
    n += [JointNode("out", "forward", ("f3",), (10,), candidate=True),
          JointNode("t", "tangent", out_bytes=(10,))]
    upstream = "t"
    for k in (3, 2, 1):
        n += [JointNode(f"b{k}", "backward", (upstream, f"h{k}"), (K,)),
              JointNode(f"d{k}", "backward", (f"b{k}", f"cat{k}"), (100 * k,))]
        upstream = f"d{k}"
    n.append(JointNode("gx", "backward", (upstream, "x"), (10,)))
    return JointGraph(nodes=tuple(n), forward_outputs=("out",), backward_outputs=("gx",))


def test_the_valleys_values_are_each_layers_features_where_no_single_value_is_a_boundary():
    g = dense_block()
    # carried on after each node: f0 100; cat1 +100; h1 f0+h1 1100; f1 f0+f1 200 (a valley);
    # cat2 400; h2 1200; f2 300 (a valley); cat3 300 (f0-f2 read last; not below f2's 300);
    # h3 1000; f3 100 (out, after it, carries nothing: not a valley)
    assert valley_saved(g) == {"f0", "f1", "f2"}
    # boundaries: where one value alone carries the forward on
    assert cut_saved(g) == {"f0", "cat3", "h3", "f3"}
    valley = search_starts(g)[2]
    assert valley.saved == {"f0", "f1", "f2"}
    # the backward recomputes each layer from them before its gradients; at b2: f0 100 (f1 was
    # read last by cat2), out and the tangent 20, d3 300, cat2 200, h2 1000, b2 1000
    assert (valley.transient_peak_bytes, valley.where) == (2620, "backward:b2")
    assert least_peak(g).peak_bytes <= valley.peak_bytes


def test_a_valleys_value_made_by_a_multi_output_op_is_saved_through_its_getitem():
    # f1 made as output 0 of a two-output op (a BatchNorm's result and its statistics), read
    # through a getitem, as AOTAutograd writes it: one start leaves it out, the next names the
    # getitem
    n = []
    for node in dense_block().nodes:
        if node.name == "f1":
            n += [JointNode("bn1", "forward", ("h1",), (100, 4), multi=2),
                  JointNode("f1", "forward", ("bn1",), (), alias=("bn1", 0), candidate=True)]
        else:
            n.append(node)
    g = dataclasses.replace(dense_block(), nodes=tuple(n))
    assert valley_saved(g) == {"f0", "f2"}
    assert valley_saved(g, through_getitems=True) == {"f0", "f1", "f2"}
    assert [s.saved for s in search_starts(g)[2:]] == [{"f0", "f2"}, {"f0", "f1", "f2"}]


def test_a_second_budget_on_the_same_graph_walks_on_from_the_kept_paths():
    g = dense_block()
    least = least_peak(g).peak_bytes
    assert any(key[0] == "path" for key in g.search_memo)
    default = predict(g, torch_default_saved(g)).peak_bytes
    for budget in (least, (least + default) // 2, default):
        assert plan_saved(g, budget) == plan_saved(dataclasses.replace(g), budget)


def test_a_saved_backward_node_stands_for_the_forward_values_it_reads():
    # min-cut computes a backward node that reads no tangent (a3's transpose, a1's rsqrt / N)
    # in the forward and saves it: the forward value it reads is what stays saved
    n = list(chain().nodes)
    n.insert(7, JointNode("t3", "backward", ("a3",), (), alias=("a3", 0)))
    n.insert(8, JointNode("d1", "backward", ("a1", "w"), (K,)))
    g = JointGraph(nodes=tuple(n), forward_outputs=("out",), backward_outputs=("gw",),
                   fixed_bytes=200)
    assert forward_sources(g, ["t3", "d1", "a2", "w", "missing"]) == {"a3", "a1", "a2"}


def test_a_saved_output_of_a_recomputed_multi_output_op_is_the_forwards_until_its_last_use():
    """bn makes y (1000 B) and its statistic m (10 B); the forward saves c and y, so the
    backward recomputes bn for m while the forward's y stays until gc reads it."""
    n = [JointNode("x", "primal"),
         JointNode("c", "forward", ("x",), (K,), candidate=True),
         JointNode("bn", "forward", ("c",), (K, 10), multi=2),
         JointNode("y", "forward", ("bn",), (), alias=("bn", 0), candidate=True),
         JointNode("m", "forward", ("bn",), (), alias=("bn", 1), candidate=True),
         JointNode("out", "forward", ("y",), (10,), candidate=True),
         JointNode("t", "tangent", out_bytes=(10,)),
         JointNode("gy", "backward", ("t",), (K,)),
         JointNode("gc", "backward", ("gy", "c", "m", "y"), (10,)),
         JointNode("gx", "backward", ("gc", "x"), (100,))]
    g = JointGraph(nodes=tuple(n), forward_outputs=("out",), backward_outputs=("gx",))
    p = predict(g, {"c", "y"})
    assert p.recomputed == ("bn", "m")
    # forward: c 1000, bn 1010 (m's 10 freed), out 10: 2010. backward: t 10 -> 2020; gy +1000
    # = 3020; bn again +1010 = 4030 (peak) beside the forward's y, its own y freed at once
    # (3030); gc +10 frees gy, c, m and the forward's y: 30; gx 130.
    assert (p.transient_peak_bytes, p.where) == (4030, "backward:bn")
