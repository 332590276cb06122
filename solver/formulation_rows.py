"""The rows of the schedule MILP (docs/formulation.md, section 4), one method per block, each
headed by its equation; `Formulation` (formulation.py) writes its columns and then calls
`_rows`. The names (M, S, R, RI, O, Fe, Y, H, G, Lm, IF, IB, P) are the columns' dicts the
formulation made."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .analysis import inplace_freed
from .cuts import SupportCut, support_terms
from .milp import Builder


@dataclass
class MemRow:
    row: int
    const: int
    """Bytes at this point that no decision changes."""
    where: str


class FormulationRows:
    """The row blocks of `Formulation`, which it inherits (the columns are its own)."""

    def _rows(self, b: Builder) -> None:
        """Every row block, in the order of docs/formulation.md."""
        self._impl_choice_rows(b)
        self._recompute_impl_rows(b)
        self._recompute_inputs_rows(b)
        self._retention_rows(b)
        self._backward_needs_rows(b)
        self._alive_backward_rows(b)
        self._held_past_rows(b)
        self._alive_in_stage_rows(b)
        # dominance cuts: each keeps an optimal schedule (docs/formulation.md section 4)
        self._useful_residency_rows(b)
        self._useful_recompute_rows(b)
        self._no_duplicate_rows(b)
        self._inplace_saved_rows(b)
        self._inplace_resident_rows(b)
        if self.offload:
            self._offload_rows(b)
            self._useful_fetch_rows(b)
        if self.support_cuts:
            self._recompute_support_rows(b)
        if self._var_int:
            self._internals_rows(b)
        self._memory_rows(b)

    def _memory_rows(self, b: Builder) -> None:
        """The memory at every point of the step is at most the budget (or the peak P)."""
        held_bytes, all_held, int_fwd_const, int_bwd_const = self._memory_constants()
        self._mem_forward_rows(b, held_bytes, int_fwd_const)
        stage_const, stage_terms = self._stage_memory_rows(b)
        self._mem_recompute_rows(b, stage_const, stage_terms, int_bwd_const, all_held)
        self._mem_backward_rows(b, stage_const, stage_terms, int_bwd_const, all_held)
        end = self.graph.fixed_bytes + self.graph.final_grad_bytes + all_held
        self._const_point(end, "end of the backward pass")

    def _impl_choice_rows(self, b: Builder) -> None:
        """sum_i M[j,i] = 1"""
        g, f = self.graph, self.facts
        ops = g.ops
        b.row_block("impl_choice")  # sum_i M[j,i] = 1
        for j in range(len(ops)):
            if len(f.impls[j]) > 1:
                b.row(f"impl_choice[{j}]", [(self.M[j, i], 1.0) for i in f.impls[j]], 1.0, 1.0)

    def _recompute_impl_rows(self, b: Builder) -> None:
        """R[t,j] = sum_i RI[t,j,i];  RI[t,j,i] <= M[j,i]"""
        f = self.facts
        b.row_block("recompute_impl")  # R[t,j] = sum_i RI[t,j,i];  RI[t,j,i] <= M[j,i]
        for (t, j), r in self.R.items():
            if j in self.split_ops:
                b.row(f"recompute_split[{t},{j}]",
                      [(r, 1.0)] + [(self.RI[t, j, i], -1.0) for i in f.impls[j]], 0.0, 0.0)
                for i in f.impls[j]:
                    b.row(f"recompute_link[{t},{j},{i}]",
                          [(self.RI[t, j, i], 1.0), (self.M[j, i], -1.0)], hi=0.0)

    def _recompute_inputs_rows(self, b: Builder) -> None:
        """R[t,j] <= S[t,u] + R[t,p(u)] + Fe[t,u] for each scheduled input u of j"""
        g, f = self.graph, self.facts
        ops, sched = g.ops, f.scheduled
        b.row_block("recompute_inputs")  # R[t,j] <= S[t,u] + R[t,p(u)] for each input u of j
        for (t, j), r in self.R.items():
            for u in ops[j].inputs:
                if sched[u]:
                    b.row(f"recompute_inputs[{t},{j},{u}]",
                          [(r, 1.0), (self.S[t, u], -1.0)] + self._made(t, u, -1.0), hi=0.0)

    def _retention_rows(self, b: Builder) -> None:
        """S[t+1,v] <= S[t,v] + R[t,p(v)] + Fe[t,v]"""
        b.row_block("retention")  # S[t+1,v] <= S[t,v] + R[t,p(v)]
        for (t, v), s in self.S.items():
            if (t + 1, v) in self.S:
                b.row(f"retention[{t},{v}]",
                      [(self.S[t + 1, v], 1.0), (s, -1.0)] + self._made(t, v, -1.0), hi=0.0)

    def _backward_needs_rows(self, b: Builder) -> None:
        """S[t,v] + R[t,p(v)] + Fe[t,v] >= sum_{i in need_t(v)} M[k_t,i]"""
        g, f = self.graph, self.facts
        b.row_block("backward_needs")  # S[t,v] + R[t,p(v)] >= [chosen Impl of stage t saves v]
        for t, need in enumerate(f.need):
            k = g.backward_order[t]
            for v, needers in need.items():
                terms = [(self.S[t, v], 1.0)] + self._made(t, v, 1.0)
                if len(needers) == len(f.impls[k]):
                    b.row(f"backward_needs[{t},{v}]", terms, lo=1.0)
                else:
                    b.row(f"backward_needs[{t},{v}]",
                          terms + [(self.M[k, i], -1.0) for i in needers], lo=0.0)

    def _alive_backward_rows(self, b: Builder) -> None:
        """Y[t,v] >= S[t+1,v];  Y[t,v] >= sum_{i in need_t(v)} M[k_t,i]"""
        g, f = self.graph, self.facts
        b.row_block("alive_backward")  # Y[t,v] >= S[t+1,v];  Y[t,v] >= sum_{i saves v} M[k_t,i]
        for (t, v), y in self.Y.items():
            k = g.backward_order[t]
            if (t + 1, v) in self.S:
                b.row(f"alive_backward_keep[{t},{v}]", [(y, 1.0), (self.S[t + 1, v], -1.0)],
                      lo=0.0)
            b.row(f"alive_backward_need[{t},{v}]",
                  [(y, 1.0)] + [(self.M[k, i], -1.0) for i in f.need[t][v]], lo=0.0)

    def _held_past_rows(self, b: Builder) -> None:
        """H[t,v,i] >= S[t+1,v] + M[k_t,i] - 1"""
        g = self.graph
        b.row_block("held_past")  # H[t,v,i] >= S[t+1,v] + M[k_t,i] - 1
        for (t, v, i), h in self.H.items():
            b.row(f"held_past[{t},{v},{i}]", [(h, 1.0), (self.S[t + 1, v], -1.0),
                                               (self.M[g.backward_order[t], i], -1.0)], lo=-1.0)

    def _alive_in_stage_rows(self, b: Builder) -> None:
        """G[t,v,u_i] >= R[t,u_i];  G[t,v,u_i] >= G[t,v,u_i+1] (or Y for the last)"""
        T = self.T
        b.row_block("alive_in_stage")  # G[t,v,u_i] >= R[t,u_i];  G[t,v,u_i] >= G[t,v,u_i+1] / Y
        for t in range(T):
            for v, us, yexpr, segs in self._alive_plan[t]:
                for idx, u in enumerate(us):
                    if (t, v, u) not in self.G:
                        continue
                    gcol = self.G[t, v, u]
                    b.row(f"alive_user[{t},{v},{u}]", [(gcol, 1.0), (self.R[t, u], -1.0)], lo=0.0)
                    if idx + 1 < len(us):
                        nxt = self.G.get((t, v, us[idx + 1]))
                        nxt_term = ("v", nxt) if nxt is not None else ("v", self.R[t, us[idx + 1]])
                    else:
                        nxt_term = yexpr
                    if nxt_term is not None and nxt_term[0] == "v":
                        b.row(f"alive_next[{t},{v},{u}]", [(gcol, 1.0), (nxt_term[1], -1.0)],
                              lo=0.0)

    def _useful_residency_rows(self, b: Builder) -> None:
        """S[t,v] <= S[t+1,v] + need + sum_{users u in C_t} R[t,u]"""
        b.row_block("useful_residency")  # S[t,v] <= S[t+1,v] + need + sum_{users u} R[t,u]
        for (t, v), s in self.S.items():
            use = self._use_terms(t, v)
            if use is not None:
                b.row(f"useful_residency[{t},{v}]", [(s, 1.0)] + use, hi=0.0)

    def _useful_recompute_rows(self, b: Builder) -> None:
        """R[t,j] <= sum_{outputs w} (S[t+1,w] + need + sum_{users u in C_t} R[t,u])"""
        g, f = self.graph, self.facts
        ops, hz, sched = g.ops, f.horizon, f.scheduled
        b.row_block("useful_recompute")  # R[t,j] <= sum_{outputs w} (S[t+1,w] + need + R users)
        for (t, j), r in self.R.items():
            terms = [(r, 1.0)]
            for w in ops[j].outputs:
                if not sched[w] or hz[w] < t:
                    continue
                use = self._use_terms(t, w)
                if use is None:
                    break
                terms += use
            else:
                b.row(f"useful_recompute[{t},{j}]", terms, hi=0.0)

    def _no_duplicate_rows(self, b: Builder) -> None:
        """R[t,j] + S[t,w] <= 1 for an op with a single output w"""
        g, f = self.graph, self.facts
        ops, sched = g.ops, f.scheduled
        b.row_block("no_duplicate")  # R[t,j] + S[t,w] <= 1 for an op with a single output w
        for (t, j), r in self.R.items():
            outs = ops[j].outputs
            if len(outs) == 1 and sched[outs[0]] and (t, outs[0]) in self.S:
                b.row(f"no_duplicate[{t},{j}]", [(r, 1.0), (self.S[t, outs[0]], 1.0)], hi=1.0)

    def _inplace_saved_rows(self, b: Builder) -> None:
        """M[j,i] + M[k,i'] <= 1 for every Impl i' of k saving x(j,i)"""
        g, f = self.graph, self.facts
        ops = g.ops
        # In-place Impls (docs/formulation.md): the Value x that Impl i of op j overwrites is gone
        # once j has run, so no chosen Impl may save it and it is never held across a stage
        # boundary (nor offloaded). Without a column M[j,i] (the op's only Impl) the rows fix
        # the other side to 0.
        b.row_block("inplace_saved")  # M[j,i] + M[k,i'] <= 1 for every Impl i' of k saving x
        for (j, i), x in f.overwrites.items():
            for k in g.backward_order:
                if k == j:
                    continue
                for i2 in f.impls[k]:
                    if x in ops[k].impls[i2].saved:
                        self._at_most_one(b, f"inplace_saved[{j},{i},{k},{i2}]",
                                          [self.M.get((j, i)), self.M.get((k, i2))])

    def _inplace_resident_rows(self, b: Builder) -> None:
        """S[t,x] + M[j,i] <= 1;  O[x] + M[j,i] <= 1"""
        f = self.facts
        hz = f.horizon
        b.row_block("inplace_resident")  # S[t,x] + M[j,i] <= 1;  O[x] + M[j,i] <= 1
        for (j, i), x in f.overwrites.items():
            for t in range(hz[x] + 1):
                self._at_most_one(b, f"inplace_resident[{t},{j},{i}]",
                                  [self.S[t, x], self.M.get((j, i))])
            if x in self.O:
                self._at_most_one(b, f"inplace_offload[{j},{i}]", [self.O[x], self.M.get((j, i))])

    def _offload_rows(self, b: Builder) -> None:
        """Fe[t,v] <= O[v];  O[v] + S[0,v] <= 1"""
        b.row_block("offload")  # Fe[t,v] <= O[v];  O[v] + S[0,v] <= 1
        for (t, v), fe in self.Fe.items():
            b.row(f"fetch_offloaded[{t},{v}]", [(fe, 1.0), (self.O[v], -1.0)], hi=0.0)
        for v, o in self.O.items():
            b.row(f"offload_leaves[{v}]", [(o, 1.0), (self.S[0, v], 1.0)], hi=1.0)

    def _useful_fetch_rows(self, b: Builder) -> None:
        """Fe[t,v] + S[t,v] <= 1;  Fe[t,v] + R[t,p(v)] <= 1;
        Fe[t,v] <= S[t+1,v] + need + sum_{users u in C_t} R[t,u]"""
        values = self.graph.values
        b.row_block("useful_fetch")  # Fe[t,v] <= S[t+1,v] + need + sum R users; no duplicate
        for (t, v), fe in self.Fe.items():
            b.row(f"fetch_not_resident[{t},{v}]", [(fe, 1.0), (self.S[t, v], 1.0)], hi=1.0)
            made = self.R.get((t, values[v].producer))
            if made is not None:
                b.row(f"fetch_not_made[{t},{v}]", [(fe, 1.0), (made, 1.0)], hi=1.0)
            use = self._use_terms(t, v)
            if use is not None:
                b.row(f"useful_fetch[{t},{v}]", [(fe, 1.0)] + use, hi=0.0)

    def _use_terms(self, t: int, v: int) -> list | None:
        """-(S[t+1,v] + sum_{i in need_t(v)} M[k_t,i] + sum_{users u in C_t} R[t,u]): what uses v
        at stage t or later, the right side of the useful_* cuts; None when every Impl of the
        stage's op saves v (the cut could not bind)."""
        g, f = self.graph, self.facts
        k = g.backward_order[t]
        needers = f.need[t].get(v, ())
        if needers and len(needers) == len(f.impls[k]):
            return None
        terms = [(self.M[k, i], -1.0) for i in needers]
        if (t + 1, v) in self.S:
            terms.append((self.S[t + 1, v], -1.0))
        terms += [(self.R[t, u], -1.0) for u in g.users[v] if u in self._cand_sets[t]]
        return terms

    def _recompute_support_rows(self, b: Builder) -> None:
        """S[t2,v] <= S[t1,v] + sum_i S[t1,u_i] + sum_{t1 <= t < t2} R[t,q] (+ Fe)"""
        b.row_block("recompute_support")  # S[t2,v] <= S[t1,v] + sum S[t1,u] + R[t1..t2-1,q]
        for c in sorted(self.support_cuts):
            self._check_cut(c)
            b.row(f"recompute_support[{c.value},{'/'.join(map(str, c.path))},{c.first},"
                  f"{c.last}]", support_terms(self, c), hi=0.0)

    def _internals_rows(self, b: Builder) -> None:
        """IF[j] = IF[j-1] + int(j-1);  IB[t] = IB[t+1] + int(k_t)"""
        g, T, ms, var_int = self.graph, self.T, self.mem_scale, self._var_int
        ops = g.ops
        b.row_block("internals")
        prev = None
        for j in range(len(ops)):  # IF[j] = IF[j-1] + internals of op j-1 (if it has a stage)
            terms = [(self.IF[j], 1.0)]
            c = 0
            if prev is not None:
                terms.append((self.IF[prev], -1.0))
                if prev in var_int:  # the others are constants of the memory rows
                    c, tt = self._choice_terms(prev, lambda im: im.internal_bytes, ms)
                    terms += [(col, -a) for col, a in tt]
            r = b.row(f"internals_forward[{j}]", terms, c / ms, c / ms)
            self._defined.append((self.IF[j], r))
            prev = j
        for t in range(T - 1, -1, -1):  # IB[t] = IB[t+1] + internals of stage t's op
            k = g.backward_order[t]
            c, tt = (self._choice_terms(k, lambda im: im.internal_bytes, ms)
                     if k in var_int else (0, []))
            terms = [(self.IB[t], 1.0)] + [(col, -a) for col, a in tt]
            if t + 1 < T:
                terms.append((self.IB[t + 1], -1.0))
            r = b.row(f"internals_backward[{t}]", terms, c / ms, c / ms)
            self._defined.append((self.IB[t], r))

    def _memory_constants(self, ) -> tuple[list[int], int, list[int], list[int]]:
        """Bytes no decision changes: held outputs made before op j (and all of them), and the
        internals of ops whose Impls agree, forward and backward."""
        g, f, T, stage_ops, var_int = self.graph, self.facts, self.T, self._stage_ops, self._var_int
        ops, values, sched = g.ops, g.values, f.scheduled
        held_bytes = [0] * (len(ops) + 1)  # bytes of held outputs produced before op j
        for v in values:
            if v.producer is not None and not sched[v.id]:
                held_bytes[v.producer + 1] += v.bytes
        for j in range(len(ops)):
            held_bytes[j + 1] += held_bytes[j]
        all_held = held_bytes[len(ops)]
        # constant internals (ops whose Impls agree on them)
        int_fwd_const = [0] * (len(ops) + 1)
        for j in range(len(ops)):
            add = 0
            if j in stage_ops and j not in var_int:
                add = self._impl(j, f.impls[j][0]).internal_bytes
            int_fwd_const[j + 1] = int_fwd_const[j] + add
        int_bwd_const = [0] * (T + 1)
        for t in range(T - 1, -1, -1):
            k = g.backward_order[t]
            add = 0 if k in var_int else self._impl(k, f.impls[k][0]).internal_bytes
            int_bwd_const[t] = int_bwd_const[t + 1] + add
        return held_bytes, all_held, int_fwd_const, int_bwd_const

    def _mem_forward_rows(self, b: Builder, held_bytes: list[int], int_fwd_const: list[int]
                          ) -> None:
        """F + Int_fwd(j) + live(j) + sum_{last(v) < j} b(v) S[0,v] + H_{<j} + out(j)
        + sum_i (int + fws - fr)(j,i) M[j,i] <= B"""
        g, f, ms, var_int = self.graph, self.facts, self.mem_scale, self._var_int
        ops, values, hz, sched, fixed = g.ops, g.values, f.horizon, f.scheduled, g.fixed_bytes
        b.row_block("mem_forward")
        # live before op j: scheduled v with p(v) < j <= last_use(v), or kept (S[0,v])
        live_const = [0] * (len(ops) + 1)
        for v in values:
            if sched[v.id]:
                live_const[v.producer + 1] += v.bytes
                live_const[f.last_use[v.id] + 1] -= v.bytes
        kept_after = [[] for _ in range(len(ops) + 1)]  # kept-or-freed decided after last use
        for v in values:
            if sched[v.id] and hz[v.id] >= 0:
                kept_after[f.last_use[v.id] + 1].append(v.id)
        running, kept_terms = 0, []
        for j, op in enumerate(ops):
            running += live_const[j]
            kept_terms += [(self.S[0, v], values[v].bytes / ms) for v in kept_after[j]]
            c_ws, t_ws = self._choice_terms(
                j, lambda im: im.internal_bytes + im.fwd_workspace - self._freed(j, im), ms)
            const = (fixed + int_fwd_const[j] + running + held_bytes[j] + f.out_bytes[j] + c_ws)
            terms = kept_terms + t_ws + ([(self.IF[j], 1.0)] if var_int else [])
            self._mem_row(b, f"mem_forward[{j}]", terms, const, f"forward of op {j} {op.name}")

    def _stage_memory_rows(self, b: Builder) -> tuple[list[list[int]], list[list[list]]]:
        """Lm[t,0] = sum_v b(v) a_t(v,0);  Lm[t,l] = Lm[t,l-1] + sum_v b(v) (a_t(v,l) - a_t(v,l-1)).
        Returns, per stage, each point's constant bytes and its terms."""
        g, f, T, ms = self.graph, self.facts, self.T, self.mem_scale
        values, cands = g.values, f.candidates
        b.row_block("stage_memory")  # Lm[t,0] = alive at the first point; Lm[t,l] = Lm[t,l-1] + delta
        stage_const: list[list[int]] = []
        stage_terms: list[list[list]] = []
        for t in range(T):
            b.check()  # without running sums a stage adds no row until its end
            L = len(cands[t])
            consts = [0] * (L + 2)
            if self.running_sums:
                deltas = [[] for _ in range(L + 2)]
            else:
                rows_terms = [[] for _ in range(L + 1)]
                wanted = [l for l, j in enumerate(cands[t]) if self._has_point(t, j)] + [L]
            for v, us, yexpr, segs in self._alive_plan[t]:
                byt = values[v].bytes
                for (lo, hi, term) in segs:
                    if term is None or lo > hi:
                        continue
                    if term == ("c",):
                        consts[lo] += byt
                        consts[hi + 1] -= byt
                    elif self.running_sums:
                        deltas[lo].append((term[1], byt / ms))
                        deltas[hi + 1].append((term[1], -byt / ms))
                        self.full_sum_nnz += hi + 1 - lo
                    else:
                        for i in range(bisect.bisect_left(wanted, lo),
                                       bisect.bisect_right(wanted, hi)):
                            rows_terms[wanted[i]].append((term[1], byt / ms))
            for l in range(1, L + 1):
                consts[l] += consts[l - 1]
            if self.running_sums:
                rows_terms = []
                for l in range(L + 1):
                    terms = [(self.Lm[t, l], 1.0)] + [(c, -a) for c, a in deltas[l]]
                    if l > 0:
                        terms.append((self.Lm[t, l - 1], -1.0))
                    r = b.row(f"stage_memory[{t},{l}]", terms, 0.0, 0.0)
                    self._defined.append((self.Lm[t, l], r))
                    rows_terms.append([(self.Lm[t, l], 1.0)])
            stage_const.append(consts[:L + 1])
            stage_terms.append(rows_terms)
        return stage_const, stage_terms

    def _mem_recompute_rows(self, b: Builder, stage_const, stage_terms, int_bwd_const: list[int],
                            all_held: int) -> None:
        """F + grad_t + Int_t + H + Lm[t,l] + sum_i (out(j) - fr(j,i) + rws(j,i)) RI[t,j,i] <= B"""
        g, f, T, ms, var_int = self.graph, self.facts, self.T, self.mem_scale, self._var_int
        ops, cands, fixed = g.ops, f.candidates, g.fixed_bytes
        b.row_block("mem_recompute")
        for t in range(T):
            base = fixed + g.stage_grad_bytes[t] + int_bwd_const[t] + all_held
            ib = [(self.IB[t], 1.0)] if var_int else []
            for l, j in enumerate(cands[t]):
                if not self._has_point(t, j):
                    continue
                out = f.out_bytes[j]
                if j in self.split_ops:
                    terms = [(self.RI[t, j, i], (out - inplace_freed(g, j, i)
                                                 + self._impl(j, i).recompute_transient) / ms)
                             for i in f.impls[j]]
                else:
                    i0 = f.impls[j][0]
                    terms = [(self.R[t, j], (out - inplace_freed(g, j, i0)
                                             + self._impl(j, i0).recompute_transient) / ms)]
                self._mem_row(b, f"mem_recompute[{t},{j}]", stage_terms[t][l] + terms + ib,
                              base + stage_const[t][l],
                              f"recomputation of op {j} {ops[j].name} before stage {t}")

    def _mem_backward_rows(self, b: Builder, stage_const, stage_terms, int_bwd_const: list[int],
                           all_held: int) -> None:
        """F + grad_t + Int_t + H + Lm[t,L_t] + sum_i bws(k_t,i) M[k_t,i] + held past <= B"""
        g, f, T, ms, var_int = self.graph, self.facts, self.T, self.mem_scale, self._var_int
        ops, cands, fixed = g.ops, f.candidates, g.fixed_bytes
        b.row_block("mem_backward")
        for t in range(T):
            k = g.backward_order[t]
            L = len(cands[t])
            c_ws, t_ws = self._choice_terms(k, lambda im: im.bwd_workspace, ms)
            base = fixed + g.stage_grad_bytes[t] + int_bwd_const[t] + all_held + c_ws
            ib = [(self.IB[t], 1.0)] if var_int else []
            held_const, held_terms = self._held_past[t]
            self._mem_row(b, f"mem_backward[{t}]", stage_terms[t][L] + t_ws + ib + held_terms,
                          base + stage_const[t][L] + held_const,
                          f"backward of op {k} {ops[k].name}")

    def _at_most_one(self, b: Builder, name: str, cols: list) -> None:
        """sum(cols) <= 1, where None stands for an Impl column that does not exist because it
        is the op's only allowed Impl (fixed at 1): the others must then be 0."""
        forced = sum(c is None for c in cols)
        if forced > 1:
            raise ValueError(f"{name}: two ops' only allowed Impls exclude each other (one "
                             f"overwrites a Value the other saves); no schedule exists in mode "
                             f"{self.mode!r}")
        b.row(name, [(c, 1.0) for c in cols if c is not None], hi=1.0 - forced)

    def _check_cut(self, c: SupportCut) -> None:
        """A cut is valid only along an input chain (solver/cuts.py): say so if it is not."""
        g = self.graph
        chain = (c.value,) + c.path
        for a, u in zip(chain, chain[1:]):
            p = g.values[a].producer
            if p is None or u not in g.ops[p].inputs:
                raise ValueError(f"support cut {c}: Value {u} is not an input of the producer "
                                 f"of Value {a}")
        if (0, g.values[c.value].producer) not in self.R or (c.last, c.value) not in self.S \
                or not 0 <= c.first < c.last:
            raise ValueError(f"support cut {c}: Value {c.value} has no recomputation or no "
                             f"residency column at stage {c.last}, or the stages are not "
                             f"first < last")

    def _has_point(self, t: int, j: int) -> bool:
        return self.recompute_points is None or (t, j) in self.recompute_points

    def _made(self, t: int, v: int, coef: float):
        """The columns that make v present at stage t besides residency: R[t,p(v)] when v's
        producer may be recomputed there, Fe[t,v] when v may be fetched from host memory."""
        p = self.graph.values[v].producer
        cols = [self.R.get((t, p)), self.Fe.get((t, v))]
        return [(col, coef) for col in cols if col is not None]

    def _mem_row(self, b: Builder, name: str, terms, const: int, where: str) -> None:
        ms = self.mem_scale
        if self.objective == "peak":
            r = b.row(name, list(terms) + [(self.P, -1.0)], hi=-const / ms)
            self.mem_rows.append(MemRow(r, const, where))
        elif not terms:
            self._const_point(const, where)
        else:
            r = b.row(name, terms, hi=(self.budget - const) / ms)
            self.mem_rows.append(MemRow(r, const, where))

    def _const_point(self, const: int, where: str) -> None:
        if const > self.const_peak:
            self.const_peak, self.const_peak_where = const, where
        if self.budget is not None and self.objective == "time" and const > self.budget:
            self.infeasible_points.append((where, const))
