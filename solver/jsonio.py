"""Reading and writing the project's JSON files: checked field readers and atomic writes.

Every malformed field becomes a FormatError naming it; every write is atomic and goes to a regular
file only. One home for both, shared by the graph, the schedule and the zoo.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from typing import Any

from .errors import FormatError


def get_field(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict):
        raise FormatError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise FormatError(f"{where}: missing field '{key}'")
    return d[key]


def int_field(d: Any, key: str, where: str, *, minimum: int | None = 0,
              optional: bool = False) -> Any:
    v = d.get(key) if (optional and isinstance(d, dict)) else get_field(d, key, where)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{where}.{key}: expected an integer, got {type(v).__name__} {v!r:.60}")
    if minimum is not None and v < minimum:
        raise FormatError(f"{where}.{key}: expected an integer >= {minimum}, got {v}")
    if v > _INT_MAX:
        raise FormatError(f"{where}.{key}: expected an integer below 2^63 (a byte count, size or "
                          f"index), got one of {len(str(v))} digits")
    return v


# Every integer a graph or schedule holds (bytes, sizes, ids) fits a signed 64-bit int; a larger
# one in a file is an edit, refused where it is read rather than overflowing where it is used.
_INT_MAX = 2**63 - 1


def float_field(d: Any, key: str, where: str, *, optional: bool = False) -> float | None:
    v = d.get(key) if (optional and isinstance(d, dict)) else get_field(d, key, where)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 \
            or v == float("inf"):
        raise FormatError(f"{where}.{key}: expected a non-negative, finite number, got "
                          f"{v!r:.60}")
    return float(v)


def str_field(d: Any, key: str, where: str, *, optional: bool = False) -> Any:
    v = d.get(key) if (optional and isinstance(d, dict)) else get_field(d, key, where)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise FormatError(f"{where}.{key}: expected a string, got {type(v).__name__} {v!r:.60}")
    return v


def bool_field(d: Any, key: str, where: str) -> bool:
    v = get_field(d, key, where)
    if not isinstance(v, bool):
        raise FormatError(f"{where}.{key}: expected true or false, got {v!r:.60}")
    return v


def list_field(d: Any, key: str, where: str) -> list:
    v = get_field(d, key, where)
    if not isinstance(v, list):
        raise FormatError(f"{where}.{key}: expected a list, got {type(v).__name__}")
    return v


def ints_field(d: Any, key: str, where: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(list_field(d, key, where)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FormatError(f"{where}.{key}[{i}]: expected a non-negative integer, got {v!r:.60}")
        if v > _INT_MAX:
            raise FormatError(f"{where}.{key}[{i}]: expected an integer below 2^63, got one of "
                              f"{len(str(v))} digits")
        out.append(v)
    return tuple(out)


def strs_field(d: Any, key: str, where: str) -> tuple[str, ...]:
    out = []
    for i, v in enumerate(list_field(d, key, where)):
        if not isinstance(v, str):
            raise FormatError(f"{where}.{key}[{i}]: expected a string, got {v!r:.60}")
        out.append(v)
    return tuple(out)


def atomic_write_text(path: "str | os.PathLike", text: str, *,
                      follow_symlinks: bool = True) -> None:
    """Write `text` (UTF-8) to `path` atomically; see `atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"), follow_symlinks=follow_symlinks)


def atomic_write_bytes(path: "str | os.PathLike", data: bytes, *,
                       follow_symlinks: bool = True) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never a part.

    A symlink is written through: its target gets the new content and the link stays (a user's
    `-o` onto a link). With follow_symlinks=False (a cache folder, whose entries nobody chose)
    whatever sits at `path`, a link or a FIFO included, is replaced by the new regular file. The
    new file keeps the mode of the file it replaces, or gets the umask's default for a new file
    (mkstemp alone would make it 0600). The temporary name is short (a 255-byte name still has
    room). Errors name `path`, never the temporary file."""
    path = os.fspath(path)
    target = os.path.realpath(path) if follow_symlinks else os.path.abspath(path)
    directory = os.path.dirname(target)
    try:
        st = os.stat(target) if follow_symlinks else os.lstat(target)
        if follow_symlinks and not stat.S_ISREG(st.st_mode):
            # A device, FIFO or directory named as an output is never replaced by a file
            # (`-o /dev/null` as root would replace the system's).
            raise OSError(errno.EINVAL, f"cannot write {path!r}: it is {file_kind(st.st_mode)}, "
                                        f"not a regular file; write to a file path")
        mode = st.st_mode & 0o7777 if stat.S_ISREG(st.st_mode) else 0o666 & ~_umask()
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:
        raise OSError(e.errno, e.strerror if str(e.strerror).startswith("cannot write")
                      else f"cannot write {path!r}: {e.strerror}") from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".monetlike-", suffix=".tmp", dir=directory)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path!r}: {e.strerror}") from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {path!r}: {e.strerror}") from None
        raise


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO', 'a character device', ... for an lstat/stat mode."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def _umask() -> int:
    """The process umask (only readable by setting it: set and restore at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_json_file(path: "str | os.PathLike", what: str) -> Any:
    """Read a JSON file, turning unreadable or truncated content into a FormatError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FormatError(f"{what} file {os.fspath(path)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise FormatError(f"{what} file {os.fspath(path)!r} is not UTF-8 text: {e}") from None
    except OSError as e:  # a directory, no permission: cannot be the file meant
        raise FormatError(f"{what} file {os.fspath(path)!r} cannot be read: {e.strerror}; pass "
                          f"the path of a {what} JSON file") from None
    try:
        return json.loads(text)
    except RecursionError:  # a hostile file nests arrays thousands deep
        raise FormatError(f"{what} file {os.fspath(path)!r} nests JSON arrays or objects too "
                          f"deeply to be a {what} written by monetlike; regenerate it") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4,300 digits
        raise FormatError(
            f"{what} file {os.fspath(path)!r} is not valid JSON (truncated or corrupted?): {e}; "
            f"regenerate it") from None
