"""The timing run: a plain training step that times each Op's forward nodes and backward
autograd nodes, with nothing else instrumented."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..core.torch_private import tree_leaves
from .costs import Timer
from .records import training_loss, walk_new_autograd_nodes


class TimingRun(fx.Interpreter):
    """A plain training step that times each Op's forward nodes and backward autograd nodes."""

    def __init__(self, gm: fx.GraphModule, node_gid: dict[str, int], timer: Timer,
                 progress=None):
        super().__init__(gm)
        self.node_gid, self.timer, self.progress = node_gid, timer, progress

    def step(self, inputs: tuple) -> tuple[dict[int, float], dict[int, float]]:
        self.fwd_marks: list[tuple[int, Any, Any]] = []
        self.bwd_marks: list[tuple[int, Any, Any]] = []
        self.fn_owner: dict[int, int] = {}
        self.fn_keep: list = []
        out = self.run(*inputs)
        loss = training_loss(out)
        if loss is not None:
            loss.backward()
        del out, loss
        self.timer.sync()
        self.env = {}
        fwd: dict[int, float] = {}
        bwd: dict[int, float] = {}
        for gid, a, b in self.fwd_marks:
            fwd[gid] = fwd.get(gid, 0.0) + self.timer.seconds(a, b)
        for gid, a, b in self.bwd_marks:
            bwd[gid] = bwd.get(gid, 0.0) + self.timer.seconds(a, b)
        self.fn_keep.clear()
        self.fn_owner.clear()
        return fwd, bwd

    def run_node(self, n: fx.Node) -> Any:
        gid = self.node_gid.get(n.name)
        if gid is None:
            result = super().run_node(n)
        else:
            a = self.timer.mark()
            result = super().run_node(n)
            b = self.timer.mark()
            self.fwd_marks.append((gid, a, b))
            walk_new_autograd_nodes(tree_leaves(result), self.fn_owner, self.fn_keep, gid,
                                     self._hook_fn)
        if self.progress is not None:
            self.progress.update(1)
        if not n.users and n.op != "output":
            return None
        return result

    def _hook_fn(self, fn, gid: int, root: bool) -> None:
        # The closures own their state (this step's list, a cell per node): an autograd node can
        # outlive a step (autocast caches weight casts with their grad_fn) and fire again later,
        # with this step's hooks still on it; it then writes into this step's dead list.
        marks, timer, cell = self.bwd_marks, self.timer, []

        def pre(grad_outputs):
            cell.append(timer.mark())

        def post(grad_inputs, grad_outputs):
            if cell:
                marks.append((gid, cell.pop(), timer.mark()))

        fn.register_prehook(pre)
        fn.register_hook(post)
