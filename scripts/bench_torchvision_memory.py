"""Predicted vs allocator-measured peaks on every torchvision classification model (issue 18).

    python scripts/bench_torchvision_memory.py               # writes its section of BENCHMARKS.md
    python scripts/bench_torchvision_memory.py --no-write    # print only
    python scripts/bench_torchvision_memory.py --models resnet18,alexnet
    python scripts/bench_torchvision_memory.py --rows tv_rows.csv --minutes 60   # resumable

Each model of `torchvision.models.list_models(module=torchvision.models)` is built with random
weights in training mode and profiled on this CPU (measured costs) at a small input. Then, by the
CPU allocator's own count (`monetlike.measure_step`): plain PyTorch's peak against the predicted
store-all peak, and the wrapped step of the solver's schedules at two budgets (a quarter and
three quarters of the way from the least feasible peak to store-all) against the budget and the
prediction. Target: measured within 1% of predicted on every row, and at or under the budget on
every solved row. Models that do not trace or do not run at the input are listed with the error;
models over --max-params parameters are listed as skipped (time on a 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
from tqdm import tqdm  # noqa: E402

import monetlike  # noqa: E402
import solver  # noqa: E402
from bench_doc import header_with_commit, replace_section  # noqa: E402
from bench_solver import markdown_table  # noqa: E402
from solver.jsonio import atomic_write_text  # noqa: E402
from solver.simulate import simulate, store_all_schedule  # noqa: E402

MIB = 2 ** 20
# Models whose constructors need the input size when it is not 224 (they size positional
# embeddings or attention windows from it).
SIZED = {"vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14"}


def build(name: str, size: int) -> torch.nn.Module:
    kwargs = {"weights": None}
    if name in SIZED:
        kwargs["image_size"] = size
    if name in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = True
    return torchvision.models.get_model(name, **kwargs).train()


def measured_peak(graph, model, module, x) -> int:
    """One step's peak by the allocator, the model's fixed memory included (as the simulator
    counts it); the step holds its output until the backward, as a training loop does."""
    def step():
        out = module(x)
        out.float().sum().backward()

    torch.manual_seed(3)
    step()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(3)
    m = monetlike.measure_step(step, warmup=0, repeat=1)
    return m.peak_bytes - m.start_bytes + graph.fixed_bytes


def rows_for(name: str, batch: int, size: int, time_limit: float) -> list[dict]:
    torch.manual_seed(0)
    model = build(name, size)
    x = torch.randn(batch, 3, size, size)
    t0 = time.perf_counter()
    graph = monetlike.profile(model, x, repeat=1)
    profile_s = time.perf_counter() - t0
    store = simulate(graph, store_all_schedule(graph)).peak_bytes
    plain = measured_peak(graph, model, model, x)
    base = {"model": name, "input": f"{batch}x3x{size}x{size}", "ops": len(graph.ops),
            "profile_s": round(profile_s, 1)}
    rows = [{**base, "schedule": "store-all (plain PyTorch)", "budget_MiB": None,
             "predicted_MiB": store / MIB, "measured_MiB": plain / MIB,
             "error_%": 100 * (plain - store) / store, "within_budget": None}]
    least = solver.min_budget(graph, time_limit_s=time_limit)
    for f in (3, 1):
        budget = least + (store - least) * f // 4
        result = solver.solve(graph, budget, time_limit_s=time_limit)
        s = result.schedule
        predicted = simulate(graph, s).peak_bytes
        measured = measured_peak(graph, model,
                                 monetlike.ScheduleWrapper(model, s, graph=graph), x)
        rows.append({**base, "schedule": f"solved, {sum(len(t.recompute) for t in s.stages)} "
                                         f"recomputed", "budget_MiB": budget / MIB,
                     "predicted_MiB": predicted / MIB, "measured_MiB": measured / MIB,
                     "error_%": 100 * (measured - predicted) / predicted,
                     "within_budget": measured <= budget})
    return rows


def run(names, batch, size, time_limit, max_params, minutes=None,
        rows_path=None) -> tuple[pd.DataFrame, list[str]]:
    """Measure `names`. With `rows_path`, the rows of each model are saved there (CSV, written
    atomically) as soon as it is done, and models already in it are not run again: a run stopped
    by --minutes or a reboot goes on where it stopped."""
    rows, notes = [], []
    done = set()
    if rows_path and os.path.exists(rows_path):
        saved = pd.read_csv(rows_path)
        rows = saved.astype(object).where(saved.notna(), None).to_dict("records")
        done = set(saved["model"])
    started = time.perf_counter()
    todo = [n for n in names if n not in done]
    for k, name in enumerate(tqdm(todo, desc="torchvision", unit="model")):
        if minutes is not None and time.perf_counter() - started > 60 * minutes:
            notes.append(f"not run (--minutes {minutes:g} reached): {', '.join(todo[k:])}")
            break
        try:
            n_params = sum(p.numel() for p in build(name, size).parameters())
            if n_params > max_params:
                notes.append(f"{name}: skipped, {n_params / 1e6:.0f}M parameters "
                             f"(over --max-params {max_params / 1e6:.0f}M)")
                continue
            rows.extend(rows_for(name, batch, size, time_limit))
            if rows_path:
                atomic_write_text(rows_path, pd.DataFrame(rows).to_csv(index=False))
        except Exception as e:  # a model that does not trace or run is reported, not fatal
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            notes.append(f"{name}: {type(e).__name__}: {first[:160]}")
            traceback.print_exc(limit=1)
    return pd.DataFrame(rows), notes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=64, help="input height and width")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    ap.add_argument("--max-params", type=float, default=100e6)
    ap.add_argument("--minutes", type=float, default=None,
                    help="start no new model after this many minutes (the rest are listed)")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch BENCHMARKS.md")
    ap.add_argument("--rows", default=None, metavar="CSV",
                    help="keep each model's rows in this file as it finishes, and skip the "
                         "models already there (resume a long run)")
    args = ap.parse_args(argv)
    names = ([n for n in args.models.split(",") if n] if args.models
             else sorted(torchvision.models.list_models(module=torchvision.models)))
    torch.set_num_threads(1)
    df, notes = run(names, args.batch, args.size, args.time_limit, args.max_params, args.minutes,
                    args.rows)
    solved = df[df["within_budget"].notna()] if len(df) else df
    summary = (f"{df['model'].nunique() if len(df) else 0} models measured (the others below). "
               f"Worst |error| {df['error_%'].abs().max():.2f}% (target 1%); solved rows over "
               f"their budget: {int((~solved['within_budget'].astype(bool)).sum())} of "
               f"{len(solved)}." if len(df) else "No model measured.")
    table = markdown_table(df.round(3).astype(object).where(df.notna(), ""))
    body = "\n".join([header_with_commit("bench_torchvision_memory.py", argv), "",
                      "Training mode, random weights, one intra-op thread, measured CPU costs; "
                      "peaks by the CPU allocator's own events (monetlike.measure_step), the "
                      "model's parameters included. error_% = (measured - predicted) / predicted.",
                      "", summary, "", table, "", "Not measured:", "",
                      *[f"- {n}" for n in notes]])
    print(body)
    if not args.no_write:
        replace_section("torchvision-memory", body)


if __name__ == "__main__":
    main()
