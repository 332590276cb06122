"""The `monetlike` command: argparse subcommands, each a thin shell over a typed function.

    monetlike profile torchvision.models.resnet50 --batch 184 --cost analytical:A100-40GB -o g.json
    monetlike solve torchvision.models.resnet50 --batch 184 --budget 8GiB --cost analytical:A100-40GB
    monetlike backends

Exit codes: 0 ok, 2 usage error (bad arguments, unparsable budget, unknown model), 1 failure (the
solve or the run failed). Errors are one line on stderr; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from solver.errors import (BackendUnavailableError, BudgetParseError, FormatError,
                           InfeasibleBudgetError, MonetlikeError, ScheduleMismatchError)
from solver.units import format_bytes, parse_bytes

from .modelspec import ModelSpecError, build_model

# Errors that mean "you asked for something malformed": exit code 2.
USAGE_ERRORS = (BudgetParseError, ModelSpecError, FormatError, BackendUnavailableError,
                ScheduleMismatchError)


class UsageError(MonetlikeError, ValueError):
    """A bad combination of command-line arguments."""


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 3,224,224, got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive sizes like 3,224,224, got {text!r}")
    return dims


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except BudgetParseError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_writable(path: str | None) -> None:
    """Fail before any work if the output cannot be written, so nothing is half-done."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"cannot write {path!r}: directory {directory!r} does not exist; "
                         f"create it or choose another -o")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"cannot write {path!r}: directory {directory!r} is not writable; "
                         f"choose another -o")


def example_inputs(batch: int, input_shape: Sequence[int], device: str = "cpu"):
    import torch

    if batch <= 0:
        raise UsageError(f"--batch must be a positive integer, got {batch}")
    return torch.randn(batch, *input_shape, device=device)


# ----------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------
def cmd_profile(args) -> int:
    from . import profile

    _check_writable(args.output)
    model = build_model(args.model)
    x = example_inputs(args.batch, args.input_shape)
    start = time.perf_counter()
    graph = profile(model, x, cost=args.cost, optimizer=args.optimizer)
    seconds = time.perf_counter() - start
    from solver import simulate, store_all_schedule

    peak = simulate(graph, store_all_schedule(graph)).peak_bytes
    print(f"profiled {args.model} batch {args.batch}: {len(graph.ops)} ops, "
          f"{len(graph.backward_order)} backward stages, costs {graph.cost_provenance}, "
          f"{seconds:.1f} s")
    print(f"store-all (plain PyTorch) peak: {format_bytes(peak)} ({peak / 1e9:.2f} GB); "
          f"fixed {format_bytes(graph.fixed_bytes)}")
    if args.output:
        graph.save(args.output)
        print(f"wrote {args.output}")
    return 0


def cmd_solve(args) -> int:
    import solver

    from . import profile

    _check_writable(args.output)
    if args.graph:
        graph = solver.OpGraph.load(args.graph)
    else:
        if not args.model:
            raise UsageError("solve needs MODEL (with --batch) or --graph FILE")
        model = build_model(args.model)
        graph = profile(model, example_inputs(args.batch, args.input_shape), cost=args.cost,
                        optimizer=args.optimizer)
    result = solver.solve(graph, args.budget, mode=args.mode, backend=args.backend,
                          time_limit_s=args.time_limit, verbose=args.verbose)
    base = solver.simulate(graph, solver.store_all_schedule(graph))
    print(summary_table(graph, result, args.budget, base))
    if not result.ok:
        print(f"error: {result.message}", file=sys.stderr)
        return 1
    if args.output:
        result.schedule.save(args.output)
        print(f"wrote {args.output}")
    return 0


def summary_table(graph, result, budget: int, base) -> str:
    import pandas as pd

    overhead = (None if result.predicted_time is None
                else 100.0 * (result.predicted_time / base.total_time - 1.0))
    row = {
        "model": graph.model, "batch": graph.batch, "budget": format_bytes(budget),
        "store-all peak": format_bytes(base.peak_bytes),
        "predicted peak": "-" if result.predicted_peak_bytes is None
        else format_bytes(result.predicted_peak_bytes),
        "overhead": "-" if overhead is None else f"{overhead:.2f}%",
        "status": result.status,
        "gap": "-" if result.mip_gap is None else f"{100 * result.mip_gap:.2f}%",
        "solve time": f"{result.solve_time_s:.1f} s", "costs": graph.cost_provenance,
    }
    return pd.DataFrame([row]).to_string(index=False)


def cmd_backends(args) -> int:
    from solver import backends

    names = backends.available()
    for name in backends.known():
        print(f"{name:8s} {'installed' if name in names else 'not installed'}")
    return 0


def _not_yet(name: str):
    def run(args) -> int:
        raise NotImplementedError(f"`monetlike {name}` is not implemented in this version yet")
    return run


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------
def _add_model_args(p, *, model_required: bool = True) -> None:
    p.add_argument("model", nargs=None if model_required else "?",
                   help="importable factory (torchvision.models.resnet50, pkg.mod:factory) or "
                        "path/to/file.py:factory")
    p.add_argument("--batch", type=int, required=model_required, help="batch size")
    p.add_argument("--input-shape", type=_shape, default=(3, 224, 224),
                   help="input shape after the batch dimension, e.g. 3,224,224 (default)")
    p.add_argument("--cost", default="measured",
                   help="'measured' (time ops on this device) or 'analytical:DEVICE', e.g. "
                        "analytical:A100-40GB")
    p.add_argument("--optimizer", choices=("none", "sgd", "adam"), default="none",
                   help="optimizer whose state counts towards the budget")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="monetlike",
                                     description="Fit PyTorch training into a memory budget at the "
                                                 "lowest recomputation cost.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("profile", help="trace and profile a model into an operator graph")
    _add_model_args(p)
    p.add_argument("-o", "--output", help="write the graph JSON here")
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("solve", help="find the cheapest schedule that fits a budget")
    _add_model_args(p, model_required=False)
    p.add_argument("--graph", help="solve this profiled graph JSON instead of profiling MODEL")
    p.add_argument("--budget", type=_budget, required=True,
                   help="memory budget: bytes, or with a unit (8GiB = 8*2^30, 8GB = 8*10^9)")
    p.add_argument("--mode", choices=("full", "checkpoint"), default="full",
                   help="full: keep/recompute and operator implementations; checkpoint: "
                        "keep/recompute only")
    p.add_argument("--backend", default="highs", help="MILP backend (see `monetlike backends`)")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="seconds; the best schedule found by then is returned with its gap")
    p.add_argument("--verbose", action="store_true", help="show the solver's progress")
    p.add_argument("-o", "--output", help="write the schedule JSON here")
    p.set_defaults(run=cmd_solve)

    p = sub.add_parser("backends", help="list the MILP backends and whether they are installed")
    p.set_defaults(run=cmd_backends)

    for name, text in (("check", "run a schedule here and compare with plain PyTorch"),
                       ("zoo", "list, show and pick prebuilt schedules"),
                       ("explain", "where the memory goes and what recomputation can save"),
                       ("pareto", "the budget vs overhead curve"),
                       ("maxbatch", "the largest batch that fits a budget")):
        p = sub.add_parser(name, help=text)
        p.set_defaults(run=_not_yet(name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "optimizer", None) == "none":
        args.optimizer = None
    try:
        return args.run(args)
    except (UsageError, *USAGE_ERRORS) as e:
        if args.debug:
            raise
        print(f"monetlike {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (InfeasibleBudgetError, MonetlikeError, NotImplementedError, OSError) as e:
        if args.debug:
            raise
        print(f"monetlike {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
