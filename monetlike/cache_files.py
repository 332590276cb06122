"""The optimize cache's files (schedules, and the measured profiles kept beside them), read as
untrusted input and written without following links.

Anyone who can write to the cache folder can put anything there: an entry copied onto another
key, a symlink to a user's file, a FIFO, a device. So an entry is read only when it is a regular
file (opened without following a link and without blocking, then checked with fstat), its
figures are never trusted (monetlike.optimize replays it with solver.verify before returning
it), an entry is written by replacing whatever sits at its name (never through a link), names
are built from a sanitised model name inside the cache folder, and a cache that cannot be
written is a warning: the solve it holds has already succeeded.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import warnings
from typing import Any, Callable

from solver.errors import FormatError
from solver.jsonio import atomic_write_text, file_kind
from solver.schedule import Schedule

__all__ = ["entry_path", "read_entry", "write_entry"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def entry_path(cache_dir: str, model: str, batch: int, key: str) -> str:
    """The entry's path: a name of letters, digits, '_' and '-' (so '../../x' or a 1,000-letter
    class name stays one short file name) directly inside `cache_dir`."""
    name = _UNSAFE.sub("_", str(model)).strip("_")[:64] or "model"
    return os.path.join(cache_dir, f"{name}-b{int(batch)}-{key}.json")


def read_entry(path: str, parse: Callable[[Any], Any] = Schedule.from_dict) -> Any:
    """What `parse` makes of the JSON stored at `path` (a Schedule by default), or None when
    there is none; a link, a FIFO, a device or a bad file there is a warning (naming it) and
    None: the caller solves (or profiles) again and replaces it."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):  # no entry (the write says why, if it fails)
        return None
    except OSError as e:
        problem = ("it is a symbolic link" if e.errno == errno.ELOOP
                   else f"it cannot be read ({e.strerror})")
        _warn(path, problem)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _warn(path, f"it is {file_kind(st.st_mode)}")
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    finally:
        os.close(fd)
    try:
        return parse(json.loads(data.decode("utf-8")))
    except FormatError as e:
        _warn(path, str(e))
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
        _warn(path, f"file {path!r} is not valid JSON (truncated or corrupted?): "
                    f"{type(e).__name__}: {str(e)[:200]}")
    return None


def write_entry(path: str, entry: Any, made: str = "the schedule was solved") -> bool:
    """Store `entry` (a Schedule or an OpGraph: its to_dict()) at `path`, replacing whatever is
    there (a link is replaced, not written through); a cache that cannot be written is a
    warning (`made` says what was made: "the schedule was solved"). Returns whether it was
    written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write_text(path, json.dumps(entry.to_dict(), indent=1), follow_symlinks=False)
    except OSError as e:
        warnings.warn(f"monetlike.optimize: {made} but cannot be cached at "
                      f"{path!r} ({e.strerror or e}); it will be done again next time "
                      f"(set MONETLIKE_CACHE or cache_dir to a writable folder)", UserWarning,
                      stacklevel=3)
        return False
    return True


def _warn(path: str, problem: str) -> None:
    warnings.warn(f"monetlike.optimize: ignoring cache entry {path}: {problem}; solving again "
                  f"and replacing it", UserWarning, stacklevel=4)


def ignore(path: str, problem: str) -> None:
    """Say that the entry at `path` is not used, and why (its replay failed, or it was made for
    another budget)."""
    _warn(path, problem)
