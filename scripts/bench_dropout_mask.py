"""What the 1-byte dropout mask (the `dropout_mask` Impl) buys on the CPU, side by side in one run.

    python scripts/bench_dropout_mask.py                 # writes its section of docs/BENCHMARKS.md
    python scripts/bench_dropout_mask.py --no-write      # print only

On the CPU, PyTorch's dropout holds its scaled noise in the input's dtype (4 bytes per element in
fp32) until the backward; `dropout_mask` holds a bool mask instead (monetlike/impls/dropout.py).
One MLP with dropout after every hidden layer is profiled once with measured CPU costs; the same
graph is solved in full mode at fractions of its store-all peak twice: as profiled, and with the
`dropout_mask` Impls removed (what the solver could do before). Overheads are predicted (the
simulator's step time over store-all's), so both columns use the same measured op costs.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import monetlike  # noqa: E402
import solver  # noqa: E402
from bench_doc import header_with_commit, replace_section  # noqa: E402
from bench_solver import markdown_table  # noqa: E402

FRACTIONS = (0.97, 0.93, 0.90, 0.87)


def _solve(graph, budget, base_time, time_limit):
    try:
        r = solver.solve(graph, budget, mode="full", time_limit_s=time_limit)
    except solver.InfeasibleBudgetError:
        return None, None, None
    masks = sum(graph.ops[j].impls[k].name == "dropout_mask" for j, k in enumerate(r.schedule.impl))
    return 100 * (r.predicted_time / base_time - 1), 100 * r.mip_gap, masks


def run(width: int, layers: int, batch: int, time_limit: float) -> pd.DataFrame:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)]
    model = nn.Sequential(*mods, nn.Linear(width, 1)).train()
    x = torch.randn(batch, width)
    with_mask = monetlike.profile(model, x, cost="measured", repeat=3)
    plain = with_mask.without_impl("dropout_mask")  # the last Impl of its Ops
    base = solver.simulate(with_mask, solver.store_all_schedule(with_mask))
    rows = []
    for f in FRACTIONS:
        budget = int(base.peak_bytes * f)
        a = _solve(with_mask, budget, base.total_time, time_limit)
        b = _solve(plain, budget, base.total_time, time_limit)
        rows.append({"budget (MiB)": round(budget / 2**20, 2), "of store-all": f"{f:.0%}",
                     "with mask: overhead %": a[0], "gap %": a[1], "masks used": a[2],
                     "without: overhead %": b[0], "gap %  ": b[1]})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    ap.add_argument("--layers", type=int, default=4, help="Linear-GELU-Dropout layers")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    args = ap.parse_args(argv)
    df = run(args.width, args.layers, args.batch, args.time_limit)
    table = markdown_table(df.round(2).astype(object).where(df.notna(), ""))
    body = "\n".join([header_with_commit("bench_dropout_mask.py", argv), "",
                      f"MLP {args.layers} x (Linear {args.width} - GELU - Dropout 0.1) - Linear 1, "
                      f"batch {args.batch}, fp32, measured CPU costs; full mode, "
                      f"{args.time_limit:g} s per solve. Empty: infeasible.", "", table])
    print(body)
    if not args.no_write:
        replace_section("dropout-mask", body)


if __name__ == "__main__":
    main()
