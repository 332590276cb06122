"""The floor under the runtime's own work: what autograd's Python hooks alone cost a schedule.

    python scripts/bench_hook_floor.py              # writes the "Hook floor" section of BENCHMARKS.md
    python scripts/bench_hook_floor.py --models unet --no-write

ScheduleWrapper runs inside ordinary autograd (docs/design.md): it sees each saved tensor of a
hooked Op through a Python saved-tensor hook (pack in the forward, unpack in the backward), starts
each backward stage from a Python prehook on the stage's autograd nodes, and rebuilds each
Value a backward or a recomputation reads as a view (`torch.as_strided`). Those calls are made
from Python whatever the runtime does inside them. This script counts them in one wrapped step
(cProfile's call counts), times each kind on its own with nothing inside (an identity hook, a
prehook that returns None, one `as_strided`; the fastest of several repeats), and sets their sum
beside the plain step: the least runtime work any runtime built on these hooks can do, against
bench_runtime's "runtime work" column and issue 21's target of 2% of the step.

Schedules are like bench_runtime's lower rows: the solver at the budget halfway between Chen's
sqrt(n) checkpointing peak and store-all and at that peak (where it recomputes anything), and
sqrt(n) checkpointing itself, on an analytical profile (the counts depend on the graph and the
schedule; the costs only choose among schedules). One thread, steady CPU allocator,
steps timed by the thread clock, as in bench_runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402

import monetlike  # noqa: E402
from bench_runtime import MODELS, RUNTIME_DIR  # noqa: E402
from solver.units import format_bytes  # noqa: E402

CHAIN = 200  # autograd nodes in the chain the hooks are timed on


def _chain_step(x: torch.Tensor, hooks: bool, prehooks: bool) -> None:
    """A chain of sigmoids on a tiny tensor (each saves its result: one pack, one unpack),
    forward and backward, with identity saved-tensor hooks and/or a prehook on every node."""
    nodes = []
    with (torch.autograd.graph.saved_tensors_hooks(_identity, _identity) if hooks
          else contextlib.nullcontext()):
        y = x
        for _ in range(CHAIN):
            y = y.sigmoid()
            nodes.append(y.grad_fn)
    if prehooks:
        for fn in nodes:
            fn.register_prehook(_no_op)
    y.sum().backward()


def _identity(t):
    return t


def _no_op(grad_outputs):
    return None


def per_call_costs(rounds: int = 5, steps: int = 50) -> dict:
    """Seconds per identity pack+unpack pair, per prehook (registered and called), per
    `torch.as_strided`, per empty Python call: the fastest of `rounds` rounds each. The three
    chains run in turn within each round, so that a change of load hits them alike."""
    x = torch.randn(4, requires_grad=True)
    configs = ((False, False), (True, False), (False, True))
    for _ in range(20):
        _chain_step(x, True, True)
    best = dict.fromkeys(configs, float("inf"))
    for _ in range(rounds * steps):
        for cfg in configs:
            t0 = time.thread_time()
            _chain_step(x, *cfg)
            best[cfg] = min(best[cfg], time.thread_time() - t0)
    plain = best[(False, False)]
    t = torch.randn(16, 32, 8, 8)
    n = 100_000
    return {
        "pair": max(0.0, best[(True, False)] - plain) / CHAIN,
        "prehook": max(0.0, best[(False, True)] - plain) / CHAIN,
        "as_strided": min(timeit.repeat(lambda: torch.as_strided(t, (16, 32, 8, 8),
                                                                 (2048, 64, 8, 1), 0),
                                        number=n, repeat=rounds)) / n,
        "call": min(timeit.repeat(lambda: _no_op(None), number=n, repeat=rounds)) / n,
    }


def hook_counts(step) -> dict:
    """Per step: saved tensors packed by the runtime, stage prehook calls, recomputed Ops,
    `as_strided` calls made by the runtime (views rebuilt), from cProfile's call counts."""
    step()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    counts = {"pack": 0, "on_stage": 0, "recompute_op": 0, "as_strided": 0}
    for (path, _, name), row in stats.items():
        if RUNTIME_DIR in os.path.abspath(path) and name in counts:
            counts[name] += row[1]
        if name == "<built-in method torch.as_strided>":
            counts["as_strided"] += sum(c[1] for caller, c in row[4].items()
                                        if RUNTIME_DIR in os.path.abspath(caller[0]))
    return counts


def bench_model(name: str, repeat: int, costs: dict) -> list[dict]:
    from solver import baselines, solve
    from solver.simulate import store_all_schedule, with_predictions

    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(*shape)
    graph = monetlike.profile(model, x, cost="analytical:A100-40GB")
    chen = baselines.chen_sqrt_n(graph)
    high = with_predictions(graph, store_all_schedule(graph)).predicted_peak_bytes
    schedules = []
    if chen.ok:
        for budget in ((chen.predicted_peak_bytes + high) // 2, chen.predicted_peak_bytes):
            found = solve(graph, budget, time_limit_s=20)
            if found.ok and any(s.recompute for s in found.schedule.stages):
                schedules.append((f"{format_bytes(budget)} (solve)", found.schedule))
        schedules.append(("sqrt(n) checkpoints", chen.schedule))

    def plain_step():
        for p in model.parameters():
            p.grad = None
        model(x).float().sum().backward()

    for _ in range(2):
        plain_step()
    plain = []
    for _ in range(repeat):
        t0 = time.thread_time()
        plain_step()
        plain.append(time.thread_time() - t0)
    plain_s = statistics.median(plain)
    rows = []
    for label, schedule in schedules:
        wrapped = monetlike.ScheduleWrapper(model, schedule, graph=graph)

        def sched_step():
            for p in model.parameters():
                p.grad = None
            wrapped(x).float().sum().backward()

        n = hook_counts(sched_step)
        floor = (n["pack"] * costs["pair"] + n["on_stage"] * costs["prehook"]
                 + n["as_strided"] * costs["as_strided"])
        left = 0.02 * plain_s - floor
        rows.append({"model": f"{name} {tuple(shape)}", "schedule": label,
                     "recomputed": n["recompute_op"], "pack": n["pack"],
                     "prehooks": n["on_stage"], "views": n["as_strided"],
                     "plain ms": 1e3 * plain_s, "floor ms": 1e3 * floor,
                     "floor share": floor / plain_s,
                     "left per op us": 1e6 * left / max(n["recompute_op"], 1)})
        print(_row_text(rows[-1]), flush=True)
    return rows


HEADER = ("| model (input) | schedule | recomputed ops | saved tensors through the hooks | "
          "stage prehooks | views rebuilt | plain step ms | hook floor ms | floor, share of the "
          "step | 2% of the step less the floor, per recomputed Op |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _row_text(r: dict) -> str:
    return (f"| {r['model']} | {r['schedule']} | {r['recomputed']} | {r['pack']} | "
            f"{r['prehooks']} | {r['views']} | {r['plain ms']:.1f} | {r['floor ms']:.2f} | "
            f"{100 * r['floor share']:.2f}% | {r['left per op us']:.1f} us |")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS),
                    help="models to run")
    ap.add_argument("--repeat", type=int, default=9, help="timed plain steps per model")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from bench_doc import header_with_commit, replace_section, steady_cpu_allocator

    steady_cpu_allocator()
    costs = per_call_costs()
    per_call = (f"Per call on this machine (the fastest of 250 runs of a {CHAIN}-node chain, the "
                f"hooked chains' extra time over the plain one's): identity pack+unpack pair "
                f"{1e6 * costs['pair']:.2f} us, prehook registered and called "
                f"{1e6 * costs['prehook']:.2f} us, `torch.as_strided` "
                f"{1e6 * costs['as_strided']:.2f} us, an empty Python call "
                f"{1e6 * costs['call']:.3f} us (timeit, fastest of 5).")
    print(per_call)
    print(HEADER)
    rows = []
    for name in args.models:
        rows += bench_model(name, args.repeat, costs)
    if not args.no_write and rows:
        worst = max(rows, key=lambda r: r["floor share"])
        tight = min(rows, key=lambda r: r["left per op us"])
        body = (header_with_commit("bench_hook_floor.py", argv) + "\n\n" + per_call + "\n\n"
                + HEADER + "\n" + "\n".join(_row_text(r) for r in rows) + "\n\n"
                "Reading it: \"hook floor\" is what the hook calls alone cost a step (their counts "
                "in one wrapped step times the per-call costs above), with no work inside them: "
                "the least runtime work of any runtime that runs inside autograd through these "
                "hooks. Highest: "
                f"{100 * worst['floor share']:.2f}% of the step ({worst['model']}, "
                f"{worst['schedule']}). The last column is what a 2% target leaves, per "
                "recomputed Op, for everything else the runtime does in Python (matching a saved "
                "tensor to its Value, capturing and replaying the RNG and autocast state, "
                "registering the recomputed Values): least "
                f"{tight['left per op us']:.1f} us ({tight['model']}, {tight['schedule']}), "
                f"against {1e6 * costs['call']:.3f} us for one empty Python call.\n")
        replace_section("hook floor", body)
        print("wrote the Hook floor section of docs/BENCHMARKS.md")
    return rows


if __name__ == "__main__":
    main()
