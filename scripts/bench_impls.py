"""Operator implementations: checkpoint mode (keep/recompute only) vs full mode (plus Impls).

    python scripts/bench_impls.py                       # MONeT's five models, 5-10 GiB, CPU part
    python scripts/bench_impls.py --models vgg16 --budgets 8 --time-limit 60 --no-cpu
    python scripts/bench_impls.py --only-cpu --time-limit 30   # rerun part 2, keep part 1

Part 1 (predicted): MONeT's five models at MONeT's batch sizes, analytical A100-40GB costs, meta
inputs (nothing is allocated). Per model: the store-all peak, the minimum feasible budget in each
mode, and at 5-10 GiB (MONeT's "GB" are GiB) the simulator's overhead over store-all for the
checkpoint-mode and full-mode schedules, next to MONeT's published overhead at the same fraction
of the store-all peak (its table in /work/shared/REFERENCE.md, linearly interpolated between its
points; '-' outside their range). A checkpoint schedule is also a full-mode schedule, so when the
full solve ends (time limit) worse than the checkpoint one, the checkpoint schedule is reported
for full and marked '*'.

Part 2 (measured): a small CNN on this CPU, measured costs, checkpoint vs full at the same budgets,
run end to end through ScheduleWrapper (peak by monetlike.measure_step, step time median).
Writes the "impls" section of docs/BENCHMARKS.md.
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
import torch.nn as nn  # noqa: E402

import solver  # noqa: E402
from bench_doc import header, impl_counts, read_section, replace_section  # noqa: E402
from monetlike.profile import profile  # noqa: E402

GIB = 2 ** 30
COST = "analytical:A100-40GB"


def _models():
    import torchvision.models as tvm

    from monetlike import models as mm

    return {
        "resnet50": (lambda: tvm.resnet50(), 184, (3, 224, 224)),
        "googlenet": (lambda: tvm.googlenet(aux_logits=False, init_weights=False), 320,
                      (3, 224, 224)),
        "unet": (lambda: mm.unet(), 11, (3, 416, 608)),
        "mobilenet_v2": (lambda: tvm.mobilenet_v2(), 272, (3, 224, 224)),
        "vgg16": (lambda: tvm.vgg16(), 176, (3, 224, 224)),
    }


# MONeT (P100, PyTorch 1.5): PyTorch's peak, then (MONeT memory, overhead %) pairs, in GiB.
MONET = {
    "resnet50": (15.06, [(10.01, 3.22), (9.01, 4.68), (8.01, 5.56), (6.99, 7.28), (6.00, 9.31),
                         (4.99, 11.95)]),
    "googlenet": (14.93, [(9.98, 7.13), (8.99, 7.87), (8.01, 8.44), (7.02, 9.71), (6.01, 12.14),
                          (4.99, 15.77)]),
    "unet": (14.32, [(10.01, -4.10), (9.01, -2.07), (8.02, -0.09), (7.00, 1.39), (6.01, 4.95),
                     (5.01, 11.51)]),
    "mobilenet_v2": (14.46, [(10.02, 2.40), (9.01, 3.10), (8.02, 4.77), (7.01, 5.53),
                             (6.01, 7.55), (5.01, 8.72)]),
    "vgg16": (14.12, [(9.71, -5.30), (8.66, -4.64), (7.88, -2.18), (6.82, 1.99), (5.90, 5.44),
                      (5.51, 9.11)]),
}


def monet_at_fraction(name: str, fraction: float) -> float | None:
    """MONeT's overhead (%) at `fraction` of its store-all peak, interpolated; None outside."""
    pytorch, pts = MONET[name]
    mem = fraction * pytorch
    pts = sorted(pts)
    if not pts[0][0] <= mem <= pts[-1][0]:
        return None
    for (m0, o0), (m1, o1) in zip(pts, pts[1:]):
        if m0 <= mem <= m1:
            return o0 + (o1 - o0) * (mem - m0) / (m1 - m0)
    return None


def _pct(x):
    return "-" if x is None else f"{x:+.2f}%"


def predicted(names, budgets, time_limit, min_time_limit, log):
    rows, mins = [], []
    for name in names:
        factory, batch, shape = _models()[name]
        t0 = time.perf_counter()
        g = profile(factory(), torch.randn(batch, *shape, device="meta"), cost=COST)
        base = solver.simulate(g, solver.store_all_schedule(g))
        n_alt = sum(len(o.impls) - 1 for o in g.ops)
        log(f"{name}: profiled in {time.perf_counter() - t0:.1f} s, store-all "
            f"{base.peak_bytes / GIB:.2f} GiB, {n_alt} extra Impls on {len(g.ops)} ops")
        lo = {m: solver.min_budget(g, m, time_limit_s=min_time_limit)
              for m in ("checkpoint", "full")}
        mins.append((name, batch, base.peak_bytes, lo["checkpoint"], lo["full"], n_alt,
                     len(g.ops)))
        log(f"{name}: min budget checkpoint {lo['checkpoint'] / GIB:.3f} GiB, full "
            f"{lo['full'] / GIB:.3f} GiB")
        for gib in budgets:
            budget = int(gib * GIB)
            res = {}
            for mode in ("checkpoint", "full"):
                t1 = time.perf_counter()
                try:
                    r = solver.solve(g, budget, mode=mode, time_limit_s=time_limit)
                    s = r.schedule
                except solver.InfeasibleBudgetError:
                    s = None
                if s is None:
                    res[mode] = None
                    log(f"{name} {gib} GiB {mode}: infeasible or no schedule")
                    continue
                tl = solver.simulate(g, s)
                assert tl.peak_bytes <= budget
                res[mode] = (tl.total_time / base.total_time - 1, s, r.status, r.mip_gap)
                log(f"{name} {gib} GiB {mode}: {r.status} overhead "
                    f"{100 * res[mode][0]:.2f}% gap {r.mip_gap} "
                    f"({time.perf_counter() - t1:.0f} s) impls: {impl_counts(g, s, 'none')}")
            fallback = False
            if res["checkpoint"] is not None and (res["full"] is None
                                                  or res["full"][0] > res["checkpoint"][0]):
                res["full"] = res["checkpoint"]
                fallback = True
            frac = budget / base.peak_bytes
            rows.append((name, gib, frac, res, fallback, monet_at_fraction(name, frac), g))
    return rows, mins


def predicted_tables(rows, mins) -> str:
    out = ["Minimum feasible budget (exact min-peak MILP, or the least peak found within the "
           "time limit):", "",
           "| model (batch) | ops (extra Impls) | store-all peak | min checkpoint | min full | "
           "full / checkpoint |", "|---|---|---|---|---|---|"]
    for name, batch, peak, lc, lf, n_alt, n_ops in mins:
        out.append(f"| {name} ({batch}) | {n_ops} ({n_alt}) | {peak / GIB:.2f} GiB | "
                   f"{lc / GIB:.2f} GiB | {lf / GIB:.2f} GiB | {lf / lc:.3f} |")
    out += ["", "Predicted overhead over store-all (A100-40GB roofline costs). MONeT: its "
            "published overhead at the same fraction of its own store-all peak (P100, conv "
            "algorithm choice included, which we do not model).", "",
            "| model | budget | fraction of store-all | checkpoint | full | Impls chosen (full) | "
            "MONeT at same fraction |", "|---|---|---|---|---|---|---|"]
    for name, gib, frac, res, fallback, monet, g in rows:
        ck = None if res["checkpoint"] is None else 100 * res["checkpoint"][0]
        fu = None if res["full"] is None else 100 * res["full"][0]
        impls = "-" if res["full"] is None else impl_counts(g, res["full"][1], "none")
        out.append(f"| {name} | {gib} GiB | {frac:.3f} | "
                   f"{'infeasible' if ck is None else _pct(ck)} | "
                   f"{'infeasible' if fu is None else _pct(fu)}{' *' if fallback else ''} | "
                   f"{impls} | {_pct(monet)} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# Part 2: measured on this CPU
# ----------------------------------------------------------------------------------------------
class SmallVGG(nn.Module):
    def __init__(self):
        super().__init__()

        def blk(i, o):
            return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True)]

        self.features = nn.Sequential(*blk(3, 32), *blk(32, 32), nn.MaxPool2d(2), *blk(32, 64),
                                      *blk(64, 64), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(),
                                        nn.Dropout(0.5), nn.Linear(256, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def measured(time_limit, log) -> str:
    import monetlike

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SmallVGG().train()
    x = torch.randn(32, 3, 32, 32)
    g = profile(model, x, cost="measured", repeat=5)
    base = solver.simulate(g, solver.store_all_schedule(g))
    lo_c = solver.min_budget(g, "checkpoint", time_limit_s=60)
    lo_f = solver.min_budget(g, "full", time_limit_s=60)
    budgets = sorted({base.peak_bytes, lo_c, (lo_c + lo_f) // 2, lo_f}, reverse=True)

    def run(s):
        w = monetlike.ScheduleWrapper(model, s)

        def step():
            # A training step as the simulator counts it: gradients start as None
            # (zero_grad(set_to_none=True); accumulating into existing ones allocates more) and
            # the output is held until the backward is done.
            for p in model.parameters():
                p.grad = None
            out = w(x)
            out.sum().backward()

        step()  # warm-up; its gradients are dropped before measure_step reads its start, or
        for p in model.parameters():  # the step's own `p.grad = None` frees them below it
            p.grad = None
        m = monetlike.measure_step(step, warmup=0, repeat=7)
        return m.peak_bytes - m.start_bytes + g.fixed_bytes, m.seconds

    run(solver.store_all_schedule(g))  # warm-up: the first steps pay page faults
    plain_peak, plain_s = run(solver.store_all_schedule(g))
    out = [f"SmallVGG (4 conv-BN-ReLU, 2 max-pool, dropout), batch 32, 3x32x32, measured CPU "
           f"costs, one thread. Store-all measured step {1000 * plain_s:.1f} ms, peak "
           f"{plain_peak / 2**20:.2f} MiB. Minimum budget: checkpoint {lo_c / 2**20:.2f} MiB, "
           f"full {lo_f / 2**20:.2f} MiB.", "",
           "| budget | mode | Impls chosen | predicted peak | measured peak | predicted overhead "
           "| measured overhead |", "|---|---|---|---|---|---|---|"]
    for b in budgets:
        for mode in ("checkpoint", "full"):
            try:
                r = solver.solve(g, b, mode=mode, time_limit_s=time_limit)
            except solver.InfeasibleBudgetError:
                out.append(f"| {b / 2**20:.2f} MiB | {mode} | - | infeasible | - | - | - |")
                continue
            s = r.schedule
            tl = solver.simulate(g, s)
            peak, sec = run(s)
            log(f"cpu {b} {mode}: pred {tl.peak_bytes} meas {peak} {sec * 1000:.1f} ms")
            out.append(f"| {b / 2**20:.2f} MiB | {mode} | {impl_counts(g, s, 'none')} | "
                       f"{tl.peak_bytes / 2**20:.2f} MiB | {peak / 2**20:.2f} MiB | "
                       f"{100 * (tl.total_time / base.total_time - 1):+.1f}% | "
                       f"{100 * (sec / plain_s - 1):+.1f}% |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,googlenet,unet,mobilenet_v2,vgg16")
    ap.add_argument("--budgets", default="5,6,7,8,9,10", help="GiB, comma-separated")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--min-budget-time-limit", type=float, default=120.0,
                    help="seconds per minimum-budget solve")
    ap.add_argument("--no-cpu", action="store_true", help="skip the measured CPU comparison")
    ap.add_argument("--only-cpu", action="store_true",
                    help="rerun only the measured CPU comparison; part 1 stays as last written")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    args = ap.parse_args(argv)
    if args.only_cpu and args.no_cpu:
        ap.error("--only-cpu and --no-cpu exclude each other")
    names = [n for n in args.models.split(",") if n]
    budgets = [float(b) for b in args.budgets.split(",") if b]
    budgets = [int(b) if b == int(b) else b for b in budgets]

    def log(msg):
        print(msg, flush=True)

    command = "python scripts/bench_impls.py " + " ".join(argv if argv is not None
                                                          else sys.argv[1:])
    parts = [header(command.strip()), ""]

    def write(extra=""):
        body = "\n".join(parts) + extra
        if args.no_write:
            print(body)
        else:
            replace_section("impls", body)

    if args.only_cpu:
        marker = "### Measured on this CPU"
        previous = read_section("impls")
        if previous is None or marker not in previous:
            raise SystemExit("--only-cpu: docs/BENCHMARKS.md has no impls section with a measured "
                             "part to replace; run without --only-cpu")
        parts = [previous.split(marker, 1)[0].rstrip(), "", f"{marker}: checkpoint vs full mode "
                 "end to end", "", "Rerun alone: " + header(command.strip()),
                 measured(args.time_limit, log)]
        write()
        return
    rows, mins = predicted(names, budgets, args.time_limit, args.min_budget_time_limit, log)
    parts += ["### Predicted: MONeT's models, checkpoint vs full mode", "",
              predicted_tables(rows, mins), ""]
    write("\n(CPU measured comparison: running)" if not args.no_cpu else "")
    if not args.no_cpu:
        parts += ["### Measured on this CPU: checkpoint vs full mode end to end", "",
                  measured(args.time_limit, log)]
        write()


if __name__ == "__main__":
    main()
