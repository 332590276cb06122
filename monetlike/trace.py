"""Model -> torch.fx GraphModule, at module granularity: the graph every other part refers to.

The profiler names Ops after fx nodes and the runtime finds them again by those names, so both
must trace the same way: call `trace(model, leaf_modules)` with the same arguments (the profiler
records them in `OpGraph.meta["leaf_modules"]`, classes as "package.module.Class" strings, which
`trace` accepts back).

Leaves are the `torch.nn` modules (fx's default: conv, bn, relu, linear, ...), any module the
caller names, and any module with forward hooks or forward pre-hooks: tracing through such a module
would run its hooks once on fx proxies at trace time and then never again, so it is kept whole and
its hooks run for real (and its Op is marked recompute-unsafe).

When symbolic tracing fails we raise TraceError naming the module being traced, the user code line
and the ways out. `monetlike.capture` falls back to torch.export (non-strict) in that case when
`capture="auto"` (the profiler's default).
"""

from __future__ import annotations

import os
import traceback
from typing import Iterable

import torch
import torch.fx as fx

from solver.errors import MonetlikeError

__all__ = ["TraceError", "MonetTracer", "trace"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class TraceError(MonetlikeError, RuntimeError):
    """The model could not be turned into a torch.fx graph."""


class MonetTracer(fx.Tracer):
    """fx.Tracer with extra leaves: named modules, module types, and modules with forward hooks."""

    def __init__(self, leaf_modules: Iterable = ()):
        super().__init__()
        leaf_modules = list(leaf_modules)
        self.leaf_names = {m for m in leaf_modules if isinstance(m, str)}
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        bad = [m for m in leaf_modules if not isinstance(m, (str, type))]
        if bad:
            raise TypeError(f"leaf_modules: expected qualified module names (str) or module "
                            f"classes, got {bad!r}")

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or (self.leaf_types
                                                        and isinstance(m, self.leaf_types)):
            return True
        # A string may also name a class as "package.module.Class" (how OpGraph.meta records
        # class leaves), so a graph's leaf_modules can be passed back to trace().
        if self.leaf_names and f"{type(m).__module__}.{type(m).__qualname__}" in self.leaf_names:
            return True
        if m._forward_hooks or m._forward_pre_hooks:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _user_frame(tb) -> str | None:
    """The innermost traceback frame outside torch itself: the line of the user's model."""
    best = None
    for fr in traceback.extract_tb(tb):
        if not os.path.abspath(fr.filename).startswith(_TORCH_DIR):
            best = fr
    if best is None:
        return None
    line = (best.line or "").strip()
    return f"{best.filename}:{best.lineno} in {best.name}" + (f": `{line}`" if line else "")


def trace(model: torch.nn.Module, leaf_modules: Iterable = ()) -> fx.GraphModule:
    """Symbolically trace `model` with `MonetTracer`; raise TraceError with a way out on failure."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    tracer = MonetTracer(leaf_modules)
    try:
        graph = tracer.trace(model)
    except Exception as e:
        stack = list(getattr(tracer, "module_stack", {}).items())
        where = ""
        if stack:
            path, info = stack[-1]
            typ = info[1] if isinstance(info, tuple) and len(info) > 1 else info
            tname = getattr(typ, "__name__", str(typ))
            where = f" while tracing module '{path or '<root>'}' ({tname})"
        frame = _user_frame(e.__traceback__)
        at = f" at {frame}" if frame else ""
        name = type(model).__name__
        if stack and stack[-1][0]:
            leaf = (f"make that module a leaf (pass leaf_modules=[{stack[-1][0]!r}] to "
                    f"monetlike.profile, so it becomes one op run as a whole)")
        else:
            leaf = ("move that code into a submodule and make it a leaf (leaf_modules=[<its "
                    "name or class>] in monetlike.profile, so it becomes one op run as a whole)")
        raise TraceError(
            f"torch.fx.symbolic_trace could not trace {name}{where}{at}: "
            f"{type(e).__name__}: {e}. Ways out: {leaf}, or remove the data-dependent Python "
            f"control flow on tensor values there (torch.where instead of `if`), or capture the "
            f"model with torch.export (monetlike.profile(..., capture='export'), the fallback "
            f"of capture='auto')") from e
    name = type(model).__name__
    gm = fx.GraphModule(tracer.root, graph, name)
    return gm
