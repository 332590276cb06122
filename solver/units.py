"""Byte budgets: parsing '8GiB' / '8GB' / '123', the relative budgets 'min', '90%' and 'auto',
and printing bytes with their unit.

The one grammar of budgets. `parse_budget` reads every form into a `BudgetSpec`; a relative one
is turned into bytes against a graph by `solver.search.budgets.resolve_budget` (and 'auto'
against a device's free memory, which the torch side reads). `parse_bytes` is the absolute
subset, for the places where a budget must already be bytes.
"""

import math
import re
from dataclasses import dataclass
from decimal import Decimal

from .errors import BudgetParseError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


RELATIVE_FORMS = "'min' (the least feasible budget), 'auto' (a CUDA device's free memory) or " \
    "a share of the store-all peak such as '90%'"
_SHARE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")
AUTO_MARGIN = 0.05
"""'auto' leaves this share of the device's total memory unbudgeted: the CUDA context, cuBLAS
workspaces and the caching allocator's rounding and fragmentation, which the budget (tensor
bytes) does not count."""


@dataclass(frozen=True)
class BudgetSpec:
    """A budget as the caller wrote it."""

    kind: str
    """'bytes', 'min', 'share' (of the store-all peak) or 'auto'."""
    value: float = 0.0
    """The bytes ('bytes') or the fraction ('share', 0.9 for '90%'); unused otherwise."""

    def __str__(self) -> str:
        return {"bytes": f"{int(self.value)} B", "min": "min", "auto": "auto",
                "share": f"{100 * self.value:g}% of the store-all peak"}[self.kind]


def parse_budget(budget: "int | float | str | BudgetSpec") -> BudgetSpec:
    """Read any budget form: bytes (an int, '8GiB', '8GB'), 'min', 'auto' or '90%'."""
    if isinstance(budget, BudgetSpec):
        return budget
    if isinstance(budget, str):
        word = budget.strip().lower()
        if word in ("min", "auto"):
            return BudgetSpec(word)
        m = _SHARE.match(budget)
        if m:
            share = float(m.group(1)) / 100
            if not 0 < share:
                raise BudgetParseError(f"budget {budget!r}: expected a share of the store-all "
                                       f"peak above 0%, e.g. '90%'")
            return BudgetSpec("share", share)
    return BudgetSpec("bytes", parse_bytes(budget))


def auto_bytes(free: int, total: int, resident: int) -> int:
    """The 'auto' budget: the device's free memory plus what the step already holds there (the
    model's parameters and the batch, part of the budget), less AUTO_MARGIN of its total."""
    return max(0, int(free + resident - math.ceil(AUTO_MARGIN * total)))


def parse_bytes(budget: "int | float | str") -> int:
    """Return a byte count from an int, or a string like '8GiB' (8 x 2^30) or '8GB' (8 x 10^9)."""
    if isinstance(budget, str) and (budget.strip().lower() in ("min", "auto")
                                    or _SHARE.match(budget)):
        raise BudgetParseError(
            f"budget {budget!r} is relative to a model and here a budget in bytes is expected, "
            f"e.g. '8GiB'; {RELATIVE_FORMS} are read by monetlike.optimize, or turned into "
            f"bytes with solver.resolve_budget(graph, {budget!r})")
    if isinstance(budget, bool):
        raise BudgetParseError(f"expected a byte count or a string like '8GiB', got {budget!r}")
    if isinstance(budget, (int, float)):
        if budget < 0 or budget != budget or budget == float("inf"):
            raise BudgetParseError(f"expected a non-negative, finite byte count, got {budget!r}")
        return _bounded(int(budget), budget)
    if not isinstance(budget, str):
        raise BudgetParseError(
            f"expected a byte count or a string like '8GiB', got {type(budget).__name__} {budget!r}")
    m = _PATTERN.match(budget)
    if m and m.group(2).endswith("b") and "i" not in m.group(2).lower():
        # A lower-case b is a bit in '8Gb' or '8mb' (and m is milli): guessing bytes could be off
        # by a factor of 8, so ask. With an i ('8 gib') the binary prefix says bytes were meant.
        num, prefix = m.group(1), m.group(2)[:-1].upper()
        fix = (f"e.g. '{num}{prefix}B' (powers of 1000) or '{num}{prefix}iB' (powers of 1024)"
               if prefix else f"e.g. '{num}B' or '{num}' for bytes")
        raise BudgetParseError(f"ambiguous budget unit in {budget!r}: a lower-case 'b' means "
                               f"bits; write bytes with a capital B, {fix}")
    if not m or m.group(2).upper() not in _UNITS:
        raise BudgetParseError(
            f"cannot parse budget {budget!r}: expected a non-negative number with an optional unit "
            f"B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
            f"e.g. '8GiB' or '8000000000', or {RELATIVE_FORMS}")
    # Exact decimal arithmetic: a 400-digit budget is refused as too large below, not met as a
    # float overflow, and a printed budget typed back is the bytes it was printed from.
    return _bounded(int(Decimal(m.group(1)) * _UNITS[m.group(2).upper()]), budget)


# Beyond any machine's memory, and the most a JSON reader or torch counts in a signed 64-bit int.
MAX_BYTES = 2**63 - 1


def _bounded(n: int, given) -> int:
    if n > MAX_BYTES:
        raise BudgetParseError(f"budget {str(given)[:40]}{'...' if len(str(given)) > 40 else ''} "
                               f"is too large: expected at most {MAX_BYTES} bytes (8 EiB)")
    return n


def budget_text(n: int) -> str:
    """'4.59 MiB (4812963 B)': rounded up, so that the figure typed back as a budget is not
    below `n`, with the exact count beside it (for a least feasible budget)."""
    n = int(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            hundredths = -(-n * 100 // scale)
            return f"{hundredths // 100}.{hundredths % 100:02d} {unit} ({n} B)"
    return f"{n} B"


def format_bytes(n: int) -> str:
    """Human-readable bytes in binary units, always naming the unit ('8.00 GiB')."""
    n = int(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
