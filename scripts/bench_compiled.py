"""The compiled step side by side (issue 54): torch.compile's own partition, its
activation_memory_budget knob, compiled per-block checkpoint and selective checkpointing (SAC), and
monetlike.backend at each of those peers' measured peaks. One model per process (Dynamo's state
is per process):

    .venv/bin/python scripts/bench_compiled.py --model transformer --compiler inductor
    .venv/bin/python scripts/bench_compiled.py --model mlp --rounds 3 --knobs 0.5   # a quick check

Models (scripts/peers.py builds them, with their block adapters): mobilenet_v2, densenet121,
transformer (a stack of monetlike.models.TransformerBlock), gpt2 (Hugging Face GPT-2, random
init), mlp. Sizes are small (SIZES): Inductor compiles each row, minutes per row here.

Every row compiles a module returning the bench's loss (peers.bench_loss), so the whole step is
inside the compiled graphs. Rows: compile plain (torch's own partition: min-cut under Inductor,
save-all under aot_eager), compile at each --knobs activation_memory_budget, compiled per-block
checkpoint, compiled SAC, then ours (monetlike.backend) at budget "min" and at each peer's
measured peak (tried below ours' "min" too: a row ours cannot fit is reported). Every row
compiles cold (FX graph and AOT autograd caches off; C++ kernels come from Inductor's disk
cache). Each row: first-step seconds (the compile, every compile ours tried included), the
step's transient peak by the CPU allocator's own events (AllocatorLog; fixed bytes, parameters,
buffers and the input, excluded), ours' predicted transient peak (Inductor: read off its
generated code; aot_eager: the eager-op model), the median thread-time step over interleaved
rounds as a ratio to compile plain, and gradients against the reference (bitwise against eager
under aot_eager; torch.testing.assert_close against compile plain under Inductor). Thread time
with one torch thread, not wall time: this machine's cores are shared. Prints a markdown table;
--out appends the raw rows as JSON lines.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import monetlike  # noqa: E402
from monetlike.core.allocator import AllocatorLog  # noqa: E402
from monetlike.runtime.compiled import GraphBreakError  # noqa: E402
from peers import (_sac_context, adapter_for, bench_loss, labels_for, ModelSpec,  # noqa: E402
                   SPECS, TransformerStack, GPT2Logits)
from solver.errors import InfeasibleBudgetError  # noqa: E402
from solver.units import format_bytes  # noqa: E402


def _tv(name: str, **kw):
    def build() -> nn.Module:
        import torchvision
        return getattr(torchvision.models, name)(**kw)
    return build


# Small: every row is a compile (Inductor: minutes each on this loaded 2-core machine).
SIZES: dict[str, ModelSpec] = {
    "mobilenet_v2": ModelSpec("mobilenet_v2", _tv("mobilenet_v2", num_classes=10),
                              (4, 3, 64, 64), "mobilenet_v2"),
    "densenet121": ModelSpec("densenet121", _tv("densenet121", num_classes=10), (8, 3, 64, 64),
                             "densenet"),
    "transformer": ModelSpec("transformer", lambda: TransformerStack(depth=2, dim=64, heads=2),
                             (4, 64, 64), "transformer"),
    "gpt2": ModelSpec("gpt2", lambda: GPT2Logits(layers=2, dim=64, heads=2, positions=64,
                                                 vocab=256), (4, 64), "gpt2", vocab=256),
}


class Mlp(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(256, 1024), nn.ReLU(), nn.Dropout(0.1), nn.Linear(1024, 1024),
                         nn.GELU(), nn.Linear(1024, 10))


class Step(nn.Module):
    """The model and the bench's loss in one module; `wrap` (checkpoint, SAC) around each of the
    model's natural blocks (peers' adapters), or none."""

    def __init__(self, model: nn.Module, spec: ModelSpec | None, wrap=None):
        super().__init__()
        self.model, self.spec, self.wrap = model, spec, wrap

    def forward(self, x):
        if self.wrap is None:
            out = self.model(x)
        else:
            out = adapter_for(self.spec).forward(self.model, x, self.wrap)
        return bench_loss(out, labels_for(out))


def _ckpt(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def _sac(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_sac_context)


def build(name: str):
    """(model, example input, spec or None)."""
    torch.manual_seed(0)
    if name == "mlp":
        return Mlp(), torch.randn(256, 256), None
    spec = SIZES.get(name)
    if spec is None:
        raise SystemExit(f"unknown model {name!r}: expected one of {', '.join(SIZES)} or mlp")
    return spec.build(), spec.example_input(), spec


def clear(model):
    for p in model.parameters():
        p.grad = None


def step(fn, model, x, seed=1):
    clear(model)
    torch.manual_seed(seed)
    fn(x).backward()


def measure_peak(fn, model, x) -> int:
    """The step's transient peak (above what is allocated when it starts), allocator events."""
    clear(model)
    torch.manual_seed(1)
    with AllocatorLog() as log:
        log.mark("start")
        loss = fn(x)
        loss.backward()
        log.mark("end")
    del loss
    return log.peak_between("start", "end")


def _close(a, b) -> bool:
    """Within torch.testing.assert_close's default tolerances."""
    try:
        torch.testing.assert_close(a, b)
    except AssertionError:
        return False
    return True


class Row:
    def __init__(self, name, kind, model, fn, backend=None, peer=None):
        self.name, self.kind, self.model, self.fn, self.backend = name, kind, model, fn, backend
        self.peer = peer  # ours: the row whose peak it was given as its budget
        self.times: list[float] = []
        self.compile_s, self.peak, self.grads, self.error = 0.0, 0, "", ""

    def first_step(self, x, want, bitwise):
        t = time.perf_counter()
        try:
            step(self.fn, self.model, x)
        finally:
            self.compile_s = time.perf_counter() - t
        got = [p.grad for p in self.model.parameters()]
        if bitwise:
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            self.grads = "bitwise" if same else "DIFFER"
        else:
            off = [(a, b) for a, b in zip(got, want) if not _close(a, b)]
            self.grads = "close" if not off else (
                f"DIFFER: {len(off)} of {len(got)} gradients, worst max abs "
                f"{max(float((a - b).abs().max()) for a, b in off):.1e} (largest gradient "
                f"{max(float(b.abs().max()) for _, b in off):.1e})")
        self.peak = measure_peak(self.fn, self.model, x)

    def time_once(self, x):
        t = time.thread_time()
        step(self.fn, self.model, x)
        self.times.append(time.thread_time() - t)

    @property
    def predicted(self) -> int | None:
        if self.backend is None or not self.backend.records:
            return None
        return self.backend.record.predicted_transient

    def as_dict(self, plain_s: float) -> dict:
        rec = self.backend.record if self.backend is not None and self.backend.records else None
        return {"row": self.name, "kind": self.kind, "compile_s": round(self.compile_s, 2),
                "step_ratio": (round(statistics.median(self.times) / plain_s, 4)
                               if self.times else None),
                "step_s": statistics.median(self.times) if self.times else None,
                "times": [round(t, 6) for t in self.times],
                "peak": self.peak, "predicted": self.predicted, "grads": self.grads,
                "error": self.error, "peer": self.peer.name if self.peer else None,
                "budget": self.backend.budget if self.backend is not None else None,
                "compiles": self.backend.compiles if self.backend is not None else None,
                "recomputed": len(rec.plan.prediction.recomputed) if rec else None,
                "unsized": list(rec.code.unsized) if rec and rec.code else None}


def fixed_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Parameters, buffers and the input: what the compiled graphs take as primals."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers(), x]}
    return sum(seen.values())


def run_rows(args, base, x, spec) -> tuple[list[Row], int]:
    """Compile and check every row (first step, gradients, peak); returns (rows, fixed bytes)."""
    bitwise = args.compiler == "aot_eager"
    eager = Step(copy.deepcopy(base), spec)
    step(eager, eager, x)
    want = [p.grad.clone() for p in eager.model.parameters()]
    fixed = fixed_bytes(base, x)
    rows: list[Row] = []

    def fresh(name):
        """torch's backend under a new identity: Dynamo reuses a cached graph for another copy
        of the model when the backend is the same object, which would skip the knob's compile."""
        inner = torch._dynamo.lookup_backend(name)
        return lambda gm, example_inputs, **kw: inner(gm, example_inputs, **kw)

    def add(name, kind, wrap=None, knob=None, backend=None, peer=None):
        m = copy.deepcopy(base)
        row = Row(name, kind, m, torch.compile(Step(m, spec, wrap),
                                                backend=backend or fresh(args.compiler)),
                  backend, peer)
        try:
            if knob is None:
                row.first_step(x, want, bitwise)
            else:
                with functorch_config.patch(activation_memory_budget=knob):
                    row.first_step(x, want, bitwise)
        except Exception as e:  # ours below its least: reported, not timed
            cause = e
            while cause is not None and not isinstance(
                    cause, (InfeasibleBudgetError, GraphBreakError)):
                cause = (getattr(cause, "inner_exception", None) or cause.__cause__
                         or cause.__context__)
            if cause is None:
                raise
            row.error = str(cause).split(";")[0][:200]
        rows.append(row)
        print(f"  {name}: compile {row.compile_s:.1f} s, peak {format_bytes(row.peak)}"
              f"{', ' + row.error if row.error else ''}", file=sys.stderr, flush=True)
        return row

    plain = add("compile plain", "plain")
    plain.grads = f"{plain.grads} (vs eager)"
    if not bitwise:  # Inductor: the others against torch.compile's own step
        clear(plain.model)
        step(plain.fn, plain.model, x)
        want = [p.grad.clone() for p in plain.model.parameters()]
    peers = [plain] + [add(f"compile, activation_memory_budget={k}", "knob", knob=k)
                       for k in args.knobs]
    if spec is not None and "ckpt" in args.peers:
        peers.append(add("compiled per-block checkpoint", "ckpt", wrap=_ckpt))
    if spec is not None and "sac" in args.peers:
        peers.append(add("compiled SAC (save matmul/conv/attention)", "sac", wrap=_sac))
    add('ours at budget "min"', "ours-min",
        backend=monetlike.backend(budget="min", compiler=args.compiler))
    done: dict[int, Row] = {}
    for p in peers:
        if p.peak in done:
            continue
        # tried below ours' "min" too: the least is a search's, and a budget's search may fit
        done[p.peak] = add(f"ours at {p.name}'s peak", "ours", peer=p,
                           backend=monetlike.backend(budget=fixed + p.peak,
                                                     compiler=args.compiler))
    for r in rows:
        if r.backend is not None and r.backend.records:
            got = r.backend.record.graph.fixed_bytes
            if got != fixed:
                print(f"  note: {r.name}: the graph's fixed bytes {got} != {fixed} counted here",
                      file=sys.stderr)
    return rows, fixed


def round_spread(row: Row, peer: Row) -> tuple[float, float]:
    """The middle half (quartiles) of row's step over peer's, round by round: the rounds are
    interleaved, so each ratio compares steps run moments apart."""
    ratios = sorted(a / b for a, b in zip(row.times, peer.times))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return q[0], q[2]


def report(args, rows: list[Row], fixed: int, spec) -> list[dict]:
    """Print the table and the comparisons; return the raw rows."""
    timed = [r for r in rows if not r.error]
    plain_s = statistics.median(rows[0].times)
    shape = tuple(spec.input_shape) if spec is not None else "(256, 256)"
    print(f"\n{args.model}, input {shape}, {args.compiler}, CPU, 1 torch thread, thread time, "
          f"median of {args.rounds} interleaved rounds; fixed (parameters, buffers, input) "
          f"{format_bytes(fixed)}; peaks are transient (above the fixed bytes)\n")
    print("| row | compile s (compiles) | step, x compile plain | measured peak | predicted | "
          "pred. error | gradients |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pred = r.predicted
        err = f"{100 * (pred - r.peak) / r.peak:+.2f}%" if pred and r.peak else "-"
        ratio = f"{statistics.median(r.times) / plain_s:.2f}" if r.times else "-"
        peak = format_bytes(r.peak) if not r.error else r.error
        n = f" ({r.backend.compiles})" if r.backend is not None else ""
        print(f"| {r.name} | {r.compile_s:.1f}{n} | {ratio} | {peak} | "
              f"{format_bytes(pred) if pred else '-'} | {err} | {r.grads or '-'} |")
    print()
    for r in rows:
        if r.kind != "ours" or r.peer is None:
            continue
        if r.error:
            print(f"- at {r.peer.name}'s peak ({format_bytes(r.peer.peak)}): {r.error}")
            continue
        verdict = "at or below" if r.peak <= r.peer.peak else "ABOVE"
        t = statistics.median(r.times) / statistics.median(r.peer.times)
        low, high = round_spread(r, r.peer)
        print(f"- at {r.peer.name}'s peak: ours {format_bytes(r.peak)} ({verdict} its "
              f"{format_bytes(r.peer.peak)}), step {t:.2f}x its time (per round, middle half: "
              f"{low:.2f}-{high:.2f}x)")
    knobs = [r for r in timed if r.kind in ("knob", "plain")]
    # ours' least: budget "min"'s row, or a row at a peer's peak that fit below it
    least = min((r for r in timed if r.kind in ("ours-min", "ours")), key=lambda r: r.peak,
                default=None)
    if knobs and least is not None:
        k = min(knobs, key=lambda r: r.peak)
        print(f"- least peak: ours {format_bytes(least.peak)} ({least.name}) against the knob's "
              f"least {format_bytes(k.peak)} ({k.name}): ratio {least.peak / k.peak:.3f}")
    return [dict(r.as_dict(plain_s), model=args.model, compiler=args.compiler,
                 input=list(shape) if spec is not None else [256, 256], fixed=fixed)
            for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenet_v2",
                    help=f"one of {', '.join(SIZES)}, or mlp")
    ap.add_argument("--compiler", default="inductor", choices=["aot_eager", "inductor"],
                    help="what compiles the partitioned graphs, for every row")
    ap.add_argument("--knobs", default="0.25,0.5,0.75",
                    help="torch's activation_memory_budget values, comma-separated")
    ap.add_argument("--peers", default="ckpt,sac",
                    help="which of the per-block peers to run, comma-separated (ckpt, sac)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--out", help="append the raw rows here as JSON lines")
    args = ap.parse_args(argv)
    args.knobs = [float(k) for k in args.knobs.split(",") if k]
    args.peers = {p for p in args.peers.split(",") if p}
    if args.peers - {"ckpt", "sac"}:
        ap.error(f"--peers: expected ckpt and/or sac, got {sorted(args.peers - {'ckpt', 'sac'})}")
    torch.set_num_threads(1)  # thread time counts the calling thread only: no intra-op pool
    torch._dynamo.config.cache_size_limit = 64
    # every row compiles cold (ours cannot use the FX graph cache: its partitioner is not
    # picklable); compiled C++ kernels are still reused from Inductor's on-disk cache by all rows
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    base, x, spec = build(args.model)
    t0 = time.perf_counter()
    rows, fixed = run_rows(args, base, x, spec)
    for _ in range(args.rounds):
        for row in rows:
            if not row.error:
                row.time_once(x)
    raw = report(args, rows, fixed, spec)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"\n(whole run {time.perf_counter() - t0:.0f} s; commit {commit})")
    if args.out:
        with open(args.out, "a") as f:
            for r in raw:
                f.write(json.dumps(dict(r, commit=commit)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
