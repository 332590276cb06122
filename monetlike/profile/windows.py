"""The profiling run's reading of the allocator: each Op's workspaces and each backward stage's
gradient memory from what the allocator (or, without its log, the storage tracker) saw between
the marks the run set, the user's loss charged to the first stage, and what stages of
interleaved Ops hold for one another (NOTE [Interleaved stages])."""

from __future__ import annotations

import torch

from .memory import INTERNAL, OTHER, VALUE
from .records import Group, early_releases, last_windows, still_held


class AllocatorWindows:
    """Mixin of `ProfileRun` (interpreter.py): reads the windows its hooks recorded."""

    def _apply_allocator_windows(self) -> None:
        """Each Op's workspaces and each stage's gradient memory from what the allocator saw
        between the marks (the tracker's figures miss kernel scratch)."""
        a = self.alloc
        spans: dict[int, list[tuple[int, int]]] = {}  # group -> its backward intervals
        for gid, s, *_, e in self._bwd_windows:
            spans.setdefault(gid, []).append((a.position(s), a.position(e)))
        # Blocks a node allocated that outlive it, are none of the storages it left (Values,
        # hooked internals) and die in its Op's backward: autograd keeps them for it without the
        # hooks (Group.unhooked_bytes). (position allocated, position freed, bytes, group)
        unhooked: list[tuple[int, int, int, int]] = []
        for gid, (s, e), persistent, nograd, left in self._fwd_windows:
            g = self.groups[gid]
            held = [b for b in a.blocks_left(s, e) if b[0] not in left and b[3] is not None
                    and any(bs < b[3] < be for bs, be in spans.get(gid, ()))]
            g.unhooked_bytes += sum(b[1] for b in held)
            persistent += sum(b[1] for b in held)
            unhooked.extend((b[2], b[3], b[1], gid) for b in held)
            workspace = a.peak_between(s, e) - a.level(s) - persistent
            g.fwd_workspace = max(g.fwd_workspace, workspace)
            if nograd is None:
                g.recompute_workspace = max(g.recompute_workspace, workspace)
            else:
                ns, ne = nograd
                nograd_workspace = a.peak_between(ns, ne) - a.level(ne)
                g.recompute_workspace = max(g.recompute_workspace, nograd_workspace)
                g.nograd_workspace = max(g.nograd_workspace, nograd_workspace)
        # The runtime replays a random Op's generator state through a state tensor (NOTE [RNG
        # capture] in monetlike/core/recompute.py): a transient of its size around the recomputation.
        state = torch.get_rng_state().numel()
        for g in self.groups:
            if g.random:
                g.recompute_workspace = max(g.recompute_workspace, state)
        # Everything the run allocated that is not a Value (or an Op's internal) counts as a
        # stage's gradient memory: gradients, but also what autograd and the loss allocate
        # outside the dispatcher (wrapped Python scalars), which the tracker misses. Levels are
        # relative to the recording's start, so only their differences within one stage are
        # compared with the tracker's (an Impl's run accumulates into gradients made earlier).
        # The workspace is the allocator's own: saved Values and internals that autograd frees
        # before the stage's peak are not in it (the tracker's figure, which holds them to the
        # stage's end, is not used); those Values are the Op's early releases.
        # A group's later interval (autograd came back to one of its nodes after other stages
        # ran) happens while the simulator is in the latest stage started: it counts there, and
        # so does what the group still holds for it meanwhile (NOTE [Interleaved stages]).
        def by_group(marked):  # mark -> (group, tag, bytes) as group -> [(position, tag, bytes)]
            out: dict[int, list[tuple[int, int, int]]] = {}
            for m, (fg, tag, nbytes) in marked.items():
                out.setdefault(fg, []).append((a.position(m), tag, nbytes))
            return out
        frees, declared = by_group(self._value_frees), by_group(self._declared)
        # Each stage's span: from its first interval to the end of the last one counting in it
        # (later intervals of earlier stages run in it: NOTE [Interleaved stages]).
        stages: dict[int, list] = {}  # group -> [start mark, end mark, Value bytes, held]
        for gid, s, values0, owner, first, held, e in self._bwd_windows:
            if first:
                stages[gid] = [s, e, values0, held]
            else:
                stages[owner][1] = e
        last = last_windows(self._bwd_windows)
        started: set[int] = set()
        for gid, (s, e, values0, held) in stages.items():
            # "other" bytes at the stage's start; the unhooked blocks of a stage already passed
            # are not the simulator's either
            other0 = (a.level(s) - values0 + still_held(held, last, self._gone_at)
                      - self._unhooked_at(unhooked, s, lambda fg: fg == gid or fg not in started))
            started.add(gid)
            start, end = a.position(s), a.position(e)
            levels = [a.level_at(i) for i in range(start, end + 1)]
            freed = [(i - start, tag, n) for i, tag, n in frees.get(gid, ()) if start <= i <= end]
            # A declared release whose Value stayed alive in this step (another Op saved it
            # too): the levels after it, as in a schedule where it goes there.
            really = {tag for _, tag, _ in freed}
            for i, tag, n in declared.get(gid, ()):
                if start <= i <= end and tag not in really:
                    freed.append((i - start, tag, n))
                    for q in range(i - start + 1, len(levels)):
                        levels[q] -= n
            # Levels are read against the stage's start: what autograd freed since (the
            # stage's own saved Values, which the stage's point still holds) cancels out.
            g = self.groups[gid]
            g.early_release.update(early_releases(levels, freed))
            g.stage_start = max(g.stage_start, other0)
            g.bwd_peak = g.stage_start + max(0, max(levels) - a.level(s))
        self._charge_loss(unhooked)
        if self._end is not None:
            end, values = self._end
            self.final_grad_bytes = max(self.final_grad_bytes, a.level(end) - values)

    def _unhooked_at(self, unhooked: list[tuple[int, int, int, int]], mark,
                     counted=lambda gid: True) -> int:
        """Bytes of `unhooked` blocks ((allocated, freed, bytes, group) positions) alive at
        `mark` whose group is `counted`: held like internals, so not part of the "other" bytes
        there."""
        i = self.alloc.position(mark)
        return sum(n for s, e, n, gid in unhooked if s < i < e and counted(gid))

    def _charge_loss(self, unhooked: list[tuple[int, int, int, int]]) -> None:
        """A user's loss runs its own kernels between the model's forward and its first stage:
        their peak, forward and backward, is charged to the first stage, whose backward point
        holds at least what the step held then (every Value kept or output at the end of the
        forward, the first stage's recomputations on top; its gradients, the output's among
        them, on top of the loss's forward), so the charge errs on the safe side. Not to the
        last Op's forward point: an in-place Impl there frees its input, which the loss's
        moment does not. The default sum allocates only scalars there and is left out."""
        if self._loss is None or not self._bwd_windows:
            return
        a = self.alloc
        (before, values_before, _), (start, values_start, _) = self._loss[:2]
        g = self.groups[self._bwd_windows[0][0]]
        first_mark = self._bwd_windows[0][1]
        # the peak of gradients and other non-Value bytes over each part, as stages count them
        forward = (a.peak_between(before, start) - values_before
                   - self._unhooked_at(unhooked, before))
        backward = (a.peak_between(start, first_mark) - values_start
                    - self._unhooked_at(unhooked, start))
        g.bwd_peak = max(g.bwd_peak, forward, backward)

    def _loss_window_start(self) -> tuple:
        """Open a window over the loss's own memory: (allocator mark, Value bytes live, the CUDA
        allocator's bytes and the non-Value bytes then)."""
        tr = self.tracker
        tr.reset_window()
        values = tr.live_by_class[VALUE] + tr.live_by_class[INTERNAL]
        cuda = None
        if self.cuda is not None:  # pragma: no cover - no GPU in CI
            torch.cuda.reset_peak_memory_stats(self.cuda)
            cuda = (torch.cuda.memory_allocated(self.cuda), tr.live_by_class[OTHER])
        return self._mark(), values, cuda

    def _loss_window_peak(self, window: tuple, tracked: bool) -> int:
        """The highest non-Value bytes since `window` opened, as a stage counts them: by the
        tracker (when it watched the loss: meta, CUDA) and the CUDA allocator. The CPU
        allocator's count is read after the run (_charge_loss)."""
        peak = self.tracker.window_class_peak if tracked else 0
        if window[2] is not None:  # pragma: no cover - no GPU in CI
            alloc0, other0 = window[2]
            peak = max(peak, other0 + torch.cuda.max_memory_allocated(self.cuda) - alloc0)
        return peak

    # NOTE [Interleaved stages]: autograd may leave an Op's backward after some of its nodes, run
    # another Op's nodes, and come back (an Op whose nodes are not contiguous in the forward:
    # `h = act_(a(x)); h += b(x)` under export is one Op, a, act_ and add_, with b's node between
    # them). The simulator runs each stage whole, in the order the stages started, and the later
    # interval counts in the stage under way then. So what such an Op still holds for its later
    # nodes while another stage runs (its internals, the Values only started stages saved, when
    # they die in that later interval) is not among the simulator's resident bytes: it counts as
    # the running stage's own bytes, as its gradients do. And the stage's levels run on through
    # the later interval, read against the level at the stage's start: the stage's point still
    # holds the saved Values autograd has freed since, and a release the stage declared holds
    # there too (_apply_allocator_windows).
    def _start_holding(self, g: Group) -> None:
        """Stage `g` starts: its internals, and the Values whose savers have all started, may
        now be held for a stage the simulator has left."""
        if self._savers is None:
            self._savers = {}
            for other in self.groups:
                for tid in other.saved:
                    self._savers.setdefault(tid, []).append(other.gid)
        self._holding_groups.add(g.gid)
        for tid in g.saved:
            savers = self._savers[tid]
            if all(self.groups[s].ran_backward for s in savers):
                self._holding_values[tid] = tuple(savers)

    def _held_elsewhere(self, owner: int) -> tuple[tuple[tuple, tuple[int, ...], int], ...]:
        """What started stages other than `owner` hold now, as ((class, tag), the groups
        holding it, bytes): it counts for `owner` if it dies in a later interval of one of those
        groups (still_held)."""
        live = self.tracker.live_by_tag
        held = []
        for gid in list(self._holding_groups):
            n = live.get((INTERNAL, gid), 0)
            if not n:  # freed: internals are made in the forward only
                self._holding_groups.discard(gid)
            elif gid != owner:
                held.append(((INTERNAL, gid), (gid,), n))
        for tid, savers in list(self._holding_values.items()):
            n = live.get((VALUE, tid), 0)
            if not n:
                del self._holding_values[tid]
            elif owner not in savers:
                held.append(((VALUE, tid), savers, n))
        return tuple(held)

    def _apply_tracked_windows(self) -> None:
        """Each stage's peak of non-Value bytes from the tracker's windows (no allocator's
        count): a later interval and what is held for one counts in the stage under way."""
        last = last_windows(self._tracked_windows)
        for _, owner, first, held, peak in self._tracked_windows:
            g = self.groups[owner]
            extra = still_held(held, last, self._gone_at)
            if first:
                g.stage_start += extra
            g.bwd_peak = max(g.bwd_peak, peak + extra)

