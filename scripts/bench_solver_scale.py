"""Solver at scale (issue 20): big graphs at fractions of their store-all peak.

    python scripts/bench_solver_scale.py                      # every row, 300 s per solve
    python scripts/bench_solver_scale.py --models gpt12 --fractions 0.5 --time-limit 60

Models (profiled on the meta device with analytical A100-40GB costs): a GPT with fine-grained
ops (monetlike.models.transformer: d 768, 12 heads, sequence 1024, batch 8, dropout 0.1) at 12,
24 and 48 layers, and torchvision's DenseNet-121 and -169 at batch 64 (3x224x224). Each row is
one solve at a fraction of store-all: the seconds to the first schedule, to the final one and to
the end, the gap to the proven bound, the predicted overhead over store-all, the best simple
rule's overhead (the first incumbent: store-all, Chen's and the cut segments, per-block and
repeated-block checkpointing, the ranked and greedy rules), where the answer came from, the size
of the MILP, and the process's peak resident memory after the solve (the solver's own memory).
Rows are appended to a JSON-lines file as they finish; the table goes to the "solver-scale"
section of docs/BENCHMARKS.md. CI does not run this.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_doc import append_row, names_from, publish, replace_section  # noqa: E402
from bench_solver import parse_solve_args, pct_over, rows_section, timed_solve  # noqa: E402
from solver import format_bytes, simulate, store_all_schedule  # noqa: E402

MODELS = ("gpt12", "gpt24", "gpt48", "densenet121", "densenet169")


def profile(name: str):
    import torch
    import torchvision

    import monetlike
    from monetlike.models import transformer

    if name.startswith("gpt"):
        model = transformer(depth=int(name[3:]), dim=768, heads=12, dropout=0.1)
        x = torch.randn(8, 1024, 768, device="meta")
    else:
        model = getattr(torchvision.models, name)()
        x = torch.randn(64, 3, 224, 224, device="meta")
    return monetlike.profile(model, x, cost="analytical:A100-40GB")


def run_one(name: str, graph, fraction: float, args) -> dict:
    base = simulate(graph, store_all_schedule(graph))
    budget = int(base.peak_bytes * fraction)
    row = {"model": name, "ops": len(graph.ops), "fraction": fraction,
           "budget": format_bytes(budget), "commit": args.commit}

    def columns(r):
        st = r.stats
        rule = st.get("heuristic_objective_s")
        return dict(
            status=r.status, first_s=st.get("first_incumbent_s"), best_s=st.get("best_found_s"),
            solve_s=round(r.solve_time_s, 1),
            gap_pct=None if r.mip_gap is None else round(100 * r.mip_gap, 2),
            overhead_pct=round(100 * (r.predicted_time / base.total_time - 1), 2),
            rule_pct=None if rule is None else round(100 * (rule / base.total_time - 1), 2),
            rule=st.get("heuristic"), source=st.get("incumbent_source"),
            bound_pct=pct_over(st.get("lower_bound_s"), base.total_time),
            stage_bound_pct=pct_over(st.get("stage_bound_s"), base.total_time),
            nonzeros=st.get("nonzeros"), build_s=st.get("build_s"))

    r = timed_solve(graph, budget, args, row, columns)
    if r is not None and r.stats.get("structured") is not None:
        # the block-copy strategy's tally (JSON lines only)
        row["structured"] = r.stats["structured"]
    return row


# the table's columns, in order (a row may lack some)
COLUMNS = ("model", "ops", "fraction", "budget", "status", "first_s", "best_s",
           "solve_s", "gap_pct", "overhead_pct", "bound_pct", "stage_bound_pct",
           "rule_pct", "rule", "source",
           "nonzeros", "build_s", "rss_gib", "cpu_pct", "commit", "note")


def render(rows: list[dict], args) -> str:
    notes = f"""
        Time limit {args.time_limit:g} s per solve, target gap {100 * args.mip_gap:g}%,
        analytical A100-40GB costs. fraction: budget over the store-all peak. overhead_pct:
        the answer's predicted step time over store-all; rule_pct: the best simple rule's
        (the first incumbent). gap_pct: to the proven lower bound (empty: none proven);
        bound_pct: that bound over store-all, stage_bound_pct: the stage bound's
        (solver/stage_bound.py). build_s: seconds before the search could start (the rules
        and the MILP's build). rss_gib: the process's peak resident memory so far (profiles
        included). cpu_pct: CPU time over wall time on all cores (well under 100: other
        processes shared them)."""
    return rows_section(rows, "bench_solver_scale.py", COLUMNS, notes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--fractions", default="0.5,0.33")
    args = parse_solve_args(ap, argv, "monetlike_bench_solver_scale.jsonl")
    models = names_from(ap, args.models, MODELS, "models")
    rows = []
    for name in models:
        graph = profile(name)
        for fraction in (float(f) for f in args.fractions.split(",")):
            append_row(rows, run_one(name, graph, fraction, args), args.results)
            if not args.no_write:  # row by row, so a run stopped early still leaves its rows
                replace_section("solver-scale", render(rows, args))
    publish("solver-scale", render(rows, args), not args.no_write)
    return 0

if __name__ == "__main__":
    sys.exit(main())
