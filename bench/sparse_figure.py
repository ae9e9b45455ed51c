"""The picture of docs/sparse.md: the Brusselator's Jacobian pattern coloured by column colour.

Two steps, because the plotting environment need not have torch::

    PYTHONPATH=src python bench/sparse_figure.py dump /tmp/pattern.npz          # jacmode's venv
    /tmp/jaxenv/bin/python bench/sparse_figure.py plot /tmp/pattern.npz docs/img/sparse-brusselator.png
"""

from __future__ import annotations

import sys

import numpy as np


def dump(path: str, n: int = 8) -> None:
    import torch

    import jacmode as jm
    sys.path.insert(0, "bench")
    from sparse import brusselator  # type: ignore[import-not-found]

    x = torch.rand(2, n, n, dtype=torch.float64)
    f = brusselator(n)
    p = jm.sparsity(lambda z: f(z.reshape(-1)), x)
    c = jm.coloring(p, "column")
    np.savez(path, rows=p.rows(), cols=p.col, colors=c.colors, n=n, k=c.n_colors, bound=c.lower_bound)


def plot(path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = np.load(path)
    rows, cols, colors, n, k = d["rows"], d["cols"], d["colors"], int(d["n"]), int(d["k"])
    big = 2 * n * n
    cmap = plt.get_cmap("tab10")
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 5), gridspec_kw={"width_ratios": [big, 6 * k]})
    a.scatter(cols, rows, c=[cmap(colors[j] % 10) for j in cols], s=6, marker="s", linewidths=0)
    a.set_xlim(-0.5, big - 0.5)
    a.set_ylim(big - 0.5, -0.5)
    a.set_aspect("equal")
    a.set_title(f"Jacobian pattern, N = {big} (n = {n}): {len(rows)} nonzeros,\ncoloured by the column's colour")
    a.axhline(n * n - 0.5, color="0.7", lw=0.5)
    a.axvline(n * n - 0.5, color="0.7", lw=0.5)
    b.scatter(colors[cols], rows, c=[cmap(colors[j] % 10) for j in cols], s=6, marker="s", linewidths=0)
    b.set_xlim(-0.5, k - 0.5)
    b.set_ylim(big - 0.5, -0.5)
    b.set_xticks(range(k))
    b.set_title(f"compressed:\n{k} jvps (bound {int(d['bound'])})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2])
    else:
        plot(sys.argv[2], sys.argv[3])
