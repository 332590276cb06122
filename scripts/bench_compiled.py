"""The compiled step side by side (issue 54): torch.compile's own partition, its
activation_memory_budget knob, and monetlike.backend at that peer's measured peak. One model per
process (Dynamo's state is per process):

    .venv/bin/python scripts/bench_compiled.py --model mobilenet_v2 --batch 8 --size 96
    .venv/bin/python scripts/bench_compiled.py --model mlp --rounds 3          # a quick check

Rows: compile plain (torch's min-cut partition), compile at activation_memory_budget
(--knob, default 0.5), ours at the knob's measured peak, ours at the least peak our search
reaches. Each row: first-step (compile) seconds, the step's transient peak by the CPU allocator's
own events (AllocatorLog; the step holds its output until its backward ends), ours' predicted
peak, the median thread-time step over interleaved rounds, and whether gradients equal eager's
(bitwise under aot_eager; torch.testing.assert_close under inductor). Thread time with one torch
thread, not wall time: this machine's cores are shared. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn

import monetlike
from monetlike.core.allocator import AllocatorLog
from solver.compiled import least_peak
from solver.units import format_bytes


def build(name: str, batch: int, size: int):
    torch.manual_seed(0)
    if name == "mobilenet_v2":
        import torchvision
        return torchvision.models.mobilenet_v2(), torch.randn(batch, 3, size, size)
    if name == "mlp":
        return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.1),
                             nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10)), \
            torch.randn(batch * 32, 256)
    raise SystemExit(f"unknown model {name!r}: expected mobilenet_v2 or mlp")


def step(fn, model, x, seed=1):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = fn(x)
    out.sum().backward()
    del out


def measure_peak(fn, model, x) -> int:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    with AllocatorLog() as log:
        log.mark("start")
        out = fn(x)
        out.sum().backward()
        log.mark("end")
    del out
    return log.peak_between("start", "end")


class Row:
    def __init__(self, name, model, fn, backend=None):
        self.name, self.model, self.fn, self.backend = name, model, fn, backend
        self.times: list[float] = []
        self.compile_s = self.peak = 0.0
        self.grads_ok = ""

    def first_step(self, x, want, bitwise):
        t = time.perf_counter()
        step(self.fn, self.model, x)
        self.compile_s = time.perf_counter() - t
        got = [p.grad for p in self.model.parameters()]
        if bitwise:
            self.grads_ok = "bitwise" if all(torch.equal(a, b) for a, b in zip(got, want)) \
                else "DIFFER"
        else:
            try:
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b)
                self.grads_ok = "close"
            except AssertionError:
                self.grads_ok = "DIFFER"
        self.peak = measure_peak(self.fn, self.model, x)

    def time_once(self, x):
        t = time.thread_time()
        step(self.fn, self.model, x)
        self.times.append(time.thread_time() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2", help="mobilenet_v2 or mlp")
    ap.add_argument("--batch", type=int, default=8, help="batch size")
    ap.add_argument("--size", type=int, default=96, help="image side (mobilenet_v2)")
    ap.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor"],
                    help="what compiles the partitioned graphs, for every row")
    ap.add_argument("--knob", type=float, default=0.5, help="torch's activation_memory_budget")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # thread time counts the calling thread only: no intra-op pool
    torch._dynamo.config.cache_size_limit = 64
    base, x = build(args.model, args.batch, args.size)
    eager = copy.deepcopy(base)
    step(eager, eager, x)
    want = [p.grad.clone() for p in eager.parameters()]
    bitwise = args.compiler == "aot_eager"
    rows = []

    def fresh(name):
        """torch's backend under a new identity: Dynamo reuses a cached graph for another copy
        of the model when the backend is the same object, which would skip the knob's compile."""
        inner = torch._dynamo.lookup_backend(name)
        return lambda gm, example_inputs, **kw: inner(gm, example_inputs, **kw)

    def compiled(name, backend=None, knob=None):
        m = copy.deepcopy(base)
        be = backend or fresh(args.compiler)
        row = Row(name, m, torch.compile(m, backend=be), backend)
        if knob is None:
            row.first_step(x, want, bitwise)
        else:
            with functorch_config.patch(activation_memory_budget=knob):
                row.first_step(x, want, bitwise)
        rows.append(row)
        print(f"  {name}: compile {row.compile_s:.1f} s, peak {format_bytes(row.peak)}",
              file=sys.stderr)
        return row

    compiled("compile plain")
    peer = compiled(f"compile, activation_memory_budget={args.knob}", knob=args.knob)
    probe = monetlike.backend(budget="1TiB", compiler=args.compiler)
    ours_probe = compiled("ours, torch's default partition", backend=probe)
    fixed = probe.record.graph.fixed_bytes
    least = least_peak(probe.record.graph).peak_bytes
    target = fixed + int(peer.peak)
    if target >= least:
        compiled(f"ours at the {args.knob} row's peak",
                 backend=monetlike.backend(budget=target, compiler=args.compiler))
    else:
        print(f"  ours at the {args.knob} row's peak: infeasible, the peer's "
              f"{format_bytes(target)} (fixed included) is below our least "
              f"{format_bytes(least)}", file=sys.stderr)
    compiled("ours at our least peak", backend=monetlike.backend(budget=least,
                                                               compiler=args.compiler))
    del ours_probe
    for _ in range(args.rounds):
        for row in rows:
            row.time_once(x)
    plain = statistics.median(rows[0].times)
    print(f"\n{args.model}, batch {args.batch}, {args.compiler}, CPU, 1 torch thread, thread "
          f"time, median of "
          f"{args.rounds} interleaved rounds; fixed (parameters, buffers, input) "
          f"{format_bytes(fixed)}\n")
    print("| row | compile s | step, x compile plain | measured transient peak | "
          "predicted | gradients vs eager |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        pred = (format_bytes(row.backend.record.plan.prediction.transient_peak_bytes)
                if row.backend is not None else "-")
        print(f"| {row.name} | {row.compile_s:.1f} | {statistics.median(row.times) / plain:.2f} "
              f"| {format_bytes(row.peak)} | {pred} | {row.grads_ok} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
