"""The sparsity pattern of a Jacobian (or of a Hessian), as users get it from :func:`jacmode.sparsity`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SCOPES = ("global", "local", "dense")


@dataclass(frozen=True, repr=False, eq=False)
class SparsityPattern:
    """Which entries of a Jacobian (Y, N) or of a Hessian (N, N) can be nonzero.

    Attributes:
        shape: (Y, N) for a Jacobian of f: R^N -> R^Y (inputs and outputs flattened, row-major),
            (N, N) for the Hessian of a scalar function.
        crow: (Y + 1,) int64 NumPy array, the CSR row pointers.
        col: (nnz,) int64 NumPy array, the CSR column indices, sorted within each row.
        in_shape: the shape of x.
        out_shape: the shape of f(x) (``()`` for a Hessian's scalar).
        scope: "global" (valid for every input of this shape and dtype: found from the operations
            alone), "local" (valid at the given input: ``f`` branches on values, or an operation
            has no rule and its pattern was read off its Jacobian there), or "dense" (the exact
            fallback: the nonzeros of the dense Jacobian at the given input).
        symmetric: True for a Hessian pattern.
        reason: why the scope is what it is (empty for "global").
        pass_bytes: bytes of the intermediate tensors of one evaluation of ``f`` (the memory a
            pushed direction costs, for chunking).
        random: ``f`` ran a random operation (dropout in training mode, ``rand_like``, ...): the
            pattern holds, but two evaluations differ, so results are not cross-checked.
    """

    shape: tuple[int, int]
    crow: np.ndarray
    col: np.ndarray
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    scope: str = "global"
    symmetric: bool = False
    reason: str = ""
    pass_bytes: int = 0
    random: bool = False

    @property
    def nnz(self) -> int:
        """Number of structural nonzeros."""
        return int(self.col.shape[0])

    @property
    def density(self) -> float:
        """nnz / (Y * N)."""
        total = self.shape[0] * self.shape[1]
        return self.nnz / total if total else 0.0

    def rows(self) -> np.ndarray:
        """The row of every nonzero, (nnz,)."""
        return np.repeat(np.arange(self.shape[0], dtype=np.int64), np.diff(self.crow))

    def row_counts(self) -> np.ndarray:
        """Nonzeros per row, (Y,)."""
        return np.diff(self.crow)

    def col_counts(self) -> np.ndarray:
        """Nonzeros per column, (N,)."""
        return np.bincount(self.col, minlength=self.shape[1])

    def transpose(self) -> "SparsityPattern":
        """The pattern of the transposed matrix (N, Y), rows sorted."""
        order = np.lexsort((self.rows(), self.col))
        crow = np.zeros(self.shape[1] + 1, dtype=np.int64)
        np.cumsum(self.col_counts(), out=crow[1:])
        return SparsityPattern((self.shape[1], self.shape[0]), crow, self.rows()[order],
                               self.out_shape, self.in_shape, self.scope, self.symmetric, self.reason,
                               self.pass_bytes, self.random)

    def to_dense(self) -> Tensor:
        """The pattern as a dense boolean tensor (Y, N); mind the size for large N."""
        dense = torch.zeros(self.shape, dtype=torch.bool, device="cpu")
        dense[torch.from_numpy(self.rows()), torch.from_numpy(self.col)] = True
        return dense

    def __repr__(self) -> str:
        why = f", {self.reason}" if self.reason else ""
        kind = "Hessian" if self.symmetric else "Jacobian"
        return (f"SparsityPattern({kind} {self.shape[0]:,} x {self.shape[1]:,}, {self.nnz:,} nonzeros "
                f"({100 * self.density:.3g}%), max {int(self.row_counts().max(initial=0))} per row, "
                f"{int(self.col_counts().max(initial=0))} per column, {self.scope}{why})")
