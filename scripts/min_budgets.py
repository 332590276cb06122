"""Minimum feasible budget of one model in checkpoint and full mode, with what each Impl saves.

    python scripts/min_budgets.py --model mobilenet_v2 --time-limit 600

Profiles the model at MONeT's batch (scripts/build_zoo.py's table) on the meta device with
analytical costs, then runs the exact min-peak MILP per mode (solver.search.min_budget_details) and
prints the least feasible peak found, the proven lower bound and whether it is proven optimal.
It also sums, per registered Impl, the bytes the matching Ops' backwards hold (saved Values plus
internals, default -> that Impl), as in docs/impls.md. Prints only; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

import solver  # noqa: E402
from solver.search import min_budget_details  # noqa: E402
from build_zoo import DEFAULT_COST, MODELS  # noqa: E402
from monetlike.modelspec import build_model  # noqa: E402
from monetlike.profile import profile  # noqa: E402

GIB = 2 ** 30


def held(g, op, k) -> int:
    im = op.impls[k]
    return im.internal_bytes + sum(g.values[v].bytes for v in im.saved
                                   if g.values[v].producer is not None)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=None, help="default: the zoo's batch")
    ap.add_argument("--cost", default=DEFAULT_COST)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds per mode")
    ap.add_argument("--modes", default="checkpoint,full")
    args = ap.parse_args(argv)
    spec, batch, shape = MODELS[args.model]
    batch = args.batch or batch
    g = profile(build_model(spec), torch.randn(batch, *shape, device="meta"), cost=args.cost)
    base = solver.simulate(g, solver.store_all_schedule(g))
    print(f"{args.model} batch {batch}, {args.cost}: {len(g.ops)} ops, "
          f"{sum(len(o.impls) - 1 for o in g.ops)} extra Impls, store-all peak "
          f"{base.peak_bytes / GIB:.3f} GiB, fingerprint {g.fingerprint}")
    per: dict[str, list[int]] = {}
    for op in g.ops:
        for k, im in enumerate(op.impls):
            if k:
                row = per.setdefault(im.name, [0, 0, 0])
                row[0] += 1
                row[1] += held(g, op, 0)
                row[2] += held(g, op, k)
    for name, (n, d, a) in per.items():
        print(f"  {name}: {n} ops, held {d / GIB:.2f} -> {a / GIB:.2f} GiB")
    for mode in [m for m in args.modes.split(",") if m]:
        t0 = time.perf_counter()
        peak, lower, proven, _ = min_budget_details(g, mode, time_limit_s=args.time_limit)
        print(f"min budget {mode}: {peak / GIB:.3f} GiB ({peak} B), lower bound "
              f"{lower / GIB:.3f} GiB, {'proven optimal' if proven else 'not proven'}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
