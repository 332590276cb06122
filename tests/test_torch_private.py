"""monetlike.core.torch_private is the only module of monetlike that touches private torch APIs.

The first test enforces the rule on the source (every other module of monetlike/, parsed with
`ast`); the others check that the wrappers still do what their callers rely on, on the installed
torch.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from monetlike.core import torch_private as tp

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "monetlike"
ALLOWED = PACKAGE / "core" / "torch_private.py"
# Private attributes reached from objects (not from a `torch.` name), found by their own name.
PRIVATE_ATTRIBUTES = {"_execution_engine", "kineto_results", "experimental_event_tree"}


def _private(component: str) -> bool:
    return component.startswith("_") and not (component.startswith("__")
                                               and component.endswith("__"))


def _first_private(dotted: str) -> str | None:
    """The first private component of a dotted torch name, or None. torch.ops.<namespace>.<op>
    is the public way to call an aten operator, underscore-named or not."""
    parts = dotted.split(".")
    if parts[:2] == ["torch", "ops"]:
        parts = parts[:2]
    return next((p for p in parts if _private(p)), None)


class _Checker(ast.NodeVisitor):
    """Collects (line, what) for every private torch name in one module. Import aliases are
    followed per scope (`import torch.fx as fx` makes `fx.graph._X` torch.fx.graph._X)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.scopes: list[dict[str, str]] = [{}]

    # -- scopes: a function's imports bind its own names -----------------------------------
    def _aliases(self, body) -> dict[str, str]:
        out = dict(self.scopes[-1])
        stack = list(body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                 ast.ClassDef)):
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        if a.asname:
                            out[a.asname] = a.name
                        else:
                            out["torch"] = "torch"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "torch" or node.module.startswith("torch.")):
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
            stack.extend(ast.iter_child_nodes(node))
        return out

    def visit_Module(self, node: ast.Module) -> None:
        self.scopes = [self._aliases(node.body)]
        self.generic_visit(node)

    def _function(self, node) -> None:
        self.scopes.append(self._aliases(node.body))
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    # -- what is private ----------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name.split(".")[0] == "torch" and _first_private(a.name):
                self.found.append((node.lineno, f"import {a.name}"))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                if _first_private(f"{node.module}.{a.name}"):
                    self.found.append((node.lineno, f"from {node.module} import {a.name}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attrs = []
        root = node
        while isinstance(root, ast.Attribute):
            attrs.append(root.attr)
            root = root.value
        attrs.reverse()
        dotted = None
        if isinstance(root, ast.Name) and root.id in self.scopes[-1]:
            dotted = ".".join([self.scopes[-1][root.id], *attrs])
        named = next((a for a in attrs if a in PRIVATE_ATTRIBUTES), None)
        if dotted and _first_private(dotted):
            self.found.append((node.lineno, dotted))
        elif named:
            self.found.append((node.lineno, f"<...>.{named}"))
        # Only the outermost attribute of a chain is checked as a whole; inner ones are
        # prefixes of it, but calls and subscripts inside the chain start new chains.
        value = node.value
        while isinstance(value, ast.Attribute):
            value = value.value
        self.visit(value)


def private_torch_uses(path: pathlib.Path) -> list[str]:
    checker = _Checker()
    checker.visit(ast.parse(path.read_text(), filename=str(path)))
    rel = path.relative_to(PACKAGE.parent)
    return [f"{rel}:{line}: {what}" for line, what in sorted(set(checker.found))]


def test_only_torch_private_touches_private_torch_apis():
    files = sorted(p for p in PACKAGE.rglob("*.py") if p != ALLOWED)
    assert len(files) > 20  # the walk found the package
    found = [hit for p in files for hit in private_torch_uses(p)]
    assert not found, ("private torch APIs outside monetlike/core/torch_private.py (wrap them "
                       "there):\n" + "\n".join(found))


@pytest.mark.parametrize("src, expected", [
    ("import torch\nx = torch._C._nn.relu6", ["torch._C._nn.relu6"]),
    ("import torch.fx as fx\ndef f(g):\n    return isinstance(g, fx.graph._PyTreeCodeGen)",
     ["torch.fx.graph._PyTreeCodeGen"]),
    ("def f():\n    from torch.nn.modules import module as m\n    return m._global_forward_hooks",
     ["torch.nn.modules.module._global_forward_hooks"]),
    ("from torch.utils._pytree import tree_leaves",
     ["from torch.utils._pytree import tree_leaves"]),
    ("from torch.utils import _pytree as pytree", ["from torch.utils import _pytree"]),
    ("from torch.nn.modules.batchnorm import _BatchNorm",
     ["from torch.nn.modules.batchnorm import _BatchNorm"]),
    ("import torch._dynamo", ["import torch._dynamo"]),
    ("import torch\ntorch.autograd.Variable._execution_engine.queue_callback(f)",
     ["torch.autograd.Variable._execution_engine.queue_callback"]),
    ("def f(p):\n    return p.profiler.kineto_results.experimental_event_tree()",
     ["<...>.kineto_results"]),
    ("def f(v, g):\n    v._execution_engine.queue_callback(g)", ["<...>._execution_engine"]),
    ("import torch\nf(torch._C._get_sdp_priority_order())", ["torch._C._get_sdp_priority_order"]),
    # Public names, dunders, aten ops and other packages' private names pass.
    ("import torch\nv = torch.__version__\ny = torch.ops.aten._scaled_dot_product_flash_attention"
     "\nimport os\nos._exit(0)\nself._x = 1\nt._version", []),
    # An alias bound inside one function does not make the same name private in another.
    ("def f():\n    from torch.nn.modules import module as m\n    return m.Module\n"
     "def g(m):\n    return m._forward_hooks", []),
])
def test_checker_sees_private_names(src, expected):
    checker = _Checker()
    checker.visit(ast.parse(src))
    assert [what for _, what in sorted(checker.found)] == expected, src


# -- the wrappers on this torch -----------------------------------------------------------------
def test_graph_task_id_is_per_backward_and_callback_runs_at_its_end():
    seen, order = [], []
    x = torch.ones(3, requires_grad=True)

    def hook(g):
        gid = tp.current_graph_task_id()
        seen.append(gid)
        tp.queue_engine_callback(lambda: order.append(("end", gid)))
        order.append(("hook", gid))
        return g

    y = (x * 2).sum()
    y.register_hook(hook)
    y.backward()
    z = (x * 3).sum()
    z.register_hook(hook)
    z.backward()
    assert all(isinstance(g, int) for g in seen) and len(seen) == 2
    assert seen[0] != seen[1]
    assert order == [("hook", seen[0]), ("end", seen[0]), ("hook", seen[1]), ("end", seen[1])]
    assert tp.current_graph_task_id() == -1  # outside a backward


def test_relu6_and_hardtanh_bindings():
    assert tp.RELU6_INPLACE and tp.RELU6_OUT
    x = torch.tensor([-1.0, 3.0, 9.0])
    (f_inplace,), (f_out,) = tp.RELU6_INPLACE, tp.RELU6_OUT
    assert torch.equal(f_out(x), torch.tensor([0.0, 3.0, 6.0]))
    y = x.clone()
    assert f_inplace(y) is y and torch.equal(y, torch.tensor([0.0, 3.0, 6.0]))
    assert torch.equal(tp.HARDTANH(x, -0.5, 2.0), torch.tensor([-0.5, 2.0, 2.0]))
    # The C bindings, not the torch.nn.functional wrappers matched separately.
    assert tp.HARDTANH not in (F.hardtanh, F.hardtanh_)
    assert F.relu6 not in tp.RELU6_OUT | tp.RELU6_INPLACE


def test_sdp_priority_order_names_backends():
    order = tp.sdp_priority_order()
    assert order and all(isinstance(b, torch.nn.attention.SDPBackend) for b in order)
    names = [b.name for b in order]
    assert {"MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"} <= set(names)
    assert len(set(names)) == len(names)
    # sdpa_kernel(set_priority=True) changes it, and the wrapper reads the change.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION], set_priority=True):
        assert tp.sdp_priority_order()[:2] == [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION]
    assert tp.sdp_priority_order() == order


def test_profiler_events_report_cpu_allocations_and_marks():
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("probe.mark"):
            pass
        a = torch.empty(1 << 20, dtype=torch.uint8)
        del a
    events = list(tp.profiler_events(prof))
    assert all(isinstance(t, int) for t, _, _ in events)
    allocs = [alloc for _, _, alloc in events if alloc is not None]
    sizes = [(device, n) for device, n, _ in allocs]
    assert ("cpu", 1 << 20) in sizes and ("cpu", -(1 << 20)) in sizes
    # The free names the block the allocation made.
    (ptr,) = {p for _, n, p in allocs if n == 1 << 20}
    assert ("cpu", -(1 << 20), ptr) in allocs
    assert any(name == "probe.mark" and alloc is None for _, name, alloc in events)


def test_norm_bases_and_global_hooks():
    assert isinstance(nn.BatchNorm2d(3), tp.BatchNormBase)
    assert isinstance(nn.InstanceNorm1d(3), tp.InstanceNormBase)
    assert not isinstance(nn.LayerNorm(3), (tp.BatchNormBase, tp.InstanceNormBase))
    assert not tp.global_module_hooks()
    h = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
    try:
        assert tp.global_module_hooks()
    finally:
        h.remove()
    assert not tp.global_module_hooks()


def test_pytree_codegen_round_trip():
    import torch.fx as fx
    from torch.export import export

    class M(nn.Module):
        def forward(self, x, y):
            return {"s": x + y}

    gm = export(M(), (torch.ones(2), torch.ones(2))).module()
    assert isinstance(gm.graph._codegen, tp.PyTreeCodeGen)
    assert not isinstance(fx.symbolic_trace(M()).graph._codegen, tp.PyTreeCodeGen)
    info = tp.PyTreeInfo(["x", "y"], None, None)
    assert isinstance(tp.PyTreeCodeGen(info), fx.graph.CodeGen)
