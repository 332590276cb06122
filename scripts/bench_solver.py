"""Solver benchmark: MONeT's five models at MONeT's batches, budgets 5..10 GiB.

    python scripts/bench_solver.py                                  # everything, 600 s per solve
    python scripts/bench_solver.py --models resnet50 --budgets 8 --time-limit 300
    nohup python scripts/bench_solver.py > bench_solver.log 2>&1 &  # it takes hours: background

Each model is profiled on the meta device with analytical A100 costs (`monetlike.profile(model,
x, cost="analytical:A100-40GB")`, input 3x224x224), then `solver.solve` runs at each budget. A row
gives the status, seconds to the first schedule, to the final incumbent and to the end of the solve
(when the final gap was reached), the final gap against the MILP's proven bound, the predicted
overhead over store-all (the simulator's step time), the peak, and the MILP's size. A budget below
the model's minimum is reported with the minimum (`solver.min_budget`). The table is printed and
written to the "Solver" section of docs/BENCHMARKS.md (other sections belong to other scripts);
rows are also appended to a JSON-lines file as they finish, so `--resume` can continue a run
(and, once every row of a model is there, renders it without profiling it again: parts of a run
made by separate processes, each with its own --results file, are joined by concatenating the
files and running once more with --resume).
CI does not run this.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import solver  # noqa: E402
from solver import format_bytes, simulate, store_all_schedule  # noqa: E402

# MONeT's models and batches (MONeT, ICLR 2021, Table 1)
MODELS = {
    "resnet50": 184,
    "googlenet": 320,
    "unet": 11,
    "mobilenet_v2": 272,
    "vgg16": 176,
}
GiB = 2**30


def code_version(root: str = ROOT) -> str:
    """The commit the solver and profiler code came from: the short hash of HEAD, plus "+dirty"
    when solver/ or monetlike/ has uncommitted (or untracked) changes, so a table says which code
    produced each row. "unknown" outside a git checkout."""
    def git(*a):
        return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=normal", "--", "solver",
                    "monetlike")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def build_model(name: str):
    import torchvision

    if name == "googlenet":
        return torchvision.models.googlenet(aux_logits=False, init_weights=False)
    if name == "unet":
        from monetlike.models import UNet
        return UNet()
    return getattr(torchvision.models, name)()


def profile(name: str, batch: int):
    import torch

    import monetlike

    # MONeT's UNet input is 3x416x608 (its cvxpy_solver.py); the others are 3x224x224.
    shape = (3, 416, 608) if name == "unet" else (3, 224, 224)
    x = torch.randn(batch, *shape, device="meta")
    return monetlike.profile(build_model(name), x, cost="analytical:A100-40GB")


def run_one(graph, budget_gib: float, args, base, floor) -> dict:
    budget = int(budget_gib * GiB)
    row = {"model": args.current, "batch": graph.batch, "budget": f"{budget_gib:g} GiB",
           "mode": args.mode, "commit": args.commit}
    started = time.perf_counter()
    cpu0 = time.process_time()
    try:
        r = solver.solve(graph, budget, mode=args.mode, backend=args.backend,
                         time_limit_s=args.time_limit, mip_gap=args.mip_gap)
    except solver.InfeasibleBudgetError as e:
        row.update(status="infeasible", solve_s=round(time.perf_counter() - started, 1),
                   note=f"min {format_bytes(e.min_budget)}" if e.min_budget else str(e))
        return row
    st = r.stats
    row.update(
        status=r.status,
        first_s=st.get("first_incumbent_s"),
        best_s=st.get("best_found_s"),
        solve_s=round(r.solve_time_s, 1),
        gap_pct=None if r.mip_gap is None else round(100 * r.mip_gap, 2),
        overhead_pct=(None if r.predicted_time is None
                      else round(100 * (r.predicted_time / base - 1), 2)),
        peak=None if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes),
        variables=st.get("variables"), integer=st.get("integer_variables"),
        constraints=st.get("constraints"), nonzeros=st.get("nonzeros"),
        source=st.get("incumbent_source"), note=r.message or "",
        # CPU seconds this process got over the solve's wall seconds on the cores: a solve uses
        # both cores (branch and bound, LNS), so well under 100% means something else ran
        cpu_pct=round(100 * (time.process_time() - cpu0)
                      / (max(1e-9, time.perf_counter() - started) * (os.cpu_count() or 1)), 1),
        # for diagnosing a miss (results file only): where the incumbent and the bound came
        # from and how far each moved (seconds of step time; store-all for scale)
        detail={k: st.get(k) for k in ("store_all_time_s", "heuristic", "heuristic_objective_s",
                                       "lower_bound_s", "lp_bound_s", "bb_bound_s",
                                       "probe_bound_s", "probes", "phase1_s", "lns",
                                       "branch_and_bound_model")})
    return row


def parse_solve_args(ap, argv, results: str):
    """`ap`'s arguments, with the options of a script that solves at a time limit and gap and
    appends its rows to a JSON-lines file (`results`, in the temporary folder by default); the
    code's version is taken once, before anything is solved, as args.commit."""
    ap.add_argument("--time-limit", type=float, default=300.0)
    ap.add_argument("--mip-gap", type=float, default=0.02)
    ap.add_argument("--results", default=os.path.join(tempfile.gettempdir(), results))
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = ap.parse_args(argv)
    args.commit = code_version()
    return args


def pct_over(seconds, base: float):
    """A step time as a percentage over store-all's (None stays None)."""
    return None if seconds is None else round(100 * (seconds / base - 1), 2)


def timed_solve(graph, budget: int, args, row: dict, columns):
    """`solver.solve` at --time-limit and --mip-gap. `row` gets `columns(result)` (a dict), then
    the process's peak resident memory so far, the CPU time over wall time on all cores and the
    search's note; the result is returned. An infeasible budget's row says so; None then."""
    started = time.perf_counter()
    cpu0 = time.process_time()
    try:
        r = solver.solve(graph, budget, time_limit_s=args.time_limit, mip_gap=args.mip_gap)
    except solver.InfeasibleBudgetError as e:
        row.update(status="infeasible", solve_s=round(time.perf_counter() - started, 1),
                   note=str(e)[:200])
        return None
    row.update(columns(r))
    row.update(
        rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        cpu_pct=round(100 * (time.process_time() - cpu0)
                      / (max(1e-9, time.perf_counter() - started) * (os.cpu_count() or 1)), 1),
        note=r.stats.get("search", ""))
    return r


def markdown_table(df) -> str:
    """A pandas DataFrame as a GitHub markdown table (no extra dependency)."""
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "---|" * len(df.columns)
    body = ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def rows_section(rows: list[dict], script: str, columns, notes: str) -> str:
    """A section of BENCHMARKS.md: the header (the command `python scripts/<script>` with this
    process's arguments), `notes` (prose: its line breaks and indents fold into single spaces),
    then the table of `rows` in those `columns` they have."""
    import pandas as pd

    from bench_doc import header

    df = pd.DataFrame(rows)
    cols = [c for c in columns if c in df.columns]
    df = df[cols].astype(object).where(df[cols].notna(), "")
    command = f"python scripts/{script} " + " ".join(sys.argv[1:])
    return "\n".join([header(command.strip()), " ".join(notes.split()), "", markdown_table(df)]) + "\n"


def render(rows: list[dict], args, models_info: dict) -> str:
    import pandas as pd

    from bench_doc import header

    df = pd.DataFrame(rows)
    cols = [c for c in ("model", "batch", "budget", "status", "first_s", "best_s", "solve_s",
                        "gap_pct", "overhead_pct", "peak", "variables", "integer", "constraints",
                        "nonzeros", "source", "cpu_pct", "commit", "note") if c in df.columns]
    df = df[cols].astype(object).where(df[cols].notna(), "")
    for c in ("variables", "integer", "constraints", "nonzeros"):
        if c in df.columns:
            df[c] = [v if v == "" else int(v) for v in df[c]]
    info = "; ".join(f"{m}: {i['ops']} ops, store-all {i['store_all']}, min budget "
                     f"{i['min_budget']}" for m, i in models_info.items())
    shown = list(sys.argv[1:])
    if "--note" in shown:  # the note is printed under the table, not in the command
        i = shown.index("--note")
        del shown[i:i + 2]
    command = "python scripts/bench_solver.py " + " ".join(shown)
    body = [header(command.strip()),
            f"Mode `{args.mode}`, backend `{args.backend}`, time limit {args.time_limit:g} s per "
            f"solve, target gap {100 * args.mip_gap:g}%. Costs: analytical A100-40GB roofline "
            f"(a plan for a GPU this machine does not have). Overhead: predicted step time over "
            f"store-all (plain PyTorch), both from the simulator. Gap: (incumbent - proven lower "
            f"bound) / incumbent on the whole step time. first_s / best_s / solve_s: seconds to "
            f"the first schedule, to the final one, and to the end of the solve (the final gap). "
            f"commit: the code that produced the row (short hash of HEAD when its run started; "
            f"+dirty: uncommitted changes under solver/ or monetlike/; empty: not recorded). "
            f"cpu_pct: CPU time the solve got over its wall time on all cores (a solve keeps "
            f"both busy; well under 100 means other processes shared the machine).",
            "", f"Models: {info}.", "", markdown_table(df)]
    if args.note:
        body += ["", args.note]
    return "\n".join(body) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--budgets", default="5,6,7,8,9,10", help="GiB, comma-separated")
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds per solve")
    ap.add_argument("--mip-gap", type=float, default=0.01, help="relative gap to stop at")
    ap.add_argument("--mode", choices=("full", "checkpoint"), default="full",
                    help="full: keep/recompute and Impl choice; checkpoint: keep/recompute")
    ap.add_argument("--backend", default="highs", help="MILP backend")
    ap.add_argument("--results",
                    default=os.path.join(tempfile.gettempdir(), "monetlike_bench_solver.jsonl"),
                    help="JSON-lines file the rows are appended to as they finish")
    ap.add_argument("--resume", action="store_true",
                    help="skip (model, budget, mode) rows already in --results")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    ap.add_argument("--note", default="",
                    help="a paragraph printed under the table (how the run was made, say)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; expected some of {list(MODELS)}")
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    # taken once, before anything is solved: the code this process loaded (a commit made while it
    # runs does not change what it runs)
    args.commit = code_version()

    done: dict[tuple, dict] = {}
    known: dict[tuple, dict] = {}  # model facts of an earlier run (profile, store-all, minimum)
    if args.resume and os.path.exists(args.results):
        with open(args.results, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                if row.get("kind") == "model":
                    known[(row["model"], row["mode"])] = row
                else:
                    done[(row["model"], row["budget"], row["mode"])] = row
    elif os.path.exists(args.results):
        os.unlink(args.results)

    rows, models_info = [], {}
    for name in models:
        batch = MODELS[name]
        keys = [(name, f"{b:g} GiB", args.mode) for b in budgets]
        if (name, args.mode) in known and all(k in done for k in keys):
            # everything of this model is in --results: render it without profiling again
            models_info[name] = {k: known[(name, args.mode)][k]
                                 for k in ("ops", "store_all", "min_budget")}
            rows.extend(done[k] for k in keys)
            continue
        t0 = time.perf_counter()
        graph = profile(name, batch)
        base_tl = simulate(graph, store_all_schedule(graph))
        floor = solver.min_budget(graph, mode=args.mode, time_limit_s=min(120.0, args.time_limit))
        models_info[name] = {"ops": len(graph.ops), "store_all": format_bytes(base_tl.peak_bytes),
                             "min_budget": format_bytes(floor)}
        with open(args.results, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": "model", "model": name, "mode": args.mode,
                                **models_info[name]}) + "\n")
        print(f"{name} batch {batch}: {len(graph.ops)} ops, store-all "
              f"{format_bytes(base_tl.peak_bytes)}, min budget {format_bytes(floor)} "
              f"({time.perf_counter() - t0:.0f} s to profile and bound)", flush=True)
        args.current = name
        for b in budgets:
            key = (name, f"{b:g} GiB", args.mode)
            if key in done:
                rows.append(done[key])
                continue
            row = run_one(graph, b, args, base_tl.total_time, floor)
            rows.append(row)
            with open(args.results, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            if not args.no_write:
                from bench_doc import replace_section
                replace_section("solver", render(rows, args, models_info))
    text = render(rows, args, models_info)
    print(text)
    if not args.no_write:
        from bench_doc import replace_section
        replace_section("solver", text)
        print("wrote the Solver section of docs/BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
