"""What torch.compile's activation-memory plan keeps and recomputes, on a bench_peers model.

    python scripts/compile_plan.py --model transformer --budgets 1.0,0.75,0.5

torch.compile (aot_eager, `activation_memory_budget` b, the "ilp" solver: bench_peers' compile
peer) partitions the joint graph into a forward and a backward; the forward's extra outputs are
what the backward keeps. For each budget this prints the kept tensors grouped by the ATen op that
made their data (views followed back to it), with their bytes, and the forward work the backward
runs again (its nodes that depend on no incoming gradient), counted by op. The model, input and
loss are bench_peers' (scripts/peers.py SPECS "full"). Reading what compile keeps against what our
schedule keeps at the same peak is how docs/BENCHMARKS.md ("Peers, rerun ... session 39")
explains the transformer's compile rows.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import torch  # noqa: E402
import torch._functorch.config as fconfig  # noqa: E402
from torch._dynamo.backends.debugging import aot_eager  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402

from peers import SPECS, bench_loss, labels_for  # noqa: E402

MiB = 2 ** 20


def _is_view(n: torch.fx.Node) -> bool:
    """An op returning a view of its input (its schema says so): a kept view's data was made by
    the op under it, and running it again in the backward recomputes nothing."""
    return n.op == "call_function" and (bool(getattr(n.target, "is_view", False))
                                        or n.target is torch.ops.aten._unsafe_view.default)


def _name(n: torch.fx.Node) -> str:
    return str(n.target) if n.op == "call_function" else n.op


def _maker(n: torch.fx.Node) -> str:
    """The op that made a kept tensor's data: views followed back; a getitem names its tuple's
    op and index (native_dropout's 1 is its mask, native_layer_norm's 1 and 2 its statistics)."""
    while _is_view(n):
        n = n.args[0]
    if n.op == "call_function" and "getitem" in str(n.target):
        return f"{_name(n.args[0])}[{n.args[1]}]"
    if n.op == "placeholder":
        return "parameter or input"
    return _name(n)


def capture(spec, budget: float) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Compile the spec's model at `budget`, run one training step, return (forward, backward)."""
    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, example_inputs, **kw):
        return aot_eager(gm, example_inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"), **kw)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = spec.build().train()
    x = spec.example_input(seed=1)
    with fconfig.patch(activation_memory_budget=budget, activation_memory_budget_solver="ilp"):
        out = torch.compile(model, backend=backend)(x)
        bench_loss(out, labels_for(out)).backward()
    torch._dynamo.reset()
    return graphs["fw"], graphs["bw"]


def plan(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> tuple[dict, collections.Counter]:
    """({maker: [count, bytes]} of the kept activations, Counter of the recomputed ops)."""
    made = {n.name: n for n in fw.graph.nodes}
    kept: dict[str, list] = collections.defaultdict(lambda: [0, 0])
    for p in bw.graph.nodes:
        if p.op != "placeholder" or p.name.startswith("tangents") or p.name not in made:
            continue
        n = made[p.name]
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or n.op == "placeholder":
            continue  # parameters and inputs: kept by any plan
        group = kept[_maker(n)]
        group[0] += 1
        group[1] += val.numel() * val.element_size()
    # Backward nodes that depend on no incoming gradient: forward work done again.
    needs_grad: dict[str, bool] = {}
    again: collections.Counter = collections.Counter()
    for n in bw.graph.nodes:
        if n.op == "placeholder":
            needs_grad[n.name] = n.name.startswith("tangents")
        elif n.op == "call_function":
            needs_grad[n.name] = any(needs_grad.get(a.name, False) for a in n.all_input_nodes)
            if not needs_grad[n.name] and not _is_view(n) and "getitem" not in str(n.target):
                again[_name(n)] += 1
    return dict(kept), again


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="transformer", choices=sorted(SPECS["full"]))
    ap.add_argument("--budgets", default="1.0,0.75,0.5",
                    help="activation_memory_budget values, comma-separated")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = SPECS["full"][args.model]
    for b in (float(v) for v in args.budgets.split(",")):
        kept, again = plan(*capture(spec, b))
        total = sum(nbytes for _, nbytes in kept.values())
        print(f"\n{args.model}, activation_memory_budget={b}: kept activations "
              f"{total / MiB:.2f} MiB\n")
        print("| made by | tensors | MiB |\n|---|---|---|")
        for maker, (count, nbytes) in sorted(kept.items(), key=lambda kv: -kv[1][1]):
            print(f"| {maker} | {count} | {nbytes / MiB:.2f} |")
        print("\nrecomputed in the backward: " + (", ".join(
            f"{op} x{k}" for op, k in again.most_common()) or "nothing"))


if __name__ == "__main__":
    main()
