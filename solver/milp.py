"""The MILP as solver-neutral sparse data: minimise c.x + offset subject to
row_lo <= A x <= row_hi, lb <= x <= ub, integrality, its columns and rows in named blocks
(docs/formulation.md), and the builder that collects them. The formulation (formulation.py)
writes one; the backends (solver/backends/) only translate it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

CHECK_EVERY = 4096
"""A builder with a `should_stop` asks it between blocks and every this many columns or rows
(a power of two: the test is a mask on a count it has anyway)."""


class BuildStopped(Exception):
    """A builder's `should_stop` said yes: the model was left unfinished (the caller's deadline)."""


@dataclass(frozen=True)
class Block:
    """A contiguous range of columns or rows sharing one meaning (see docs/formulation.md)."""

    name: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class MILP:
    """minimise c.x + offset  s.t.  row_lo <= A x <= row_hi,  lb <= x <= ub,  x_i integer where
    integrality[i]. Infinite bounds are +-inf."""

    c: np.ndarray
    offset: float
    A: sp.csr_matrix
    row_lo: np.ndarray
    row_hi: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    var_names: tuple[str, ...]
    row_names: tuple[str, ...]
    var_blocks: tuple[Block, ...]
    row_blocks: tuple[Block, ...]

    @property
    def num_vars(self) -> int:
        return len(self.c)

    @property
    def num_rows(self) -> int:
        return self.A.shape[0]

    @property
    def nnz(self) -> int:
        return int(self.A.nnz)

    @property
    def num_integer(self) -> int:
        return int(self.integrality.sum())

    def objective(self, x: np.ndarray) -> float:
        return float(self.c @ x + self.offset)

    def relaxation(self) -> "MILP":
        """The LP relaxation: the same model with every column continuous."""
        return dataclasses.replace(self, integrality=np.zeros_like(self.integrality))

    def violations(self, x: np.ndarray, tol: float = 1e-6) -> list[str]:
        """Human-readable list of the bounds, rows and integralities x violates."""
        out = []
        act = self.A @ x
        for i in np.nonzero((act < self.row_lo - tol) | (act > self.row_hi + tol))[0][:20]:
            out.append(f"row {self.row_names[i]}: {self.row_lo[i]:.6g} <= {act[i]:.6g} <= "
                       f"{self.row_hi[i]:.6g}")
        for i in np.nonzero((x < self.lb - tol) | (x > self.ub + tol))[0][:20]:
            out.append(f"column {self.var_names[i]} = {x[i]:.6g} outside "
                       f"[{self.lb[i]:.6g}, {self.ub[i]:.6g}]")
        frac = np.abs(x - np.round(x)) > tol
        for i in np.nonzero(frac & self.integrality)[0][:20]:
            out.append(f"column {self.var_names[i]} = {x[i]:.6g} is not integral")
        return out

    def block(self, name: str, rows: bool = True) -> Block:
        for b in (self.row_blocks if rows else self.var_blocks):
            if b.name == name:
                return b
        raise KeyError(name)


class Builder:
    """Collects columns and rows block by block; `finish()` returns the MILP. `should_stop`
    (a callable, or None): asked between blocks, every CHECK_EVERY columns or rows and at each
    `check()`; when it returns True the builder raises BuildStopped."""

    def __init__(self, should_stop=None):
        self.should_stop = should_stop
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[bool] = []
        self.cost: list[float] = []
        self.names: list[str] = []
        self.var_blocks: list[Block] = []
        self.ri: list[int] = []
        self.ci: list[int] = []
        self.vals: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []
        self.row_names: list[str] = []
        self.row_blocks: list[Block] = []
        self._var_block = self._row_block = None

    # blocks are contiguous: open one, add, the next open closes it
    def var_block(self, name: str) -> None:
        self.check()
        self._close_var_block()
        self._var_block = (name, len(self.lb))

    def row_block(self, name: str) -> None:
        self.check()
        self._close_row_block()
        self._row_block = (name, len(self.row_lo))

    def _close_var_block(self):
        if self._var_block and len(self.lb) > self._var_block[1]:
            self.var_blocks.append(Block(self._var_block[0], self._var_block[1], len(self.lb)))
        self._var_block = None

    def _close_row_block(self):
        if self._row_block and len(self.row_lo) > self._row_block[1]:
            self.row_blocks.append(Block(self._row_block[0], self._row_block[1],
                                         len(self.row_lo)))
        self._row_block = None

    def check(self) -> None:
        """Raise BuildStopped when `should_stop` says so (the loops call it once per stage)."""
        if self.should_stop is not None and self.should_stop():
            raise BuildStopped

    def var(self, name: str, *, lb=0.0, ub=1.0, integer=True, cost=0.0) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.cost.append(cost)
        self.names.append(name)
        n = len(self.lb) - 1
        if not n & (CHECK_EVERY - 1):
            self.check()
        return n

    def row(self, name: str, terms, lo=-math.inf, hi=math.inf) -> int:
        r = len(self.row_lo)
        merged: dict[int, float] = {}
        for c, a in terms:
            merged[c] = merged.get(c, 0.0) + a
        for c, a in merged.items():
            if a != 0.0:
                self.ri.append(r)
                self.ci.append(c)
                self.vals.append(a)
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        self.row_names.append(name)
        if not r & (CHECK_EVERY - 1):
            self.check()
        return r

    def finish(self, offset: float) -> MILP:
        self._close_var_block()
        self._close_row_block()
        n, m = len(self.lb), len(self.row_lo)
        parts = []
        for data, dtype in ((self.vals, float), (self.ri, np.int64), (self.ci, np.int64)):
            self.check()  # 0.3 s each at 8 M nonzeros, and the matrix 0.8 s
            parts.append(np.array(data, dtype=dtype))
        self.check()
        A = sp.csr_matrix((parts[0], (parts[1], parts[2])), shape=(m, n))
        return MILP(c=np.array(self.cost, dtype=float), offset=offset, A=A,
                    row_lo=np.array(self.row_lo, dtype=float),
                    row_hi=np.array(self.row_hi, dtype=float),
                    lb=np.array(self.lb, dtype=float), ub=np.array(self.ub, dtype=float),
                    integrality=np.array(self.integer, dtype=bool), var_names=tuple(self.names),
                    row_names=tuple(self.row_names), var_blocks=tuple(self.var_blocks),
                    row_blocks=tuple(self.row_blocks))


def pow2_scale(target: float, ref: float) -> float:
    """A power of two s with ref * s close to target: scaling by it is exact in floating point."""
    if ref <= 0:
        return 1.0
    return 2.0 ** round(math.log2(target / ref))

