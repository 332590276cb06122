"""The MILP backends and their registry.

`get_backend(name)` returns a ready backend or raises BackendUnavailableError listing the installed
ones; `available()` names the installed backends (checked with importlib.util.find_spec, without
loading native code); `known()` names every backend this version knows. Each backend lives in its
own module and imports its solver only when it solves.

    highs        HiGHS via highspy (default: warm start, dual bound, progress)
    cvxpy        cvxpy with its HIGHS solver
    cvxpy-scipy  cvxpy with its SCIPY solver (scipy.optimize.milp, HiGHS inside)
    cbc          PuLP with its bundled CBC (warm start, dual bound from CBC's log)
    pulp-highs   PuLP with HiGHS
"""

from __future__ import annotations

from ..errors import BackendUnavailableError
from .base import Backend, BackendResult
from .cvxpy_backend import CvxpyHighsBackend, CvxpyScipyBackend
from .highs import HighsBackend
from .pulp_backend import PulpCbcBackend, PulpHighsBackend

_REGISTRY: dict[str, type[Backend]] = {
    cls.name: cls for cls in (HighsBackend, CvxpyHighsBackend, CvxpyScipyBackend,
                              PulpCbcBackend, PulpHighsBackend)
}
ALIASES = {"pulp": "cbc", "scipy": "cvxpy-scipy"}


def known() -> list[str]:
    """Every backend name this version knows, installed or not."""
    return list(_REGISTRY)


def available() -> list[str]:
    """The backends whose solver is installed here."""
    return [name for name, cls in _REGISTRY.items() if cls.available()]


def get_backend(name: str | Backend) -> Backend:
    """A backend instance by name (or alias), or `name` itself when it is a Backend already (a
    caller's own subclass); BackendUnavailableError if unknown or missing."""
    if isinstance(name, Backend):
        return name
    key = ALIASES.get(name, name)
    cls = _REGISTRY.get(key)
    installed = available()
    if cls is None:
        raise BackendUnavailableError(
            f"unknown MILP backend {name!r}; expected one of {known()} (installed here: "
            f"{installed or 'none'})")
    if not cls.available():
        raise BackendUnavailableError(
            f"MILP backend {name!r} is not installed (it needs {', '.join(cls.requires)}); "
            f"installed here: {installed or 'none'}; pip install the missing package or pick "
            f"another --backend")
    return cls()


__all__ = ["Backend", "BackendResult", "available", "get_backend", "known"]
