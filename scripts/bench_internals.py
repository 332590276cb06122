"""What recompute_internals buys on models whose memory is internal to torch.nn leaf modules.

    python scripts/bench_internals.py                     # writes the "Internals" section
    python scripts/bench_internals.py --time-limit 30 --no-write

torch.fx keeps `nn.TransformerEncoderLayer`, `nn.MultiheadAttention` and the RNNs whole (modules
of torch.nn are leaves), so everything their backward holds is internal to one Op and no
keep/recompute decision can drop it: checkpoint mode cannot go below store-all. The
`recompute_internals` Impl (monetlike/impls/internals.py) holds the Op's inputs instead and runs
its forward again at its backward stage. Per model (analytical A100-40GB costs, meta-device
profile): the store-all peak, the minimum feasible budget in checkpoint mode, in full mode
without this Impl and in full mode (`solver.min_budget`), and the predicted overhead over
store-all at budgets of 1/2 and 1/3 of the store-all peak in each. Hand-written attention
(`gpt6_768`) is the same problem in small: its matmuls hold copies of their permuted operands.
CI does not run this (tests/test_impls_internals.py checks the Impl itself).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import monetlike  # noqa: E402
import solver  # noqa: E402
from solver import format_bytes, simulate, store_all_schedule  # noqa: E402

COST = "analytical:A100-40GB"
NAME = "recompute_internals"


class EncoderStack(nn.Module):
    """`depth` nn.TransformerEncoderLayer (BERT-base-like width) and a classifier head."""

    def __init__(self, depth: int = 6, dim: int = 768, heads: int = 12, dropout: float = 0.1):
        super().__init__()
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout,
                                                                batch_first=True)
                                     for _ in range(depth)])
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x[:, 0])


class AttentionStack(nn.Module):
    """nn.MultiheadAttention with its default need_weights=True (the attention probabilities
    are kept and returned), interleaved with Linear layers."""

    def __init__(self, depth: int = 6, dim: int = 512, heads: int = 8):
        super().__init__()
        self.attn = nn.ModuleList([nn.MultiheadAttention(dim, heads, dropout=0.1,
                                                         batch_first=True)
                                   for _ in range(depth)])
        self.mlp = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

    def forward(self, x):
        for attn, mlp in zip(self.attn, self.mlp):
            a, _ = attn(x, x, x)
            x = mlp(a)
        return x.mean(1)


class LstmStack(nn.Module):
    def __init__(self, dim: int = 1024, layers: int = 4):
        super().__init__()
        self.rnn = nn.LSTM(dim, dim, num_layers=layers, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


def gpt(depth: int = 6) -> nn.Module:
    """Attention written by hand (monetlike.models.transformer: `q @ k.transpose(-2, -1)` on the
    permuted heads of a fused projection): its matmuls hold contiguous copies of q, k and v."""
    from monetlike.models import transformer
    return transformer(depth=depth, dim=768, heads=12, dropout=0.1)


MODELS = {
    # name: (factory, input shape)
    "gpt6_768": (lambda: gpt(), (8, 1024, 768)),
    "encoder6_768": (lambda: EncoderStack(), (32, 512, 768)),
    "mha6_512": (lambda: AttentionStack(), (32, 512, 512)),
    "lstm4_1024": (lambda: LstmStack(), (64, 256, 1024)),
}


def rows_for(name: str, time_limit: float) -> list[dict]:
    factory, shape = MODELS[name]
    graph = monetlike.profile(factory().train(), torch.randn(*shape, device="meta"), cost=COST)
    base = simulate(graph, store_all_schedule(graph))
    without = graph.without_impl(NAME)
    mins = {m: solver.min_budget(graph, m) for m in ("checkpoint", "full")}
    mins["full_without"] = solver.min_budget(without, "full")
    n_impl = sum(any(im.name == NAME for im in op.impls) for op in graph.ops)
    rows = []
    for frac in (1 / 2, 1 / 3):
        budget = int(base.peak_bytes * frac)
        row = {"model": name, "input": "x".join(map(str, shape)), "ops_with_impl": n_impl,
               "store_all": format_bytes(base.peak_bytes),
               "min_checkpoint": format_bytes(mins["checkpoint"]),
               "min_full_without": format_bytes(mins["full_without"]),
               "min_full": format_bytes(mins["full"]), "budget": format_bytes(budget)}
        for mode in ("checkpoint", "full_without", "full"):
            try:
                r = solver.solve(without if mode == "full_without" else graph, budget,
                                 mode=mode.removesuffix("_without"), time_limit_s=time_limit)
            except solver.InfeasibleBudgetError:
                row[f"{mode}_overhead"] = "infeasible"
                continue
            if not r.ok:
                row[f"{mode}_overhead"] = r.status
                continue
            ovh = 100 * (r.predicted_time / base.total_time - 1)
            gap = "" if r.mip_gap is None else f" (gap {100 * r.mip_gap:.1f}%)"
            row[f"{mode}_overhead"] = f"{ovh:+.2f}%{gap}"
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: "
                    + ", ".join(MODELS))
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args(argv)
    import pandas as pd

    from bench_doc import header, replace_section
    from bench_solver import markdown_table

    rows = [r for m in args.models.split(",") for r in rows_for(m.strip(), args.time_limit)]
    table = markdown_table(pd.DataFrame(rows).fillna(""))
    print(table)
    if not args.no_write:
        body = "\n".join([
            header(("python scripts/bench_internals.py " + " ".join(sys.argv[1:] if argv is None
                                                                     else argv)).strip()),
            f"Costs: analytical A100-40GB roofline on the meta device (a plan for a GPU this "
            f"machine does not have), {args.time_limit:g} s per solve. Overheads: the "
            f"simulator's predicted step time over store-all. `recompute_internals` exists "
            f"only in full mode; checkpoint mode cannot drop what a torch.nn leaf or a "
            f"matmul holds inside. full_without: full mode with every other Impl but this "
            f"one.",
            "", table])
        replace_section("internals", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
