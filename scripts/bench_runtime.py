"""Runtime benchmark: what ScheduleWrapper costs over plain PyTorch, measured against predicted.

    python scripts/bench_runtime.py                 # writes the "Runtime" section of BENCHMARKS.md
    python scripts/bench_runtime.py --models unet --repeat 5 --no-write

Per model: a measured-cost profile on this CPU, then schedules at decreasing budgets (the store-all
peak; then budgets between it and Chen's sqrt(n) checkpointing peak, solved by `solver.solve` when
it exists, else by the greedy baseline). For each schedule, the step time (forward and backward)
is timed against plain PyTorch in interleaved pairs (median over pairs, so load from other
processes hits both alike) and the measured overhead is set next to the simulator's predicted
one. The store-all row is the runtime's own cost: nothing is recomputed. "runtime work" is the
share of the scheduled step spent in monetlike/runtime, by cProfile corrected for its own cost
per call (`runtime_share`). Peaks are measured with `monetlike.measure_step` (the model's fixed memory
plus what the step allocates) next to the simulator's.

One thread (`torch.set_num_threads(1)`): on a shared 2-core machine, OpenMP threads spinning
against other processes swing timings tenfold; one thread keeps the ratios meaningful.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402
import torchvision  # noqa: E402

import monetlike  # noqa: E402
from monetlike.calibrate import calibrate  # noqa: E402
from monetlike.models import transformer_block, unet  # noqa: E402
from solver import min_budget as solver_min_budget  # noqa: E402
from solver.simulate import simulate, store_all_schedule, with_predictions  # noqa: E402
from solver.units import format_bytes  # noqa: E402
from bench_doc import impl_counts  # noqa: E402

MODELS = {
    # name: (factory, input shape)
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (16, 3, 64, 64)),
    "mobilenet_v2": (lambda: torchvision.models.mobilenet_v2(num_classes=10), (16, 3, 64, 64)),
    "unet": (lambda: unet(width=16, depth=3), (4, 3, 64, 64)),
    "transformer_block": (lambda: transformer_block(dim=128, heads=4), (16, 64, 128)),
    "densenet121": (lambda: torchvision.models.densenet121(num_classes=10), (8, 3, 64, 64)),
    # The same model on 16 times the pixels: kernels grow, the runtime's Python per Op does not.
    "densenet121_128": (lambda: torchvision.models.densenet121(num_classes=10),
                        (16, 3, 128, 128)),
}


def schedules_for(graph, fractions):
    """[(label, schedule)]: store-all, then schedules at budgets between the store-all peak and
    the sqrt(n) checkpointing peak."""
    from solver import baselines

    store = with_predictions(graph, store_all_schedule(graph))
    out = [("store-all", store)]
    high = store.predicted_peak_bytes
    chen = baselines.chen_sqrt_n(graph)
    low = chen.predicted_peak_bytes if chen.ok else high
    try:
        from solver import solve
    except ImportError:
        solve = None
    for f in fractions:
        budget = int(low + f * (high - low))
        if solve is not None:
            result, how = solve(graph, budget, time_limit_s=60), "solve"
        else:
            result, how = baselines.greedy(graph, budget), "greedy"
        if result.ok:
            out.append((f"{format_bytes(budget)} ({how})", result.schedule))
    if chen.ok:
        out.append(("sqrt(n) checkpoints", chen.schedule))
    if solve is not None:
        # Below what recomputation alone reaches, only Impls (operator implementations) lower
        # the peak: these rows choose many of them.
        least = solver_min_budget(graph, "checkpoint", time_limit_s=60)
        least_full = solver_min_budget(graph, "full", time_limit_s=60)
        for f in (0.5, 0.0):
            budget = int(least_full + f * (least - least_full))
            if budget < least:
                result = solve(graph, budget, time_limit_s=60)
                if result.ok:
                    out.append((f"{format_bytes(budget)} (solve, below checkpoint-only)",
                                result.schedule))
    return out


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def time_pairs(plain_step, sched_step, repeat: int,
               clock=time.perf_counter) -> tuple[float, float, float]:
    """Median times of the two steps run in alternating order, and the median of the ratios of
    adjacent runs (adjacent runs see the same load from other processes)."""
    for _ in range(2):
        plain_step()
        sched_step()
    a, b = [], []
    for i in range(repeat):
        order = (plain_step, sched_step) if i % 2 == 0 else (sched_step, plain_step)
        for fn in order:
            t0 = clock()
            fn()
            (a if fn is plain_step else b).append(clock() - t0)
    ratio = statistics.median(y / x for x, y in zip(a, b))
    return statistics.median(a), statistics.median(b), ratio


RUNTIME_DIR = os.path.join(ROOT, "monetlike", "runtime") + os.sep


def runtime_share(step, steps: int = 3) -> float:
    """Share of a step's time spent in monetlike's runtime code (monetlike/runtime/*.py:
    bookkeeping, hooks, recomputation driving), by cProfile's own time per function, corrected
    for cProfile's own cost. cProfile adds a fixed cost to every Python and C call it
    sees, which inflates Python-heavy code most; the correction times the same steps without
    the profiler, spreads the difference evenly over every call cProfile counted, takes that
    off the runtime's own time, and divides by the unprofiled time."""
    step()
    clock = time.perf_counter
    t0 = clock()
    for _ in range(steps):
        step()
    unprofiled = clock() - t0
    prof = cProfile.Profile()
    t0 = clock()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    profiled = clock() - t0
    stats = pstats.Stats(prof).stats
    per_call = max(0.0, profiled - unprofiled) / sum(v[1] for v in stats.values())
    ours = [(v[1], v[2]) for k, v in stats.items() if RUNTIME_DIR in os.path.abspath(k[0])]
    own = sum(t for _, t in ours)
    return max(0.0, own - per_call * sum(n for n, _ in ours)) / unprofiled


def measured_peak(graph, model, module, x) -> int:
    def step():
        # The output is held until the backward is done, as a training loop holds it and as the
        # simulator counts it (dropped before the backward, the step measures less by its bytes).
        out = module(x)
        out.float().sum().backward()

    step()
    for p in model.parameters():
        p.grad = None
    m = monetlike.measure_step(step, warmup=0, repeat=1)
    return m.peak_bytes - m.start_bytes + graph.fixed_bytes


def bench_model(name: str, repeat: int, fractions, clock: str = "wall") -> list[dict]:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(*shape)
    profiled = monetlike.profile(model, x, cost="measured", repeat=3, clock=clock)
    # Costs in context (monetlike.calibrate): schedules are solved on the calibrated graph; the
    # per-op profile's own prediction is kept beside it.
    graph = calibrate(model, x, profiled)
    base = simulate(graph, store_all_schedule(graph))

    def plain_step():
        for p in model.parameters():
            p.grad = None
        model(x).float().sum().backward()

    rows = []
    for label, schedule in schedules_for(graph, fractions):
        wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)

        def sched_step():
            for p in model.parameters():
                p.grad = None
            wrapped(x).float().sum().backward()

        t_plain, t_sched, ratio = time_pairs(plain_step, sched_step, repeat, CLOCKS[clock])
        tl = simulate(graph, schedule)
        rows.append({
            "model": f"{name} {tuple(shape)}", "schedule": label,
            "recomputed ops": sum(len(s.recompute) for s in schedule.stages),
            "impls": impl_counts(graph, schedule),
            "plain ms": 1e3 * t_plain, "scheduled ms": 1e3 * t_sched,
            "measured overhead": ratio - 1,
            "predicted overhead": tl.total_time / base.total_time - 1,
            "profiled ms": 1e3 * simulate(profiled, schedule).total_time,
            "predicted ms": 1e3 * tl.total_time,
            "runtime work": runtime_share(sched_step),
            "measured peak": measured_peak(graph, model, wrapped, x),
            "predicted peak": tl.peak_bytes,
        })
        print(_row_text(rows[-1]), flush=True)
    return rows


def _row_text(r: dict) -> str:
    return (f"| {r['model']} | {r['schedule']} | {r['recomputed ops']} | {r['impls']} | "
            f"{r['plain ms']:.1f} | "
            f"{r['scheduled ms']:.1f} | {r['profiled ms']:.1f} | {r['predicted ms']:.1f} | "
            f"{100 * (r['predicted ms'] / r['scheduled ms'] - 1):+.1f}% | "
            f"{100 * r['measured overhead']:+.1f}% | "
            f"{100 * r['predicted overhead']:+.1f}% | {100 * load_adjusted(r):+.1f}% | "
            f"{100 * r['runtime work']:.2f}% | "
            f"{format_bytes(r['measured peak'])} | "
            f"{format_bytes(r['predicted peak'])} |")


def load_adjusted(r: dict) -> float:
    """The predicted step against the measured one, each over plain PyTorch (the prediction's
    store-all time, the plain steps run beside it): load from other processes between the
    calibration and the timed pairs cancels."""
    return (1 + r["predicted overhead"]) / (1 + r["measured overhead"]) - 1


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS),
                    help="models to run")
    ap.add_argument("--repeat", type=int, default=15, help="timed pairs per schedule")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.95, 0.9, 0.5, 0.0],
                    help="budgets as fractions of the way from the sqrt(n) peak to store-all")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="thread",
                    help="profile, calibrate and time steps by the wall clock or by this "
                         "thread's CPU time (the default: the machine's speed and other processes "
                         "move the wall clock by tens of percent over minutes)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from bench_doc import steady_cpu_allocator

    steady = steady_cpu_allocator()
    header = ("| model (input) | schedule | recomputed ops | Impls | plain ms | scheduled ms | "
              "per-op profile ms | calibrated ms | calibrated vs measured | "
              "measured overhead | predicted overhead | predicted vs measured, over plain | "
              "runtime work | measured peak | predicted peak |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(header)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.repeat, args.fractions, args.clock)
    if not args.no_write:
        import json
        import subprocess

        from bench_doc import header as doc_header, replace_section
        from solver.jsonio import atomic_write_text

        command = "python scripts/bench_runtime.py " + " ".join(argv if argv is not None
                                                                else sys.argv[1:])
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True).stdout.strip() or "unknown"
        raw = os.path.join("docs", "bench-data", f"runtime-{commit}.jsonl")
        atomic_write_text(os.path.join(ROOT, raw),
                          "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        store = [r for r in rows if r["schedule"] == "store-all"]
        worst = max(1 + r["measured overhead"] for r in store) if store else float("nan")
        errors = [(r["measured peak"] - r["predicted peak"]) / r["predicted peak"] for r in rows]
        cal_err = [r["predicted ms"] / r["scheduled ms"] - 1 for r in rows]
        raw_err = [r["profiled ms"] / r["scheduled ms"] - 1 for r in rows]
        within = sum(abs(e) <= 0.05 for e in cal_err)
        with_impls = [r for r in rows if r["impls"] != "-"]
        impl_err = [load_adjusted(r) for r in with_impls]
        impl_within = sum(abs(e) <= 0.05 for e in impl_err)
        faster = [r for r in rows if r["predicted overhead"] < 0]
        raw_within = sum(abs(e) <= 0.05 for e in raw_err)
        peaks = (f"Measured peaks (the CPU allocator's count) against predicted: worst "
                 f"{100 * max(errors, key=abs):+.2f}%, {sum(e <= 0 for e in errors)} of "
                 f"{len(errors)} rows at or below the prediction." if errors else "")
        body = (doc_header(command.strip()) + "\n"
                f"Step = forward + backward of one batch, one thread, timed by the {args.clock} "
                "clock (profile, calibration and steps alike), costs measured on this CPU "
                "and calibrated (monetlike.calibrate: plain forward and backward timed, every "
                "recomputation timed in context, the runtime's own work per recomputation fitted "
                "to whole steps); schedules are solved on the calibrated graph. "
                "\"per-op profile ms\" is the simulator's step time on the costs as profiled op "
                "by op, \"calibrated ms\" on the calibrated ones, against the measured scheduled "
                "step (target: within 5%). Overheads are over plain PyTorch on the same model "
                "(median over interleaved pairs of the ratio of adjacent runs); predicted ones are "
                "the simulator's over its own store-all time. "
                + ("The CPU allocator is kept steady (glibc's malloc told to keep freed memory: "
                   "no fresh mappings for large blocks, no trimming; bench_doc."
                   "steady_cpu_allocator), so that profile, calibration and timed steps page-fault "
                   "alike. " if steady else "")
                + f"Store-all step time over plain PyTorch: worst {worst:.3f} (target <= 1.05). "
                f"Calibrated step time against measured: {within} of {len(rows)} rows within 5% "
                f"(worst {100 * max(cal_err, key=abs):+.1f}%); the per-op profile's: "
                f"{raw_within} (worst {100 * max(raw_err, key=abs):+.1f}%). "
                "Rows that choose Impls (operator implementations; monetlike.calibrate times "
                "each Impl in context and credits a saving only where every paired step showed "
                "one): predicted against measured, each over plain PyTorch (\"predicted vs "
                f"measured, over plain\", which load between calibration and timing leaves "
                f"alone): {impl_within} of {len(with_impls)} within 5%"
                + (f" (worst {100 * max(impl_err, key=abs):+.1f}%)" if impl_err else "")
                + f". Rows predicted faster than plain: {len(faster)}, of which measured "
                f"slower: {sum(r['measured overhead'] > 0 for r in faster)}. Commit {commit}; "
                f"raw rows: {raw}.\n\n"
                + header + "\n" + "\n".join(_row_text(r) for r in rows) + "\n\n"
                "Reading it: the forward is fx's generated code for the traced graph, bound to "
                "the model; only the nodes a schedule needs at run time (saved-tensor handles, "
                "recomputed Ops, Values the runtime holds, active backward stages) call into "
                "the runtime, and each recomputed Op runs as generated code under no_grad. "
                "\"runtime work\" is the share of the step spent in monetlike/runtime's own "
                "code: cProfile's own time there, less cProfile's cost per call (the profiled "
                "steps' extra time over the same steps unprofiled, spread evenly over every call "
                "it counted), over the unprofiled step time. "
                f"Worst: {100 * max(r['runtime work'] for r in rows):.2f}% of the step. The "
                "measured overhead also holds what the predicted one leaves out: fresh "
                "allocations for recomputed activations and kernels timed in context rather than "
                "op by op; the plain step times move by tens of percent between rows on this "
                "shared 2-core machine, so differences of a few percent are noise. Calibrated "
                "predictions fall further short the more Ops are recomputed; set the shortfall "
                "beside the runtime work column: the runtime's own bookkeeping (handles, hooks, "
                "rebuilding arguments) is no cost in the graph. " + peaks + "\n")
        replace_section("runtime", body)
        print("wrote the Runtime section of docs/BENCHMARKS.md")
    return rows


if __name__ == "__main__":
    main()
