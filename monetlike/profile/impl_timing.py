"""Measuring the registered Impls of every Op, the way the default Impl is measured.

For each Op the registry lists the Impls that apply. Their memory is measured in rounds: each
round runs one more instrumented training step in which some Ops run one of their candidates and
every other Op runs as written. What an Op's backward holds and its costs depend on its own
nodes; its stage's workspace also depends on the gradients its neighbours' backwards hand it: an Op reading its output makes its output gradient (a fresh tensor or a view),
and an Op reading the same input adds into the same input gradient (in place into a fresh tensor,
out of place into a view). So the Ops of one round are never neighbours (`_rounds`): each Impl is
measured as the only change to the model around it, as the default's figures are. Found by
tests/test_fuzz_models.py: a ReLU's mask Impl measured next to a split Linear (whose input half
hands over a fresh gradient, which the ReLU's stage adds into in place) was 2,112 B short beside
the default Linear (a view, added out of place). Measured costs are taken in timing steps per
level instead (every Op running its r-th candidate at once, `_time_levels`): a kernel's time is
its own, and a level spread over several memory rounds costs one set of timing steps, not one per
round (ResNet-18: 4 rounds, 2 levels). Each timing step runs beside a step of the model as written
(alternating), and an Impl's time is its Op's default time plus the paired difference, a saving
credited only when every pair showed one (`costs.credited_difference`).

The step is the profiler's own (ProfileRun, TimingRun) with the Op's fx nodes replaced: the saved
set, internal bytes, workspace and stage gradient bytes come from the same saved-tensor and
storage accounting as the default's. Values are matched back to the main run by (creator node,
index), and an Impl whose Op does not produce exactly the default's Values is dropped.
"""

from __future__ import annotations

import statistics
import warnings

import torch

from .costs import Roofline, Timer, credited_difference
from .interpreter import ProfileRun
from .timing import TimingRun
from ..impls.registry import SubstitutingMixin, matches


class SubstitutingProfileRun(SubstitutingMixin, ProfileRun):
    def _nograd_transient(self, *_args, **_kwargs) -> None:
        """Not run again (ProfileRun's rerun under no_grad, its figure None: none was made): a
        round reads no recomputation figure (`alternatives_from`), and the rerun calls the node
        as written, which the main run measured already."""
        return None


class _ChosenRoofline:
    """A round's roofline, pricing only the aten calls of its chosen Ops (their nodes, their
    backward stages): no other Op's cost is read (`alternatives_from`), and pricing every call
    of the step was a fifth of a round's time (a 32-layer Llama)."""

    def __init__(self, preset, nodes: set[str], names: set[str]):
        self._roofline = Roofline(preset)
        self.nodes, self.names = nodes, names
        self.run: ProfileRun | None = None

    def op_time(self, func, args, kwargs, out) -> float:
        run = self.run
        if run.phase == "forward":
            wanted = run.cur is not None and run.cur.node.name in self.nodes
        else:
            wanted = run.bcur is not None and run.groups[run.bcur].name in self.names
        return self._roofline.op_time(func, args, kwargs, out) if wanted else 0.0

    def priced(self, sub: ProfileRun) -> bool:
        """Every node of the chosen Ops, as this round grouped them, was priced."""
        return all(set(g.nodes) <= self.nodes for g in sub.groups if g.name in self.names)


class SubstitutingTimingRun(SubstitutingMixin, TimingRun):
    pass


def candidates(gm, run: ProfileRun, target: str) -> dict[int, list]:
    """Main-run group id -> [(ImplSpec, replacements)] for every group some Impl applies to, on
    a profile whose target device type is `target` (`ImplSpec.devices`)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for g in run.groups:
        if not g.ran_backward or any(name not in nodes for name in g.nodes):
            continue
        found = [(spec, subs) for spec, subs in matches(gm, [nodes[name] for name in g.nodes])
                 if spec.overwrites is None  # in-place ones: inplace_alternatives
                 and (spec.devices is None or target in spec.devices)
                 and (not spec.needs_internals or g.internal_bytes > 0)]
        if found:
            out[g.gid] = found
    return out


def _parameters_read(gm, run: ProfileRun) -> dict[int, set[int]]:
    """Group id -> ids of the parameters its nodes read (a module's own, or through get_attr)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for g in run.groups:
        found = set()
        for name in g.nodes:
            n = nodes.get(name)
            if n is None:
                continue
            if n.op == "call_module":
                found.update(id(p) for p in gm.get_submodule(n.target).parameters())
            attrs = (run.fetch_attr(a.target) for a in (n, *n.all_input_nodes)
                     if a.op == "get_attr")
            found.update(id(p) for p in attrs if isinstance(p, torch.nn.Parameter))
        out[g.gid] = found
    return out


def _rounds(gm, run: ProfileRun, cands: dict[int, list]) -> list[tuple[int, dict[int, tuple]]]:
    """Each Op's candidates, in registration order, spread over rounds ((level, {group id:
    candidate}): level r holds each Op's r-th candidate)
    in which no two Ops are neighbours: one reads what the other makes, both read one Value, or
    both read one parameter (autograd sums a shared weight's gradients into the first that
    reaches it, and whether it keeps that tensor or copies it depends on the later call's layout:
    a split's figures, measured beside a split of the other call, would credit it with the
    other's saving). Greedy, in group order: a chain of Ops with candidates takes two rounds per
    candidate."""
    # only Values with a gradient pass one between Ops
    ins = {g.gid: {t for t in g.inputs if run.values[t].requires_grad} for g in run.groups}
    outs = {g.gid: set(g.outputs) for g in run.groups}
    params = _parameters_read(gm, run)

    def neighbours(a, b) -> bool:
        return bool(ins[a] & outs[b] or ins[b] & outs[a] or ins[a] & ins[b]
                    or params[a] & params[b])

    rounds = []
    for r in range(max(len(c) for c in cands.values())):
        pending = [gid for gid, c in cands.items() if len(c) > r]
        while pending:
            chosen, rest = [], []
            for gid in pending:
                (rest if any(neighbours(gid, o) for o in chosen) else chosen).append(gid)
            rounds.append((r, {gid: cands[gid][r] for gid in chosen}))
            pending = rest
    return rounds


def measure_alternatives(gm, work, xs, run: ProfileRun, *, measured: bool, preset, device,
                         repeat: int, note: str, context,
                         clock: str = "wall", target: str | None = None,
                         rounds: list | None = None) -> dict[int, list[dict]]:
    """Main-run group id -> list of measured Impls (dicts with main-run value tids).

    target: the device type whose Impls are offered; None: the measured device, or a GPU for an
    analytical profile (it plans for a GPU preset whatever device it runs on).
    rounds: what `profile_rounds` returned for the same run, when the memory was profiled
    before (the profile answers feasibility from memory before any timing); None: profiled
    here."""
    if rounds is None:
        rounds = profile_rounds(gm, work, xs, run, measured=measured, preset=preset,
                                device=device, note=note, context=context, target=target)
    times = _time_levels(gm, work, xs, run, rounds, device=device, repeat=repeat,
                         context=context, clock=clock) if measured and rounds else {}
    return alternatives_from(run, rounds, times if measured else None)


def profile_rounds(gm, work, xs, run: ProfileRun, *, measured: bool, preset, device, note: str,
                   context, target: str | None = None) -> list:
    """The memory half of `measure_alternatives`: one instrumented step per round of Impls,
    nothing timed. Returns the rounds as `alternatives_from` and the timing steps read them."""
    if target is None:
        target = torch.device(device).type if measured else "cuda"
    cands = candidates(gm, run, target)
    if not cands:
        return []
    for spec in {spec.name: spec for found in cands.values() for spec, _ in found}.values():
        if spec.warm is not None:
            spec.warm(torch.device(device))
    # (level, chosen, the round's Values as (creator node, index), its groups by name): the
    # round's ProfileRun itself is let go before the timing steps
    profiled = []
    for level, chosen in _rounds(gm, run, cands):
        subs = {}
        for spec, repl in chosen.values():
            subs.update(repl)
        try:
            sub = _round_step(gm, work, xs, run, chosen, subs, preset=preset, device=device,
                              note=note, context=context)
        except Exception as e:  # an Impl that cannot run on this model must not stop profiling
            _left_out(chosen, e)
            continue
        profiled.append((level, chosen, [(v.name, v.index) for v in sub.values],
                         {g.name: g for g in sub.groups}))
    return profiled


def _round_step(gm, work, xs, run: ProfileRun, chosen: dict, subs: dict, *, preset, device,
                note: str, context) -> ProfileRun:
    """A round's instrumented step, only its chosen Ops priced by the roofline
    (`_ChosenRoofline`); run again pricing every call in a round whose Ops took a node the main
    run gave another Op (none seen), from the same generator state: the same step again."""
    if not preset:
        return _substituted_step(gm, work, xs, subs, None, device=device, note=note,
                                 context=context)
    roofline = _ChosenRoofline(preset, {name for gid in chosen for name in run.groups[gid].nodes},
                               {run.groups[gid].name for gid in chosen})
    rng = torch.get_rng_state()
    sub = _substituted_step(gm, work, xs, subs, roofline, device=device, note=note,
                            context=context)
    if roofline.priced(sub):
        return sub
    torch.set_rng_state(rng)
    return _substituted_step(gm, work, xs, subs, Roofline(preset), device=device, note=note,
                             context=context)


def _substituted_step(gm, work, xs, subs: dict, roofline, *, device, note: str, context
                      ) -> ProfileRun:
    _no_grads(work, xs)
    with torch.enable_grad(), context():
        sub = SubstitutingProfileRun(gm, work, roofline=roofline, device_note=note, device=device)
        sub.impl_subs = subs
        if isinstance(roofline, _ChosenRoofline):
            roofline.run = sub
        sub.profile_step(xs)
    return sub


def alternatives_from(run: ProfileRun, profiled: list, times: dict | None
                      ) -> dict[int, list[dict]]:
    """Main-run group id -> its Impls from the rounds `profiled`, with the round timings
    `times` (None: costs from the instrumented step, zero without a roofline)."""
    measured = times is not None
    main_tid = {(v.name, v.index): v.tid for v in run.values}
    result: dict[int, list[dict]] = {}
    for i, (_, chosen, names, by_name) in enumerate(profiled):
        if measured and i not in times:
            continue  # its timing steps failed (warned)
        fwd_t, bwd_t = (times or {}).get(i, ({}, {}))
        for gid, (spec, _) in chosen.items():
            g = run.groups[gid]
            sg = by_name.get(g.name)
            if sg is None or not sg.ran_backward:
                continue
            outs = [names[t] for t in sg.outputs]
            if outs != [(run.values[t].name, run.values[t].index) for t in g.outputs]:
                continue
            saved, early = [], []
            for t in sg.saved:
                key = names[t]
                if key not in main_tid:
                    break
                saved.append(main_tid[key])
                if t in sg.early_release:
                    early.append(main_tid[key])
            else:
                allowed = set(g.inputs) | set(g.outputs)
                if not set(saved) <= allowed:
                    continue
                if measured:  # over the default's (`over_defaults`)
                    fwd = credited_difference(fwd_t.get(gid, []))
                    bwd = credited_difference(bwd_t.get(gid, []))
                else:
                    fwd, bwd = sg.fwd_cost, sg.bwd_cost
                result.setdefault(gid, []).append(dict(
                    name=spec.name, saved=tuple(sorted(set(saved))),
                    internal_bytes=int(sg.held_bytes), fwd_time=float(fwd),
                    bwd_time=float(bwd), fwd_workspace=int(max(0, sg.fwd_workspace)),
                    bwd_workspace=int(max(0, sg.bwd_peak - sg.stage_start)),
                    early_release=tuple(sorted(set(early)))))
    # Rounds go through each Op's candidates in registration order: so are its Impls.
    return result


def over_defaults(alternatives: dict, fwd_times: dict, bwd_times: dict) -> None:
    """Measured Impls carry their times over their Op's default, timed beside it
    (`_timing_steps`, credited by `credited_difference`): add the default's median times
    (`fwd_times`, `bwd_times`: group id -> the main timing steps' times), in place."""
    for gid, alts in alternatives.items():
        for a in alts:
            a["fwd_time"] = max(0.0, a["fwd_time"] + statistics.median(fwd_times.get(gid) or [0]))
            a["bwd_time"] = max(0.0, a["bwd_time"] + statistics.median(bwd_times.get(gid) or [0]))


def _no_grads(work, xs) -> None:
    """Each round starts as the main run did and as a training step does after
    zero_grad(set_to_none=True): no gradients yet. Left from the last step, they would be
    accumulated into in place, and every gradient the round makes would be freed at once (a
    split's weight gradient, held through its input half at run time, would not count)."""
    for t in (*work.parameters(), *xs):
        if isinstance(t, torch.Tensor):
            t.grad = None


def _left_out(chosen: dict, e: Exception) -> None:
    names = sorted({spec.name for spec, _ in chosen.values()})
    warnings.warn(f"monetlike: operator implementations {names} could not be profiled and are "
                  f"left out ({type(e).__name__}: {e})", RuntimeWarning)


def _time_levels(gm, work, xs, run: ProfileRun, profiled: list, *, device, repeat: int,
                 context, clock: str) -> dict[int, tuple[dict, dict]]:
    """Index in `profiled` -> (forward, backward) times by main-run group id, of each round's
    chosen Ops. Memory is measured round by round (`_rounds`: a neighbour's Impl changes the
    gradients an Op's stage holds), but time is an Op's own kernels: all rounds of one level are
    timed in the same steps, every Op running its candidate of that level, as the in-place
    Impls are (`inplace_alternatives`). A level whose steps fail is timed round by round, so
    that only the rounds that fail are left out."""
    levels: dict[int, list[int]] = {}
    for i, (level, *_) in enumerate(profiled):
        levels.setdefault(level, []).append(i)
    def timed(members):
        return _timed(gm, work, xs, run, profiled, members, device=device, repeat=repeat,
                      context=context, clock=clock)

    out = {}
    for members in levels.values():
        if len(members) > 1:
            try:
                out.update(timed(members))
                continue
            except Exception:  # noqa: BLE001 - timed again round by round below
                pass
        for i in members:
            try:
                out.update(timed([i]))
            except Exception as e:  # an Impl that cannot run on this model must not stop it
                _left_out(profiled[i][1], e)
    return out


def _timed(gm, work, xs, run: ProfileRun, profiled: list, members: list[int], *, device,
           repeat: int, context, clock: str) -> dict[int, tuple[dict, dict]]:
    """Times of the rounds `members` (indices in `profiled`) run in the same steps."""
    # Every node is timed (an Op's backward time is the autograd nodes it made that no earlier
    # node made), a chosen Op's as the round grouped them, as its memory figures have it.
    subs, node_gid, chosen_gids = {}, dict(run.node_gid), set()
    for i in members:
        _, chosen, _, by_name = profiled[i]
        for gid, (_, repl) in chosen.items():
            subs.update(repl)
            chosen_gids.add(gid)
            for name in run.groups[gid].nodes:
                node_gid[name] = -1
            sg = by_name.get(run.groups[gid].name)
            for name in (sg.nodes if sg is not None else ()):
                node_gid[name] = gid
    _no_grads(work, xs)
    with torch.enable_grad(), context():
        times = _timing_steps(gm, node_gid, subs, xs, chosen_gids, base_gid=run.node_gid,
                              device=device, clock=clock, repeat=repeat)
    return {i: times for i in members}


def _timing_steps(gm, node_gid: dict, subs: dict, xs, gids, *, base_gid: dict, device,
                  clock: str, repeat: int
                  ) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Forward and backward times of the groups `gids` with the nodes `subs` replaced, less
    their times as written (`base_gid`: the main run's node -> group), over `repeat` pairs of
    training steps run side by side, alternating which goes first, after one warm-up of each.
    Timed apart, minutes from the default's steps, an Impl's figures carried the load of
    another moment (ResNet-18's conv_split: 9 of 20 Ops timed faster than the default conv on
    a busy machine, a step predicted 6.7% faster than plain that measured 6.7% slower)."""
    fwd_t: dict[int, list[float]] = {}
    bwd_t: dict[int, list[float]] = {}
    timing = SubstitutingTimingRun(gm, node_gid, Timer(device, clock))
    timing.impl_subs = subs
    plain = TimingRun(gm, base_gid, Timer(device, clock))
    timing.step(xs)
    plain.step(xs)
    for i in range(repeat):
        if i % 2:
            (f, b), (f0, b0) = timing.step(xs), plain.step(xs)
        else:
            (f0, b0), (f, b) = plain.step(xs), timing.step(xs)
        for gid in gids:
            fwd_t.setdefault(gid, []).append(f.get(gid, 0.0) - f0.get(gid, 0.0))
            bwd_t.setdefault(gid, []).append(b.get(gid, 0.0) - b0.get(gid, 0.0))
    return fwd_t, bwd_t


def inplace_alternatives(gm, xs, run: ProfileRun, *, measured: bool, device, repeat: int,
                         clock: str = "wall") -> dict[int, list[dict]]:
    """Main-run group id -> [the in-place Impl (a dict with main-run value tids)] for every Op
    where one is legal (inplace.py). An Op gets at most one: the first registered that fits.

    What its backward holds is the default's: the in-place kernel's backward reads what the
    out-of-place one reads (the result for ReLU-like activations, nothing for add), which the
    legality conditions require (its saved set does not contain the overwritten Value), and
    the bytes test of tests/test_impls_inplace.py checks against the runtime. The forward point
    no longer allocates the output: that is `Impl.overwrites`, which the simulator and the MILP
    account for. Costs: measured in timing steps with every legal in-place call substituted at
    once (each overwrites a different Value, and nothing any backward reads); analytical costs
    are the default's (the roofline moves the same bytes: read x, write the output)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    saved_anywhere = set().union(*(g.saved for g in run.groups)) if run.groups else set()
    foreign = {tid for _, _, tid in run.foreign_writes}
    creator = {(v.name, v.index): v.tid for v in run.values}
    found: dict[int, tuple] = {}
    for g in run.groups:
        # Ops without a backward (a frozen stem) are candidates too: the forward point is what
        # in place lowers. The creator is the Op's first node; any others write its output in
        # place (ResNet's add + relu_) and run unchanged.
        if len(g.outputs) != 1 or any(name not in nodes for name in g.nodes):
            continue
        node = nodes[g.nodes[0]]
        for spec, subs in matches(gm, [nodes[name] for name in g.nodes]):
            if spec.overwrites is None:
                continue
            arg = spec.overwrites(gm, node)
            x = creator.get((arg.name, None)) if arg is not None else None
            # A non-contiguous other operand (x.add_(y.transpose(1, 2))): autograd then makes
            # a gradient-sized copy in an earlier Op's stage, which this Op's figures cannot
            # carry (found by tests/test_fuzz_models.py). A non-contiguous operand written into
            # by a binary op: the result keeps its layout where `a + b` takes its own (the
            # first operand's), and the gradients behind it change layout (an embedding's
            # backward then copied one: 512 B over a budget, also found by the fuzzer).
            binary = len(node.all_input_nodes) > 1
            strided = [n for n in node.all_input_nodes
                       if (n is not arg or binary) and not run.contiguous.get(n.name, True)]
            if x is not None and not strided and _may_overwrite(run, g, x, saved_anywhere,
                                                                  foreign):
                found[g.gid] = (spec, subs, x)
                break
    if not found:
        return {}
    fwd_t: dict[int, list[float]] = {}
    bwd_t: dict[int, list[float]] = {}
    if measured:
        subs = {}
        for spec, repl, _ in found.values():
            subs.update(repl)
        try:
            with torch.enable_grad():
                fwd_t, bwd_t = _timing_steps(gm, run.node_gid, subs, xs, found,
                                             base_gid=run.node_gid, device=device, clock=clock,
                                             repeat=repeat)
        except Exception as e:  # an Impl that cannot run on this model must not stop profiling
            names = sorted({spec.name for spec, _, _ in found.values()})
            warnings.warn(f"monetlike: in-place implementations {names} could not be timed and "
                          f"are left out ({type(e).__name__}: {e})", RuntimeWarning)
            return {}
    out = {}
    for gid, (spec, _, x) in found.items():
        g = run.groups[gid]
        if measured:  # over the default's (`over_defaults`)
            fwd = credited_difference(fwd_t.get(gid, []))
            bwd = credited_difference(bwd_t.get(gid, []))
        else:
            fwd, bwd = g.fwd_cost, g.bwd_cost
        if not g.ran_backward:
            bwd = 0.0
        internal_bytes, fwd_workspace = g.forward_figures()
        out[gid] = [dict(name=spec.name, saved=tuple(sorted(g.saved)),
                         internal_bytes=int(internal_bytes), fwd_time=float(fwd),
                         bwd_time=float(bwd), fwd_workspace=int(max(0, fwd_workspace)),
                         bwd_workspace=int(max(0, g.bwd_peak - g.stage_start))
                         if g.ran_backward else 0, overwrites=x,
                         early_release=tuple(sorted(g.early_release & g.saved)))]
    return out


def _may_overwrite(run: ProfileRun, g, x: int, saved_anywhere: set, foreign: set) -> bool:
    """The profiler's legality rule for group g writing its output into Value x's storage
    (docs/impls.md, "In-place execution"). The op order is checked when the graph is built."""
    v, y = run.values[x], run.values[g.outputs[0]]
    if v.producer is None or v.producer == g.gid or x not in g.inputs:
        return False  # a graph input (or a parameter: never a Value), or not an input of g
    if x in run.output_tids or x in saved_anywhere or x in foreign:
        return False  # the caller holds it, some backward reads it, or it is written elsewhere
    if (v.shape, v.dtype, v.nbytes) != (y.shape, y.dtype, y.nbytes):
        return False  # the output would not fit the storage exactly
    # Every other reader (views included: readers are by storage) runs before g in fx order,
    # which is the order the runtime's forward runs the nodes in; g itself reads x only at its
    # creator node (a later in-place node of g reading x would see the output instead).
    return all(pos < g.position if gid != g.gid else pos == g.position
               for pos, gid in run.readers.get(x, ()))
