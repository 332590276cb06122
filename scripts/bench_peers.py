"""monetlike side by side with PyTorch's own checkpointing, measured in one run (issue 7).

    .venv/bin/python scripts/bench_peers.py                       # full sizes, all models
    .venv/bin/python scripts/bench_peers.py --quick --models resnet18 --out /tmp/b.md

For each model, every peer (plain PyTorch, checkpoint per block, checkpoint_sequential, selective
activation checkpointing, torch.compile with activation_memory_budget 0.25/0.5/0.75) and ours
(profile with measured costs, solve at a budget equal to the peer's measured peak, run through
ScheduleWrapper) runs a full training step (grads None, forward, loss, backward) measured with
monetlike.measure_step. Ours must give gradients equal to plain PyTorch (assert_close) before any
saving is reported. The table goes into the "Peers" section of docs/BENCHMARKS.md and one Pareto
plot per model into docs/img/peers_<model>.png.

NOTE [How the bench measures]
- Peak: measure_step's peak minus the tensors alive at the start of the call that belong to other
  configs (the bench holds one model copy per config at once). A config's own resident bytes are
  the storages its construction and a warm-up step left alive (its model copy, compiled
  artifacts, runtime state), plus the shared input batch and labels. So each peak is what
  measure_step reports when that config is alone in the process.
- torch.compile: measure_step reads the CPU allocator's own events (the profiler's memory events),
  which see the compiled code's allocations as they see eager ones; no dispatch mode is active, so
  Dynamo compiles and runs the compiled graph as it would outside the bench. The bench checks that
  the compiled graph really ran inside the measured call (a counting wrapper around the aot_eager
  backend) and fails otherwise.
- Time: a block of configs is timed in interleaved rounds (plain, peer, ours, plain, peer, ...),
  each round one measure_step call (1 warm-up, --repeat timed steps, median); a config's time is
  the median over rounds and overheads are against plain PyTorch timed in the same block. The
  spread of plain over the rounds is reported as the noise floor.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import monetlike  # noqa: E402
from bench_doc import steady_cpu_allocator  # noqa: E402
from monetlike.calibrate import calibrate  # noqa: E402
from monetlike.measure import live_cpu_storages, measure_step  # noqa: E402
from peers import (COMPILE_BUDGETS, PEERS, SPECS, ModelSpec, adapter_for,  # noqa: E402
                   bench_loss, labels_for)

MiB = 2 ** 20
DEFAULT_MODELS = ("resnet18", "densenet121", "mobilenet_v2", "transformer", "gpt2")


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------
def _live_bytes() -> dict[int, int]:
    # live_cpu_storages goes by tensor.device, and FakeTensors in Dynamo's caches say "cpu" while
    # their storages are on the meta device: they hold no memory, so they must not count.
    return {k: int(s.nbytes()) for k, s in live_cpu_storages().items() if s.device.type == "cpu"}


@dataclass
class Config:
    """One way of running the model's training step."""

    name: str
    kind: str  # "plain", "peer", "compile", "ours"
    forward: Callable[[torch.Tensor], torch.Tensor]
    params: list
    resident_bytes: int = 0
    peaks: list = field(default_factory=list)
    times: list = field(default_factory=list)
    """Per measure_step call: the median step time on the bench's clock (--clock)."""
    wall: list = field(default_factory=list)
    """Per measure_step call: measure_step's own median wall time."""
    predicted_peak: int | None = None
    predicted_time: float | None = None
    budget: int | None = None
    note: str = ""
    grad_check: str = ""
    solve: object = None
    compile_calls: Callable[[], int] | None = None

    @property
    def peak(self) -> int | None:
        return self.peaks[0] if self.peaks else None

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.times) if self.times else None


class Bench:
    """Shared state for one model: the input batch, the loss, and the step builder."""

    def __init__(self, spec: ModelSpec, args, log=lambda s: None):
        self.spec, self.args, self.log = spec, args, log
        torch.manual_seed(0)
        self.model = spec.build().train()
        self.x = spec.example_input(seed=1)
        self.adapter = adapter_for(spec)
        with torch.no_grad():
            out = self.model(self.x)
        self.labels = labels_for(out)
        self.shared_bytes = sum(int(t.untyped_storage().nbytes())
                                for t in (self.x, self.labels) if t is not None)

    def loss(self, out: torch.Tensor) -> torch.Tensor:
        return bench_loss(out, self.labels)

    def step_fn(self, cfg: Config) -> Callable[[], None]:
        fwd, params, x, loss = cfg.forward, cfg.params, self.x, self.loss

        def step():
            for p in params:
                p.grad = None
            torch.manual_seed(1234)  # the same dropout masks in every config
            loss(fwd(x)).backward()
            # Cleared again so the next call starts, like a real step after zero_grad(set_to_none),
            # with no gradients alive.
            for p in params:
                p.grad = None
        return step

    def outputs_and_grads(self, cfg: Config, named_params) -> tuple[torch.Tensor, dict]:
        for _, p in named_params:
            p.grad = None
        torch.manual_seed(1234)
        out = cfg.forward(self.x)
        self.loss(out).backward()
        grads = {n: p.grad.detach().clone() for n, p in named_params if p.grad is not None}
        for _, p in named_params:
            p.grad = None
        return out.detach().clone(), grads

    def fresh_copy(self) -> torch.nn.Module:
        return copy.deepcopy(self.model)

    def add(self, name: str, kind: str, build: Callable[[], tuple]) -> Config:
        """Build a config, warm it up once, and record the bytes it keeps resident."""
        before = _live_bytes()
        forward, params = build()
        cfg = Config(name=name, kind=kind, forward=forward, params=list(params))
        self.step_fn(cfg)()
        after = _live_bytes()
        cfg.resident_bytes = sum(b for k, b in after.items() if k not in before)
        return cfg

    def measure(self, cfg: Config, *, peak: bool = True) -> None:
        step = self.step_fn(cfg)
        cpu: list[float] = []

        def timed():
            # Thread CPU time of the step: with one intra-op thread the whole step (forward and
            # the CPU autograd engine's backward) runs on this thread, and time spent waiting for
            # a core that another process holds is not counted (see --clock).
            c0 = time.thread_time()
            step()
            cpu.append(time.thread_time() - c0)
        calls0 = cfg.compile_calls() if cfg.compile_calls else 0
        m = measure_step(timed, warmup=1, repeat=self.args.repeat)
        if cfg.compile_calls is not None:
            # warm-up + tracked call + timed calls must all have run the compiled graph
            ran = cfg.compile_calls() - calls0
            if ran < 2 + self.args.repeat:
                raise RuntimeError(f"{cfg.name}: the compiled graph ran {ran} times in "
                                   f"{2 + self.args.repeat} steps; the measurement saw eager code")
        if peak:
            cfg.peaks.append(int(m.peak_bytes - m.start_bytes + cfg.resident_bytes
                                 + self.shared_bytes))
        cfg.wall.append(m.seconds)
        # measure_step runs warm-up, tracked call, then the `repeat` timed calls, in this order.
        cfg.times.append(m.seconds if self.args.clock == "wall"
                         else statistics.median(cpu[-self.args.repeat:]))


def time_block(bench: Bench, cfgs: list[Config], rounds: int) -> float:
    """Interleaved timing rounds; returns the spread (max/min - 1) of plain over the rounds."""
    plain = cfgs[0]
    start = len(plain.times)
    for _ in range(rounds):
        for cfg in cfgs:
            bench.measure(cfg)
    for cfg in cfgs:
        pred = cfg.predicted_peak
        if pred is not None and max(cfg.peaks) > pred:
            over = sum(p > pred for p in cfg.peaks)
            peaks = ", ".join(f"{p / MiB:.2f}" for p in cfg.peaks)
            bench.log(f"[{bench.spec.name}] {cfg.name}: measured over its prediction "
                      f"({pred / MiB:.2f} MiB) in {over} of {len(cfg.peaks)} steps: {peaks} MiB")
    ts = plain.times[start:]
    return max(ts) / min(ts) - 1 if len(ts) > 1 else float("nan")


# ----------------------------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------------------------
def _solver_module():
    import solver.search
    return solver.search


def solve(graph, budget: int, time_limit: float):
    """solver.solve in full mode on HiGHS; an infeasible budget becomes a failed SolveResult."""
    from solver.errors import InfeasibleBudgetError
    from solver.schedule import INFEASIBLE, SolveResult
    try:
        # A 0.1% gap, not the default 1%: 1% of MobileNetV2's step is a point of overhead, as
        # much as separates ours from a peer in a close row; the time limit still bounds it.
        return _solver_module().solve(graph, budget, mode="full", backend="highs",
                                      time_limit_s=time_limit, mip_gap=0.001)
    except InfeasibleBudgetError as e:
        return SolveResult.failure(status=INFEASIBLE, backend="highs", message=str(e))


def min_budget(graph, time_limit: float) -> int:
    return _solver_module().min_budget(graph, "full", backend="highs", time_limit_s=time_limit)


def wrapper_class():
    return getattr(monetlike, "ScheduleWrapper", None) or __import__(
        "monetlike.runtime", fromlist=["ScheduleWrapper"]).ScheduleWrapper


class Ours:
    """Profile once, solve per budget (cached), check gradients, build configs."""

    def __init__(self, bench: Bench):
        self.bench = bench
        t0 = time.perf_counter()
        # The profile times Ops on the clock the bench times steps on: with --clock cpu, thread
        # CPU time, else predicted and measured overheads would be on different scales (a
        # wall-clock profile on busy cores makes every Op, and so the store-all step, look slower).
        # With the bench's own loss: its kernels and the output gradient it hands the model are
        # part of the step's peak (a profile with the default sum missed 1 MiB on the
        # transformer, whose loss is the output's mean square).
        model = bench.fresh_copy()
        clock = "thread" if bench.args.clock == "cpu" else "wall"
        profiled = monetlike.profile(model, bench.x, cost="measured",
                                     repeat=bench.args.profile_repeat, clock=clock,
                                     loss_fn=bench.loss)
        self.profile_s = time.perf_counter() - t0
        # Costs in context (monetlike.calibrate): the steps' forward and backward, each
        # recomputation as it runs, and the runtime's own work per recomputation.
        self.graph = calibrate(model, bench.x, profiled, clock=clock, loss_fn=bench.loss)
        from solver import simulate, store_all_schedule
        self.store_all_s = simulate(self.graph, store_all_schedule(self.graph)).total_time
        self.results: dict[int, object] = {}
        self.grads_checked = 0

    def result(self, budget: int):
        if budget not in self.results:
            t0 = time.perf_counter()
            res = solve(self.graph, budget, self.bench.args.time_limit)
            self.results[budget] = res
            keep_dir = getattr(self.bench.args, "schedules_dir", None)
            if keep_dir and res.ok:
                Path(keep_dir).mkdir(parents=True, exist_ok=True)
                res.schedule.save(Path(keep_dir) / f"{self.bench.spec.name}_{budget}.json")
            self.bench.log(f"[{self.bench.spec.name}] solve at {budget / MiB:.2f} MiB: {res.status}"
                           f" in {time.perf_counter() - t0:.1f} s"
                           + (f", predicted peak {res.predicted_peak_bytes / MiB:.2f} MiB"
                              if res.ok else ""))
        return self.results[budget]

    def config(self, budget: int, name: str, reference: tuple) -> Config:
        res = self.result(budget)
        if not getattr(res, "ok", False):
            cfg = Config(name=name, kind="ours", forward=None, params=[])
            cfg.budget, cfg.solve = budget, res
            cfg.note = f"solver: {res.status}: {res.message}".strip()
            return cfg
        holder = {}

        def build():
            model = self.bench.fresh_copy()
            holder["model"] = model
            w = wrapper_class()(model, res.schedule, graph=self.graph)
            return w, model.parameters()
        cfg = self.bench.add(name, "ours", build)
        cfg.budget, cfg.solve = budget, res
        cfg.predicted_peak, cfg.predicted_time = res.predicted_peak_bytes, res.predicted_time
        # Gradients equal to plain PyTorch before any saving is reported.
        out, grads = self.bench.outputs_and_grads(cfg, list(holder["model"].named_parameters()))
        ref_out, ref_grads = reference
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(grads, ref_grads)
        self.grads_checked += 1
        cfg.grad_check = "equal"
        return cfg

    def internals(self, top: int = 3) -> tuple[int, str]:
        """Bytes of internal saved tensors (not graph Values: dropout masks, pooling indices, norm
        statistics) that every Impl of their Op holds. The execution model holds an Op's
        internals from its forward to its backward stage whatever the schedule (recomputation
        runs without grad and does not regenerate them), so the least of them over the Op's
        Impls is memory no schedule of ours can free, while torch.utils.checkpoint frees and
        regenerates it."""
        g = self.graph
        per = {op.id: least for op in g.ops
               if (least := min(im.internal_bytes for im in op.impls))}
        worst = sorted(per, key=per.get, reverse=True)[:top]
        return sum(per.values()), ", ".join(f"{g.ops[o].name} {per[o] / MiB:.1f} MiB"
                                             for o in worst)

    def recompute_breakdown(self, res, top: int = 3) -> str:
        """The Ops ours recomputes and their measured forward cost (from the profile)."""
        sched, g = res.schedule, self.graph
        counts: dict[int, int] = {}
        for st in sched.stages:
            for op in st.recompute:
                counts[op] = counts.get(op, 0) + 1
        cost = {op: n * g.ops[op].impls[sched.impl[op]].rerun_time for op, n in counts.items()}
        total = sum(cost.values())
        worst = sorted(cost, key=cost.get, reverse=True)[:top]
        parts = ", ".join(f"{g.ops[o].name} {1e3 * cost[o]:.1f} ms"
                          + (f" x{counts[o]}" if counts[o] > 1 else "") for o in worst)
        return total, (f"recompute of {sum(counts.values())} ops {1e3 * total:.0f} ms at their "
                       f"measured costs" + (f" (top: {parts})" if parts else ""))


# ----------------------------------------------------------------------------------------------
# Mirrors: a peer's checkpoints written as a schedule of ours
# ----------------------------------------------------------------------------------------------
# Op kinds whose outputs the SAC policy saves (convolutions and matmuls): the solver's rule.
from solver.rules.simple import SAC_SAVE_KINDS as SAC_KINDS, kind_in  # noqa: E402


def _fx_name(qualname: str) -> str:
    # torch.fx names a call_module node after its path, dots to underscores, "_" before a digit.
    n = qualname.replace(".", "_")
    return "_" + n if n[:1].isdigit() else n


def block_ops(graph, qualnames: list[str]) -> set[int]:
    """The Ops one block of the model runs: the contiguous range from its first to its last Op
    named after one of its modules (function calls inside a module's forward, such as attention's
    matmul, have no module name), plus the unnamed Ops just before it whose outputs only the block
    reads (DenseNet's concatenation of earlier feature maps happens inside the dense layer)."""
    prefixes = [_fx_name(q) for q in qualnames]

    def named(op) -> bool:
        return any(nd == p or nd.startswith(p + "_") for nd in op.nodes for p in prefixes)
    ids = [op.id for op in graph.ops if named(op)]
    if not ids:
        return set()
    inside = set(range(min(ids), max(ids) + 1))
    j = min(ids) - 1
    while j >= 0 and all(u in inside for v in graph.ops[j].outputs for u in graph.users[v]) \
            and graph.ops[j].outputs:
        inside.add(j)
        j -= 1
    return inside


def mirror_schedule(graph, blocks: list[list[str]], *, save_kinds=frozenset()):
    """The schedule of ours that checkpoints like the peer: keep what crosses a block boundary
    (and, for SAC, the outputs of `save_kinds` Ops inside blocks), recompute the rest of a block
    in its backward. A checkpointed block's Ops also regenerate what they save inside (dropout
    noise, a matmul's copies) in the peer's backward; in our execution model that is an Impl
    holding less of it, so each Op inside a block may run the Impl with the fewest internal
    bytes. Those Impls can cost time and hold more elsewhere (DenseNet-121's), so both variants
    are simulated and the one with the lower peak (then the faster) is the mirror.
    Returns (predicted peak bytes, predicted overhead over store-all)."""
    from solver import simulate, store_all_schedule
    from solver.rules.simple import schedule_from_keep
    owner: dict[int, int] = {}
    for b, quals in enumerate(blocks):
        for o in block_ops(graph, quals):
            owner.setdefault(o, b)
    keep = set()
    for op in graph.ops:
        b = owner.get(op.id)
        for v in op.outputs:
            readers = graph.users[v]
            if b is None or kind_in(op.kind, save_kinds) or any(owner.get(u) != b for u in readers):
                keep.add(v)
    lean = tuple(min(range(len(op.impls)), key=lambda k: (op.impls[k].internal_bytes, k))
                 if op.id in owner else 0 for op in graph.ops)
    base = simulate(graph, store_all_schedule(graph)).total_time
    variants = []
    for impl in {(0,) * len(graph.ops), lean}:
        tl = simulate(graph, schedule_from_keep(graph, keep, retain="saved", impl=impl,
                                                mode="full", created_by="mirror"))
        variants.append((tl.peak_bytes, tl.total_time / base - 1))
    return min(variants)


# ----------------------------------------------------------------------------------------------
# One model
# ----------------------------------------------------------------------------------------------
def counting_aot_eager():
    """The aot_eager backend, counting how often its compiled graphs run."""
    from torch._dynamo.backends.debugging import aot_eager
    calls = [0]

    def backend(gm, example_inputs, **kw):
        compiled = aot_eager(gm, example_inputs, **kw)

        def run(*args):
            calls[0] += 1
            return compiled(*args)
        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run
    return backend, (lambda: calls[0])


def bench_model(spec: ModelSpec, args, log) -> dict:
    bench = Bench(spec, args, log)
    ad = bench.adapter
    rows, sweep_pts, notes = [], [], []
    plain = bench.add("plain", "plain", lambda: (lambda m: (m, m.parameters()))(bench.fresh_copy()))
    ref = bench.outputs_and_grads(plain, list(plain.forward.named_parameters()))
    log(f"[{spec.name}] adapters: {ad.n_blocks(bench.model)} blocks, chain of "
        f"{len(ad.chain(bench.model))}")
    # The adapters must run the same computation as the model.
    torch.testing.assert_close(ad.forward(bench.fresh_copy().eval(), bench.x),
                               bench.fresh_copy().eval()(bench.x))
    peers = []
    for peer in PEERS:
        holder = {}

        def build(peer=peer):
            m = bench.fresh_copy()
            holder["m"] = m
            return peer.build(m, ad), m.parameters()
        cfg = bench.add(peer.name, "peer", build)
        out, grads = bench.outputs_and_grads(cfg, list(holder["m"].named_parameters()))
        torch.testing.assert_close(out, ref[0])
        torch.testing.assert_close(grads, ref[1])
        cfg.grad_check = "equal"
        cfg.note = peer.describe
        peers.append(cfg)

    # Ours: one profile; the first solve is checked on a tiny budget later by the sweep.
    ours = Ours(bench)
    log(f"[{spec.name}] profiled {len(ours.graph.ops)} ops in {ours.profile_s:.1f} s")
    blocks = ad.blocks(bench.fresh_copy(), bench.x)
    mirrors = {}
    if ours.graph.meta.get("capture") != "export":
        # Ops are found by the fx node names of the blocks' modules; an exported graph's ATen
        # nodes are not named after modules, so no mirror is written for it.
        mirrors = {"ckpt-block": mirror_schedule(ours.graph, blocks),
                   "ckpt-seq": mirror_schedule(ours.graph, ad.segments(bench.model)),
                   "sac": mirror_schedule(ours.graph, blocks, save_kinds=SAC_KINDS)}
    for k, (pk, ov) in mirrors.items():
        log(f"[{spec.name}] mirror of {k} in our execution model: peak {pk / MiB:.1f} MiB, "
            f"predicted {100 * ov:+.1f}%")

    # Block 1: plain, eager peers and ours at each peer's peak, timed side by side.
    bench.measure(plain)
    for cfg in peers:
        bench.measure(cfg)
        log(f"[{spec.name}] {cfg.name}: peak {cfg.peak / MiB:.1f} MiB")
    pairs = []
    for cfg in peers:
        o = ours.config(cfg.peak, f"ours@{cfg.name}", ref)
        pairs.append((cfg, o))
    block = [plain] + [c for pair in pairs for c in pair if c.forward is not None]
    spread = time_block(bench, block, args.rounds)
    t_plain = (statistics.median(plain.times), statistics.median(plain.wall))
    for peer_cfg, o in pairs:
        rows.append(_row(spec, peer_cfg, o, t_plain, spread, ours, mirrors.get(peer_cfg.name)))

    # Blocks 2..4: torch.compile at each activation_memory_budget, its own dynamo state.
    import torch._functorch.config as fconfig
    for b in COMPILE_BUDGETS:
        torch._dynamo.reset()
        with fconfig.patch(activation_memory_budget=b, activation_memory_budget_solver="ilp"):
            backend, calls = counting_aot_eager()
            holder = {}

            def build(backend=backend):
                m = bench.fresh_copy()
                holder["m"] = m
                return torch.compile(m, backend=backend), m.parameters()
            t0 = time.perf_counter()
            cfg = bench.add(f"compile@{b}", "compile", build)
            compile_s = time.perf_counter() - t0
            cfg.compile_calls = calls
            cfg.note = (f"torch.compile(aot_eager), activation_memory_budget={b}, solver=ilp; "
                        f"compiled in {compile_s:.1f} s")
            out, grads = bench.outputs_and_grads(cfg, list(holder["m"].named_parameters()))
            try:
                torch.testing.assert_close(out, ref[0])
                torch.testing.assert_close(grads, ref[1])
                cfg.grad_check = "equal"
            except AssertionError:
                diff = max((grads[k] - ref[1][k]).abs().max().item() for k in ref[1])
                cfg.grad_check = f"differs (max abs {diff:.1e})"
            pstart = len(plain.times)
            bench.measure(cfg)
            log(f"[{spec.name}] {cfg.name}: peak {cfg.peak / MiB:.1f} MiB")
            o = ours.config(cfg.peak, f"ours@{cfg.name}", ref)
            block = [plain, cfg] + ([o] if o.forward is not None else [])
            spread = time_block(bench, block, args.rounds)
            t_plain_b = (statistics.median(plain.times[pstart:]),
                         statistics.median(plain.wall[pstart:]))
            rows.append(_row(spec, cfg, o, t_plain_b, spread, ours))
        torch._dynamo.reset()
        holder.clear()  # the compiled model copy goes

    # Pareto sweep of ours: budgets between the fixed bytes and plain's peak, plus the peers'.
    lo = min_budget(ours.graph, args.time_limit)
    # The top of the sweep is a budget at which store-all fits (predicted), so its point measures
    # the runtime with nothing recomputed.
    hi = max(plain.peak, _store_all_peak(ours.graph))
    budgets = sorted({int(lo + f * (hi - lo)) for f in args.sweep} | {hi})
    sweep_cfgs = []
    for bgt in budgets:
        o = ours.config(bgt, f"ours@{bgt / MiB:.0f}MiB", ref)
        if o.forward is None:
            notes.append(f"budget {bgt / MiB:.1f} MiB: {o.note}")
            continue
        sweep_cfgs.append(o)
    floor = None
    if sweep_cfgs:
        pstart = len(plain.times)
        time_block(bench, [plain] + sweep_cfgs, max(1, args.rounds - 1))
        t_plain_s = statistics.median(plain.times[pstart:])
        for o in sweep_cfgs:
            if o.budget == hi:
                # At plain's own peak nothing needs recomputing: what ours costs there is the
                # runtime's own overhead (fx interpretation, saved-tensor hooks, stage hooks).
                n_rec = sum(len(st.recompute) for st in o.solve.schedule.stages)
                floor = (o.seconds / t_plain_s - 1, n_rec)
            sweep_pts.append({"budget": o.budget, "peak": o.peak, "predicted_peak": o.predicted_peak,
                              "overhead": o.seconds / t_plain_s - 1,
                              "predicted_overhead": _pred_ovh(o, ours)})
    return {"spec": spec, "rows": rows, "sweep": sweep_pts, "notes": notes,
            "plain_peak": plain.peak, "plain_s": statistics.median(plain.times),
            "grads_checked": ours.grads_checked, "profile_s": ours.profile_s,
            "store_all_peak": _store_all_peak(ours.graph), "n_ops": len(ours.graph.ops),
            "min_budget": lo, "internals": ours.internals(), "floor": floor}


def _store_all_peak(graph) -> int:
    from solver import simulate, store_all_schedule
    return simulate(graph, store_all_schedule(graph)).peak_bytes


def _pred_ovh(o: Config, ours: Ours) -> float | None:
    base = ours.store_all_s
    return None if o.predicted_time is None or not base else o.predicted_time / base - 1


def _row(spec, peer: Config, o: Config, plain_t: tuple, spread: float, ours: Ours,
         mirror: tuple | None = None) -> dict:
    """One pair. plain_t: plain's median (bench clock, wall) in the same timing block; mirror:
    (peak, overhead) predicted for the peer's own checkpoints as a schedule of ours."""
    t_plain, w_plain = plain_t
    p_ovh = peer.seconds / t_plain - 1
    row = {"model": spec.name, "peer": peer.name, "peer_peak_MiB": peer.peak / MiB,
           "peer_ovh_%": 100 * p_ovh, "peer_grads": peer.grad_check,
           "peer_ovh_wall_%": 100 * (statistics.median(peer.wall) / w_plain - 1),
           "ours_ovh_wall_%": None,
           "ours_peak_MiB": None, "ours_pred_MiB": None, "ours_ovh_%": None,
           "ours_pred_ovh_%": None, "ours_bound_ovh_%": None, "ovh_ratio": None,
           "ours_grads": o.grad_check or "not run",
           "noise_%": 100 * spread, "solve": _solve_label(o.solve), "verdict": "", "why": "",
           "peer_note": peer.note}
    mirror_note = ("" if mirror is None else
                   f"the peer's own checkpoints written as a schedule of ours: predicted peak "
                   f"{mirror[0] / MiB:.1f} MiB, overhead {100 * mirror[1]:+.1f}%")
    if o.forward is None:
        row["verdict"] = "no schedule"
        held, top = ours.internals()
        row["why"] = "; ".join(x for x in (
            o.note, f"internal saved tensors every Impl of their Op holds from forward to "
                    f"backward: {held / MiB:.1f} MiB (top: {top})", mirror_note) if x)
        return row
    o_ovh = o.seconds / t_plain - 1
    row["ours_ovh_wall_%"] = 100 * (statistics.median(o.wall) / w_plain - 1)
    pred = _pred_ovh(o, ours)
    # The solver's proven lower bound on the step time at this budget, as an overhead: no
    # schedule of ours, in the model it was solved on, costs less.
    lower = o.solve.stats.get("lower_bound_s") if o.solve is not None else None
    base = ours.store_all_s
    bound = None if lower is None or not base else lower / base - 1
    row["ours_bound_ovh_%"] = None if bound is None else 100 * bound
    row.update({"ours_peak_MiB": o.peak / MiB,
                "ours_pred_MiB": None if o.predicted_peak is None else o.predicted_peak / MiB,
                "ours_ovh_%": 100 * o_ovh, "ours_pred_ovh_%": None if pred is None else 100 * pred,
                "ovh_ratio": (o_ovh / p_ovh) if p_ovh > 0 else float("nan")})
    mem_ok = o.peak <= peer.peak
    time_ok = o_ovh <= p_ovh / 2
    noisy = abs(o_ovh - p_ovh / 2) <= spread
    reasons = []
    if not mem_ok:
        reasons.append(f"measured peak {(o.peak - peer.peak) / MiB:+.1f} MiB over the budget "
                       f"(predicted {o.predicted_peak / MiB:.1f} MiB)"
                       if o.predicted_peak is not None else "over the budget")
    if not time_ok:
        extra = (o.seconds - t_plain)
        pred_extra = (o.predicted_time or 0) - (ours.store_all_s or 0)
        rec_s, rec_text = ours.recompute_breakdown(o.solve)
        reasons.append(f"overhead {1e3 * extra:.0f} ms/step (target at most "
                       f"{1e3 * t_plain * p_ovh / 2:.0f} ms) = predicted {1e3 * pred_extra:.0f} ms "
                       f"[{rec_text}; Impl choices {1e3 * (pred_extra - rec_s):+.0f} ms] + "
                       f"unpredicted {1e3 * (extra - pred_extra):+.0f} ms (runtime work and "
                       f"timing noise)")
        if bound is not None and bound > p_ovh / 2:
            reasons.append(f"out of reach at this budget: the solver's proven bound for any "
                           f"schedule of ours is {100 * bound:+.1f}%, above half the peer's "
                           f"overhead ({50 * p_ovh:+.1f}%)")
        if mirror_note:
            reasons.append(mirror_note)
    row["verdict"] = ("met" if mem_ok and time_ok else
                      "missed" + (" (within noise)" if mem_ok and noisy else ""))
    row["why"] = "; ".join(reasons)
    return row


def _solve_label(res) -> str:
    if res is None:
        return ""
    short = {"optimal": "opt", "feasible-at-time-limit": "tl", "infeasible": "infeasible",
             "error": "none in time", "heuristic": "heuristic"}.get(res.status, res.status)
    gap = getattr(res, "mip_gap", None)
    return short + (f" gap {100 * gap:.0f}%" if gap is not None and res.status != "optimal" else "")


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------
def plot(result: dict, img_dir: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    spec = result["spec"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = sorted((p for p in result["sweep"] if p["peak"] is not None), key=lambda p: p["peak"])
    if pts:
        ax.plot([p["peak"] / MiB for p in pts], [100 * p["overhead"] for p in pts], "o-",
                color="C0", label="monetlike (measured, budget sweep)")
        pp = [p for p in pts if p["predicted_peak"] is not None
              and p["predicted_overhead"] is not None]
        ax.plot([p["predicted_peak"] / MiB for p in pp],
                [100 * p["predicted_overhead"] for p in pp], "x--", color="C0", alpha=0.5,
                label="monetlike (predicted)")
    for i, r in enumerate(result["rows"]):
        ax.plot(r["peer_peak_MiB"], r["peer_ovh_%"], "s", color=f"C{i + 1}", label=r["peer"])
        if r["ours_peak_MiB"] is not None:
            ax.plot(r["ours_peak_MiB"], r["ours_ovh_%"], "*", color=f"C{i + 1}", markersize=11)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("measured peak tensor memory of a training step (MiB)")
    ax.set_ylabel("step time overhead over plain PyTorch (%)")
    ax.set_title(f"{spec.name}, input {tuple(spec.input_shape)}: squares = peers, "
                 f"stars = ours at the peer's peak", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / f"peers_{spec.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(results: list[dict]):
    import pandas as pd
    df = pd.DataFrame([r for res in results for r in res["rows"]])
    return df


def _fmt(df, clock: str) -> str:
    cols = ["model", "peer", "peer_peak_MiB", "ours_peak_MiB", "ours_pred_MiB", "peer_ovh_%",
            "ours_ovh_%", "ours_pred_ovh_%", "ours_bound_ovh_%", "ovh_ratio", "noise_%"]
    tail = ["solve", "peer_grads", "ours_grads", "verdict"]
    if clock != "wall":
        cols += ["peer_ovh_wall_%", "ours_ovh_wall_%"]
    numeric = cols[2:]
    cols += tail
    out = df[cols].copy()
    for c in numeric:
        out[c] = out[c].map(lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v))
                            else f"{v:.2f}" if c == "ovh_ratio" else f"{v:.1f}")
    header = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return header + "".join("| " + " | ".join(str(v) for v in r) + " |\n"
                            for r in out.itertuples(index=False))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads, Python {platform.python_version()}")


def markdown(results: list[dict], df, args, command: str, img_paths: list[Path],
             out_path: Path) -> str:
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = ["PyTorch's own checkpointing vs monetlike, measured in one run.", "",
             f"Measured {when} on {machine()}.", "",
             f"Command: `{command}`", "",
             "Each row pairs one peer with ours solved at a budget equal to the peer's measured "
             "peak. Peaks are measure_step peaks of one full training step (grads None, forward, "
             "loss, backward) with parameters, gradients, inputs and activations, as if the config "
             "were alone in the process; overheads are step time over plain PyTorch timed in the "
             f"same interleaved block (median of {args.rounds} rounds x {args.repeat} steps), on "
             + ("measure_step's wall clock. " if args.clock == "wall" else
                "the thread CPU time of measure_step's timed steps, with one intra-op thread "
                "(`--clock cpu`: the cores were shared with other jobs, whose time slices "
                "would otherwise count; the `*_wall_%` columns give the same steps on the wall "
                "clock; our profile times its Ops on the same thread clock). ")
             + "`noise_%` is the spread of plain PyTorch over those rounds. Target: ours at or below "
             "the peer's peak with at most half its overhead. Ours is solved on its measured "
             "profile calibrated to the step as it runs (monetlike.calibrate: forward and "
             "backward scaled to timed steps, recomputations timed in context, the runtime's own "
             "work per recomputation). `ours_bound_ovh_%`: the solver's "
             "proven lower bound on the step time of any schedule of ours at that budget, as an "
             "overhead in the model it solved on (predicted, not measured). `ours_grads = equal`: "
             "torch.testing.assert_close of outputs and every parameter gradient against plain "
             "PyTorch passed before the row was measured. Peaks are the CPU allocator's own count "
             "(measure_step), compiled rows included (see NOTE [How the bench measures] in "
             "scripts/bench_peers.py).", ""]
    for res in results:
        spec = res["spec"]
        lines.append(f"- {spec.name} input {tuple(spec.input_shape)}: plain peak "
                     f"{res['plain_peak'] / MiB:.1f} MiB (store-all predicted "
                     f"{res['store_all_peak'] / MiB:.1f} MiB), step {1e3 * res['plain_s']:.0f} ms; "
                     f"{res['n_ops']} ops profiled in {res['profile_s']:.0f} s; gradient checks "
                     f"passed: {res['grads_checked']}. Least feasible budget of ours "
                     f"{res['min_budget'] / MiB:.1f} MiB, of which {res['internals'][0] / MiB:.1f} "
                     f"MiB are internal saved tensors that every Impl of their Op holds from "
                     f"forward to backward "
                     f"({res['internals'][1] or 'none'}). "
                     + (f"Runtime floor (ours at plain's peak, {res['floor'][1]} recomputed ops): "
                        f"{100 * res['floor'][0]:+.1f}%." if res["floor"] else ""))
    if df["peer_grads"].str.startswith("differs").any():
        lines += ["", "`peer_grads = differs`: that peer's gradients are not those of plain PyTorch "
                  "although its outputs are. torch.compile with activation_memory_budget < 1 "
                  "recomputes dropout in the backward with fresh randomness, so the backward uses "
                  "another mask than the forward (pytorch/pytorch#190758, open); those rows compare "
                  "against memory bought with wrong gradients."]
    lines += ["", _fmt(df, args.clock), "", "Misses (measured):", ""]
    misses = df[df["verdict"] != "met"]
    if misses.empty:
        lines.append("- none")
    for r in misses.itertuples(index=False):
        lines.append(f"- {r.model} vs {r.peer}: {r.verdict}. {r.why}")
    for res in results:
        for n in res["notes"]:
            lines.append(f"- {res['spec'].name} sweep: {n}")
    lines.append("")
    for p in img_paths:
        rel = os.path.relpath(p, out_path.parent)
        lines.append(f"![{p.stem}]({rel})")
    return "\n".join(lines)


def write_section(out_path: Path, body: str) -> None:
    """Replace only the text between the peers markers (scripts/bench_doc.py, shared by every
    benchmark script); other scripts own other sections."""
    from bench_doc import replace_section
    out_path.parent.mkdir(parents=True, exist_ok=True)
    replace_section("peers", body, str(out_path))


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help=f"comma-separated, from {', '.join(SPECS['full'])}")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed steps per measure_step call (median)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="interleaved timing rounds per block (median over rounds)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (test and smoke run)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"),
                    help="markdown file whose Peers section is replaced")
    ap.add_argument("--img-dir", default=str(ROOT / "docs" / "img"), help="where PNGs go")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="solver time limit per budget in seconds (default 120, quick 10)")
    ap.add_argument("--profile-repeat", type=int, default=5,
                    help="timed steps per op in the measured profile")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's choice; quick: 1, because tiny "
                         "ops on oversubscribed cores spend more time in OpenMP barriers than "
                         "in work)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="step time: measure_step's median wall time, or the median thread CPU "
                         "time of the same timed steps (needs --threads 1; robust when other "
                         "processes share the cores)")
    ap.add_argument("--schedules-dir", default=None,
                    help="save each of our solved schedules there as JSON "
                         "(<model>_<budget bytes>.json), to look into a row afterwards")
    ap.add_argument("--sweep", default="0.1,0.25,0.4,0.6,0.8",
                    help="Pareto budgets as fractions between fixed memory and plain's peak")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in SPECS["full"]]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(SPECS['full'])}")
    args.sweep = [float(f) for f in args.sweep.split(",") if f.strip()]
    if args.time_limit is None:
        args.time_limit = 10.0 if args.quick else 120.0
    if args.threads is None and args.quick:
        args.threads = 1
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (other intra-op threads' CPU time is not seen)")
    if args.repeat < 1 or args.rounds < 1:
        ap.error("--repeat and --rounds must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = " ".join(["scripts/bench_peers.py"] + list(sys.argv[1:] if argv is None else argv))
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    sizes = SPECS["quick" if args.quick else "full"]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    results, failures = [], []
    for name in args.models:
        t0 = time.perf_counter()
        try:
            results.append(bench_model(sizes[name], args, log))
        except Exception as e:  # one model's failure must not hide the others' numbers
            failures.append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
        log(f"[{name}] done in {time.perf_counter() - t0:.0f} s")
    if not results:
        print("\n".join(failures), file=sys.stderr)
        return 1
    df = table(results)
    import pandas as pd
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(df.drop(columns=["why", "peer_note"]).to_string(index=False,
                                                               float_format=lambda v: f"{v:.2f}"))
    img_paths = [plot(r, Path(args.img_dir)) for r in results]
    out = Path(args.out)
    section = markdown(results, df, args, command, img_paths, out)
    if failures:
        section += "\n\nFailed models:\n\n" + "\n".join(f"- {f}" for f in failures)
    write_section(out, section)
    log(f"wrote {out} and {', '.join(map(str, img_paths))}")
    return 1 if failures else 0


if __name__ == "__main__":
    steady_cpu_allocator()  # every block in the same allocator state (bench_doc); not in tests
    sys.exit(main())
