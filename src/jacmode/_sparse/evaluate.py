"""Compressed evaluation (one vectorised jvp, vjp or Hessian-vector product per colour) and
decompression into the nonzeros of the pattern.

NOTE: [Compression and decompression]
A colouring with C colours gives C seed vectors (the sum of the unit vectors of one colour).
Bidirectional: the jvps of its column colours and the vjps of its row colours, each nonzero read
in the block its side says (``from_rows``).
Column colouring: the C jvps J v_c, stacked (C, Y), hold J[i, j] at (colour(j), i). Row colouring:
the C vjps u_c^T J, stacked (C, N), hold J[i, j] at (colour(i), j). Star colouring: the C Hessian-
vector products H v_c (forward over reverse), stacked (C, N), hold H[i, j] at (colour(j), i) or,
when colour(j) is shared by another neighbour of i, at (colour(i), j). ``sources`` computes the
flat position of every nonzero once per colouring, so decompression is one gather, which autograd
differentiates (``create_graph=True``). The seeds are pushed in chunks of colours that fit the
memory budget.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Optional

import numpy as np
import torch
from torch import Tensor
from torch.func import grad, vjp

from .._threads import jvp  # one thread at a time: see [Threads] in _threads.py
from .._autodiff.forward import pushforward
from .._autodiff.reverse import pullback, recording
from .._cache import register
from .coloring import Coloring
from .pattern import SparsityPattern

Fn = Callable[[Tensor], Tensor]
_SOURCES: "weakref.WeakKeyDictionary[Coloring, np.ndarray]" = register(weakref.WeakKeyDictionary(), "sparse sources")


def sources(c: Coloring) -> np.ndarray:
    """Flat position of every nonzero of ``c.pattern`` (CSR order) in the stacked compressed products."""
    hit = _SOURCES.get(c)
    if hit is not None:
        return hit
    p = c.pattern
    rows, cols = p.rows(), p.col
    y, n = p.shape
    if c.partition == "column":
        src = c.colors[cols] * y + rows
    elif c.partition == "bidirectional":  # the jvps' block (C_f, Y), then the vjps' (C_r, N)
        assert c.row_colors is not None and c.from_rows is not None
        src = np.where(c.from_rows, c.n_column_colors * y + c.row_colors[rows] * n + cols,
                       c.colors[cols] * y + rows)
    elif c.partition == "row":
        src = c.colors[rows] * n + cols
    else:
        src = _star_sources(c, rows, cols)
    _SOURCES[c] = src
    return src


def _star_sources(c: Coloring, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    n, k = c.pattern.shape[0], c.n_colors
    col_of = c.colors
    key = rows * k + col_of[cols]  # (i, colour(j)) for every nonzero, diagonal included
    counts = np.bincount(key, minlength=n * k)
    direct = counts[key] == 1
    other = counts[cols * k + col_of[rows]] == 1
    if not np.all(direct | other):
        raise RuntimeError("jacmode internal error: the colouring is not a star colouring")
    return np.where(direct, col_of[cols] * n + rows, col_of[rows] * n + cols)


_SEEDS: "weakref.WeakKeyDictionary[Coloring, dict[tuple, Tensor]]" = register(weakref.WeakKeyDictionary(),
                                                                           "sparse seeds")
SEED_CACHE_BYTES = 64 * 2**20


def seeds(c: Coloring, start: int, stop: int, shape: tuple[int, ...], like: Tensor,
          side: str = "columns") -> Tensor:
    """(stop - start, *shape) tangents: the indicator of each colour (kept for small colourings).

    ``side="rows"`` seeds the row colours of a bidirectional colouring (its vjps).
    """
    key = (start, stop, like.dtype, str(like.device), side)
    cache = _SEEDS.setdefault(c, {})
    hit = cache.get(key)
    if hit is not None:
        return hit
    colors = c.row_colors if side == "rows" and c.row_colors is not None else c.colors
    col = torch.from_numpy(colors).to(like.device)
    ks = torch.arange(start, stop, device=like.device)
    out = (col.unsqueeze(0) == ks.unsqueeze(1)).to(like.dtype).reshape(stop - start, *shape)
    if out.numel() * out.element_size() <= SEED_CACHE_BYTES:
        cache[key] = out
    return out


def compressed(f: Fn, x: Tensor, c: Coloring, chunk: int, out_shape: tuple[int, ...]) -> Tensor:
    """The C compressed products, stacked and flattened: (C, Y) for columns, (C, N) otherwise;
    for "bidirectional" the jvps' (C_f, Y) and the vjps' (C_r, N) flattened one after the other."""
    if c.partition == "bidirectional":
        fwd = _pushed(f, x, c.n_column_colors, chunk, lambda s, e: seeds(c, s, e, tuple(x.shape), x))
        rev = _pulled(f, x, c.n_row_colors, chunk, lambda s, e: seeds(c, s, e, out_shape, x, "rows"))
        return torch.cat([fwd.reshape(-1), rev.reshape(-1)])
    blocks = []
    if c.partition == "row":
        with recording() as kept:  # see [Grad mode of the reverse engines]
            vjp_fn = vjp(f, x)[1]
            for s in range(0, c.n_colors, chunk):
                e = min(c.n_colors, s + chunk)
                blocks.append(kept(pullback(vjp_fn, seeds(c, s, e, out_shape, x))).reshape(e - s, -1))
    else:
        fn = f if c.partition == "column" else _gradient(f)
        for s in range(0, c.n_colors, chunk):
            e = min(c.n_colors, s + chunk)
            blocks.append(pushforward(fn, x, seeds(c, s, e, tuple(x.shape), x)).reshape(e - s, -1))
    if not blocks:
        width = math.prod(out_shape) if c.partition == "column" else x.numel()
        return x.new_zeros(0, width)
    return torch.cat(blocks)


def _pushed(f: Fn, x: Tensor, k: int, chunk: int, seed: Callable[[int, int], Tensor]) -> Tensor:
    blocks = [pushforward(f, x, seed(s, min(k, s + chunk))).reshape(min(k, s + chunk) - s, -1)
              for s in range(0, k, chunk)]
    return torch.cat(blocks) if blocks else x.new_zeros(0)


def _pulled(f: Fn, x: Tensor, k: int, chunk: int, seed: Callable[[int, int], Tensor]) -> Tensor:
    if k == 0:
        return x.new_zeros(0)
    vjp_fn = vjp(f, x)[1]
    return torch.cat([pullback(vjp_fn, seed(s, min(k, s + chunk))).reshape(min(k, s + chunk) - s, -1)
                      for s in range(0, k, chunk)])


def _gradient(f: Fn) -> Fn:
    return grad(lambda z: f(z).sum())  # f is scalar: sum() only drops a shape of ones


def values(f: Fn, x: Tensor, c: Coloring, chunk: int, out_shape: tuple[int, ...]) -> Tensor:
    """The nonzeros of the Jacobian (or Hessian) in CSR order of the pattern."""
    stacked = compressed(f, x, c, chunk, out_shape)
    return stacked.reshape(-1)[_sources_on(c, x.device)]


_SRC_T: "weakref.WeakKeyDictionary[Coloring, dict[str, Tensor]]" = register(weakref.WeakKeyDictionary(),
                                                                         "sparse sources as tensors")


def _sources_on(c: Coloring, device: torch.device) -> Tensor:
    cache = _SRC_T.setdefault(c, {})
    if str(device) not in cache:
        cache[str(device)] = torch.from_numpy(sources(c)).to(device)
    return cache[str(device)]


def layout(p: SparsityPattern, vals: Tensor, kind: str, out_shape: tuple[int, ...]) -> Tensor:
    """The nonzeros as a CSR, COO or dense tensor (2-D (Y, N) for CSR/COO)."""
    crow = torch.from_numpy(p.crow).to(vals.device)
    col = torch.from_numpy(p.col).to(vals.device)
    if kind == "csr":
        return torch.sparse_csr_tensor(crow, col, vals, size=p.shape, device=vals.device,
                                       check_invariants=False)
    rows = torch.from_numpy(p.rows()).to(vals.device)
    if kind == "coo":
        return torch.sparse_coo_tensor(torch.stack([rows, col]), vals, size=p.shape, device=vals.device, is_coalesced=True,
                                       check_invariants=False)
    dense = vals.new_zeros(p.shape).index_put((rows, col), vals)
    return dense.reshape(*out_shape, *p.in_shape)


def probe_check(f: Fn, x: Tensor, c: Coloring, vals: Tensor) -> Optional[float]:
    """Compare the decompressed matrix times a random vector with one exact product.

    Returns None when they agree to the dtype's precision, else the relative error. A pattern that
    missed a nonzero makes two columns (rows) of one colour collide, which this sees.
    """
    p = c.pattern
    gen = torch.Generator(device="cpu").manual_seed(1234)
    rows = torch.from_numpy(p.rows()).to(x.device)
    col = torch.from_numpy(p.col).to(x.device)
    vals = vals.detach()
    xd = x.detach()
    if c.partition == "row":
        u = torch.randn(p.shape[0], generator=gen, dtype=x.dtype, device="cpu").to(x.device)
        with recording() as kept:
            exact = kept(vjp(f, xd)[1](u.reshape(p.out_shape))[0]).reshape(-1)
        approx = torch.zeros(p.shape[1], dtype=x.dtype, device=x.device).index_add_(0, col, vals * u[rows])
    else:  # a jvp also checks a bidirectional colouring: a missed nonzero changes J v either way
        v = torch.randn(p.shape[1], generator=gen, dtype=x.dtype, device="cpu").to(x.device)
        fn = _gradient(f) if c.partition == "star" else f
        exact = jvp(fn, (xd,), (v.reshape(xd.shape),))[1].reshape(-1)
        approx = torch.zeros(p.shape[0], dtype=x.dtype, device=x.device).index_add_(0, rows, vals * v[col])
    eps = torch.finfo(x.dtype).eps
    scale = float(exact.abs().max()) if exact.numel() else 0.0
    err = float((exact - approx).abs().max()) if exact.numel() else 0.0
    tol = 1e3 * eps * max(scale, 1.0) * max(1.0, math.sqrt(max(p.row_counts().max(initial=1), 1)))
    return None if err <= tol else err / max(scale, 1e-300)

