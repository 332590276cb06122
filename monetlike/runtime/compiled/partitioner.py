"""`monetlike.backend(budget=...)`: a torch.compile backend whose partition is the plan.

AOTAutograd traces the joint forward+backward graph and hands it to `CompiledBackend.partition`,
which describes it (joint.py), searches the saved set that fits the budget at the least
recomputation (solver/compiled.py), tags the joint graph so that torch's default partition saves
exactly that set, and checks that the forward it got saves what the plan says.

Under Inductor the plan is searched on the eager-op model at a target, Inductor compiles it, and
the step's peak is read off the code it generated (inductor_code.py); the target moves by the
difference between that peak and the budget (to the search's least after two compiles over the
budget), up to MAX_COMPILES compiles, and the cheapest plan whose code fits the budget runs.

One plan per step: the budget is the whole step's, so a second graph (a graph break, or a
recompilation for other shapes) is refused, naming where it starts.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from solver.compiled import (AUTO_REFUSED, CompiledPlan, JointGraph, forward_sources,
                             least_alternatives, least_peak, plan_saved, predict, resolve_budget,
                             search_starts, torch_default_saved)
from solver.errors import BudgetParseError, InfeasibleBudgetError, MonetlikeError
from solver.units import format_bytes, parse_budget

from ...core import torch_private
from .inductor_code import CodePeak, call_ops, measure_scratch, read_call, replay_step
from .joint import OpMeasures, describe, measure_ops, saved_names, tag_saved

__all__ = ["CompiledBackend", "GraphBreakError", "PartitionRecord", "COMPILERS", "learned_scratch"]

COMPILERS = ("aot_eager", "inductor")
MAX_COMPILES = 3
"""Inductor: compiles tried per graph while moving the eager-op model's target."""
SETTLE = 0.02
"""Inductor: a compiled peak this close under the budget (a share of it) ends the search."""
MIN_ALTERNATIVES = 2
"""Inductor, budget 'min': near-least plans compiled beside the least and min-cut's own."""
NEAR_LEAST = 0.05
"""How far above the least peak by the model (a share of it) a near-least plan may be."""


class GraphBreakError(MonetlikeError, RuntimeError):
    """torch.compile split the training step into more than one graph."""


@dataclass(frozen=True)
class PartitionRecord:
    """One partitioned graph: the plan and what the forward graph torch built saves."""

    graph: JointGraph
    plan: CompiledPlan
    saved: frozenset[str]
    """The forward values (not primals, not RNG states) the partitioned forward hands on."""
    forward: fx.GraphModule
    backward: fx.GraphModule
    unmeasured: tuple[str, ...] = ()
    """Ops whose scratch and time could not be measured (they would not run on zeros)."""
    target: int = 0
    """The peak the plan was searched under, by the eager-op model (the budget, but under
    Inductor, where it moves with what the compiled code allocates)."""
    code: CodePeak | None = None
    """Inductor: the step's memory as the code it generated allocates it."""

    @property
    def predicted_transient(self) -> int:
        """The step's predicted peak above the primals: Inductor's code replayed, or (aot_eager)
        the eager-op model's."""
        return (self.code.transient_peak_bytes if self.code is not None
                else self.plan.prediction.transient_peak_bytes)

    @property
    def predicted_peak(self) -> int:
        return self.graph.fixed_bytes + self.predicted_transient


def _input_layouts(gm: fx.GraphModule) -> dict[str, tuple]:
    """(size, stride, dtype name) of each tensor placeholder of a partitioned graph (the names
    Inductor's wrapper unpacks its `args` into)."""
    out = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            out[node.name] = (tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride()),
                              str(val.dtype).removeprefix("torch."))
    return out


def _where(gm: fx.GraphModule | None) -> str:
    """Where a dynamo graph starts in the user's code (the first op's stack trace line)."""
    for node in (gm.graph.nodes if gm is not None else ()):
        trace = node.meta.get("stack_trace")
        lines = [ln.strip() for ln in (trace or "").splitlines() if ln.strip()]
        files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        if files:
            i = files[-1]
            return " ".join(lines[i:i + 2])  # 'File "...", line N, in f' and its code
    return "an unknown place (the graph's nodes carry no stack trace)"


def learned_scratch(graph: JointGraph, plans, scratch, ops: dict[str, str]) -> dict[str, int]:
    """The scratch each joint node's kernel call in Inductor's code allocated, where more than
    the eager op's (a depthwise convolution's backward on the channels-last input Inductor hands
    it: 8.4 MiB on MobileNetV2, which the model planned without). `plans` and `scratch`: each
    graph's GraphPlan and its measured scratch per call; `ops`: joint node -> its op. A call is
    matched to the one node of its op that reads the graph names it reads."""
    learned: dict[str, int] = {}
    for plan, got in zip(plans, scratch):
        for i, (op, names) in enumerate(call_ops(plan)):
            known = {n for n in names if n in graph.by_name}
            if got.get(i, 0) <= 0 or not op or not known:
                continue
            match = [n for n in graph.nodes if ops.get(n.name) == op
                     and n.phase != "primal" and known <= set(n.inputs)]
            if len(match) == 1 and got[i] > match[0].scratch:
                learned[match[0].name] = got[i]
    return learned


class CompiledBackend:
    """A torch.compile backend that runs the step within `budget` bytes (see monetlike.backend)."""

    def __init__(self, budget, *, compiler: str = "aot_eager", width: int = 8,
                 planner: "Callable[[JointGraph, int], CompiledPlan] | None" = None) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"compiler {compiler!r} is not one of {', '.join(COMPILERS)}; "
                             f"'aot_eager' runs the graphs' aten ops (gradients bitwise equal "
                             f"to eager), 'inductor' compiles them")
        self.spec = parse_budget(budget)
        if self.spec.kind == "auto":
            raise BudgetParseError(AUTO_REFUSED)
        self.budget: int | None = int(self.spec.value) if self.spec.kind == "bytes" else None
        """The budget in bytes; a relative form ('min', '90%') is resolved on the joint graph."""
        self.compiler = compiler
        self.width = width
        # the search by default; a seam for a caller (or a test) that picks the saved set itself
        self.planner = planner or (lambda graph, budget: plan_saved(graph, budget, width=width))
        self.records: list[PartitionRecord] = []
        self.compiles = 0
        """Graphs compiled (Inductor may compile one graph under several targets)."""
        self._graphs: list[fx.GraphModule] = []
        self._ddp_split = False  # a graph came from DistributedDataParallel's bucket split
        self._target: int | None = None  # None: the budget
        self._made: PartitionRecord | None = None  # the last partition, not yet chosen
        self._measures: OpMeasures | None = None
        self._start: list[str] | None = None  # Inductor: min-cut's saved set, the search's start
        self._learned: dict[str, int] = {}  # node -> scratch its kernel showed in Inductor's code
        self._described: tuple[dict[str, int], JointGraph] | None = None  # (learned, graph)
        self._ops: dict[str, str] = {}  # joint node -> its op, str(target)
        self._force: frozenset[str] | None = None
        self._code: dict[bool, str] = {}
        self._compile = (torch_private.aot_backend(self.partition) if compiler == "aot_eager"
                         else torch_private.inductor_backend(self.partition, self._keep_code))

    def _keep_code(self, is_backward: bool, source: str | None) -> None:
        self._code[is_backward] = source

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self._graphs.append(gm)
        outside = None if self.records else self._computed_outside(gm, example_inputs)
        if outside is not None:  # (after a first training graph: the second-graph refusal)
            raise GraphBreakError(outside)
        self._ddp_split = self._ddp_split or torch_private.ddp_splits_graphs()
        self._measures, self._made, self._learned, self._described = None, None, {}, None
        if self.compiler == "aot_eager":
            out = self._compile(gm, example_inputs)
            self.compiles += 1
            if self._made is not None:
                self.records.append(self._made)
            return out
        return self.settle(gm, example_inputs)

    def compile_at(self, gm, example_inputs, target: int | None,
                   force: frozenset[str] | None = None):
        """Compile `gm` with Inductor at `target` (or with the saved set `force`); (the compiled
        step, its record with the code's peak or None for a graph without a backward, whether
        the code's kernel calls showed scratch the model had not counted). The one place
        Inductor runs: tests of `settle` stand in for it here."""
        self._target, self._force, self._made, self._code = target, force, None, {}
        out = self._compile(copy.deepcopy(gm), example_inputs)
        self.compiles += 1
        made = self._made
        if made is None:
            return out, None, False
        if None in (self._code.get(False), self._code.get(True)):
            raise MonetlikeError("Inductor compiled the step without the Python wrapper code "
                                 "the plan's memory is read from (a C++ wrapper?): not supported")
        tangents = [n.out_bytes[0] if n.out_bytes else 0 for n in made.graph.nodes
                    if n.phase == "tangent"]
        plans, scratch, unmeasured = [], [], []
        for graph, source in ((made.forward, self._code[False]),
                              (made.backward, self._code[True])):
            plan = read_call(source)
            got, failed = measure_scratch(plan, source, _input_layouts(graph))
            plans.append(plan)
            scratch.append(got)
            unmeasured += [plan.calls[i][:120] for i in failed]
        code = replay_step(plans[0], plans[1], num_fwd_outputs=len(made.graph.forward_outputs),
                           tangent_bytes=tangents, fixed_bytes=made.graph.fixed_bytes,
                           scratch=(scratch[0], scratch[1]), unmeasured=tuple(unmeasured))
        more = learned_scratch(made.graph, plans, scratch, self._ops)
        self._learned.update(more)
        learned = bool(more)
        return out, dataclasses.replace(made, code=code), learned

    def settle(self, gm, example_inputs):
        """Compile `gm` under Inductor within the budget, `compile_at` each try. Move the eager-op
        target by what the compiled code allocates more or less than the budget; run the cheapest
        plan whose code fits (compiled last, as Dynamo keeps it). Where a compile shows scratch
        the model missed, the next plan counts it (one compile more). Where no target's code
        fits, the plans 'min' compiles beside the least are tried before refusing."""
        tried: list[tuple] = []  # (compiled, record), in order
        target, extra, force, others = None, 0, None, None
        for _ in range(MAX_COMPILES + 2 + MIN_ALTERNATIVES):
            try:
                out, rec, learned = self.compile_at(gm, example_inputs, target, force)
            except InfeasibleBudgetError as e:
                # under the eager-op model's least: Inductor's code may still fit at that least
                if e.min_budget is None or e.min_budget in {r.target for _, r in tried}:
                    break
                target = e.min_budget
                continue
            if rec is None:
                return out
            tried.append((out, rec))
            extra = extra or int(learned)
            if self.spec.kind == "min":  # the least: what the code allocates at the plan's least
                if learned and len(tried) == 1:  # the least again, with the scratch it missed
                    self.budget = target = None
                    continue
                if others is None:
                    others = self._least_others(rec.graph, [r for _, r in tried])
                if others:
                    force = others.pop(0)
                    continue
                self.budget = min(r.code.peak_bytes for _, r in tried)
                break
            over = rec.code.peak_bytes - self.budget
            # within the budget, and close to it or at a target where the search saves all
            settled = over <= 0 and (over >= -SETTLE * self.budget
                                     or rec.target >= rec.plan.default.peak_bytes)
            nxt = rec.target if learned and over > 0 else rec.target - over
            if over > 0 and sum(r.code.peak_bytes > self.budget for _, r in tried) >= 2:
                # over twice: the search's least, the plan most likely to fit, if anything does
                # (before planning at the same target again with scratch just learned: on
                # MobileNetV2 each compile learned more, and the compiles ran out first)
                nxt = least_peak(rec.graph, self.width).peak_bytes
            if settled or len(tried) >= MAX_COMPILES + extra or (
                    not learned and nxt in {r.target for _, r in tried}):
                break
            target = nxt
        fits = [v for v in tried if v[1].code.peak_bytes <= self.budget]
        if not fits and tried and self.spec.kind != "min":
            # what 'min' compiles too: a plan alike by the model may compile under the budget
            # (MobileNetV2 at 16.31 MiB: 3 targets over it where 'min' reached 16.18)
            for saved in self._least_others(tried[-1][1].graph, [r for _, r in tried]):
                out, rec, _ = self.compile_at(gm, example_inputs, None, saved)
                tried.append((out, rec))
                if rec.code.peak_bytes <= self.budget:
                    fits = [(out, rec)]
                    break
        if not fits:
            least = min((r for _, r in tried), key=lambda r: r.code.peak_bytes, default=None)
            got = (f"the least of the {len(tried)} tried peaks at "
                   f"{format_bytes(least.code.peak_bytes)} by the code Inductor generated"
                   if least is not None else "no plan compiled")
            raise InfeasibleBudgetError(
                f"budget {format_bytes(self.budget)}: Inductor's compiled step does not fit it "
                f"({got}); raise the budget to at least that, or lower the batch",
                budget=self.budget, min_budget=least.code.peak_bytes if least else None)
        out, rec = min(fits, key=lambda v: (v[1].plan.prediction.recompute_cost, -v[1].target))
        if rec is not tried[-1][1]:  # compiled again: the last compile is the one Dynamo holds
            out, rec, _ = self.compile_at(gm, example_inputs, rec.target, force=rec.saved)
        self.records.append(rec)
        return out

    def _least_others(self, graph: JointGraph, tried: list) -> list[frozenset[str]]:
        """Saved sets to compile beside the least by the model (budget 'min', and a budget no
        target fit): min-cut's own, then up to MIN_ALTERNATIVES near-least ones, none of `tried`.
        The model does not see Inductor's fusion, so which of plans alike by the model compiles
        lowest is the code's to say (transformer stack: the least's saved set moved with the
        measured times' noise, 1.23 to 2.01 MiB)."""
        pinned = {n.name for n in graph.nodes if n.pinned}  # a saved set names them only where read
        done = {r.plan.prediction.saved | pinned for r in tried}
        own = None if graph.start is None else search_starts(graph)[0].saved | pinned
        first = [own] if own is not None and own not in done else []
        least = least_peak(graph, self.width).peak_bytes
        near = [p.saved | pinned for p in least_alternatives(graph, self.width)
                if p.peak_bytes <= least * (1 + NEAR_LEAST)]
        return first + [s for s in dict.fromkeys(near) if s not in done and s not in first][
            :MIN_ALTERNATIVES]

    @property
    def record(self) -> PartitionRecord:
        """The one partition this backend made (after the first training step)."""
        if not self.records:
            raise MonetlikeError("no training graph has been compiled yet: run one forward and "
                                 "backward step of the compiled model first")
        return self.records[0]

    @staticmethod
    def _computed_outside(gm: fx.GraphModule, example_inputs) -> str | None:
        """A refusal where the graph reads a tensor autograd made outside it: part of the step
        ran eagerly (code Dynamo skipped), holding memory the plan cannot count."""
        holders = gm.graph.find_nodes(op="placeholder")
        for node, value in zip(holders, example_inputs):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                return (f"torch.compile handed monetlike.backend a graph starting at {_where(gm)} "
                        f"whose input {node.target} was computed with gradients outside it: "
                        f"part of the step ran eagerly (a graph break before it, or a module "
                        f"Dynamo does not trace, as nn.GRU and nn.LSTM by default), holding "
                        f"activations the budget cannot count. Compute that input inside the "
                        f"compiled model, remove the break (torch._dynamo.explain lists them), "
                        f"or for recurrent layers set torch._dynamo.config.allow_rnn = True")
        return None

    def _second_graph_refusal(self) -> str:
        head = (f"torch.compile handed monetlike.backend a second training graph, starting at "
                f"{_where(self._graphs[-1])}; the first started at {_where(self._graphs[0])}. ")
        tail = ("One plan per graph under one budget is not implemented yet (each graph's "
                "saved values stay alive through the later graphs' steps, so their budgets add "
                "up)")
        if self._ddp_split:
            return (head + "DistributedDataParallel split the step: Dynamo's DDPOptimizer "
                    "compiles one graph per gradient bucket so that each bucket's all-reduce "
                    "overlaps the backward. " + tail + ": set torch._dynamo.config.optimize_ddp "
                    "= False for one graph (the all-reduces then run after the backward)")
        return (head + "A graph break, a recompilation for other input shapes or dtypes, or "
                "blocks compiled one by one (as FSDP2 per-block compile does) split the step. "
                + tail + ": remove the break (torch._dynamo.explain lists them), use one "
                "backend per shape, or compile the whole model once")

    def partition(self, joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        if self.records:
            raise GraphBreakError(self._second_graph_refusal())
        if self._measures is None:  # the same joint graph under each of Inductor's targets
            self._measures = measure_ops(joint)
            self._start = (self._min_cut(joint, joint_inputs, num_fwd_outputs, kwargs)
                           if self.compiler == "inductor" else None)
        if self._described is None or self._described[0] != self._learned:
            measures = dataclasses.replace(self._measures,
                                           scratch={**self._measures.scratch, **self._learned})
            graph = describe(joint, num_fwd_outputs, measures, pin_rng=self.compiler == "inductor")
            if self._start is not None:
                graph = dataclasses.replace(graph, start=forward_sources(graph, self._start))
            # kept while nothing new is learned: the search's paths stay with the graph
            self._described = (dict(self._learned), graph)
        graph = self._described[1]
        self._ops = {n.name: str(n.target) for n in joint.graph.nodes if n.op == "call_function"}
        if self.budget is None:
            self.budget = resolve_budget(graph, self.spec, self.width)
        target = self.budget if self._target is None else self._target
        if self._force is not None:  # a plan compiled before, again (its saved set)
            p = predict(graph, self._force)
            target = p.peak_bytes
            plan = CompiledPlan(prediction=p, budget=target,
                                default=predict(graph, torch_default_saved(graph)))
        else:
            plan = self.planner(graph, target)
        if plan.prediction.peak_bytes > target:
            raise MonetlikeError(f"the planner's saved set peaks at "
                                 f"{format_bytes(plan.prediction.peak_bytes)}, over the target "
                                 f"{format_bytes(target)}; expected a plan within it")
        redrawn = [n for n in plan.prediction.recomputed if graph.by_name[n].pinned]
        if redrawn:
            raise MonetlikeError(f"the plan recomputes the random op(s) {redrawn[:3]}, whose "
                                 f"numbers {self.compiler} does not replay; expected them saved")
        tag_saved(joint, graph, plan.saved)
        kwargs.pop("compiler", None)  # Inductor names itself for its min-cut's op lists
        forward, backward = torch_private.default_partition(
            joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        got = frozenset(n for n in saved_names(forward, num_fwd_outputs)
                        if n in graph.by_name and graph.by_name[n].candidate)
        if got != plan.saved:
            raise MonetlikeError(
                f"torch's partition saved other values than the plan (a monetlike bug, please "
                f"report it): saved but not planned {sorted(got - plan.saved)[:5]}, planned but "
                f"not saved {sorted(plan.saved - got)[:5]}")
        self._made = PartitionRecord(graph=graph, plan=plan, saved=got, forward=forward,
                                     backward=backward, unmeasured=self._measures.failed,
                                     target=target)
        return forward, backward

    @staticmethod
    def _min_cut(joint, joint_inputs, num_fwd_outputs: int, kwargs) -> list[str]:
        """What Inductor's own min-cut partition saves: the search's start under Inductor. The
        op-by-op model prices a recomputed pointwise op as a materialized eager one, where
        Inductor fuses it into the backward's kernels (from torch's default partition, ours at
        compile plain's peak did not fit on MobileNetV2); where min-cut's fits, it is the plan."""
        forward, _ = torch_private.min_cut_partition(
            joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        return saved_names(forward, num_fwd_outputs)

    def __repr__(self) -> str:
        budget = str(self.spec) if self.budget is None else format_bytes(self.budget)
        return f"monetlike.backend(budget={budget!r}, compiler={self.compiler!r})"
