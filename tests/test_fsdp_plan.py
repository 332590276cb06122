"""Planning one rank of FSDP2 where it cannot be run: the per-rank graph of a model sharded per
block (as torchtitan shards a transformer) on the meta device with analytical costs, its figures
at 1/N, its repeated blocks, and `--fsdp` on the command line. (The per-rank peaks against the
allocator's events on gloo ranks: tests/test_fsdp_memory.py.)"""

from __future__ import annotations

import math

import pytest
import torch

import monetlike
import solver
from monetlike.cli import main
from monetlike.llama_tiny import llama_tiny
from monetlike.profile.fsdp import FSDPConfig, block_units, per_rank_graph
from solver.rules.blocks import find_blocks
from solver.units import format_bytes

LAYERS, WORLD = 8, 4
SIZES = dict(layers=LAYERS, vocab=16, dim=32, heads=2, hidden=64)


@pytest.fixture(scope="module")
def graphs():
    with torch.device("meta"):  # a small vocabulary: the blocks outweigh the root
        model = llama_tiny(**SIZES)
    x = torch.empty(2, 8, dtype=torch.long, device="meta")
    plain = monetlike.profile(model, x, cost="analytical:A100-40GB", optimizer="adam",
                              impls=False)
    config = FSDPConfig.per_block(model, WORLD)
    return model, plain, per_rank_graph(plain, model, config, optimizer_multiplier=2)


def test_per_block_units_are_the_block_list():
    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.small = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.body = torch.nn.Module()
            self.body.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    assert block_units(Nested()) == ("body.blocks.0", "body.blocks.1", "body.blocks.2")
    assert block_units(torch.nn.Linear(2, 2)) == ()
    with torch.device("meta"):
        model = llama_tiny(**SIZES)
    config = FSDPConfig.per_block(model, WORLD, param_dtype=torch.bfloat16)
    assert config.units == tuple(f"layers.{i}" for i in range(LAYERS))
    assert config.param_dtype == torch.bfloat16


def test_per_rank_figures_are_one_nth(graphs):
    model, plain, graph = graphs
    f = graph.meta["fsdp"]["per_rank"]
    shard = sum(math.ceil(p.shape[0] / WORLD) * (p.numel() // p.shape[0]) * 4
                for p in model.parameters())
    assert f["sharded_params"] == f["sharded_grads"] == shard
    assert f["unsharded_params"] == 4 * sum(p.numel() for p in model.parameters())
    assert graph.param_bytes == plain.param_bytes - f["unsharded_params"] + shard
    # Adam: two states per element of rank 0's shard (every dim 0 here is a multiple of WORLD)
    assert f["optimizer"] == graph.optimizer_bytes == 2 * shard
    block = sum(p.numel() for p in model.layers[0].parameters()) * 4
    assert f["largest_unit_unsharded"] == block
    assert f["root_unsharded"] == f["unsharded_params"] - LAYERS * block


def test_backward_workspace_grows_only_where_a_unit_is_all_gathered(graphs):
    """Regression: once the reduced blocks' shards fell below their unsharded gradients (the
    levels are relative), every later stage got that difference as workspace, and the layers
    no longer looked alike."""
    _, plain, graph = graphs
    grown = {graph.stage_of_op[op.id] for op, was in zip(graph.ops, plain.ops)
             if op.id in graph.stage_of_op
             and op.impls[0].bwd_workspace != was.impls[0].bwd_workspace}
    # the loss's stage, each block's first (its all-gathers, the reduce-scatter of the block
    # after it), and the stage after the last block's reduce-scatter
    assert len(grown) <= LAYERS + 2
    chain = find_blocks(graph)
    # alike but the first and last in the backward: no reduce-scatter before the first, the
    # last's stage prefetches nothing
    assert max(len(c.members) for c in chain.classes) >= LAYERS - 2


def test_cli_plans_one_rank(tmp_path, capsys):
    spec = tmp_path / "tiny.py"
    spec.write_text(
        "import torch\nfrom monetlike.llama_tiny import llama_tiny\n\n"
        "def build():\n"
        f"    m = llama_tiny(**{SIZES!r})\n"
        "    m.example_inputs = lambda batch, seq_len=None, device=None: torch.zeros(\n"
        "        batch, seq_len or 8, dtype=torch.long, device=device)\n"
        "    return m\n")
    out = tmp_path / "g.json"
    assert main(["profile", f"{spec}:build", "--batch", "2", "--input-shape", "8", "--fsdp",
                 str(WORLD), "--cost", "analytical:A100-40GB", "--optimizer", "adam",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    graph = solver.OpGraph.load(str(out))
    f = graph.meta["fsdp"]
    assert f["world_size"] == WORLD and f["param_dtype"] == "torch.bfloat16"
    assert len(f["units"]) == LAYERS
    assert (f"FSDP2 per rank ({WORLD} ranks; {LAYERS} block units and the root; param_dtype "
            f"torch.bfloat16" in text)
    assert f"{format_bytes(f['per_rank']['sharded_params'])} sharded (1/{WORLD})" in text
    # --fsdp with a profiled graph is a contradiction
    assert main(["solve", "--graph", str(out), "--budget", "1GiB", "--fsdp", "2"]) == 2
    assert "--fsdp" in capsys.readouterr().err


def test_a_graph_too_large_for_the_milp_gets_the_best_rule_and_its_bound(graphs, monkeypatch):
    from solver.analysis import GraphFacts
    from solver.rules.segments import block_schedule
    from solver.search import pipeline

    _, _, graph = graphs
    base = solver.simulate(graph, solver.store_all_schedule(graph))
    peer = solver.simulate(graph, block_schedule(graph, GraphFacts(graph, "full")))
    budget = (base.peak_bytes + peer.peak_bytes) // 2
    monkeypatch.setattr(pipeline, "MAX_MILP_CELLS", 1)  # every graph is too large
    r = solver.solve(graph, budget, time_limit_s=30, mip_gap=1e-9)
    assert r.stats["search"].startswith("skipped: the MILP")
    tl = solver.simulate(graph, r.schedule)
    assert tl.peak_bytes == r.predicted_peak_bytes <= budget
    lower = r.stats["lower_bound_s"]
    assert lower <= tl.total_time
    assert r.mip_gap == pytest.approx((tl.total_time - lower) / tl.total_time)
    assert r.status == ("optimal" if r.mip_gap <= 1e-9 else "feasible-at-time-limit")
