"""The `monetlike` command: argparse subcommands, each a thin shell over a typed function.

    monetlike profile torchvision.models.resnet50 --batch 184 --cost analytical:A100-40GB -o g.json
    monetlike solve torchvision.models.resnet50 --batch 184 --budget 8GiB --cost analytical:A100-40GB
    monetlike backends

Exit codes: 0 ok, 2 usage error (bad arguments, unparsable budget, unknown model), 1 failure (the
solve or the run failed), 130 interrupted (Ctrl-C). Errors are one line on stderr (argparse's own
included: `Parser.error`); `--debug` shows the traceback.

A file never decides what code runs: a model is imported only from what the user typed (MODEL,
`check --model`). The model a schedule records (`meta.model_spec`) is only shown as a hint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from typing import Sequence

import torch

import solver
from solver import backends, simulate, store_all_schedule
from solver.errors import (BackendUnavailableError, BudgetParseError, FormatError,
                           InfeasibleBudgetError, MonetlikeError, OverBudgetError,
                           ScheduleMismatchError)
from solver.units import format_bytes, parse_bytes
from solver.formulation import OFFLOAD_MODES, offload_obstacle
from solver.verify import verified

from . import zoo
from .calibrate import calibrate
from .check import check_schedule
from .cli_args import (DEFAULT_INPUT_SHAPE, Parser, UsageError, add_link_and_fsdp_args,
                       add_model_args, budget_arg, budgets_arg,
                       check_writable, example_inputs, model_file, percent_arg, positive_int,
                       profile_device, seconds_arg, shape_arg)
from .cli_help import add_examples
from .core.torch_private import tree_leaves
from .explain import explain
from .maxbatch import max_batch, model_batch_maker
from .modelspec import LOSSES, ModelSpecError, build_model, load_loss
from .pareto import pareto, plot_pareto, table
from .profile import FSDPConfig, profile
from .profile.costs import parse_cost
from .profile.records import ProfileError
from .zoo import ZooError

# Errors that mean "you asked for something malformed": exit code 2.
USAGE_ERRORS = (BudgetParseError, ModelSpecError, FormatError, BackendUnavailableError, ZooError,
                ScheduleMismatchError)


# ----------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _fed_by_the_cli(args, model, shape: Sequence):
    """Errors of a model that fails on the input the command line made for it (one float tensor
    of --batch x --input-shape; `shape` its shape, the batch as a name where it varies) say so,
    and how to give it its own."""

    try:
        yield
    except (ProfileError, TypeError) as e:
        if callable(getattr(model, "example_inputs", None)):
            raise
        raise UsageError(
            f"{_one_line(e)}. The command line gave {args.model} one float32 tensor of shape "
            f"({', '.join(map(str, shape))}) (--batch, --input-shape "
            f"{','.join(map(str, shape[1:]))}); if the model takes other inputs (token ids, "
            f"several tensors, keywords), give the model your factory returns a method "
            f"example_inputs(batch, seq_len, device) that makes them (monetlike.models.gpt2 has "
            f"one), or profile it from Python: monetlike.profile(model, inputs)") from e


def _profile_args(args):
    """Build MODEL and profile it at --batch/--input-shape with --cost, --optimizer and
    --host-bandwidth (commands without that flag: the profiler's own figure)."""

    device = profile_device(args.cost)
    # Analytical costs need shapes only: built on the meta device, an 8B model allocates nothing.
    with torch.device(device) if device == "meta" else contextlib.nullcontext():
        model = build_model(args.model)
    loss_fn = load_loss(args.loss)
    x = example_inputs(args.batch, args.input_shape, device, model)
    fsdp = _fsdp_config(args, model)
    with _fed_by_the_cli(args, model, getattr(x, "shape", ())):
        graph = profile(model, x, cost=args.cost, optimizer=args.optimizer,
                        host_bandwidth=getattr(args, "host_bandwidth", None), loss_fn=loss_fn,
                        fsdp=fsdp)
    if getattr(args, "calibrate", False):

        graph = calibrate(model, x, graph)
    return graph


def _fsdp_config(args, model) -> "FSDPConfig | None":
    """--fsdp RANKS: FSDP2 as torchtitan shards a transformer (FSDPConfig.per_block)."""
    if getattr(args, "fsdp", None) is None:
        return None
    dtypes = {name: None if value == "none" else getattr(torch, value)
              for name, value in (("param_dtype", args.fsdp_param_dtype),
                                  ("reduce_dtype", args.fsdp_reduce_dtype))}
    fsdp = FSDPConfig.per_block(model, args.fsdp, **dtypes)
    if not fsdp.units:
        print(f"--fsdp: {type(model).__name__} has no block list (nn.ModuleList): the root is "
              f"its only fully_shard unit", file=sys.stderr)
    return fsdp


def fsdp_summary(graph) -> str:
    """One rank's FSDP2 figures of a graph profiled with fsdp=..., in a few lines; '' without."""
    fsdp = graph.meta.get("fsdp") if isinstance(graph.meta, dict) else None
    if not fsdp or "per_rank" not in fsdp:
        return ""
    f = fsdp["per_rank"]
    n = fsdp["world_size"]
    units = fsdp["units"]
    return "\n".join([
        f"FSDP2 per rank ({n} ranks; {len(units)} block units and the root; param_dtype "
        f"{fsdp['param_dtype']}; reduce_dtype {fsdp.get('reduce_dtype') or 'as param_dtype'}; "
        f"reshard_after_forward {fsdp['reshard_after_forward']}):",
        f"  parameters {format_bytes(f['unsharded_params'])} unsharded in param_dtype, "
        f"{format_bytes(f['sharded_params'])} sharded (1/{n}); sharded gradients "
        f"{format_bytes(f['sharded_grads'])}; optimizer state {format_bytes(f['optimizer'])}",
        f"  all-gathered while in use: the root's {format_bytes(f['root_unsharded'])} (all "
        f"step), a block's {format_bytes(f['largest_unit_unsharded'])} (its own, the one "
        f"prefetched, and their flat buffers)"])


def cmd_profile(args) -> int:
    check_writable(args.output, model_file(args.model))
    if args.calibrate and parse_cost(args.cost)[0] == "analytical":
        raise UsageError(f"--calibrate fits measured costs to the step as it runs on this "
                         f"device; --cost {args.cost} is a roofline for another one: use "
                         f"--cost measured, or leave out --calibrate")
    if args.calibrate and args.fsdp is not None:
        raise UsageError("--calibrate times the unsharded step on this device; it is not "
                         "modelled under --fsdp: leave out one of them")
    start = time.perf_counter()
    graph = _profile_args(args)
    seconds = time.perf_counter() - start

    peak = simulate(graph, store_all_schedule(graph)).peak_bytes
    print(f"profiled {args.model} batch {args.batch}: {len(graph.ops)} ops, "
          f"{len(graph.backward_order)} backward stages, costs {graph.cost_provenance}, "
          f"{seconds:.1f} s")
    print(f"store-all (plain PyTorch) peak: {format_bytes(peak)} ({peak / 1e9:.2f} GB); "
          f"fixed {format_bytes(graph.fixed_bytes)}; host link "
          f"{_format_rate(graph.host_bandwidth)}")
    if fsdp_summary(graph):
        print(fsdp_summary(graph))
    cal = graph.meta.get("calibration")
    if cal:
        print(f"calibrated: forward x{cal['forward_scale']:.3f}, backward "
              f"x{cal['backward_scale']:.3f}, {cal['recompute_timed_ops']} of {cal['ops']} ops' "
              f"recomputation timed in context")
    if args.output:
        graph.save(args.output)
        print(f"wrote {args.output}")
    return 0


def _format_rate(rate: float | None) -> str:
    return "none (offload unavailable)" if rate is None else f"{rate / 1e9:.1f} GB/s"


# Said when --offload meets a graph without a host link (a CPU profile has none).
_NO_LINK = ("--offload needs the bandwidth of the device<->host link, and this graph has none "
            "(measured profiles here run on the CPU, which has no such link): pass "
            "--host-bandwidth (bytes per second, e.g. 25GB/s), use --cost analytical:DEVICE "
            "(each preset has a nominal figure), or solve without --offload")


def cmd_solve(args) -> int:

    check_writable(args.output, args.graph, model_file(args.model))
    if args.offload and args.mode not in OFFLOAD_MODES:
        raise UsageError(f"--offload is a choice of --mode full, not of --mode {args.mode}")
    if args.graph and args.fsdp is not None:
        raise UsageError("--fsdp profiles MODEL as one rank of FSDP2; a --graph is already "
                         "profiled: profile it with --fsdp (monetlike profile MODEL --fsdp N -o "
                         "FILE), or give MODEL instead of --graph")
    if args.graph:
        graph = solver.OpGraph.load(args.graph)
        _check_graph_agrees(graph, args)
        if args.host_bandwidth is not None:  # a cost, not part of the fingerprint
            graph = dataclasses.replace(graph, host_bandwidth=args.host_bandwidth)
    else:
        if not args.model:
            raise UsageError("solve needs MODEL (with --batch) or --graph FILE")
        if args.batch is None:
            raise UsageError(f"solve {args.model} needs --batch N (the batch to plan for), or "
                             f"--graph FILE from `monetlike profile`")
        if args.offload and args.host_bandwidth is None and \
                parse_cost(args.cost)[0] != "analytical":
            raise UsageError(_NO_LINK)  # before profiling: the profile would have no link
        graph = _profile_args(args)
    if args.offload and offload_obstacle(args.mode, graph.host_bandwidth) == "link":
        raise UsageError(_NO_LINK)
    best = _BestSoFar(graph, args)
    try:
        with interruptible("monetlike solve", on_interrupt=best.write):
            result = solver.solve(graph, args.budget, mode=args.mode, backend=args.backend,
                                  time_limit_s=args.time_limit, verbose=args.verbose,
                                  offload=args.offload, on_incumbent=best.offer)
    except ValueError as e:
        if isinstance(e, MonetlikeError):  # infeasible budget and the like keep their exit code
            raise
        # solve() checks its arguments with plain ValueErrors (offload without a host link,
        # a bad mode) before any work: a usage error here.
        raise UsageError(str(e)) from e
    base = solver.simulate(graph, solver.store_all_schedule(graph))
    if fsdp_summary(graph):
        print(fsdp_summary(graph))
    print(summary_table(graph, result, args.budget, base))
    if not result.ok:
        print(f"error: {result.message}", file=sys.stderr)
        return 1
    if args.output:
        _save_schedule(result.schedule, graph, args)
        print(f"wrote {args.output}")
    return 0


def _save_schedule(sched, graph, args, **meta_extra) -> None:
    meta = {**sched.meta, "input_shape": list(_graph_input_shape(graph) or ()), **meta_extra}
    if args.model:  # a hint for `check` (module docstring), never imported from the file
        meta["model_spec"] = args.model
    if getattr(args, "loss", "sum") != "sum":
        meta["loss"] = args.loss  # what `check` measures with, unless told otherwise
    dataclasses.replace(sched, meta=meta).save(args.output)


class _BestSoFar:
    """The best schedule a running solve has found that fits the budget (replayed by the
    simulator as it arrives), so that Ctrl-C with -o writes it, marked as interrupted."""

    def __init__(self, graph, args):
        import threading

        self.graph, self.args = graph, args
        self.lock = threading.Lock()
        self.schedule = None
        self.bound = None

    def offer(self, schedule, bound) -> None:
        budget = parse_bytes(self.args.budget)
        try:  # the gate (solver/verify.py): a lazy-row model's plan is not yet checked
            s = verified(self.graph, dataclasses.replace(schedule, budget_bytes=budget),
                         source="the solver's incumbent")
        except OverBudgetError:
            return
        with self.lock:
            self.schedule, self.bound = s, bound

    def write(self) -> str:
        with self.lock:
            s, bound = self.schedule, self.bound
        if s is None or not self.args.output:
            return "no output written" if s is None else \
                "no output written (no -o); a schedule had been found"
        gap = None if bound is None else max(0.0, (s.predicted_time - bound) / s.predicted_time)
        _save_schedule(s, self.graph, self.args, interrupted=True, gap=gap)
        gap_text = "gap unknown" if gap is None else f"gap {gap:.1%}"
        return f"best schedule so far written to {self.args.output} ({gap_text})"


def _graph_input_shape(graph) -> tuple[int, ...] | None:
    """The first input's shape after the batch dimension, as the graph records it."""
    shapes = graph.summary().get("input_shapes") or []
    return tuple(shapes[0][1:]) if shapes and shapes[0] else None


def _check_graph_agrees(graph, args) -> None:
    """`solve --graph` plans for the graph's own batch and input shape: a different --batch or
    --input-shape is a contradiction, not a request (the graph cannot be re-shaped here)."""
    shape = _graph_input_shape(graph)
    if args.batch is not None and args.batch != graph.batch:
        raise UsageError(f"--batch {args.batch} contradicts the graph {args.graph!r}, profiled at "
                         f"batch {graph.batch}; drop --batch or profile again at that batch")
    if args.input_shape is not None and shape is not None and tuple(args.input_shape) != shape:
        raise UsageError(f"--input-shape {','.join(map(str, args.input_shape))} contradicts the "
                         f"graph {args.graph!r}, profiled with input shape "
                         f"{','.join(map(str, shape))}; drop --input-shape or profile again")


def _exit_interrupted(command: str, outcome: str) -> None:
    sys.stderr.write(f"{command}: interrupted; {outcome}\n")
    sys.stderr.flush()
    os._exit(130)


@contextlib.contextmanager
def interruptible(command: str, outcome: str = "no output written", on_interrupt=None):
    """Around a long solve: native stdout to stderr, and Ctrl-C stops the process at once with
    the one line "COMMAND: interrupted; OUTCOME" and exit code 130 (scripts/build_zoo.py too).
    `on_interrupt()`, if given, runs first (in the watcher thread) and returns the OUTCOME to
    report, e.g. after writing the best schedule found so far; if it fails, OUTCOME is used.

    At once, not at the solver's next return: HiGHS swallows a KeyboardInterrupt raised in its
    callbacks and runs on to its time limit (measured: a GoogLeNet solve given SIGINT after 40 s
    ended 86 s later with rc 0 and its output written), and Python runs a signal handler only
    between bytecodes of the main thread, which can sit in native code for seconds. So the C
    handler's wakeup byte is read by a watcher thread blocked in os.read (no GIL needed to
    wait), which ends the process. Nothing is written while this is in place (outputs are
    written after), so an old output file stays as it was."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        with _native_stdout_to_stderr():
            yield
        return
    r, w = os.pipe()
    os.set_blocking(w, False)

    def watch():
        while True:
            data = os.read(r, 64)
            if not data:  # the write end closed: the solve is over
                return
            if signal.SIGINT in data:
                said = outcome
                if on_interrupt is not None:
                    try:
                        said = on_interrupt()
                    except Exception as e:  # never a traceback on Ctrl-C
                        said = f"{outcome} ({type(e).__name__}: {str(e).splitlines()[0]})"
                _exit_interrupted(command, said)

    # The Python-level handler does nothing: the watcher alone ends the process (one message),
    # and it also sees a Ctrl-C that lands just as the solve returns (read before the close).
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="monetlike-sigint", daemon=True)
    watcher.start()
    try:
        with _native_stdout_to_stderr():
            yield
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, previous)
        os.close(w)  # the watcher's read returns b"" and it ends
        watcher.join()
        os.close(r)


@contextlib.contextmanager
def _native_stdout_to_stderr():
    """Send what native code prints on file descriptor 1 (HiGHS prints its banner there on
    every solve, whatever its options) to stderr: stdout carries the command's answer only."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedding host): nothing to redirect
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


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

    names = backends.available()
    for name in backends.known():
        print(f"{name:12s} {'installed' if name in names else 'not installed'}")
    return 0


def _hint(text) -> str:
    """A string read from a file, safe to print in one ASCII line."""
    text = str(text)[:200]
    return text.encode("ascii", "backslashreplace").decode().replace("\n", " ")


def _schedule_batch(sched, path: str) -> int:
    batch = sched.graph_summary.get("batch")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise UsageError(f"{path}: graph_summary.batch: expected a positive integer, got "
                         f"{_hint(repr(batch))}; pass --batch N or re-solve the schedule")
    return batch


def _schedule_input_shape(sched, path: str) -> tuple[int, ...]:
    shapes = sched.graph_summary.get("input_shapes")
    first = shapes[0] if isinstance(shapes, list) and shapes else None
    if (not isinstance(first, list) or len(first) < 1
            or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in first)):
        raise UsageError(f"{path}: graph_summary.input_shapes[0]: expected a list of positive "
                         f"integers, got {_hint(repr(first))}; pass --input-shape or re-solve")
    return tuple(first[1:])


def cmd_check(args) -> int:


    sched = solver.Schedule.load(args.schedule)
    if not args.model:
        # A file never decides what code runs (module docstring): the model it records is a hint.
        recorded = sched.meta.get("model_spec")
        hint = (f": this schedule was made for {_hint(recorded)}; if you trust that, run "
                f"`monetlike check {args.schedule} --model {_hint(recorded)}`"
                if isinstance(recorded, str) and recorded.strip() else "")
        raise UsageError(f"check needs --model MODEL (a schedule file never chooses the code to "
                         f"run){hint}")
    batch = args.batch or _schedule_batch(sched, args.schedule)
    shape = args.input_shape or _schedule_input_shape(sched, args.schedule)
    model = build_model(args.model)
    loss_fn = load_loss(args.loss or _recorded_loss(sched, args.schedule))
    x = _check_inputs(model, sched, args, batch, shape)
    try:
        report = check_schedule(sched, model, x, loss_fn=loss_fn)
    except MonetlikeError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        # The model itself failed on the example input: a wrong --model or --input-shape.
        raise UsageError(f"{args.model} failed on {_describe_inputs(x)}: "
                         f"{type(e).__name__}: {_one_line(e)}; pass the --model the schedule "
                         f"was made for and its --input-shape") from e
    print(report.table().to_string(index=False) if hasattr(report, "table") else report)
    if getattr(report, "passed", True):
        return 0
    print(f"monetlike check: failed: {report.failure}", file=sys.stderr)
    return 1


def _recorded_loss(sched, path: str) -> str:
    """The loss a schedule was solved with (`solve --loss`), when it is one of the built-in
    names; a function is only named back as a hint (a file never chooses the code to run)."""

    recorded = sched.meta.get("loss", "sum")
    if not isinstance(recorded, str):
        return "sum"
    if recorded in LOSSES:
        return recorded
    raise UsageError(f"this schedule was solved with the loss {_hint(recorded)}; check runs "
                     f"the step with the same loss: if you trust that code, run `monetlike "
                     f"check {path} --model ... --loss {_hint(recorded)}`")


def _describe_inputs(x) -> str:
    """'an input of shape [4, 8]', or for a keyword batch 'its example batch input_ids [4, 16],
    attention_mask [4, 16], labels [4, 16]'."""
    import torch

    if isinstance(x, torch.Tensor):
        return f"an input of shape {list(x.shape)}"
    items = x.items() if isinstance(x, dict) else enumerate(x)
    parts = [f"{k} {list(v.shape)}" for k, v in items if isinstance(v, torch.Tensor)]
    return f"its example batch {', '.join(parts)}"


def _float_dtype(name) -> bool:
    return isinstance(name, str) and name.startswith(("float", "bfloat", "complex"))


def _check_inputs(model, sched, args, batch: int, shape: tuple[int, ...]):
    """The batch `check` runs: the schedule's recorded batch and shapes (or --batch and
    --input-shape), made by the model's example_inputs(batch, seq_len) when it has one (a
    keyword batch: input_ids, attention_mask, labels), else one float tensor."""

    summary = sched.graph_summary
    shapes = summary.get("input_shapes")
    dtypes = summary.get("input_dtypes")
    if not callable(getattr(model, "example_inputs", None)):
        n = len(shapes) if isinstance(shapes, list) else 1
        if n > 1 or (isinstance(dtypes, list) and dtypes and not _float_dtype(dtypes[0])):
            raise UsageError(
                f"{args.schedule} was solved for {n} input(s) of shapes {_hint(shapes)} and dtypes "
                f"{_hint(dtypes)} (a keyword batch like input_ids, attention_mask, labels?), and "
                f"`monetlike check` makes such a batch only with the model's own "
                f"example_inputs(batch, seq_len, device) method, which {args.model} has not (the "
                f"named transformers shapes gpt2, llama_1b, bert_base, vit_base... have one); "
                f"add that method to the model your factory returns, or call "
                f"monetlike.check_schedule(schedule, model, batch) from Python with your batch")
        return example_inputs(batch, shape)
    # --input-shape is the sequence length (or, checked only, an image model's 3,H,W); the
    # recorded shape gives it when its first input is (batch, seq).
    given = args.input_shape is not None
    try:
        if given:
            x = model_batch_maker(model, shape, "cpu")(batch)
        else:
            seq = shape[0] if len(shape) == 1 else None
            x = model.example_inputs(batch, seq, device="cpu")
    except ValueError as e:
        flag = "--input-shape" if given else f"{args.schedule}'s recorded input shape"
        raise UsageError(f"{args.model}: {flag}: {_one_line(e)}") from None
    if not given and not args.batch and isinstance(shapes, list):
        import torch


        made = [list(t.shape) for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
        if sorted(made) != sorted(s for s in shapes if isinstance(s, list)) \
                or len(made) != len(shapes):
            raise UsageError(
                f"{args.model} makes {_describe_inputs(x)}, but {args.schedule} was solved for "
                f"input shapes {_hint(shapes)}; pass the --model (and config) the schedule was "
                f"made for")
    return x


def cmd_zoo(args) -> int:

    if args.zoo_command == "list":
        print(zoo.table().to_string(index=False))
    elif args.zoo_command == "show":
        e = zoo.get(args.name)
        for k, v in e.to_dict().items():
            print(f"{k:22s} {v}")
        print(f"{'overhead':22s} {100 * e.overhead:.2f}%")
    else:
        check_writable(args.output)
        e = zoo.pick(args.model, args.batch, args.budget)
        print(zoo.table([e]).to_string(index=False))
        if args.output:
            zoo.schedule(e.name).save(args.output)
            print(f"wrote {args.output}")
    return 0


def cmd_explain(args) -> int:

    check_writable(args.plot)
    model = build_model(args.model)
    x = example_inputs(args.batch, args.input_shape, profile_device(args.cost), model)
    with _fed_by_the_cli(args, model, getattr(x, "shape", ())):
        ex = explain(model, x, optimizer=args.optimizer, cost=args.cost,
                     loss_fn=load_loss(args.loss))
    print(ex.report())
    if args.plot:
        ex.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def cmd_pareto(args) -> int:

    check_writable(args.plot)
    graph = _profile_args(args)
    with interruptible("monetlike pareto"):
        df = pareto(graph, args.budgets, backend=args.backend, time_limit_s=args.time_limit)
    print(f"{graph.model} batch {graph.batch}, figures: {graph.cost_provenance}")
    print(table(df))
    if df["overhead_pct"].isna().all():
        print(f"monetlike pareto: error: no method fits any of the budgets "
              f"{', '.join(format_bytes(b) for b in args.budgets)}; raise --budgets (`monetlike "
              f"solve` with one of them names the minimum feasible budget)", file=sys.stderr)
        return 1
    if args.plot:
        plot_pareto(df, args.plot, f"{graph.model} batch {graph.batch} ({graph.cost_provenance})")
        print(f"wrote {args.plot}")
    return 0


def cmd_maxbatch(args) -> int:


    check_writable(args.output, model_file(args.model))
    model = build_model(args.model)
    if callable(getattr(model, "example_inputs", None)):
        # A model that makes its own batch (a named transformers shape: input_ids,
        # attention_mask, labels): every batched tensor scaled, --input-shape SEQ kept.

        try:
            make = model_batch_maker(model, args.input_shape, profile_device(args.cost))
        except ValueError as e:
            raise UsageError(f"{args.model}: --input-shape: {_one_line(e)}") from None
        shape = None
    else:
        make, shape = None, args.input_shape or DEFAULT_INPUT_SHAPE
    with interruptible("monetlike maxbatch"), \
            _fed_by_the_cli(args, model, ("batch", *(shape or ()))):
        found = max_batch(model, args.budget, shape, max_overhead=args.max_overhead,
                          cost=args.cost, optimizer=args.optimizer, limit=args.limit,
                          time_limit_s=args.time_limit, make_inputs=make,
                          loss_fn=load_loss(args.loss))
    base = solver.simulate(found.graph, solver.store_all_schedule(found.graph))
    print(f"largest batch that fits: {found.batch} ({found.refusal()})")
    print(found.tried_table())
    print(summary_table(found.graph, found.result, args.budget, base))
    if args.output:
        _save_schedule(found.result.schedule, found.graph, args)
        print(f"wrote {args.output}")
    return 0


# ----------------------------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="monetlike",
                                     description="Fit PyTorch training into a memory budget at the "
                                                 "lowest recomputation cost.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("profile", help="trace and profile a model into an operator graph")
    add_model_args(p)
    add_link_and_fsdp_args(p)
    p.add_argument("--calibrate", action="store_true",
                   help="fit measured costs to the step as it runs: time the plain forward and "
                        "backward and every recomputation in context (monetlike.calibrate)")
    p.add_argument("-o", "--output", help="write the graph JSON here")
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("solve", help="find the cheapest schedule that fits a budget")
    add_model_args(p, model_required=False)
    p.add_argument("--graph", help="solve this profiled graph JSON instead of profiling MODEL")
    p.add_argument("--budget", type=budget_arg, required=True,
                   help="memory budget: bytes, or with a unit (8GiB = 8*2^30, 8GB = 8*10^9)")
    p.add_argument("--mode", choices=("full", "checkpoint"), default="full",
                   help="full: keep/recompute and operator implementations; checkpoint: "
                        "keep/recompute only")
    p.add_argument("--backend", default="highs", help="MILP backend (see `monetlike backends`)")
    p.add_argument("--time-limit", type=seconds_arg, default=600.0,
                   help="seconds; the best schedule found by then is returned with its gap")
    p.add_argument("--verbose", action="store_true", help="show the solver's progress")
    add_link_and_fsdp_args(p, offload=True)
    p.add_argument("-o", "--output", help="write the schedule JSON here")
    p.set_defaults(run=cmd_solve)

    p = sub.add_parser("backends", help="list the MILP backends and whether they are installed")
    p.set_defaults(run=cmd_backends)

    p = sub.add_parser("check", help="run a schedule here; compare memory, time and gradients "
                                     "with plain PyTorch")
    p.add_argument("schedule", help="schedule JSON written by `monetlike solve`")
    p.add_argument("--model", help="model factory to run the schedule on (required: a schedule "
                                   "file never chooses the code to run; the one it records is "
                                   "shown as a hint)")
    p.add_argument("--loss", default=None,
                   help="the loss to run the step with (default: the one the schedule was "
                        "solved with when it is a built-in name; else gradients are compared "
                        "under a signed sum of the outputs and peaks measured under their sum, "
                        "the profiler's default)")
    p.add_argument("--batch", type=positive_int, help="batch (default: the schedule's)")
    p.add_argument("--input-shape", type=shape_arg, help="input shape after the batch dimension "
                                                      "(default: the schedule's); the sequence "
                                                      "length for a model that makes its own "
                                                      "keyword batch (gpt2, llama_1b, ...)")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("zoo", help="list, show and pick prebuilt schedules")
    zsub = p.add_subparsers(dest="zoo_command", required=True, metavar="ZOO_COMMAND")
    zsub.add_parser("list", help="a table of the zoo's schedules")
    z = zsub.add_parser("show", help="one zoo entry in full")
    z.add_argument("name", help="entry name, e.g. resnet50_184_8GiB")
    z = zsub.add_parser("pick", help="the cheapest schedule that fits a budget")
    z.add_argument("--model", required=True, help="model name, e.g. resnet50")
    z.add_argument("--batch", type=positive_int, required=True, help="batch size")
    z.add_argument("--budget", type=budget_arg, required=True, help="memory budget, e.g. 8GiB")
    z.add_argument("-o", "--output", help="write the picked schedule JSON here")
    p.set_defaults(run=cmd_zoo)

    p = sub.add_parser("explain", help="where the memory goes and what recomputation can save")
    add_model_args(p, default_cost="analytical:A100-40GB")
    p.add_argument("--plot", help="write a PNG of the memory timeline and breakdown here")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("pareto", help="the budget vs overhead curve, ours and the baselines")
    add_model_args(p, default_cost="analytical:A100-40GB")
    p.add_argument("--budgets", type=budgets_arg, required=True,
                   help="comma-separated budgets, e.g. 5GiB,6GiB,8GiB")
    p.add_argument("--backend", default="highs", help="MILP backend")
    p.add_argument("--time-limit", type=seconds_arg, default=120.0, help="seconds per solve")
    p.add_argument("--plot", help="write the curve as a PNG here")
    p.set_defaults(run=cmd_pareto)

    p = sub.add_parser("maxbatch", help="the largest batch that fits a budget, found by planning")
    add_model_args(p, batch=False, default_cost="analytical:A100-40GB")
    p.add_argument("--budget", type=budget_arg, required=True, help="memory budget, e.g. 8GiB")
    p.add_argument("--max-overhead", type=percent_arg, help="largest acceptable overhead, e.g. 10%%")
    p.add_argument("--limit", type=positive_int, default=4096,
                   help="largest batch to consider")
    p.add_argument("--time-limit", type=seconds_arg, default=60.0, help="seconds per solve")
    p.add_argument("-o", "--output", help="write the schedule JSON here")
    p.set_defaults(run=cmd_maxbatch)
    add_examples(parser, sub)
    return parser


def _one_line(e: BaseException) -> str:
    """An error's first line (fx and torch append notes on further lines; --debug shows all)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


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
        print(f"monetlike {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (InfeasibleBudgetError, MonetlikeError, NotImplementedError, OSError) as e:
        if args.debug:
            raise
        # the Python message speaks of budgets; here the budget is a flag
        flag = "; raise --budget" if isinstance(e, InfeasibleBudgetError) and "no schedule can " \
            "help" not in str(e) and hasattr(args, "budget") else ""
        print(f"monetlike {args.command}: error: {_one_line(e)}{flag}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.debug:
            raise
        # Outputs are written atomically at the very end, so an interrupted run leaves any old
        # file as it was.
        print(f"monetlike {args.command}: interrupted; no output written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
