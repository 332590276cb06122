"""Replace one script's section of docs/BENCHMARKS.md, between its markers, atomically.

Each benchmark script owns one section (`<!-- NAME:start -->` ... `<!-- NAME:end -->`) and never
touches the others, so they can run at different times and in any order.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from solver.jsonio import atomic_write_text  # noqa: E402

DEFAULT_PATH = os.path.join(ROOT, "docs", "BENCHMARKS.md")


def steady_cpu_allocator() -> bool:
    """Keep freed CPU memory in the process, as a caching allocator (CUDA's) does: glibc's
    malloc otherwise maps large blocks fresh from the OS and trims the heap's free top, so
    whether a step's tensors page-fault (system time, on the thread clock too) depends on what
    ran before it (docs/BENCHMARKS.md, "Runtime"). The allocator's counts (the peaks) are not
    affected. True if set (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def machine() -> str:
    import torch

    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
            f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def header(command: str) -> str:
    return (f"Date: {datetime.date.today().isoformat()}. Machine: {machine()}.\n"
            f"Command: `{command}`\n")


def header_with_commit(script: str, argv) -> str:
    """`header` for `python scripts/<script> <argv>` (sys.argv when None), plus the commit."""
    import subprocess

    args = argv if argv is not None else sys.argv[1:]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    command = " ".join(["python", f"scripts/{script}", *args])
    return header(command) + f"Commit: {commit}."


def impl_counts(graph, schedule, none: str = "-") -> str:
    """A table cell: how many Ops `schedule` runs with each Impl other than the default
    ('conv_split 3, relu_mask 5'), or `none`."""
    counts: dict[str, int] = {}
    for j, k in enumerate(schedule.impl):
        if k:
            name = graph.ops[j].impls[k].name
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {c}" for n, c in sorted(counts.items())) or none


def read_section(name: str, path: str = DEFAULT_PATH) -> str | None:
    """The body of section `name` as last written, or None when it is not there."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if start not in text or end not in text:
        return None
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def replace_section(name: str, body: str, path: str = DEFAULT_PATH) -> None:
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + f"\n\n## {name.capitalize()}\n{block}\n"
    atomic_write_text(path, text)


def names_from(ap, text: str, known, what: str) -> list[str]:
    """The comma-separated names in `text`, each one of `known` (else `ap.error`)."""
    names = [s for s in text.split(",") if s]
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown {what} {unknown}; expected some of {list(known)}")
    return names


def append_row(rows: list, row: dict, results: str, echo: bool = True) -> None:
    """`row` added to `rows` and to the JSON-lines file `results` (printed too: `echo`)."""
    rows.append(row)
    if echo:
        print(json.dumps(row), flush=True)
    with open(results, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def publish(name: str, body: str, write: bool = True) -> None:
    """Print a rendered table; with `write`, also make it section `name` of BENCHMARKS.md."""
    print(body)
    if write:
        replace_section(name, body)
