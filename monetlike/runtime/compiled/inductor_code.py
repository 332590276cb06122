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

What it does not see: scratch inside a kernel (an extern matmul's or convolution's workspace, a
fallback op's temporaries). A tensor the code returns without a size assertion is listed as
unsized and counted as 0 bytes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import torch

__all__ = ["CodePeak", "GraphPlan", "read_call", "replay_step"]


@dataclass(frozen=True)
class GraphPlan:
    """One graph's `call` body, in order: what each statement does to the storages."""

    inputs: tuple[str, ...]
    """The names `args` is unpacked into, in order."""
    steps: tuple[tuple, ...]
    """('alloc', name, bytes) / ('alloc_many', tuple_name, ((name, bytes), ...)) for a
    multi-output call whose elements are read later / ('alias', name, of) / ('item', name,
    tuple_name) / ('del', name) / ('return', (name or None, ...))."""
    unsized: tuple[str, ...] = ()


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


def _call_name(node: ast.AST) -> str:
    """'empty_strided_cpu', 'reinterpret_tensor', 'extern_kernels.convolution', ..."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_call_name(node.value)}.{node.attr}"
    return ""


def _nbytes(size, stride, dtype: str) -> int:
    if any(s == 0 for s in size):
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(size, stride))
    return span * getattr(torch, dtype.split(".")[-1]).itemsize


def _dtype_name(node: ast.AST) -> str:
    return _call_name(node) or "float32"


def _sizes(body: list[ast.stmt]) -> dict[str, int]:
    """Bytes of each name the code asserts the size of (assert_tensor_metadata carries the
    dtype; assert_size_stride does not, and is read as float32)."""
    out: dict[str, int] = {}
    for st in body:
        if not (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)):
            continue
        fn, args = _call_name(st.value.func), st.value.args
        if fn in ("assert_tensor_metadata", "assert_size_stride") and len(args) >= 3 \
                and isinstance(args[0], ast.Name):
            try:
                size, stride = ast.literal_eval(args[1]), ast.literal_eval(args[2])
            except ValueError:
                continue
            dtype = _dtype_name(args[3]) if fn == "assert_tensor_metadata" and len(args) > 3 \
                else "float32"
            out.setdefault(args[0].id, _nbytes(size, stride, dtype))
    return out


def _base(node: ast.AST) -> str | None:
    """The buffer a returned or aliased expression lives on (a name, or reinterpret_tensor's
    first argument); None for None or a constant."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call) and _call_name(node.func) == "reinterpret_tensor":
        return _base(node.args[0])
    return None


def read_call(source: str) -> GraphPlan:
    """The allocation plan of the `call` function in Inductor's generated wrapper `source`."""
    tree = ast.parse(source)
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "call")
    body = call.body
    sizes = _sizes(body)
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
                steps.append(("alias", name, _base(value)))
            elif isinstance(value, ast.Call) and _call_name(value.func) == "empty_strided_cpu":
                size, stride = ast.literal_eval(value.args[0]), ast.literal_eval(value.args[1])
                steps.append(("alloc", name, _nbytes(size, stride, _dtype_name(value.args[2]))))
            elif name in items:
                steps.append(("alloc_many", name, tuple((i, sizes.get(i, 0))
                                                        for i in items[name])))
                unsized.extend(i for i in items[name] if i not in sizes)
            else:
                steps.append(("alloc", name, sizes.get(name, 0)))
                if name not in sizes:
                    unsized.append(name)
        elif isinstance(st, ast.Delete):
            steps.extend(("del", t.id) for t in st.targets if isinstance(t, ast.Name))
        elif isinstance(st, ast.Return) and isinstance(st.value, (ast.Tuple, ast.List)):
            steps.append(("return", tuple(_base(e) for e in st.value.elts)))
    return GraphPlan(inputs=inputs, steps=tuple(steps), unsized=tuple(unsized))


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

    def drop(self, name: str) -> None:
        sid = self.names.pop(name, None)
        if sid is not None and sid not in self.held and sid not in self.names.values():
            self.level -= self.bytes.pop(sid)

    def free_unheld(self, keep: set[int]) -> None:
        for sid in [s for s in self.bytes if s not in self.held and s not in keep]:
            self.level -= self.bytes.pop(sid)


def _run(plan: GraphPlan, mem: _Memory, inputs: list[int | None], phase: str) -> list[int | None]:
    """Replay one graph on `mem` (inputs bound to the given storages; None: fixed memory);
    returns the storage of each value it returns (None: fixed memory or None)."""
    mem.names = {n: s for n, s in zip(plan.inputs, inputs) if s is not None}
    multi: dict[str, dict[str, int]] = {}
    for step in plan.steps:
        kind = step[0]
        if kind == "alloc":
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
                tangent_bytes: list[int], fixed_bytes: int) -> CodePeak:
    """The training step's peak as the code runs it: the forward (primals are fixed memory);
    its user outputs held by the caller to the end of the backward and its saved values handed
    to the backward, which frees each at its last `del`; the backward's tangents (at the sizes
    given, held by autograd until it returns) and gradients (kept)."""
    mem = _Memory()
    returned = _run(forward, mem, [None] * len(forward.inputs), "forward")
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
    grads = _run(backward, mem, [*saved, *tangents], "backward")
    del grads
    b_peak, b_where = mem.peak, mem.where
    peak, where = (f_peak, f_where) if f_peak >= b_peak else (b_peak, b_where)
    return CodePeak(forward_peak=f_peak, backward_peak=b_peak, transient_peak_bytes=peak,
                    peak_bytes=fixed_bytes + peak, where=where,
                    unsized=forward.unsized + backward.unsized)
