"""Saving matplotlib figures as PNG atomically (a reader never sees half a file)."""

from __future__ import annotations

import os
import tempfile


def save_figure(fig, path: str, dpi: int = 120) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=dpi, format="png")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
