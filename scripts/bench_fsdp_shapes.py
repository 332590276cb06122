"""One rank of FSDP2 on today's large shapes (issue 53): our plan against per-block checkpointing.

    python scripts/bench_fsdp_shapes.py                       # 8B on 8 ranks, 70B on 64
    python scripts/bench_fsdp_shapes.py --shapes llama3_8b --budgets peer --time-limit 60

Each shape (monetlike.hf_models, built on the meta device) is profiled at batch 1 x 8192 tokens
with analytical H100-80GB costs as one rank of FSDP2 as torchtitan shards it: every decoder layer
a fully_shard unit, then the root, bf16 parameters (MixedPrecisionPolicy(param_dtype=bfloat16)),
AdamW state, the model's own loss (`FSDPConfig.per_block`, `--loss model`). The peer is
torchtitan-style per-block full checkpointing (each decoder layer checkpointed: its input kept,
its inside recomputed at its backward; solver.rules.segments.block_schedule), replayed by the
simulator. Each row is one solve: at the peer's own predicted peak (`peer`), and at budgets in
bytes (`60GiB`); the overheads are predicted step times over store-all's (plain PyTorch), our
gap to the proven lower bound and the bound itself. Rows are appended to a JSON-lines file as
they finish; the table goes to the "fsdp-shapes" section of docs/BENCHMARKS.md. CI does not run
this (each solve takes minutes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_doc import append_row, names_from, replace_section  # noqa: E402
from bench_solver import parse_solve_args, pct_over, rows_section, timed_solve  # noqa: E402
from solver import format_bytes, simulate, store_all_schedule  # noqa: E402
from solver.analysis import GraphFacts  # noqa: E402
from solver.rules.segments import block_schedule  # noqa: E402
from solver.units import parse_bytes  # noqa: E402

# shape -> FSDP2 ranks
SHAPES = {"llama3_8b": 8, "llama_70b": 64}
COST = "analytical:H100-80GB"
BATCH, SEQ = 1, 8192


def profile(name: str, ranks: int):
    """(the per-rank graph, seconds the profile took)."""
    import torch

    import monetlike
    import monetlike.models
    from monetlike.modelspec import model_loss

    with torch.device("meta"):
        model = getattr(monetlike.models, name)()
    started = time.perf_counter()
    fsdp = monetlike.FSDPConfig.per_block(model, ranks, param_dtype=torch.bfloat16)
    graph = monetlike.profile(model, model.example_inputs(BATCH, SEQ, device="meta"), cost=COST,
                              optimizer="adam", loss_fn=model_loss, fsdp=fsdp)
    return graph, time.perf_counter() - started


def run_one(name: str, ranks: int, graph, profile_s: float, budget_arg: str, args) -> dict:
    base = simulate(graph, store_all_schedule(graph))
    peer = simulate(graph, block_schedule(graph, GraphFacts(graph, "full")))
    budget = peer.peak_bytes if budget_arg == "peer" else parse_bytes(budget_arg)
    per_rank = graph.meta["fsdp"]["per_rank"]
    row = {"shape": name, "ranks": ranks, "ops": len(graph.ops), "budget_of": budget_arg,
           "budget": format_bytes(budget), "store_all_peak": format_bytes(base.peak_bytes),
           "sharded_params": format_bytes(per_rank["sharded_params"]),
           "optimizer": format_bytes(per_rank["optimizer"]),
           "peer_peak": format_bytes(peer.peak_bytes),
           "peer_overhead_pct": pct_over(peer.total_time, base.total_time),
           "profile_s": round(profile_s, 1), "commit": args.commit}

    def columns(r):
        st = r.stats
        ours = pct_over(r.predicted_time, base.total_time)
        return dict(
            status=r.status, peak=format_bytes(r.predicted_peak_bytes), overhead_pct=ours,
            vs_peer=None if not row["peer_overhead_pct"] else
            round(ours / row["peer_overhead_pct"], 3),
            gap_pct=None if r.mip_gap is None else round(100 * r.mip_gap, 2),
            bound_pct=pct_over(st.get("lower_bound_s"), base.total_time),
            first_s=st.get("first_incumbent_s"), best_s=st.get("best_found_s"),
            solve_s=round(r.solve_time_s, 1), source=st.get("incumbent_source"))

    timed_solve(graph, budget, args, row, columns)
    return row


# the table's columns, in order (a row may lack some)
COLUMNS = ("shape", "ranks", "ops", "budget_of", "budget", "store_all_peak",
           "peer_peak", "peer_overhead_pct", "status", "peak", "overhead_pct",
           "vs_peer", "gap_pct", "bound_pct", "first_s", "best_s", "solve_s",
           "source", "profile_s", "rss_gib", "cpu_pct", "commit")


def render(rows: list[dict], args) -> str:
    notes = f"""
        Batch {BATCH} x {SEQ} tokens, one rank of FSDP2 (every decoder layer a fully_shard
        unit and the root, bf16 parameters, AdamW state, the model's own loss), {COST} costs
        (a plan for a GPU this machine does not have). Time limit {args.time_limit:g} s per
        solve, target gap {100 * args.mip_gap:g}%. peer: per-block full checkpointing (each
        decoder layer checkpointed, as torchtitan's activation checkpointing 'full');
        budget_of: 'peer' solves at the peer's own predicted peak. Overheads: predicted step
        time over store-all's (plain PyTorch); vs_peer: ours over the peer's. gap_pct: to
        the proven lower bound, bound_pct: that bound over store-all (no schedule within the
        budget is faster). profile_s: the profile (capture and analytical costs); rss_gib:
        the process's peak resident memory so far (profile included); cpu_pct: CPU time over
        wall time on all cores."""
    return rows_section(rows, "bench_fsdp_shapes.py", COLUMNS, notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budgets", default="peer",
                    help="comma-separated: 'peer' (the per-block checkpointing peak) or bytes")
    args = parse_solve_args(ap, argv, "monetlike_bench_fsdp_shapes.jsonl")
    shapes = names_from(ap, args.shapes, SHAPES, "shapes")
    rows = []
    for name in shapes:
        graph, profile_s = profile(name, SHAPES[name])
        for budget in (b for b in args.budgets.split(",") if b):
            append_row(rows, run_one(name, SHAPES[name], graph, profile_s, budget, args),
                       args.results)
            if not args.no_write:  # row by row: a run stopped early still leaves its rows
                replace_section("fsdp-shapes", render(rows, args))
    print(render(rows, args))
    return 0

if __name__ == "__main__":
    sys.exit(main())
