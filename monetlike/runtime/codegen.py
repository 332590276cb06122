"""Python code generated from the traced graph: the scheduled forward, and each recomputation.

Both are fx codegen of a graph built from the traced one, bound to the live model (`self`), so
parameters and submodules replaced after tracing are the ones used. Only the nodes that need the
runtime call back into it; every other node costs what it costs in the model's own forward
(NOTE [Generated forward] in executor.py).
"""

from __future__ import annotations

import linecache
from typing import Callable

import torch
import torch.fx as fx

from ..core.torch_private import PyTreeCodeGen
from ..core import recompute as rc
from .plan import Plan
from ..core.modules import MISSING, attr_path

def _compiled(graph: fx.Graph, what: str, key: int) -> Callable:
    code = graph.python_code(root_module="self")
    filename = f"<monetlike {what} {key:x}>"
    # Tracebacks through the generated code show its lines (fx's GraphModule does the same).
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    scope = dict(code.globals)
    exec(compile(code.src, filename, "exec"), scope)
    return scope["forward"]


def _free_name(gm: fx.GraphModule, name: str) -> str:
    """`name`, prefixed with underscores until no model input is called that."""
    taken = {n.target.lstrip("*") for n in gm.graph.nodes if n.op == "placeholder"}
    while name in taken:
        name = "_" + name
    return name


def generated_forward(plan: Plan, root: torch.nn.Module):
    """NOTE [Generated forward]: the traced graph as Python code, `forward(runner, model, *args)`.

    A node in `plan.runtime_nodes` (or a get_attr / call_module the live model lacks: a constant
    fx made at trace time) becomes a call `runner.run_node(i, args, kwargs)`; every
    other node is fx's own code for it."""
    gm = plan.gm
    through = set(plan.runtime_nodes)
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "call_module") and attr_path(root, n.target) is MISSING:
            through.add(n.name)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    # The runner is the generated function's first argument, named unlike any model input.
    runner = graph.placeholder(_free_name(gm, "_runner"))
    for i, n in enumerate(gm.graph.nodes):
        if n.op not in ("placeholder", "output") and n.name in through:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = graph.create_node("call_method", "run_node", (runner, i, args, kwargs),
                                       name=n.name)
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
    # An exported graph (monetlike.capture) flattens its inputs and rebuilds its outputs (a
    # ModelOutput) with specs kept on the GraphModule: the code is generated flat (the new
    # graph's default CodeGen) and the original codegen does both around it.
    flat_forward = _compiled(graph, "scheduled forward", id(plan))
    codegen = gm.graph._codegen
    if not isinstance(codegen, PyTreeCodeGen):
        def forward(runner, root, *args):
            return flat_forward(root, runner, *args)
    else:
        def forward(runner, root, *args):
            return codegen.process_outputs(
                flat_forward(root, runner, *codegen.process_inputs(*args)))
    return forward


def _runs_differently(n: fx.Node, root: torch.nn.Module, impl_calls: dict) -> bool:
    """True for a node a recomputation cannot run as the forward's code does: a norm (run
    without its running statistics, rc.call_for_recompute), the node of an in-place Impl, an
    attribute the live model lacks."""
    if n.name in impl_calls:
        return True
    if n.op in ("get_attr", "call_module"):
        found = attr_path(root, n.target)
        if found is MISSING:
            return True
        return n.op == "call_module" and rc.norm_kind(type(found)) is not None
    return n.op == "call_function" and rc.recomputes_differently(n.target)


def generated_recompute(plan: Plan, j: int, root: torch.nn.Module,
                        index: dict[fx.Node, int]) -> Callable:
    """The recomputation of Op j as Python code, `recompute(model, call)`.

    Op j's nodes are fx's code for them, in the forward's order; `call` (executor.Recomputation)
    supplies what lies outside them: `call.arg(i)` rebuilds node i of the traced graph from the
    resident Values (the geometry the forward recorded), `call.run(i, args, kwargs)` runs a node
    that `_runs_differently`, `call.made(i, result)` registers the Values the Op's node makes
    (before later nodes of the Op, which may read them through a view), `call.local(name, x)`
    gives a result to the rebuilding of nodes outside the Op that read it. Every result is
    returned, so each lives until the Op is done, as the profile measured it. `index`: each
    node's position in the traced graph."""
    mine = plan.op_nodes[j]
    own = set(mine)
    op_name = plan.graph.ops[j].name
    inplace = plan.impl_calls if j in plan.overwrites else {}
    # Results of the Op that a node outside it reads, where `call.arg` may rebuild that node by
    # running it again (a view between two nodes of a non-contiguous Op).
    read_back: set[fx.Node] = set()
    stack = [a for n in mine for a in n.all_input_nodes if a not in own]
    seen = set(stack)
    while stack:
        for b in stack.pop().all_input_nodes:
            if b in own:
                read_back.add(b)
            elif b not in seen:
                seen.add(b)
                stack.append(b)
    graph = fx.Graph()
    call = graph.placeholder("_call")
    env: dict[fx.Node, fx.Node] = {}
    for n in mine:
        for a in n.all_input_nodes:
            if a not in own and a not in env:
                env[a] = graph.call_method("arg", (call, index[a]))
        if _runs_differently(n, root, inplace) or n.name in plan.stashed_recompute:
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            env[n] = graph.call_method("run", (call, index[n], args, kwargs))
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
        if n.name == op_name:
            graph.call_method("made", (call, index[n], env[n]))
        if n in read_back:
            graph.call_method("local", (call, n.name, env[n]))
    graph.output(tuple(env[n] for n in mine))
    return _compiled(graph, f"recomputation of op {j}", id(plan))
