"""asv suite: sparse Jacobians and Hessians (issue 21), small sizes only.

``SparseJacobian``: the 2-D Brusselator residual on an n x n periodic grid (N = 2 n^2, n = 8, 16)
with ``jm.sparse_jacobian`` (pattern and colouring cached: the repeated evaluation of a Newton
solver), each explicit mode, and ``torch.func.jacfwd`` dense. ``SparseDetection``: detection and
colouring from a cold cache. ``SparseHessian``: star-coloured Hessian of a sum of local terms on an
m x m grid against a dense ``torch.func.hessian``. ``bench/sparse.py`` at the repository root runs
the issue's sizes (N up to 32,768) side by side.

Importable as plain Python: ``python -c "import bench_sparse"`` from this folder.
"""

from __future__ import annotations

from typing import Callable

import torch

import jacmode as jm
from jacmode._sparse import detect as _detect

Fn = Callable[[torch.Tensor], torch.Tensor]


def brusselator(n: int, a: float = 3.4, b: float = 1.0, alpha: float = 0.02) -> Fn:
    h2 = (1.0 / n) ** 2

    def lap(w: torch.Tensor) -> torch.Tensor:
        return (torch.roll(w, 1, 0) + torch.roll(w, -1, 0) + torch.roll(w, 1, 1) + torch.roll(w, -1, 1) - 4 * w) / h2

    def f(x: torch.Tensor) -> torch.Tensor:
        u, v = x.reshape(2, n, n)
        return torch.stack([b + u * u * v - (a + 1) * u + alpha * lap(u), a * u - u * u * v + alpha * lap(v)]).reshape(-1)

    return f


def energy(m: int) -> Fn:
    def e(x: torch.Tensor) -> torch.Tensor:
        u = x.reshape(m, m)
        return (((torch.roll(u, 1, 0) - u) ** 2 + (torch.roll(u, 1, 1) - u) ** 2).sum() + (u ** 4).sum()
                + torch.sin(u * torch.roll(u, 1, 0)).sum())

    return e


METHODS: dict[str, Callable[[Fn, torch.Tensor], object]] = {
    "jm.sparse_jacobian": lambda f, x: jm.sparse_jacobian(f, x),
    "jm.sparse_jacobian forward": lambda f, x: jm.sparse_jacobian(f, x, mode="forward"),
    "jm.sparse_jacobian reverse": lambda f, x: jm.sparse_jacobian(f, x, mode="reverse"),
    "torch.func.jacfwd": lambda f, x: torch.func.jacfwd(f)(x),
}


class SparseJacobian:
    """Repeated sparse Jacobian of the Brusselator residual against dense jacfwd."""

    params = ([8, 16], list(METHODS))
    param_names = ["n", "method"]
    timeout = 120

    def setup(self, n: int, method: str) -> None:
        torch.set_num_threads(1)
        self.f = brusselator(n)
        self.x = torch.rand(2 * n * n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        self.fn = METHODS[method]
        self.fn(self.f, self.x)  # detection, colouring and the one probe check out of the timing

    def time_jacobian(self, n: int, method: str) -> None:
        self.fn(self.f, self.x)

    def peakmem_jacobian(self, n: int, method: str) -> None:
        self.fn(self.f, self.x)


class SparseDetection:
    """Pattern detection plus column and row colouring from a cold cache; colours as a track."""

    params = ([8, 16],)
    param_names = ["n"]

    def setup(self, n: int) -> None:
        torch.set_num_threads(1)
        self.f = brusselator(n)
        self.x = torch.rand(2 * n * n, dtype=torch.float64)

    def time_detect_and_color(self, n: int) -> None:
        _detect._PATTERNS.clear()
        p = jm.sparsity(self.f, self.x)
        jm.coloring(p, "column")
        jm.coloring(p, "row")

    def track_colors(self, n: int) -> int:
        return jm.coloring(jm.sparsity(self.f, self.x)).n_colors


class SparseHessian:
    """Star-coloured sparse Hessian of a sum of local terms against dense torch.func.hessian."""

    params = ([10, 20], ["jm.sparse_hessian", "torch.func.hessian"])
    param_names = ["m", "method"]
    timeout = 120

    def setup(self, m: int, method: str) -> None:
        torch.set_num_threads(1)
        self.e = energy(m)
        self.x = torch.rand(m * m, dtype=torch.float64)
        self.fn = (lambda: jm.sparse_hessian(self.e, self.x)) if method == "jm.sparse_hessian" else (
            lambda: torch.func.hessian(self.e)(self.x))
        self.fn()

    def time_hessian(self, m: int, method: str) -> None:
        self.fn()

    def track_star_colors(self, m: int, method: str) -> int:
        return jm.coloring(jm.sparsity(self.e, self.x, hessian=True)).n_colors
