"""Measuring the registered Impls of every Op, the way the default Impl is measured.

For each Op the registry lists the Impls that apply. They are measured in rounds: round r runs one
more instrumented training step (and, for measured costs, timing steps) in which every Op with at
least r+1 candidates runs its r-th candidate and every other Op runs as written. What an Op's
backward holds, its workspace and its costs depend only on its own nodes, so one step measures
many Ops at once; a ResNet needs two rounds (BatchNorm + ReLU groups have two candidates).

The step is the profiler's own (ProfileRun, TimingRun) with the Op's fx nodes replaced: the saved
set, internal bytes, workspace and stage gradient bytes come from the same saved-tensor and
storage accounting as the default's. Values are matched back to the main run by (creator node,
index), and an Impl whose Op does not produce exactly the default's Values is dropped.
"""

from __future__ import annotations

import warnings

import torch

from ..profile.costs import Roofline, Timer, median
from ..profile.interpreter import ProfileRun, TimingRun
from .registry import SubstitutingMixin, matches


class SubstitutingProfileRun(SubstitutingMixin, ProfileRun):
    pass


class SubstitutingTimingRun(SubstitutingMixin, TimingRun):
    pass


def candidates(gm, run: ProfileRun) -> dict[int, list]:
    """Main-run group id -> [(ImplSpec, replacements)] for every group some Impl applies to."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for g in run.groups:
        if not g.ran_backward or any(name not in nodes for name in g.nodes):
            continue
        found = matches(gm, [nodes[name] for name in g.nodes])
        if found:
            out[g.gid] = found
    return out


def measure_alternatives(gm, work, xs, run: ProfileRun, *, measured: bool, preset, device,
                         repeat: int, note: str, context,
                         clock: str = "wall") -> dict[int, list[dict]]:
    """Main-run group id -> list of measured Impls (dicts with main-run value tids)."""
    cands = candidates(gm, run)
    if not cands:
        return {}
    main_tid = {(v.name, v.index): v.tid for v in run.values}
    result: dict[int, list[dict]] = {}
    for r in range(max(len(c) for c in cands.values())):
        chosen = {gid: c[r] for gid, c in cands.items() if len(c) > r}
        subs = {}
        for spec, repl in chosen.values():
            subs.update(repl)
        try:
            with torch.enable_grad(), context():
                sub = SubstitutingProfileRun(gm, work, roofline=Roofline(preset) if preset else None,
                                             device_note=note, device=device)
                sub.impl_subs = subs
                sub.profile_step(xs)
                fwd_t: dict[int, list[float]] = {}
                bwd_t: dict[int, list[float]] = {}
                if measured:
                    timing = SubstitutingTimingRun(gm, sub.node_gid, Timer(device, clock))
                    timing.impl_subs = subs
                    timing.step(xs)
                    for _ in range(repeat):
                        f, b = timing.step(xs)
                        for gid in range(len(sub.groups)):
                            fwd_t.setdefault(gid, []).append(f.get(gid, 0.0))
                            bwd_t.setdefault(gid, []).append(b.get(gid, 0.0))
        except Exception as e:  # an Impl that cannot run on this model must not stop profiling
            names = sorted({spec.name for spec, _ in chosen.values()})
            warnings.warn(f"monetlike: operator implementations {names} could not be profiled "
                          f"and are left out ({type(e).__name__}: {e})", RuntimeWarning)
            continue
        by_name = {g.name: g for g in sub.groups}
        for gid, (spec, _) in chosen.items():
            g = run.groups[gid]
            sg = by_name.get(g.name)
            if sg is None or not sg.ran_backward:
                continue
            outs = [(sub.values[t].name, sub.values[t].index) for t in sg.outputs]
            if outs != [(run.values[t].name, run.values[t].index) for t in g.outputs]:
                continue
            saved = []
            for t in sg.saved:
                key = (sub.values[t].name, sub.values[t].index)
                if key not in main_tid:
                    break
                saved.append(main_tid[key])
            else:
                allowed = set(g.inputs) | set(g.outputs)
                if not set(saved) <= allowed:
                    continue
                if measured:
                    fwd, bwd = median(fwd_t.get(sg.gid, [])), median(bwd_t.get(sg.gid, []))
                else:
                    fwd, bwd = sg.fwd_cost, sg.bwd_cost
                result.setdefault(gid, []).append(dict(
                    name=spec.name, saved=tuple(sorted(set(saved))),
                    internal_bytes=int(sg.internal_bytes), fwd_time=float(fwd),
                    bwd_time=float(bwd), fwd_workspace=int(max(0, sg.fwd_workspace)),
                    bwd_workspace=int(max(0, sg.bwd_peak - sg.stage_start))))
    # Rounds go through each Op's candidates in registration order: so are its Impls.
    return result
