"""GPT-2-small shape (12 layers, d 768, seq 1024, batch 8, AdamW), analytical A100-40GB costs:
store-all, Hugging Face-style block checkpointing expressed as a schedule of ours, and ours at
that same memory and at half of it. Prints a table (docs/BENCHMARKS.md keeps it).

    python scripts/bench_hf_gpt2.py --time-limit 60

Profiled on the meta device from the named shape (monetlike.models.gpt2, captured by
torch.export); nothing is downloaded and no activation is allocated. "HF checkpointing" keeps the
residual stream at each block boundary (and what lies outside the blocks) and recomputes
everything inside a block once, at that block's backward, holding it until its last use: what
`gradient_checkpointing_enable()` does per GPT2Block. Blocks are found from the export's
`nn_module_stack` of each Op's first node.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import monetlike  # noqa: E402
import monetlike.hf_models as hf  # noqa: E402
import solver  # noqa: E402
from monetlike.capture.api import capture  # noqa: E402
from runtime_support import keep_schedule  # noqa: E402
from solver.baselines import store_all  # noqa: E402
from solver.simulate import simulate  # noqa: E402


def block_of(node) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = re.search(r"transformer\.h\.(\d+)$", path) or re.search(r"h\.(\d+)$", path)
        if m:
            return int(m.group(1))
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60, help="solver seconds per budget")
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    args = ap.parse_args(argv)
    with torch.device("meta"):
        model = hf.gpt2()
    batch = model.example_inputs(args.batch, args.seq)
    t0 = time.perf_counter()
    graph = monetlike.profile(model, batch, cost="analytical:A100-40GB", optimizer="adamw")
    print(f"profiled in {time.perf_counter() - t0:.1f} s: {len(graph.ops)} ops, capture "
          f"{graph.meta['capture']}")
    meta = {k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}
    gm, _ = capture(model, (), meta, mode="export")
    nodes = {n.name: n for n in gm.graph.nodes}
    op_block = [block_of(nodes[op.nodes[0]]) for op in graph.ops]
    consumers: dict[int, set] = {}
    for op in graph.ops:
        for v in op.inputs:
            consumers.setdefault(v, set()).add(op_block[op.id])
    keep = set()
    for v in graph.values:
        if v.producer is None:
            continue
        b = op_block[v.producer]
        if b is None or any(c != b for c in consumers.get(v.id, ())):
            keep.add(v.id)  # outside the blocks, or crossing a block boundary
    base = store_all(graph)
    hf_sched = keep_schedule(graph, lambda v: v in keep, "hf-checkpointing", hold="last_use")
    hf_t = simulate(graph, hf_sched)
    rows = [("store-all (plain PyTorch)", base.predicted_peak_bytes, base.predicted_time,
             None, 0.0),
            ("HF block checkpointing", hf_t.peak_bytes, hf_t.total_time, None, 0.0)]
    for label, budget in (("ours at HF's memory", hf_t.peak_bytes),
                          ("ours at half of HF's memory", hf_t.peak_bytes // 2)):
        t0 = time.perf_counter()
        try:
            r = solver.solve(graph, budget, time_limit_s=args.time_limit)
            rows.append((f"{label} ({r.status})", r.predicted_peak_bytes, r.predicted_time,
                         r.mip_gap, time.perf_counter() - t0))
        except solver.InfeasibleBudgetError as e:
            rows.append((f"{label}: infeasible ({e})", budget, None, None,
                         time.perf_counter() - t0))
    print(f"GPT-2 small shape, batch {args.batch} x {args.seq}, AdamW, analytical:A100-40GB")
    print("| schedule | peak GiB | step s | overhead | gap | solve s |")
    print("|---|---|---|---|---|---|")
    for label, peak, t, gap, secs in rows:
        over = "" if t is None else f"{t / base.predicted_time - 1:+.1%}"
        print(f"| {label} | {peak / 2**30:.2f} | {'' if t is None else f'{t:.4f}'} | {over} | "
              f"{'' if gap is None else f'{gap:.1%}'} | {secs:.1f} |")


if __name__ == "__main__":
    main()
