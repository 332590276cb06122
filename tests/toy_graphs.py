"""Tiny hand-built OpGraphs for the IR and simulator tests (no torch)."""

from solver.graph import Impl, Op, OpGraph, Value


def chain(sizes=(100, 200, 300), *, internal=0, fwd=1.0, bwd=2.0, bwd_ws=0, grads=None):
    """input -> op0 -> op1 -> ... ; every op's backward saves its input (like a conv)."""
    values = [Value(0, "x", None, (1,), "float32", 10, None, False)]
    ops = []
    for i, size in enumerate(sizes):
        values.append(Value(i + 1, f"op{i}", None, (size // 4,), "float32", size, i, True))
        ops.append(Op(i, f"op{i}", "Linear", (f"op{i}",), (i,), (i + 1,),
                      (Impl("default", (i,), internal, fwd, bwd, 0, bwd_ws),), True))
    n = len(sizes)
    return OpGraph(model="chain", batch=1, values=tuple(values), ops=tuple(ops),
                   backward_order=tuple(reversed(range(n))),
                   stage_grad_bytes=tuple(grads or [0] * n), final_grad_bytes=0,
                   outputs=(n,), param_bytes=1000, optimizer_bytes=0, input_bytes=10,
                   cost_provenance="analytical:toy")
