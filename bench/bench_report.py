"""The bench command's output: ratios to jacmode, the Markdown table and the log-log plot."""

from __future__ import annotations

import sys
from typing import Optional


def add_ratios(rows: list[dict]) -> None:
    """Give each row ``ratio``: its median over jacmode's at the same problem and B (>1: slower).

    Example:
        >>> rows = [{"problem": "p", "B": 2, "method": "jacmode", "median_ms": 2.0},
        ...         {"problem": "p", "B": 2, "method": "loop", "median_ms": 10.0}]
        >>> add_ratios(rows); [r["ratio"] for r in rows]
        [1.0, 5.0]
    """
    ref = {(r["problem"], r["B"]): r["median_ms"]
           for r in rows if r["method"] == "jacmode" and "median_ms" in r}
    for r in rows:
        base = ref.get((r["problem"], r["B"]))
        r["ratio"] = r["median_ms"] / base if base and "median_ms" in r else None


def _mb(n: Optional[int]) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MB"


def table(rows: list[dict], memory: str) -> str:
    """The rows as a Markdown table.

    Example:
        >>> print(table([{"problem": "dydt", "B": 100, "method": "jacmode", "median_ms": 0.5,
        ...               "ratio": 1.0, "peak_bytes": 2**20}], "peak RSS"))
        | problem | B | method | median ms | time / jacmode | peak memory |
        |---|---:|---|---:|---:|---:|
        | dydt | 100 | jacmode | 0.5 | 1.00 | 1.0 MB |
        <BLANKLINE>
        peak memory: peak RSS
    """
    lines = ["| problem | B | method | median ms | time / jacmode | peak memory |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['problem']} | {r['B']} | {r['method']} | failed: {r['error']} | | |")
            continue
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        ms = f"{r['median_ms']:.3g}" if r["median_ms"] < 1000 else f"{r['median_ms']:.0f}"
        mem = _mb(r.get("peak_bytes"))
        lines.append(f"| {r['problem']} | {r['B']} | {r['method']} | {ms} | {ratio} | {mem} |")
    return "\n".join(lines) + f"\n\npeak memory: {memory}"


def check_plotting() -> bool:
    """True if matplotlib can be imported; otherwise say how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench: --plot needs matplotlib: pip install 'jacmode[plot]' (or drop --plot).",
              file=sys.stderr)
        return False
    return True


def plot(report: dict, path: str) -> None:
    """Median time against B for each method, log-log, one panel per problem."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .baselines import PROBLEMS

    rows = [r for r in report["results"] if "median_ms" in r]
    problems = list(dict.fromkeys(r["problem"] for r in rows))
    others = dict.fromkeys(r["method"] for r in rows if r["method"] != "jacmode")
    colours = {m: f"C{i}" for i, m in enumerate(others)}
    fig, axes = plt.subplots(1, len(problems), figsize=(6.2 * len(problems), 4.6), squeeze=False)
    for ax, problem in zip(axes[0], problems):
        mine = [r for r in rows if r["problem"] == problem]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r["B"], r["median_ms"]) for r in mine if r["method"] == method)
            jm = method == "jacmode"
            style = {"lw": 2.6 if jm else 1.4, "color": "black" if jm else colours[method]}
            ax.plot(*zip(*pts), marker="o", label=method, **style)
        ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="median time per call (ms)",
               title=PROBLEMS[problem].title if problem in PROBLEMS else problem)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    m = report["machine"]
    threads = m.get("torch_threads", "?")
    fig.suptitle(f"{m['device']}, torch {m['torch']} ({threads} threads), {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
