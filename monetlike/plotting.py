"""Saving matplotlib figures as PNG atomically (a reader never sees half a file), and the unit
byte axes read in."""

from __future__ import annotations

import io

from solver.jsonio import atomic_write_bytes


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Render to memory, then write atomically like every other output (umask respected, a
    symlink written through, the old file kept if anything fails)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    atomic_write_bytes(path, buf.getvalue())


def axis_unit(max_bytes: float) -> tuple[str, int]:
    """The unit a byte axis reads in: GiB from 1 GiB up, MiB below (a small model's curve is
    not squeezed into 0.01 GiB)."""
    return ("GiB", 2**30) if max_bytes >= 2**30 else ("MiB", 2**20)
