"""The per-rank memory of a training step under FSDP2 (`torch.distributed.fsdp.fully_shard`).

`profile(model, x, fsdp=FSDPConfig(...))` (or `fsdp=FSDPConfig.of(sharded_model)`, read off a
model FSDP2 has sharded) profiles the unsharded model as usual and then turns the graph's memory
into one rank's: the budget of a schedule solved on it is a per-rank peak. Only
bytes the IR already counts change, so the simulator and the MILP count them with no new logic:

- fixed memory: each parameter sharded on dim 0 in chunks of ceil(dim0 / N) rows, padded as FSDP2
  pads its sharded storage; optimizer state on the local shard (rank 0 holds the largest);
- forward, each Op's `fwd_workspace`: the unsharded (all-gathered) parameters resident while it
  runs (the root unit's from its first Op, a block's from its all-gather to its reshard) and the
  flat all-gather buffer FSDP2 keeps until the next unit's all-gather; at a unit's first Op, the
  all-gather itself (its flat buffer and the unsharded copy-out both alive), if higher;
- backward, each stage's `stage_grad_bytes`: the unsharded parameters of the units whose
  backward has begun and not ended, the flat buffer of the unit prefetched for the next, a
  finished unit's sharded gradients instead of its unsharded ones, and the last reduce-scatter
  input (FSDP2 keeps one until the next unit's reduce-scatter); the all-gathers at a unit's
  first stage are counted at that stage's backward point (its `bwd_workspace`, if higher);
- the end point (`final_grad_bytes`): the root's reduce-scatter after the last stage.

Mixed precision (`param_dtype`): the model is profiled in param_dtype (FSDP2 computes in it),
the shards and the optimizer state stay in the parameters' dtype, and the unsharded parameters,
their gradients are in param_dtype, the reduce-scatter's buffers in reduce_dtype (param_dtype
where it is None); an all-gather also holds its local shards cast to param_dtype while it runs.

What FSDP2 allocates and when was read from torch/distributed/fsdp/_fully_shard (torch 2.14)
and checked against the CPU allocator's events on 2 gloo ranks (tests/test_fsdp_memory.py).
On gloo, the all-gather and the reduce-scatter each copy their buffer once more while they run;
`backend="gloo"` counts that copy. Gloo's worker thread can also hold a collective's flat buffer
a while after FSDP2 lets go of it (timing: seen at random ranks under load); that is not counted.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from solver.analysis import inplace_freed

from ..core import torch_private
from solver.graph import OpGraph

__all__ = ["FSDPConfig", "block_units", "per_rank_graph", "cast_for_mixed_precision"]

@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """How the model is sharded: `fully_shard(model.<unit>)` for each unit, then
    `fully_shard(model)` (the root unit holds every parameter no other unit holds)."""

    world_size: int
    """Ranks the parameters are sharded over (FSDP2's shard mesh size)."""
    units: tuple[str, ...] = ()
    """Dotted paths of the submodules given their own fully_shard call (torchtitan shards each
    `layers.<i>`); empty: the root unit alone, as `fully_shard(ScheduleWrapper(model))` runs."""
    reshard_after_forward: bool = True
    """The units' `reshard_after_forward` (the root never reshards after forward: FSDP2's
    default for the root, which would all-gather again at once)."""
    forward_prefetch: bool = False
    """FSDP2's default: no unit all-gathers the next one in the forward."""
    backward_prefetch: bool = True
    """FSDP2's default: at a unit's backward, the unit before it in the forward is all-gathered."""
    param_dtype: torch.dtype | None = None
    """The MixedPrecisionPolicy's param_dtype; None: no mixed precision. The model is profiled
    in param_dtype (its floating parameters cast, as FSDP2 computes)."""
    reduce_dtype: torch.dtype | None = None
    """The MixedPrecisionPolicy's reduce_dtype (torchtitan: float32 under bfloat16 parameters):
    the reduce-scatter's buffers are in it; None: in the gradients' dtype (param_dtype), then
    cast to the sharded parameters' dtype."""
    backend: str = "nccl"
    """The process group's backend: 'gloo' copies each collective's buffer once more."""

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"FSDPConfig.world_size: expected an integer >= 1, got "
                             f"{self.world_size!r}")
        if isinstance(self.units, str) or not all(isinstance(u, str) and u for u in self.units):
            raise ValueError(f"FSDPConfig.units: expected a tuple of module paths such as "
                             f"('layers.0', 'layers.1'), got {self.units!r}")
        object.__setattr__(self, "units", tuple(self.units))
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"FSDPConfig.backend: expected 'nccl' or 'gloo', got "
                             f"{self.backend!r}")
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype)
                                          and dtype.is_floating_point):
                raise ValueError(f"FSDPConfig.{field}: expected a floating torch.dtype such as "
                                 f"torch.bfloat16 or None, got {dtype!r}")
        if self.forward_prefetch or not self.backward_prefetch:
            raise NotImplementedError(
                "FSDPConfig: only FSDP2's default prefetching is modelled (forward_prefetch=False, "
                "backward_prefetch=True); leave both at their defaults")

    @classmethod
    def of(cls, model: torch.nn.Module, *, backend: str | None = None) -> "FSDPConfig":
        """The config of `model` as FSDP2 has sharded it (`fully_shard` on its units, then on
        the model itself), to profile the unsharded model with: world size from its sharded
        parameters, units from its FSDP2 submodules, their reshard_after_forward and
        param_dtype; `backend` defaults to the default process group's."""
        from torch.distributed.fsdp import FSDPModule  # imported where a sharded model exists
        from torch.distributed.tensor import DTensor

        if not isinstance(model, FSDPModule):
            raise ValueError(f"FSDPConfig.of: expected a model sharded with fully_shard (the root "
                             f"unit), got {type(model).__name__}; call fully_shard(model) after "
                             f"its units, or give FSDPConfig(world_size=..., units=...)")
        meshes = {p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)}
        if len(meshes) != 1:
            raise ValueError(f"FSDPConfig.of: expected parameters sharded over one mesh size, "
                             f"got {sorted(meshes)}")
        units = tuple(n for n, m in model.named_modules() if n and isinstance(m, FSDPModule))
        reshard = {torch_private.fsdp_unit_settings(model.get_submodule(u))[0] for u in units}
        dtypes = {torch_private.fsdp_unit_settings(m)[1:]
                  for m in (model, *(model.get_submodule(u) for u in units))}
        if len(reshard) > 1 or len(dtypes) > 1:
            raise NotImplementedError(
                f"FSDPConfig.of: units with different reshard_after_forward ({sorted(reshard)}) "
                f"or mixed precision (param_dtype, reduce_dtype: {sorted(map(str, dtypes))}) "
                f"are not modelled; give them one setting")
        param_dtype, reduce_dtype = dtypes.pop()
        if backend is None:
            backend = torch.distributed.get_backend()
        return cls(world_size=meshes.pop(), units=units, backend=backend,
                   reshard_after_forward=reshard.pop() if reshard else True,
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    @classmethod
    def per_block(cls, model: torch.nn.Module, world_size: int, **settings) -> "FSDPConfig":
        """As torchtitan shards a transformer: every block of the model's block list a unit of
        its own (`block_units`), then the root; `settings` as the other fields
        (`param_dtype=torch.bfloat16` for its bf16 mixed precision)."""
        return cls(world_size=world_size, units=block_units(model), **settings)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["units"] = list(self.units)
        d["param_dtype"] = None if self.param_dtype is None else str(self.param_dtype)
        d["reduce_dtype"] = None if self.reduce_dtype is None else str(self.reduce_dtype)
        return d


def block_units(model: torch.nn.Module) -> tuple[str, ...]:
    """The paths of the children of the model's block list: the `nn.ModuleList` holding the most
    parameters (a Llama's `model.layers`, GPT-2's `transformer.h`); () when it has none."""
    lists = [(sum(p.numel() for p in m.parameters()), name) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return ()
    _, name = max(lists, key=lambda t: (t[0], -len(t[1])))
    prefix = f"{name}." if name else ""
    return tuple(f"{prefix}{child}" for child, _ in model.get_submodule(name).named_children())


@dataclass(frozen=True)
class _Unit:
    sharded: int      # padded local shard bytes (FSDP2's sharded storage; its sharded gradient)
    unsharded: int    # padded unsharded bytes in param_dtype: the copy-out, and the flat buffer
    grads: int        # unsharded gradient bytes (in param_dtype, as the profile counts them)
    full: int         # the parameters' bytes as the profile counts them (in param_dtype)
    state: int        # optimizer state per rank (rank 0's local shard, the largest)
    reduce_out: int   # the reduce-scatter's output, in reduce_dtype (cast to the sharded dtype)
    gather_in: int    # the all-gather's inputs cast to param_dtype (mixed precision only)
    sharded_grads: int  # the sharded gradients after the step (the trainable parameters' shards)
    reduce_in: int    # the reduce-scatter's padded input, in reduce_dtype
    copy_scratch: int  # the copy into a reduce_dtype input: the largest gradient, converted alone
    last_grad: int    # the unit's last unsharded gradient, which foreach_reduce's loop variable
    #                   keeps alive through the reduce-scatter and the cast

    def running(self, gloo: bool) -> int:
        """Bytes an all-gather holds while it runs: its flat buffer, gloo's copy of it, and the
        local shards cast to param_dtype."""
        return self.unsharded * (2 if gloo else 1) + self.gather_in

    def gathering(self, gloo: bool) -> int:
        """The most an all-gather and its copy-out (flat buffer and parameters) hold."""
        return max(self.running(gloo), 2 * self.unsharded)


def _owner(path: str, units: list[str]) -> str:
    """The innermost unit holding module or parameter `path` ('' is the root)."""
    best = ""
    for u in units:
        if (path == u or path.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _units(model: torch.nn.Module, config: FSDPConfig, mult: int) -> dict[str, _Unit]:
    paths = dict(model.named_modules())
    missing = [u for u in config.units if u not in paths]
    if missing:
        raise ValueError(f"FSDPConfig.units: {missing} name no submodule of "
                         f"{type(model).__name__}; expected paths such as "
                         f"{[p for p in paths if p][:4]}")
    n = config.world_size
    sums: dict[str, list[int]] = {u: [0] * 11 for u in ("", *config.units)}
    for name, p in model.named_parameters():
        cast = config.param_dtype if config.param_dtype and p.is_floating_point() else p.dtype
        low = torch.empty((), dtype=cast).element_size()
        reduce = config.reduce_dtype if config.reduce_dtype and p.is_floating_point() else cast
        red = torch.empty((), dtype=reduce).element_size()
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // max(rows, 1)
        chunk = math.ceil(rows / n)
        s = sums[_owner(name.rpartition(".")[0], list(config.units))]
        s[0] += chunk * per_row * p.element_size()
        s[1] += chunk * n * per_row * low
        s[2] += p.numel() * low if p.requires_grad else 0
        s[3] += p.numel() * low
        s[4] += mult * min(chunk, rows) * per_row * p.element_size() if p.requires_grad else 0
        s[5] += chunk * per_row * red if p.requires_grad else 0
        s[6] += chunk * per_row * low if cast != p.dtype else 0
        s[7] += chunk * per_row * p.element_size() if p.requires_grad else 0
        s[8] += chunk * n * per_row * red if p.requires_grad else 0
        if p.requires_grad and red != low:  # a max, not a sum: one gradient at a time
            s[9] = max(s[9], chunk * n * per_row * low)
        if p.requires_grad:  # the last one in the unit's parameter order
            s[10] = p.numel() * low
    return {u: _Unit(*s) for u, s in sums.items()}


def cast_for_mixed_precision(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` whose floating parameters are in `dtype`, as FSDP2's mixed precision
    computes with them (buffers stay as they are: FSDP2 does not cast them)."""
    work = copy.deepcopy(model)
    for p in work.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return work


def per_rank_graph(graph: OpGraph, model: torch.nn.Module, config: FSDPConfig, *,
                   optimizer_multiplier: int) -> OpGraph:
    """`graph` (profiled unsharded) with one rank's memory under FSDP2 `config`;
    `optimizer_multiplier`: optimizer state bytes per trainable parameter byte."""
    units = _units(model, config, optimizer_multiplier)
    op_modules = graph.meta.get("op_modules")
    if op_modules is None or len(op_modules) != len(graph.ops):
        raise ValueError("per_rank_graph: the graph records no module path per Op "
                         "(meta['op_modules']); profile the model again with monetlike.profile")
    unit_of = [_owner(p, list(config.units)) for p in op_modules]
    first = {u: unit_of.index(u) for u in config.units if u in unit_of}
    unused = [u for u in config.units if u not in first]
    if unused:
        raise ValueError(f"FSDPConfig.units: {unused} run no Op of the profiled step; expected "
                         f"modules the forward calls")
    blocks = sorted(first, key=first.get)  # FSDP2's post-forward order, the root last
    root = units[""]
    gloo = config.backend == "gloo"
    ops = _forward(graph, units, unit_of, first, root, config, gloo)
    stage_grad, bwd_extra, after = _backward(graph, units, unit_of, blocks, root, config, gloo)
    ops = [dataclasses.replace(op, impls=tuple(
        dataclasses.replace(im, bwd_workspace=max(im.bwd_workspace, bwd_extra[t]))
        for im in op.impls)) if (t := graph.stage_of_op.get(op.id)) is not None else op
        for op in ops]
    end = _end(graph.final_grad_bytes, after, root, gloo)
    params = sum(u.full for u in units.values())
    s_all = sum(u.sharded for u in units.values())
    return dataclasses.replace(
        graph, ops=tuple(ops), stage_grad_bytes=tuple(stage_grad), final_grad_bytes=end,
        param_bytes=graph.param_bytes - params + s_all,
        optimizer_bytes=sum(u.state for u in units.values()),
        meta={**graph.meta, "fsdp": {**config.to_dict(), "per_rank": _per_rank(units)}})


def _per_rank(units: dict[str, _Unit]) -> dict:
    """One rank's FSDP2 figures in bytes, for reports (`meta["fsdp"]["per_rank"]`)."""
    blocks = [u for name, u in units.items() if name]
    return {"sharded_params": sum(u.sharded for u in units.values()),
            "sharded_grads": sum(u.sharded_grads for u in units.values()),
            "optimizer": sum(u.state for u in units.values()),
            "unsharded_params": sum(u.full for u in units.values()),
            "root_unsharded": units[""].unsharded,
            "largest_unit_unsharded": max((u.unsharded for u in blocks), default=0)}


def _forward(graph, units, unit_of, first, root, config, gloo) -> list:
    """Each Op's forward workspace with the unsharded parameters and all-gathers around it."""
    starts = {j: u for u, j in first.items()}
    keep = not config.reshard_after_forward
    kept = 0     # blocks left unsharded after their forward (reshard_after_forward=False)
    current = 0  # the running block's unsharded parameters
    flat = 0     # the last all-gather's flat buffer, freed at the next one's copy-out
    ops = []
    for op in graph.ops:
        j = op.id
        gather = 0  # the level the all-gathers before Op j reach (above the fixed memory)
        if j == 0:  # the root's, at its pre-forward: flat buffer and copy-out (or gloo's copy)
            gather, flat = root.gathering(gloo), root.unsharded
        if j in starts or unit_of[j] == "":  # the running block's post-forward has run
            kept, current = (kept + current, 0) if keep else (kept, 0)
        if j in starts:
            u = units[starts[j]]
            gather = max(gather, root.unsharded + kept + flat + u.gathering(gloo))
            current, flat = u.unsharded, u.unsharded
        resident = root.unsharded + kept + current + flat
        outs = sum(graph.values[v].bytes for v in op.outputs)
        impls = []
        for k, im in enumerate(op.impls):
            rw = im.recompute_transient  # fixed before fwd_workspace changes under it
            held = outs - inplace_freed(graph, j, k) + im.internal_bytes
            impls.append(dataclasses.replace(
                im, fwd_workspace=max(im.fwd_workspace + resident, gather - held),
                recompute_workspace=rw))
        ops.append(dataclasses.replace(op, impls=tuple(impls)))
    return ops


def _backward(graph, units, unit_of, blocks, root, config, gloo):
    """Per stage: the gradient level with FSDP2's bytes, and how far the all-gathers at its
    start rise above it. Returns (stage_grad_bytes, extra backward workspace per stage, FSDP2's
    bytes after the last stage besides the root's own)."""
    order = graph.backward_order
    first_stage: dict[str, int] = {}
    last_stage: dict[str, int] = {}
    for t, k in enumerate(order):
        if unit_of[k]:
            first_stage.setdefault(unit_of[k], t)
            last_stage[unit_of[k]] = t
    rev = blocks[::-1]  # FSDP2 prefetches the block before in its post-forward order
    prefetched: dict[str, int] = {}  # block -> flat buffer, all-gathered, not copied out
    unsharded = {} if config.reshard_after_forward else {b: units[b].unsharded for b in blocks}
    reduced = [0]       # sharded minus unsharded gradient bytes of the reduced blocks
    rs_input = [0]      # the last reduce-scatter's input, kept until the next one

    def post_backward(t: int) -> int:
        """Reshard and reduce-scatter the blocks whose backward ended at stage t; returns how
        far above the level after it the reduce rises: the unsharded gradients copied into the
        input (the output not yet made), gloo's copy of the input beside the output, the
        output cast to the shards' dtype (the last gradient still held by both)."""
        rise = 0
        for b in blocks:
            if last_stage.get(b) == t:
                u = units[b]
                unsharded.pop(b, None)
                reduced[0] += u.sharded - u.grads
                rs_input[0] = u.reduce_in
                rise = max(rise, u.grads - u.sharded + u.copy_scratch,
                           (u.reduce_in if gloo else 0) + u.reduce_out - u.sharded + u.last_grad,
                           (u.reduce_out if u.reduce_out != u.sharded else 0) + u.last_grad)
        return rise

    def level() -> int:
        return (root.unsharded + sum(unsharded.values()) + sum(prefetched.values())
                + rs_input[0] + reduced[0])

    stage_grad, extra = [], []
    for t, k in enumerate(order):
        reduce_rise = post_backward(t - 1)
        # Levels are relative to the profile's unsharded gradients, so they go negative once
        # enough blocks are reduced: no all-gather here is no extra, not a rise to 0.
        peak = level() + reduce_rise  # before the next unit's pre-backward
        starting = [b for b in blocks if first_stage.get(b) == t]
        if t == 0 or starting:  # a pre-backward: the unit's own copy-out, then a prefetch
            target = rev[0] if rev else None
            if starting:
                b = starting[0]
                if b not in unsharded:
                    flat = prefetched.pop(b, None)
                    if flat is None:  # not prefetched: all-gathered here
                        peak = max(peak, level() + units[b].gathering(gloo))
                        flat = units[b].unsharded
                    peak = max(peak, level() + flat + units[b].unsharded)
                    unsharded[b] = units[b].unsharded
                i = rev.index(b) + 1
                target = rev[i] if i < len(rev) else None
            if target is not None and target not in unsharded and target not in prefetched:
                peak = max(peak, level() + units[target].running(gloo))
                prefetched[target] = units[target].unsharded
        steady = level()
        stage_grad.append(graph.stage_grad_bytes[t] + steady)
        extra.append(max(0, peak - steady))
    reduce_rise = post_backward(len(order) - 1)
    return stage_grad, extra, (level() - root.unsharded, rs_input[0], reduce_rise)


def _end(final: int, after: tuple[int, int], root: _Unit, gloo: bool) -> int:
    """The gradient level at the end point: the highest of the root's post-backward, which FSDP2
    runs from its final callback after the last stage (the root's inputs need no grad): reshard,
    release the last block's reduce-scatter input, copy the root's gradients into its own, free
    them, reduce-scatter (gloo copying its input meanwhile), cast to the sharded dtype."""
    fsdp, rs_input, reduce_rise = after
    last = final + fsdp + root.unsharded + reduce_rise
    copy_in = final + fsdp - rs_input + root.reduce_in
    scattered = copy_in - root.grads + root.reduce_out
    cast = scattered + (root.sharded if root.sharded != root.reduce_out else 0)
    return max(last, copy_in + root.copy_scratch,
               scattered + (root.reduce_in if gloo else 0) + root.last_grad,
               cast + root.last_grad)
