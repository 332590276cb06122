"""Saving matplotlib figures as PNG atomically (a reader never sees half a file)."""

from __future__ import annotations

import io

from solver.graph import atomic_write_bytes


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Render to memory, then write atomically like every other output (umask respected, a
    symlink written through, the old file kept if anything fails)."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    atomic_write_bytes(path, buf.getvalue())
