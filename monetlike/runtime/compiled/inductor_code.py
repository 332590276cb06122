"""The memory of Inductor's compiled step, read off the code it generated.

Inductor fuses pointwise ops into kernels that allocate only the buffers its scheduler keeps, and
adds its own (a weight's channels-last copy for a convolution): the eager-op model of
solver/compiled.py does not see either. The Python wrapper Inductor writes for each graph
(`call(self, args)`) is its allocation plan: `bufN = empty_strided_cpu(size, stride, dtype)`
allocates, `bufM = bufN; del bufN  # reuse` and `reinterpret_tensor(bufN, ...)` share a
storage, `del x` drops a name, an extern or fallback call that returns a tensor allocates it (its
size and dtype from the `assert_tensor_metadata` / `assert_size_stride` Inductor writes after
it), `return (...)` hands buffers on. `replay_step` runs the forward's and the backward's plans
as the step runs them and gives the peak; the measured side is tests/test_compiled_inductor.py.

Scratch inside a call the wrapper makes to an ATen or extern kernel (a convolution's backward
allocated 8.4 MiB of workspace on MobileNetV2) is not in the code: `measure_scratch` runs each
distinct such call once on zero tensors laid out as the code lays them out and counts, by the
CPU allocator's events, what it allocates beyond what it returns. Inductor's own C++ kernels
allocate nothing on the heap. A tensor the code returns without a size assertion is listed as
unsized and counted as 0 bytes.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

import torch

from ...core import torch_private
from ...core.allocator import AllocatorLog

__all__ = ["CodePeak", "GraphPlan", "read_call", "replay_step", "measure_scratch", "call_ops"]

Layout = tuple  # (size, stride, dtype name or None)


@dataclass(frozen=True)
class GraphPlan:
    """One graph's `call` body, in order: what each statement does to the storages."""

    inputs: tuple[str, ...]
    """The names `args` is unpacked into, in order."""
    steps: tuple[tuple, ...]
    """('alloc', name, bytes) / ('alloc_many', tuple_name, ((name, bytes), ...)) for a
    multi-output call whose elements are read later / ('alias', name, of) / ('item', name,
    tuple_name) / ('del', name) / ('call', index into `calls`) after a kernel call's outputs /
    ('return', (name or None, ...))."""
    unsized: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    """The source of each call to an ATen or extern kernel (its scratch is measured)."""
    layouts: dict[str, Layout] = field(default_factory=dict)
    """(size, stride, dtype) of each buffer the code allocates or asserts."""


@dataclass(frozen=True)
class CodePeak:
    """The step's memory as Inductor's generated code allocates it (bytes above the primals)."""

    forward_peak: int
    backward_peak: int
    transient_peak_bytes: int
    peak_bytes: int
    """Fixed bytes (parameters, inputs) plus the transient peak."""
    where: str
    """'forward:<buffer>' or 'backward:<buffer>': the allocation at which the peak falls."""
    unsized: tuple[str, ...] = ()
    unmeasured: tuple[str, ...] = ()
    """Kernel calls whose scratch was not measured (they would not run on zeros): 0 bytes."""


def _call_name(node: ast.AST) -> str:
    """'empty_strided_cpu', 'reinterpret_tensor', 'extern_kernels.convolution', ..."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_call_name(node.value)}.{node.attr}"
    return ""


# Inductor's extern kernels, by the ATen op of the graph node they run
_EXTERN_OPS = {"extern_kernels.convolution": "aten.convolution.default",
               "extern_kernels.mm": "aten.mm.default", "extern_kernels.bmm": "aten.bmm.default",
               "extern_kernels.addmm": "aten.addmm.default"}


def call_ops(plan: GraphPlan) -> list[tuple[str, tuple[str, ...]]]:
    """For each kernel call of `plan`: (the ATen op it runs, as str(node.target) names it, or
    '' where unknown; the names it reads that are not the code's own buffers, which are the
    partitioned graph's node names: primals, saved values)."""
    out = []
    for text in plan.calls:
        st = ast.parse(text).body[0]
        call = st.value
        fn = _call_name(call.func)
        op = _EXTERN_OPS.get(fn, fn.removeprefix("torch.ops.") if fn.startswith("torch.ops.")
                             else "")
        names = tuple(dict.fromkeys(
            n.id for a in [*call.args, *(k.value for k in call.keywords)] for n in ast.walk(a)
            if isinstance(n, ast.Name) and not re.fullmatch(r"buf\d+", n.id)))
        out.append((op, names))
    return out


def _nbytes(size, stride, dtype: str) -> int:
    if any(s == 0 for s in size):
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(size, stride))
    return span * getattr(torch, dtype.split(".")[-1]).itemsize


def _dtype_name(node: ast.AST) -> str:
    """'float32' for `torch.float32`."""
    return (_call_name(node) or "float32").split(".")[-1]


def _asserted(body: list[ast.stmt]) -> dict[str, Layout]:
    """The layout of each name the code asserts (assert_tensor_metadata carries the dtype;
    assert_size_stride and its grouped form do not: None)."""
    out: dict[str, Layout] = {}
    for st in body:
        if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)):
            continue
        fn, args = _call_name(st.value.func), st.value.args
        try:
            if fn in ("assert_tensor_metadata", "assert_size_stride") and len(args) >= 3 \
                    and isinstance(args[0], ast.Name):
                dtype = _dtype_name(args[3]) if fn == "assert_tensor_metadata" \
                    and len(args) > 3 else None
                out.setdefault(args[0].id, (ast.literal_eval(args[1]),
                                            ast.literal_eval(args[2]), dtype))
            elif fn == "assert_size_stride_grouped" and isinstance(args[0], ast.Tuple):
                sizes, strides = ast.literal_eval(args[1]), ast.literal_eval(args[2])
                for n, size, stride in zip(args[0].elts, sizes, strides):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, (size, stride, None))
        except ValueError:
            continue
    return out


def _bytes_of(layout: Layout | None) -> int | None:
    return None if layout is None else _nbytes(layout[0], layout[1], layout[2] or "float32")


def _kernel_call(st: ast.stmt) -> bool:
    """A call to an ATen or extern kernel (may allocate scratch): not Inductor's own kernels,
    its allocations, views or assertions."""
    value = st.value if isinstance(st, (ast.Assign, ast.Expr)) else None
    if not isinstance(value, ast.Call):
        return False
    fn = _call_name(value.func)
    return fn.startswith(("extern_kernels.", "aten.", "torch.ops."))


def _base(node: ast.AST) -> str | None:
    """The buffer a returned or aliased expression lives on (a name, or reinterpret_tensor's
    first argument); None for None or a constant."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and _call_name(node.func) == "reinterpret_tensor":
        return _base(node.args[0])
    return None


def _call_body(source: str) -> list[ast.stmt]:
    tree = ast.parse(source)
    return next(n for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.name == "call").body


def read_call(source: str) -> GraphPlan:
    """The allocation plan of the `call` function in Inductor's generated wrapper `source`."""
    body = _call_body(source)
    layouts = _asserted(body)
    sizes = {n: _bytes_of(lay) for n, lay in layouts.items()}
    calls: list[str] = []
    items: dict[str, list[str]] = {}  # tuple name -> the names read from it, in order
    for st in body:
        if isinstance(st, ast.Assign) and isinstance(st.value, ast.Subscript) \
                and isinstance(st.value.value, ast.Name):
            items.setdefault(st.value.value.id, []).append(st.targets[0].id)
    inputs: tuple[str, ...] = ()
    steps: list[tuple] = []
    unsized: list[str] = []
    for st in body:
        if isinstance(st, ast.Assign) and isinstance(st.value, ast.Name) \
                and st.value.id == "args":
            target = st.targets[0]
            inputs = tuple(e.id for e in (target.elts if isinstance(target, ast.Tuple)
                                          else [target]))
        elif isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Name):
            name, value = st.targets[0].id, st.value
            if isinstance(value, ast.Subscript):
                steps.append(("item", name, value.value.id))
            elif _base(value) is not None:
                base = _base(value)
                steps.append(("alias", name, base))
                if isinstance(value, ast.Call):  # reinterpret_tensor(base, size, stride, offset)
                    dtype = (layouts.get(base) or (None, None, None))[2]
                    layouts[name] = (ast.literal_eval(value.args[1]),
                                     ast.literal_eval(value.args[2]), dtype)
                elif base in layouts:
                    layouts[name] = layouts[base]
            elif isinstance(value, ast.Call) and _call_name(value.func) == "empty_strided_cpu":
                size, stride = ast.literal_eval(value.args[0]), ast.literal_eval(value.args[1])
                layouts[name] = (size, stride, _dtype_name(value.args[2]))
                steps.append(("alloc", name, _nbytes(size, stride, _dtype_name(value.args[2]))))
            elif name in items:
                steps.append(("alloc_many", name, tuple((i, sizes.get(i, 0))
                                                        for i in items[name])))
                unsized.extend(i for i in items[name] if i not in sizes)
            else:
                steps.append(("alloc", name, sizes.get(name, 0)))
                if name not in sizes:
                    unsized.append(name)
            if _kernel_call(st):
                steps.append(("call", len(calls)))
                calls.append(ast.unparse(st))
        elif _kernel_call(st):
            steps.append(("call", len(calls)))
            calls.append(ast.unparse(st))
        elif isinstance(st, ast.Delete):
            steps.extend(("del", t.id) for t in st.targets if isinstance(t, ast.Name))
        elif isinstance(st, ast.Return) and isinstance(st.value, (ast.Tuple, ast.List)):
            steps.append(("return", tuple(_base(e) for e in st.value.elts)))
    return GraphPlan(inputs=inputs, steps=tuple(steps), unsized=tuple(unsized),
                     calls=tuple(calls), layouts=layouts)


class _Memory:
    """Storages by id, the names bound to each, and the running level and its peak."""

    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        self.names: dict[str, int] = {}
        self.held: set[int] = set()  # kept whatever the names say (a caller holds them)
        self.level = self.peak = 0
        self.where = ""
        self._next = 0

    def new(self, nbytes: int, label: str) -> int:
        self._next += 1
        self.bytes[self._next] = nbytes
        self.level += nbytes
        if self.level > self.peak:
            self.peak, self.where = self.level, label
        return self._next

    def spike(self, nbytes: int, label: str) -> None:
        """A kernel's scratch, allocated and freed while it runs."""
        if self.level + nbytes > self.peak:
            self.peak, self.where = self.level + nbytes, label

    def drop(self, name: str) -> None:
        sid = self.names.pop(name, None)
        if sid is not None and sid not in self.held and sid not in self.names.values():
            self.level -= self.bytes.pop(sid)

    def free_unheld(self, keep: set[int]) -> None:
        for sid in [s for s in self.bytes if s not in self.held and s not in keep]:
            self.level -= self.bytes.pop(sid)


def _run(plan: GraphPlan, mem: _Memory, inputs: list[int | None], phase: str,
         scratch: dict[int, int]) -> list[int | None]:
    """Replay one graph on `mem` (inputs bound to the given storages; None: fixed memory), with
    each kernel call's `scratch`; returns the storage of each value it returns (None: fixed
    memory or None)."""
    mem.names = {n: s for n, s in zip(plan.inputs, inputs) if s is not None}
    multi: dict[str, dict[str, int]] = {}
    last = "start"
    for step in plan.steps:
        kind = step[0]
        if kind in ("alloc", "alloc_many"):
            last = step[1]
        if kind == "call":
            mem.spike(scratch.get(step[1], 0), f"{phase}:{last}")
        elif kind == "alloc":
            mem.names[step[1]] = mem.new(step[2], f"{phase}:{step[1]}")
        elif kind == "alloc_many":
            multi[step[1]] = {i: mem.new(b, f"{phase}:{i}") for i, b in step[2]}
            mem.held.update(multi[step[1]].values())  # the tuple holds them until its del
        elif kind == "item":
            sid = multi.get(step[2], {}).get(step[1])
            if sid is not None:
                mem.names[step[1]] = sid
        elif kind == "alias":
            if step[2] in mem.names:
                mem.names[step[1]] = mem.names[step[2]]
        elif kind == "del":
            if step[1] in multi:
                for sid in multi.pop(step[1]).values():
                    mem.held.discard(sid)
                    if sid not in mem.names.values():
                        mem.level -= mem.bytes.pop(sid)
            else:
                mem.drop(step[1])
        elif kind == "return":
            out = [mem.names.get(n) if n is not None else None for n in step[1]]
            for sids in multi.values():
                mem.held.difference_update(sids.values())
            mem.free_unheld({s for s in out if s is not None})
            mem.names = {}
            return out
    mem.free_unheld(set())
    return []


def replay_step(forward: GraphPlan, backward: GraphPlan, *, num_fwd_outputs: int,
                tangent_bytes: list[int], fixed_bytes: int,
                scratch: tuple[dict[int, int], dict[int, int]] = ({}, {}),
                unmeasured: tuple[str, ...] = ()) -> CodePeak:
    """The training step's peak as the code runs it: the forward (primals are fixed memory);
    its user outputs held by the caller to the end of the backward and its saved values handed
    to the backward, which frees each at its last `del`; the backward's tangents (at the sizes
    given, held by autograd until it returns) and gradients (kept). scratch: the forward's and
    the backward's kernel calls' scratch bytes (measure_scratch), by call index."""
    mem = _Memory()
    returned = _run(forward, mem, [None] * len(forward.inputs), "forward", scratch[0])
    f_peak, f_where = mem.peak, mem.where
    user, saved = returned[:num_fwd_outputs], returned[num_fwd_outputs:]
    mem.held = {s for s in user if s is not None}
    mem.peak = mem.level
    tangents = [mem.new(b, "backward:tangents") for b in tangent_bytes]
    mem.held.update(tangents)
    n_saved = len(backward.inputs) - len(tangents)
    if n_saved != len(saved):
        raise ValueError(f"the backward takes {n_saved} saved values, the forward returned "
                         f"{len(saved)}: expected the same (Inductor's code is not as read)")
    grads = _run(backward, mem, [*saved, *tangents], "backward", scratch[1])
    del grads
    b_peak, b_where = mem.peak, mem.where
    peak, where = (f_peak, f_where) if f_peak >= b_peak else (b_peak, b_where)
    return CodePeak(forward_peak=f_peak, backward_peak=b_peak, transient_peak_bytes=peak,
                    peak_bytes=fixed_bytes + peak, where=where,
                    unsized=forward.unsized + backward.unsized, unmeasured=unmeasured)


def _namespace(source: str) -> dict:
    """The names the wrapper's `call` uses (torch, aten, extern_kernels, reinterpret_tensor,
    ...), from its own top-level imports and aliases; its kernels are not compiled."""
    tree = ast.parse(source)
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            or (isinstance(n, ast.Assign) and isinstance(n.value, (ast.Attribute, ast.Name)))]
    ns: dict = {}
    for st in keep:
        try:
            exec(compile(ast.Module(body=[st], type_ignores=[]), "<inductor wrapper>", "exec"),
                 ns)
        except (NameError, AttributeError):  # an alias of what the module defines later
            continue
    return ns


def _zeros(layout: Layout) -> torch.Tensor:
    size, stride, dtype = layout
    dt = getattr(torch, dtype or "float32")
    return torch.empty_strided(size, stride, dtype=dt).zero_()


def _anonymous(tree: ast.AST, names: list[str]) -> str:
    """The statement with its buffers named by order of appearance (the same call on other
    buffers of the same layouts reads the same)."""
    index = {n: i for i, n in enumerate(names)}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id in index:
                return ast.copy_location(ast.Name(id=f"_{index[node.id]}", ctx=node.ctx), node)
            return node
    return ast.unparse(Rename().visit(tree))


def measure_scratch(plan: GraphPlan, source: str,
                    input_layouts: dict[str, Layout]) -> tuple[dict[int, int], tuple[int, ...]]:
    """Run each distinct kernel call of `plan` once on zero tensors laid out as the code lays
    them out (`input_layouts` for the graph's inputs); its scratch is the peak the CPU
    allocator saw while it ran above what it left allocated (its outputs). Returns (scratch by
    call index, the calls that would not run on zeros). The RNG state is restored."""
    # an input's strides as the code asserts them (Inductor makes a convolution's saved input
    # channels-last), its dtype from the graph (the assertion has none)
    layouts = dict(plan.layouts)
    for name, (size, stride, dtype) in input_layouts.items():
        asserted = layouts.get(name)
        layouts[name] = (asserted[0], asserted[1], dtype) if asserted else (size, stride, dtype)
    ns = _namespace(source)
    failed: list[int] = []
    first: dict[int, int] = {}  # call -> the first call of its kind (measured)
    seen: dict[str, int] = {}
    state = torch.get_rng_state()
    try:
        with torch_private.outside_dispatch_modes(), torch.no_grad(), AllocatorLog() as log:
            for i, text in enumerate(plan.calls):
                tree = ast.parse(text)
                names = list(dict.fromkeys(n.id for n in ast.walk(tree)
                                           if isinstance(n, ast.Name) and n.id in layouts))
                key = _anonymous(tree, names) + repr([layouts[n] for n in names])
                first[i] = seen.setdefault(key, i)
                if first[i] != i:
                    continue
                env = dict(ns, **{n: _zeros(layouts[n]) for n in names})
                log.mark(f"{i}a")
                try:
                    exec(text, env)
                except Exception:  # it needs real data (indices, sizes) to run
                    failed.append(i)
                log.mark(f"{i}b")
                del env
    finally:
        torch.set_rng_state(state)
    measured = {i: max(0, log.peak_between(f"{i}a", f"{i}b") - log.level(f"{i}b"))
                for i in set(first.values())}
    return {i: measured[j] for i, j in first.items()}, tuple(failed)
