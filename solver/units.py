"""Byte budgets: parsing '8GiB' / '8GB' / '123' and printing bytes with their unit."""

import re
from decimal import Decimal

from .errors import BudgetParseError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(budget: "int | float | str") -> int:
    """Return a byte count from an int, or a string like '8GiB' (8 x 2^30) or '8GB' (8 x 10^9)."""
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
            f"e.g. '8GiB' or '8000000000'")
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
