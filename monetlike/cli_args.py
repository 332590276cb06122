"""What the `monetlike` command line accepts: the argument types (each a one-line error naming
what was expected), the arguments every model command shares, the example batch it builds, and
the check that an -o can be written before any work starts."""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from typing import Sequence

from solver.errors import BudgetParseError, MonetlikeError
from solver.jsonio import file_kind
from solver.units import parse_bytes

from .profile.costs import parse_cost


class UsageError(MonetlikeError, ValueError):
    """A bad combination of command-line arguments."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: argparse prints the whole usage block before its message,
    which buries the one line that says what to fix."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive, finite number of seconds like 60, got {text!r}")
    return value


def cost_arg(text: str) -> str:
    """'measured' or 'analytical:DEVICE', checked now and spelled canonically, so every later
    test of the kind (the meta device for analytical profiles) sees one spelling."""

    try:
        kind, preset = parse_cost(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return "measured" if preset is None else f"analytical:{preset.name}"


def shape_arg(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 3,224,224, got {text!r}") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected positive sizes like 3,224,224, got {text!r}")
    return dims


def budget_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except BudgetParseError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Bandwidth units: powers of 1000 (GB/s, as link specifications quote them) or of 1024 (GiB/s).
_RATE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*(?:/\s*s)?\s*$")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from '25e9', '25000000000', '25GB/s' or '16GiB/s' (the '/s' optional)."""
    m = _RATE.match(text)
    unit = m.group(2).upper() if m else None
    if unit is not None and unit not in _RATE_UNITS and unit.endswith("PS"):
        unit = unit[:-2]  # 'GBps'
    if m is None or unit not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected bytes per second like 25e9, 25GB/s or 16GiB/s, got {text!r}")
    value = float(m.group(1)) * _RATE_UNITS[unit]
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive, finite bandwidth, got {text!r}")
    return value


def check_writable(path: str | None, *inputs: str | None) -> None:
    """Fail before any work if the output cannot be written, or would replace one of the
    command's own input files, so nothing is half-done and no input is lost."""
    if path is None:
        return
    for src in inputs:
        if src and os.path.exists(src) and os.path.exists(path) and os.path.samefile(src, path):
            raise UsageError(f"-o {path!r} is the input file {src!r}: writing the output there "
                             f"would destroy the input; choose another -o")
    try:
        mode = os.stat(path).st_mode  # through a symlink (/dev/stdout included), as written
    except OSError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(f"cannot write {path!r}: it is {file_kind(mode)}, not a regular file; "
                         f"choose a file path for -o")
    target = os.path.realpath(path)  # an output symlink is written through (atomic_write_bytes)
    directory = os.path.dirname(target)
    name_max = _name_max(directory)
    if len(os.fsencode(os.path.basename(target))) > name_max:
        raise UsageError(f"cannot write {path!r}: its name is longer than the {name_max} bytes "
                         f"this file system allows; choose a shorter -o")
    if not os.path.isdir(directory):
        raise UsageError(f"cannot write {path!r}: directory {directory!r} does not exist; "
                         f"create it or choose another -o")
    if not os.access(directory, os.W_OK):
        raise UsageError(f"cannot write {path!r}: directory {directory!r} is not writable; "
                         f"choose another -o")


def _name_max(directory: str) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


# The input shape when neither --input-shape nor a graph or schedule gives one.
DEFAULT_INPUT_SHAPE = (3, 224, 224)


def model_file(spec: str | None) -> str | None:
    """The file part of a 'path/to/model.py:factory' MODEL (an input an -o must not replace)."""
    if spec and ":" in spec:
        return spec.rpartition(":")[0]
    return None


def example_inputs(batch: int, input_shape: Sequence[int] | None, device: str = "cpu",
                   model=None):
    import torch

    if batch <= 0:
        raise UsageError(f"--batch must be a positive integer, got {batch}")
    numel = math.prod((batch, *(input_shape or ())))
    if numel > 2**63 - 1:  # torch would fail with an overflow deep inside the first call
        raise UsageError(f"--batch {batch} with --input-shape "
                         f"{','.join(map(str, input_shape or ()))} makes more elements than a "
                         f"tensor can hold (2^63 - 1); give smaller sizes")
    make = getattr(model, "example_inputs", None)
    if callable(make):
        # A named transformers shape (monetlike.hf_models) makes its own keyword batch
        # (input_ids, attention_mask, labels); --input-shape SEQ is its sequence length.
        return make(batch, input_shape[0] if input_shape else None, device=device)
    return torch.randn(batch, *(input_shape or DEFAULT_INPUT_SHAPE), device=device)


def profile_device(cost: str) -> str:
    """Analytical profiles never touch real data: build the example batch on the meta device."""
    return "meta" if parse_cost(cost)[0] == "analytical" else "cpu"


def percent_arg(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage like 10% or 0.1, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative overhead, got {text!r}")
    return value


def budgets_arg(text: str) -> list[int]:
    budgets = [budget_arg(t) for t in text.split(",") if t.strip()]
    if not budgets:
        raise argparse.ArgumentTypeError(
            f"expected one or more comma-separated budgets like 5GiB,6GiB, got {text!r}")
    return budgets


def add_model_args(p, *, model_required: bool = True, batch: bool = True,
                    default_cost: str = "measured") -> None:
    p.add_argument("model", nargs=None if model_required else "?",
                   help="importable factory (torchvision.models.resnet50, pkg.mod:factory) or "
                        "path/to/file.py:factory")
    if batch:
        p.add_argument("--batch", type=positive_int, required=model_required,
                       help="batch size")
    p.add_argument("--input-shape", type=shape_arg, default=None,
                   help="input shape after the batch dimension (default 3,224,224; `solve "
                        "--graph` takes the graph's); for a model that makes its own keyword "
                        "batch (gpt2, llama_1b, bert_base: input_ids, attention_mask, labels) "
                        "the sequence length, e.g. 512 (default: the model's)")
    p.add_argument("--cost", type=cost_arg, default=default_cost,
                   help="'measured' (time ops on this device) or 'analytical:DEVICE', e.g. "
                        "analytical:A100-40GB")
    p.add_argument("--optimizer", choices=("none", "sgd", "adam"), default="none",
                   help="optimizer whose state counts towards the budget")
    p.add_argument("--loss", default="sum",
                   help="the training loss of the model's output, whose memory is part of the "
                        "step: sum (default), cross_entropy (logits against class 0), "
                        "mean_square, model (the model's own 'loss' output: a Hugging Face "
                        "model given labels), or a function like mypkg.losses:loss or "
                        "path/to/loss.py:loss")


def add_fsdp_args(p) -> None:
    p.add_argument("--fsdp", type=positive_int, default=None, metavar="RANKS",
                   help="plan one rank of FSDP2 over RANKS ranks, as torchtitan shards a "
                        "transformer: every block of the model's block list a fully_shard unit, "
                        "then the root; the budget is a per-rank peak")
    p.add_argument("--fsdp-param-dtype", choices=("bfloat16", "float16", "none"),
                   default="bfloat16",
                   help="with --fsdp: the MixedPrecisionPolicy's param_dtype (default bfloat16, "
                        "torchtitan's; none: no mixed precision)")
    p.add_argument("--fsdp-reduce-dtype", choices=("float32", "bfloat16", "float16", "none"),
                   default="none",
                   help="with --fsdp: the MixedPrecisionPolicy's reduce_dtype, the dtype "
                        "gradients are reduce-scattered in (torchtitan: float32; default none: "
                        "in param_dtype)")


def add_host_bandwidth(p) -> None:
    p.add_argument("--host-bandwidth", type=parse_bandwidth, default=None,
                   help="bytes per second of the device<->host link, e.g. 25e9, 25GB/s or "
                        "16GiB/s: the cost of offload to host (default: the analytical preset's "
                        "nominal figure; none for a CPU profile)")


def add_link_and_fsdp_args(p, offload: bool = False) -> None:
    """--host-bandwidth and the FSDP options (profile, solve); with `offload`, solve's --offload,
    which copies over that link."""
    add_host_bandwidth(p)
    add_fsdp_args(p)
    if offload:
        p.add_argument("--offload", action="store_true",
                       help="also let the solver copy activations to host memory and back (runs "
                            "on CUDA only; needs the graph's host link bandwidth)")
