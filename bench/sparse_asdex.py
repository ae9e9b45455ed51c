"""The 2-D Brusselator residual of bench/sparse.py written in JAX, timed with asdex.

Measures on this CPU, one thread: asdex's detection + colouring (``jacobian_coloring``, cold: a
fresh function each repeat) and a repeated jitted evaluation of ``jacobian_from_coloring``, at
n = 64 (N = 8,192) by default, with the colour count. Needs a separate environment::

    python3.11 -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install jax asdex
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false /tmp/jaxenv/bin/python bench/sparse_asdex.py [--n 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_ENABLE_X64", "1")

import asdex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def brusselator(n: int, a: float = 3.4, b: float = 1.0, alpha: float = 0.02):
    h2 = (1.0 / n) ** 2

    def lap(w):
        return (jnp.roll(w, 1, 0) + jnp.roll(w, -1, 0) + jnp.roll(w, 1, 1) + jnp.roll(w, -1, 1) - 4 * w) / h2

    def f(x):
        u, v = x.reshape(2, n, n)
        fu = b + u * u * v - (a + 1) * u + alpha * lap(u)
        fv = a * u - u * u * v + alpha * lap(v)
        return jnp.stack([fu, fv]).reshape(-1)

    return f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.n
    x = jax.random.uniform(jax.random.PRNGKey(0), (2 * n * n,), dtype=jnp.float64)
    detect = []
    for _ in range(max(3, args.repeats // 3)):
        f = brusselator(n)  # a fresh function: nothing cached
        t0 = time.perf_counter()
        coloring = asdex.jacobian_coloring(f, x)
        detect.append(time.perf_counter() - t0)
    jac = jax.jit(asdex.jacobian_from_coloring(f, coloring))
    t0 = time.perf_counter()
    jac(x).data.block_until_ready() if hasattr(jac(x), "data") else None
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = jac(x)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    print(coloring)
    res = {"n": n, "N": 2 * n * n, "colors": int(getattr(coloring, "num_colors", -1)),
           "detect_color_s_median": statistics.median(detect), "detect_color_s_min": min(detect),
           "first_call_s": first, "eval_s_median": statistics.median(times), "eval_s_min": min(times)}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
