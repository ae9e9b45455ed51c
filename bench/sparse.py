"""Sparse Jacobians and Hessians against dense torch.func, side by side in one run.

Measures, on one CPU thread:

* the 2-D Brusselator residual on an n x n periodic grid (N = 2 n^2) for n = 32, 64, 128:
  detection and colouring time (cold: caches cleared), colours of the column and row colourings
  and their lower bound, the repeated evaluation time of ``jm.sparse_jacobian`` (pattern and
  colouring reused, median of repeats), and ``torch.func.jacfwd`` dense where it fits
  (N = 2,048 and 8,192) with the largest difference between the two;
* the sparse Hessian of a sum of local terms on a 100 x 100 grid (N = 10,000) with star
  colouring against a dense Hessian (``vmap`` over Hessian-vector products of every unit vector,
  timed on 1,000 of the 10,000 columns and scaled: the whole one needs about 16 GB at once).

Run from the repository root::

    PYTHONPATH=src python bench/sparse.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch
from torch.func import grad, jvp, vmap

import jacmode as jm
from jacmode._sparse import detect as _detect
from jacmode._sparse.coloring import color

Fn = Callable[[torch.Tensor], torch.Tensor]


def brusselator(n: int, a: float = 3.4, b: float = 1.0, alpha: float = 0.02) -> Fn:
    """Residual of u_t = b + u^2 v - (a + 1) u + alpha lap u, v_t = a u - u^2 v + alpha lap v."""
    h2 = (1.0 / n) ** 2

    def lap(w: torch.Tensor) -> torch.Tensor:
        return (torch.roll(w, 1, 0) + torch.roll(w, -1, 0) + torch.roll(w, 1, 1) + torch.roll(w, -1, 1) - 4 * w) / h2

    def f(x: torch.Tensor) -> torch.Tensor:
        u, v = x.reshape(2, n, n)
        fu = b + u * u * v - (a + 1) * u + alpha * lap(u)
        fv = a * u - u * u * v + alpha * lap(v)
        return torch.stack([fu, fv]).reshape(-1)

    return f


def local_energy(m: int) -> Fn:
    """A discretised energy on an m x m periodic grid: gradient terms, a quartic, a local coupling."""

    def e(x: torch.Tensor) -> torch.Tensor:
        u = x.reshape(m, m)
        g = (torch.roll(u, 1, 0) - u) ** 2 + (torch.roll(u, 1, 1) - u) ** 2
        return g.sum() + (u ** 4).sum() + torch.sin(u * torch.roll(u, 1, 0)).sum()

    return e


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jacobian_row(n: int, repeats: int, dense: bool) -> dict[str, Any]:
    f = brusselator(n)
    x = torch.rand(2 * n * n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    jm.clear_cache()
    _detect._PATTERNS.clear()
    t0 = time.perf_counter()
    p = jm.sparsity(f, x)
    t_detect = time.perf_counter() - t0
    t0 = time.perf_counter()
    col = jm.coloring(p, "column")
    t_col = time.perf_counter() - t0
    t0 = time.perf_counter()
    row = jm.coloring(p, "row")
    t_row = time.perf_counter() - t0
    chosen = jm.plan(f, x, batched=False, structure="sparse")
    J = jm.sparse_jacobian(f, x)  # first call: timing tie-break and the one probe check
    t_eval = median_time(lambda: jm.sparse_jacobian(f, x), repeats)
    t_eval_fwd = median_time(lambda: jm.sparse_jacobian(f, x, coloring=col), repeats)
    t_eval_rev = median_time(lambda: jm.sparse_jacobian(f, x, coloring=row), repeats)
    out: dict[str, Any] = {
        "n": n, "N": 2 * n * n, "nnz": p.nnz, "lower_bound": col.lower_bound,
        "colors_column": col.n_colors, "colors_row": row.n_colors, "order_column": col.order,
        "mode_auto": chosen.mode, "detect_s": t_detect, "color_column_s": t_col, "color_row_s": t_row,
        "eval_s": t_eval, "eval_forward_s": t_eval_fwd, "eval_reverse_s": t_eval_rev,
    }
    if dense:
        t0 = time.perf_counter()
        ref = torch.func.jacfwd(f)(x)
        out["dense_jacfwd_s"] = time.perf_counter() - t0
        out["max_abs_diff"] = float((J.to_dense() - ref).abs().max())
        out["speedup_eval"] = out["dense_jacfwd_s"] / t_eval
        out["speedup_with_detection"] = out["dense_jacfwd_s"] / (t_detect + t_col + t_row + t_eval)
        del ref
    return out


def hessian_row(m: int, repeats: int, dense_cols: int) -> dict[str, Any]:
    e = local_energy(m)
    x = torch.rand(m * m, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    jm.clear_cache()
    _detect._PATTERNS.clear()
    t0 = time.perf_counter()
    p = jm.sparsity(e, x, hessian=True)
    t_detect = time.perf_counter() - t0
    t0 = time.perf_counter()
    star = jm.coloring(p)
    t_color = time.perf_counter() - t0
    column = color(p, "column")
    H = jm.sparse_hessian(e, x)
    t_eval = median_time(lambda: jm.sparse_hessian(e, x), repeats)
    n = x.numel()
    basis = torch.eye(n, dtype=x.dtype)[:dense_cols]
    hvp = vmap(lambda t: jvp(grad(e), (x,), (t,))[1])
    t0 = time.perf_counter()
    block = hvp(basis)
    t_block = time.perf_counter() - t0
    diff = float((H.to_dense()[:dense_cols] - block).abs().max())
    t_dense = t_block * n / dense_cols
    return {"N": n, "nnz": p.nnz, "colors_star": star.n_colors, "colors_column": column.n_colors,
            "lower_bound": star.lower_bound, "detect_s": t_detect, "color_s": t_color, "eval_s": t_eval,
            "dense_s_scaled": t_dense, "dense_columns_timed": dense_cols, "max_abs_diff": diff,
            "speedup_eval": t_dense / t_eval, "speedup_with_detection": t_dense / (t_detect + t_color + t_eval)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="n = 16, 32 and a 30 x 30 Hessian (seconds)")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [(16, True), (32, True)] if args.quick else [(32, True), (64, True), (128, False)]
    rows = [jacobian_row(n, args.repeats, dense) for n, dense in sizes]
    hess = hessian_row(30 if args.quick else 100, args.repeats, 300 if args.quick else 1000)
    print("| n | N | colours col / row (bound) | auto | detect | colour col + row | eval auto | eval fwd | eval rev | jacfwd dense | speed-up | max diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dense = f"{r['dense_jacfwd_s']:.2f} s" if "dense_jacfwd_s" in r else "--"
        speed = f"{r['speedup_eval']:.0f}x" if "speedup_eval" in r else "--"
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "--"
        print(f"| {r['n']} | {r['N']:,} | {r['colors_column']} / {r['colors_row']} ({r['lower_bound']}) | {r['mode_auto']} "
              f"| {r['detect_s'] * 1e3:.0f} ms | {(r['color_column_s'] + r['color_row_s']) * 1e3:.0f} ms "
              f"| {r['eval_s'] * 1e3:.2f} ms | {r['eval_forward_s'] * 1e3:.2f} ms | {r['eval_reverse_s'] * 1e3:.2f} ms "
              f"| {dense} | {speed} | {diff} |")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        grow = (b["eval_s"] / a["eval_s"]) / (b["N"] / a["N"])
        print(f"\nevaluation time per unknown, N = {b['N']:,} against N = {a['N']:,}: x{grow:.2f} (1.0 = linear)")
    h = hess
    print(f"\nsparse Hessian, N = {h['N']:,}: {h['colors_star']} star colours (column colouring: "
          f"{h['colors_column']}, bound {h['lower_bound']}), detect {h['detect_s'] * 1e3:.0f} ms, colour "
          f"{h['color_s'] * 1e3:.0f} ms, eval {h['eval_s'] * 1e3:.1f} ms; dense {h['dense_s_scaled']:.1f} s "
          f"(scaled from {h['dense_columns_timed']} columns): {h['speedup_eval']:.0f}x "
          f"({h['speedup_with_detection']:.0f}x with detection), max diff {h['max_abs_diff']:.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"jacobian": rows, "hessian": hess}, fh, indent=1)


if __name__ == "__main__":
    main()
