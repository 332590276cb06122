"""Hand-built OpGraphs for the solver tests and the solver benchmark (no torch).

`GraphBuilder` writes an OpGraph in a few lines (values, ops, impls; the backward order defaults to
reverse topological order). `resnet_like` builds a ResNet-style graph with torchvision's grouping
(in-place ReLU and the residual add folded into the op that creates the storage) and roofline
costs, so solver speed can be measured at realistic size before a profiled graph is at hand.
The tests' independent exact method (enumeration over schedules) lives in the test files, not here.
"""

from __future__ import annotations

import contextlib

import random
from unittest import mock

from solver.analysis import GraphFacts
from solver.rules.simple import chen_schedule, schedule_from_keep
from solver.graph import Impl, Op, OpGraph, Value
from solver.simulate import store_all_schedule


class GraphBuilder:
    """Accumulate values and ops; `build()` returns the OpGraph."""

    def __init__(self, model: str = "toy", *, batch: int = 1, param_bytes: int = 0,
                 input_bytes: int = 0):
        self.model, self.batch = model, batch
        self.param_bytes, self.input_bytes = param_bytes, input_bytes
        self.values: list[Value] = []
        self.ops: list[Op] = []

    def input(self, name: str = "x", size: int = 0) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, name, None, (max(1, size // 4),), "float32", size, None,
                                 False))
        return vid

    def op(self, name: str, inputs, out_sizes, *, saved=None, fwd=1.0, bwd=1.0, internal=0,
           fwd_ws=0, bwd_ws=0, early=(), impls=None, has_backward=True, unsafe=None,
           kind="Op"):
        """Add an op; returns its output Value id (or the tuple of ids for several outputs).

        `saved` names Values by id or the strings 'in0', 'in1', ..., 'out0', 'out1', ...
        `impls` is a list of dicts with Impl fields (saved in the same notation) overriding the
        single default Impl built from the keyword arguments.
        """
        oid = len(self.ops)
        sizes = out_sizes if isinstance(out_sizes, (tuple, list)) else (out_sizes,)
        outs = []
        for i, size in enumerate(sizes):
            vid = len(self.values)
            self.values.append(Value(vid, f"{name}" if len(sizes) == 1 else f"{name}.{i}",
                                     None if len(sizes) == 1 else i, (max(1, size // 4),),
                                     "float32", size, oid, True))
            outs.append(vid)
        inputs = tuple(inputs)

        def resolve(items):
            res = []
            for s in items:
                if isinstance(s, str):
                    res.append(inputs[int(s[2:])] if s.startswith("in") else outs[int(s[3:])])
                else:
                    res.append(s)
            return tuple(res)

        if impls is None:
            impls = [dict(name="default", saved=saved if saved is not None else ("in0",),
                          internal_bytes=internal, fwd_time=fwd, bwd_time=bwd,
                          fwd_workspace=fwd_ws, bwd_workspace=bwd_ws, early_release=early)]
        built = tuple(Impl(name=d["name"], saved=resolve(d.get("saved", ())),
                           internal_bytes=d.get("internal_bytes", 0), fwd_time=d.get("fwd_time", 1.0),
                           bwd_time=d.get("bwd_time", 1.0), fwd_workspace=d.get("fwd_workspace", 0),
                           bwd_workspace=d.get("bwd_workspace", 0),
                           overwrites=(resolve((d["overwrites"],))[0] if d.get("overwrites")
                                       is not None else None),
                           recompute_workspace=d.get("recompute_workspace"),
                           early_release=resolve(d.get("early_release", ()))) for d in impls)
        self.ops.append(Op(oid, name, kind, (name,), inputs, tuple(outs), built, has_backward,
                           unsafe))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def build(self, *, outputs, backward_order=None, stage_grad_bytes=None, final_grad_bytes=0,
              optimizer_bytes=0) -> OpGraph:
        if backward_order is None:
            backward_order = [o.id for o in reversed(self.ops) if o.has_backward]
        outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
        return OpGraph(model=self.model, batch=self.batch, values=tuple(self.values),
                       ops=tuple(self.ops), backward_order=tuple(backward_order),
                       stage_grad_bytes=tuple(stage_grad_bytes or [0] * len(backward_order)),
                       final_grad_bytes=final_grad_bytes, outputs=outputs,
                       param_bytes=self.param_bytes, optimizer_bytes=optimizer_bytes,
                       input_bytes=self.input_bytes, cost_provenance="analytical:toy")


# ----------------------------------------------------------------------------------------------
# Random graphs for property tests
# ----------------------------------------------------------------------------------------------
def _early(rng: random.Random, saved: tuple, on: bool) -> tuple:
    """A random part of `saved` that the backward frees before its peak (Impl.early_release);
    none unless `on` (so graphs drawn without it stay what they were)."""
    return tuple(s for s in saved if rng.random() < 0.5) if on else ()


def random_chain(rng: random.Random, n: int, *, early: bool = False) -> OpGraph:
    """A chain of n ops with random sizes, costs and saved sets (input, output or both); with
    `early`, random early releases too."""
    b = GraphBuilder("chain", param_bytes=rng.randint(0, 5), input_bytes=rng.randint(1, 5))
    v = b.input("x", b.input_bytes)
    for i in range(n):
        saved = rng.choice([("in0",), ("out0",), ("in0", "out0"), ()])
        v = b.op(f"op{i}", [v], rng.randint(1, 9), saved=saved, fwd=rng.randint(1, 5),
                 bwd=rng.randint(1, 5), internal=rng.choice([0, 0, 1, 2]),
                 fwd_ws=rng.choice([0, 0, 1, 3]), bwd_ws=rng.choice([0, 1, 2]),
                 early=_early(rng, saved, early))
    grads = [rng.randint(0, 4) for _ in range(n)]
    return b.build(outputs=v, stage_grad_bytes=grads, final_grad_bytes=rng.randint(0, 3))


def random_dag(rng: random.Random, n: int, *, two_impl: bool = False,
               early: bool = False) -> OpGraph:
    """A small DAG: each op reads one or two earlier values (skips, joins, multi-use); with
    `early`, random early releases too."""
    b = GraphBuilder("dag", param_bytes=rng.randint(0, 5), input_bytes=rng.randint(1, 5))
    vals = [b.input("x", b.input_bytes)]
    for i in range(n):
        k = 1 if i == 0 or rng.random() < 0.5 else 2
        ins = sorted(set(rng.sample(vals[-4:], min(k, len(vals[-4:])))))
        saved = rng.choice([("in0",), ("out0",), ("in0", "out0"), (), tuple(
            f"in{j}" for j in range(len(ins)))])
        kw = dict(saved=saved, fwd=rng.randint(1, 5), bwd=rng.randint(1, 5),
                  internal=rng.choice([0, 0, 1]), fwd_ws=rng.choice([0, 0, 2]),
                  bwd_ws=rng.choice([0, 1, 2]), early=_early(rng, saved, early))
        if two_impl and rng.random() < 0.4:
            alt_saved = rng.choice([("out0",), (), ("in0",)])
            kw["impls"] = [
                dict(name="default", saved=saved, internal_bytes=kw["internal"],
                     fwd_time=kw["fwd"], bwd_time=kw["bwd"], fwd_workspace=kw["fwd_ws"],
                     bwd_workspace=kw["bwd_ws"], early_release=kw["early"]),
                dict(name="alt", saved=alt_saved, internal_bytes=rng.choice([0, 1]),
                     early_release=_early(rng, alt_saved, early),
                     fwd_time=rng.randint(1, 5), bwd_time=rng.randint(1, 6),
                     fwd_workspace=rng.choice([0, 1]), bwd_workspace=rng.choice([0, 2]),
                     # measured (profiled graphs) or not (None: internals + workspace)
                     recompute_workspace=rng.choice([None, 0, 1, 3]))]
        vals.append(b.op(f"op{i}", ins, rng.randint(1, 9), **kw))
    grads = [rng.randint(0, 4) for _ in range(n)]
    return b.build(outputs=vals[-1], stage_grad_bytes=grads, final_grad_bytes=rng.randint(0, 3))


def random_inplace_dag(rng: random.Random, n: int) -> OpGraph:
    """A small DAG where every op whose last-read input has its output's bytes may also run in
    place over that input (an Impl with `overwrites`, saving what the default saves, which then
    never includes that input), beside random saved sets of other ops that sometimes make it
    clash with another op's backward."""
    sizes = [rng.choice([4, 8])]
    structure = []
    for i in range(n):
        k = 1 if i == 0 or rng.random() < 0.5 else 2
        ins = sorted(set(rng.sample(range(max(0, len(sizes) - 4), len(sizes)),
                                    min(k, len(sizes)))))
        structure.append((ins, rng.choice([4, 8])))
        sizes.append(structure[-1][1])
    last = {}
    for i, (ins, _) in enumerate(structure):
        for u in ins:
            last[u] = i
    output = len(sizes) - 1
    b = GraphBuilder("inplace_dag", param_bytes=rng.randint(0, 5), input_bytes=rng.randint(1, 5))
    b.input("x", b.input_bytes)
    for i, (ins, size) in enumerate(structure):
        saved = rng.choice([("in0",), ("out0",), (), tuple(f"in{j}" for j in range(len(ins)))])
        default = dict(name="default", saved=saved, internal_bytes=rng.choice([0, 0, 1]),
                       fwd_time=rng.randint(1, 5), bwd_time=rng.randint(1, 5),
                       fwd_workspace=rng.choice([0, 0, 2]), bwd_workspace=rng.choice([0, 1, 2]))
        impls = [default]
        over = [j for j, u in enumerate(ins) if u > 0 and last[u] == i and sizes[u] == size
                and u != output]
        if over and rng.random() < 0.7:
            # Like ReLU or add: the backward reads the same under both Impls, never the input
            # the in-place one overwrites.
            j = rng.choice(over)
            default["saved"] = tuple(s for s in saved if s != f"in{j}")
            impls.append(dict(default, name="inplace", overwrites=f"in{j}",
                              fwd_time=rng.randint(1, 5)))
        b.op(f"op{i}", [u for u in ins], size, impls=impls)
    grads = [rng.randint(0, 4) for _ in range(n)]
    return b.build(outputs=output, stage_grad_bytes=grads, final_grad_bytes=rng.randint(0, 3))


def random_repeated(rng: random.Random, k: int, inner: int, *,
                    fixed_boundaries: bool = False) -> OpGraph:
    """A prologue op, k copies of one random block of `inner` ops plus a residual add, and an
    epilogue op: every op of a block reads the block's input, earlier Values of the block (skips,
    joins) or, half the time, a mask the prologue makes (a Value every block reads from outside,
    like an attention mask); gradients made per stage follow the block's pattern. With
    `fixed_boundaries`, the prologue's ops and the adds must never be recomputed (so every plan
    keeps the boundaries between blocks)."""
    template = []
    for i in range(inner):
        n_in = 1 if i == 0 or rng.random() < 0.5 else 2
        ins = sorted(set(rng.sample(range(i + 1), min(n_in, i + 1))))  # 0: the block's input
        saved = rng.choice([("in0",), ("out0",), ("in0", "out0"), ()])
        template.append((ins, rng.randint(1, 9), saved, rng.randint(1, 5), rng.randint(1, 5),
                         rng.choice([0, 0, 1]), rng.choice([0, 1, 2]), rng.random() < 0.3))
    stream = rng.randint(1, 4)
    with_mask = rng.random() < 0.5
    grad_pattern = [rng.randint(0, 2) for _ in range(inner + 1)]
    b = GraphBuilder("repeated", param_bytes=rng.randint(0, 3), input_bytes=rng.randint(1, 3))
    x = b.input("x", b.input_bytes)
    unsafe = "a boundary" if fixed_boundaries else None
    h = b.op("embed", [x], stream, saved=(), fwd=1, bwd=1, unsafe=unsafe)
    mask = (b.op("mask", [x], rng.randint(1, 3), saved=(), fwd=1, bwd=0, unsafe=unsafe)
            if with_mask else None)
    for c in range(k):
        local = [h]
        for ins, size, saved, fwd, bwd, fwd_ws, bwd_ws, masked in template:
            reads = [local[u] for u in ins] + ([mask] if masked and mask is not None else [])
            local.append(b.op(f"b{c}.op{len(local) - 1}", reads, size, saved=saved, fwd=fwd,
                              bwd=bwd, fwd_ws=fwd_ws, bwd_ws=bwd_ws))
        h = b.op(f"b{c}.add", [h, local[-1]] if inner else [h], stream, saved=(), fwd=0.5,
                 bwd=0.5, unsafe=unsafe)
    out = b.op("loss", [h], 1, saved=("in0",), fwd=1, bwd=1)
    order = [o.id for o in reversed(b.ops) if o.has_backward]
    grads, made = [], 0
    for j in order:  # parameter gradients accumulate along the backward
        name = b.ops[j].name
        if name.startswith("b"):
            part = name.split(".")[1]
            made += grad_pattern[inner if part == "add" else int(part[2:])]
        grads.append(made)
    return b.build(outputs=out, backward_order=order, stage_grad_bytes=grads,
                   final_grad_bytes=made + 1)


def random_schedules(g: OpGraph, rng: random.Random, *, random_impls: bool = False) -> list:
    """Schedules from every rule with random kept sets, plus store-all and Chen's; with
    `random_impls`, each op's Impl drawn at random too (five store-all and five kept-set
    schedules)."""
    facts = GraphFacts(g, "full")
    values = [v.id for v in g.values if v.producer is not None]
    if not random_impls:
        out = [store_all_schedule(g), chen_schedule(g, facts, 2)]
        for _ in range(4):
            keep = {v for v in values if rng.random() < 0.5}
            out.append(schedule_from_keep(g, keep, retain=rng.choice(["all", "saved", "none"]),
                                          facts=facts))
        return out
    out = []
    for _ in range(5):
        impl = tuple(rng.randrange(len(op.impls)) for op in g.ops)
        out.append(store_all_schedule(g, impl))
        keep = {v for v in values if rng.random() < 0.5}
        out.append(schedule_from_keep(g, keep, retain=rng.choice(["all", "saved", "none"]),
                                      facts=facts, impl=impl))
    return out


# ----------------------------------------------------------------------------------------------
# A ResNet-style graph at realistic size, with roofline costs (A100-like rates)
# ----------------------------------------------------------------------------------------------
_FLOPS = 19.5e12      # fp32 peak, FLOP/s
_BANDWIDTH = 1.55e12  # HBM, bytes/s
_LAUNCH = 5e-6        # per-kernel overhead, s


def _roofline(flops: float, moved: float) -> float:
    return max(flops / _FLOPS, moved / _BANDWIDTH) + _LAUNCH


class _ResNetBuilder:
    def __init__(self, batch: int, fp_bytes: int = 4):
        self.b = GraphBuilder("resnet_like", batch=batch)
        self.batch, self.fp = batch, fp_bytes
        self.params = 0
        self.param_of_op: list[int] = []

    def numel(self, c, h, w):
        return self.batch * c * h * w

    def conv(self, name, x, cin, cout, h, w, k, stride):
        ho, wo = h // stride, w // stride
        out = self.numel(cout, ho, wo) * self.fp
        inp = self.numel(cin, h, w) * self.fp
        weight = cout * cin * k * k * self.fp
        flops = 2.0 * self.batch * cout * ho * wo * cin * k * k
        fwd = _roofline(flops, inp + out + weight)
        bwd = _roofline(2 * flops, 2 * inp + out + weight)
        ws = min(out, 64 << 20)  # cuDNN-like workspace, capped
        self.params += weight
        self.param_of_op.append(weight)
        # its backward saves its input; it creates the input gradient and the weight gradient
        return self.b.op(name, [x], out, saved=("in0",), fwd=fwd, bwd=bwd, fwd_ws=ws,
                         bwd_ws=inp + weight + ws, kind="Conv2d"), ho, wo

    def bn(self, name, x, c, h, w, *, relu=True, residual=None):
        size = self.numel(c, h, w) * self.fp
        ins = [x] if residual is None else [x, residual]
        saved = ("in0", "out0") if relu else ("in0",)
        passes = 3 + (1 if relu else 0) + (2 if residual is not None else 0)
        fwd = _roofline(8.0 * size / self.fp, passes * size)
        bwd = _roofline(12.0 * size / self.fp, (passes + 2) * size)
        self.params += 4 * c * self.fp
        self.param_of_op.append(2 * c * self.fp)
        return self.b.op(name, ins, size, saved=saved, fwd=fwd, bwd=bwd, internal=2 * c * 4,
                         bwd_ws=size + (size if residual is not None else 0), kind="BatchNorm2d")


def resnet_like(blocks=(3, 4, 6, 3), *, batch: int = 184, width: int = 64,
                expansion: int = 4, image: int = 224, stage_grads: bool = True) -> OpGraph:
    """torchvision-style ResNet with bottleneck blocks (ResNet-50 by default), one op per storage.

    As the profiler groups it: `bn + relu_` is one op (saves the BN input and the output),
    `bn3 + add_ + relu_` is one op (inputs: conv3 output and the identity), maxpool keeps int64
    indices as internals, fc saves its input.
    """
    r = _ResNetBuilder(batch)
    fp = r.fp
    x = r.b.input("x", r.numel(3, image, image) * fp)
    r.b.input_bytes = r.numel(3, image, image) * fp
    h = w = image
    y, h, w = r.conv("conv1", x, 3, width, h, w, 7, 2)
    y = r.bn("bn1", y, width, h, w)
    mp_out = r.numel(width, h // 2, w // 2) * fp
    y = r.b.op("maxpool", [y], mp_out, saved=("in0",), internal=2 * mp_out,
               fwd=_roofline(9.0 * mp_out / fp, 5 * mp_out), bwd=_roofline(mp_out / fp, 6 * mp_out),
               bwd_ws=4 * mp_out, kind="MaxPool2d")
    r.param_of_op.append(0)
    h, w = h // 2, w // 2
    cin = width
    for stage, nblocks in enumerate(blocks):
        planes = width * 2 ** stage
        for blk in range(nblocks):
            stride = 2 if (blk == 0 and stage > 0) else 1
            pre = f"layer{stage + 1}.{blk}."
            identity = y
            o, h1, w1 = r.conv(pre + "conv1", y, cin, planes, h, w, 1, 1)
            o = r.bn(pre + "bn1", o, planes, h1, w1)
            o, h2, w2 = r.conv(pre + "conv2", o, planes, planes, h1, w1, 3, stride)
            o = r.bn(pre + "bn2", o, planes, h2, w2)
            o, h3, w3 = r.conv(pre + "conv3", o, planes, planes * expansion, h2, w2, 1, 1)
            if blk == 0:
                d, _, _ = r.conv(pre + "downsample.0", y, cin, planes * expansion, h, w, 1,
                                 stride)
                identity = r.bn(pre + "downsample.1", d, planes * expansion, h3, w3, relu=False)
            y = r.bn(pre + "bn3", o, planes * expansion, h3, w3, residual=identity)
            h, w, cin = h3, w3, planes * expansion
    pooled = r.numel(cin, 1, 1) * fp
    y = r.b.op("avgpool", [y], pooled, saved=(), fwd=_roofline(0, r.numel(cin, h, w) * fp),
               bwd=_roofline(0, r.numel(cin, h, w) * fp), bwd_ws=r.numel(cin, h, w) * fp,
               kind="AdaptiveAvgPool2d")
    r.param_of_op.append(0)
    logits = batch * 1000 * fp
    fcw = cin * 1000 * fp
    y = r.b.op("fc", [y], logits, saved=("in0",), fwd=_roofline(2.0 * batch * cin * 1000, fcw),
               bwd=_roofline(4.0 * batch * cin * 1000, 2 * fcw), bwd_ws=pooled + fcw,
               kind="Linear")
    r.params += fcw
    r.param_of_op.append(fcw)
    r.b.param_bytes = r.params
    ops = r.b.ops
    order = [o.id for o in reversed(ops)]
    grads = [0] * len(order)
    if stage_grads:
        # Gradient of a Value is live from the first backward of its users until its producer's
        # backward ends; parameter gradients accumulate.
        values = r.b.values
        stage = {op: t for t, op in enumerate(order)}
        users: dict[int, list[int]] = {}
        for op in ops:
            for v in op.inputs:
                users.setdefault(v, []).append(op.id)
        param_so_far = 0
        for t, op_id in enumerate(order):
            live = 0
            for v in values:
                if v.producer is None:
                    continue
                first = min((stage[u] for u in users.get(v.id, [])), default=-1)
                if v.id == y:
                    first = -1
                if first < t <= stage[v.producer]:
                    live += v.bytes
            grads[t] = live + param_so_far
            param_so_far += r.param_of_op[op_id]
    return r.b.build(outputs=y, backward_order=order, stage_grad_bytes=grads,
                     final_grad_bytes=r.params)


def branch_and_bound_finding_nothing(seconds: float):
    """A stand-in for the search's branch-and-bound runner (`solver.search.branch_and_bound.
    run_milp`) that waits `seconds` and finds nothing, so a test sees what the other thread (LP,
    LNS) does."""
    import time

    from solver.backends.base import BackendResult

    def finds_nothing(backend, milp, **kw):
        time.sleep(seconds)
        return BackendResult(status="time_limit", x=None, objective=None, bound=None,
                             seconds=seconds, message="stub: nothing found")

    return finds_nothing


@contextlib.contextmanager
def no_search_shortcuts():
    """solve without its answers that need no MILP (store-all on the fastest Impls fitting, the
    best rule proven by the floor and the stage bound, which also leaves the costly rules out):
    for tests of the search and of the backends, on graphs small enough that those answers would
    otherwise often be taken."""
    import importlib

    pipeline = importlib.import_module("solver.search.pipeline")
    with mock.patch.object(pipeline, "SHORTCUTS", False):
        yield
