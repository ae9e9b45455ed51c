"""``python -m bench.bench``: time jacmode against the idioms it replaces, without asv.

NOTE: [Honest timing and memory]
Each (problem, B, method) runs in a fresh process forked from this one before it has computed
anything (CPU, Linux), so no method inherits another's allocator pages or warm caches. In that
process a call on two samples first pays the one-time costs (lazy imports, vmap set-up, the
coupling probe); then the first call on the whole batch is the measured-memory call: its peak
resident memory above the set-up (Linux VmHWM after resetting it through /proc/self/clear_refs)
is reported, result included. The following calls are timed with ``time.perf_counter`` until a
time budget is spent; the median is reported. The parent only imports (it never enters an OpenMP
parallel region, which would not survive the fork). On CUDA everything runs in this process: peak
memory is ``torch.cuda.max_memory_allocated`` above the allocation before the first call, and
each timed call ends with ``torch.cuda.synchronize``. Where neither is available the peak is the
growth of ``ru_maxrss`` during the first call, a lower bound, and labelled so.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import os
import platform
import re
import resource
import sys
import time
from typing import Any, Callable, Iterable, Optional

MemoryProbe = Callable[[], Callable[[], int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer methods, smaller loops, shorter timing (< 1 min)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw time against B, log-log (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the raw figures and the machine as JSON")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch CPU threads (default: torch's own); 1 is steadier on a busy machine")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: tiny sizes


def cases(quick: bool, tiny: bool = False) -> list[tuple[str, int, str]]:
    """The (problem, B, method) triples to time, each problem in order of B.

    Example:
        >>> cases(quick=True, tiny=True)[:2]
        [('params', 2, "users' loop"), ('params', 2, 'vmap(jacrev)')]
    """
    from .baselines import METHODS, PROBLEMS, runs_at

    sizes = {"params": (2, 4), "dydt": (4, 16)} if tiny else {k: p.sizes for k, p in PROBLEMS.items()}
    limits = {"params": 2, "dydt": 100} if quick and not tiny else {}
    skip = {"jacmode forward", "jacmode reverse"} if quick else set()
    return [
        (problem, batch, method)
        for problem, methods in METHODS.items()
        for batch in sizes[problem]
        for method in methods
        if method not in skip and runs_at(problem, method, batch, limits.get(problem))
    ]


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+) kB", f.read()).group(1)) * 1024  # type: ignore[union-attr]


def _rss_peak() -> Callable[[], int]:
    """Reset the resident-memory high-water mark; return a function giving the growth since."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _vm("VmRSS")
    return lambda: _vm("VmHWM") - start


def _maxrss_growth() -> Callable[[], int]:
    scale = 1 if sys.platform == "darwin" else 1024
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return lambda: (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * scale


def _cuda_peak() -> Callable[[], int]:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    return lambda: torch.cuda.max_memory_allocated() - start


def measure(problem: str, batch: int, method: str, device: str, budget: float, memory: MemoryProbe) -> dict:
    """Time one method (see the note at the top); return its figures."""
    import torch

    from .baselines import METHODS, PROBLEMS
    from .timing import repeat_ms

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model, x = PROBLEMS[problem].make(batch, device)
    fn = METHODS[problem][method]
    fn(model, x[:2])  # one-time costs (lazy imports, caches) kept out of the figures
    sync()
    gc.collect()
    peak = memory()
    start = time.perf_counter()
    out = fn(model, x)
    sync()
    first = time.perf_counter() - start
    peak_bytes, shape = peak(), tuple(out.shape)
    del out
    ms = repeat_ms(lambda: fn(model, x), budget_s=budget, max_repeats=100, device=device)
    return {"problem": problem, "B": batch, "method": method, "median_ms": ms[len(ms) // 2],
            "times_ms": ms, "first_call_ms": first * 1e3, "peak_bytes": peak_bytes, "shape": list(shape)}


def _child(send: Any, args: tuple) -> None:
    try:
        send.send(measure(*args))
    except BaseException as err:  # reported as a row, the run goes on
        send.send({"error": f"{type(err).__name__}: {err}"})
    finally:
        send.close()


def _in_fresh_process(args: tuple) -> dict:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, args))
    proc.start()
    send.close()
    try:
        row = recv.recv()
    except EOFError:
        row = {"error": "the process measuring it died"}
    proc.join()
    if proc.exitcode:
        row.setdefault("error", f"the process measuring it exited with code {proc.exitcode}")
    return row


def _progress(items: list) -> Iterable:
    stream = sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        print("bench: tqdm is not installed (pip install 'jacmode[bench]'); plain progress lines.",
              file=stream)
        return _plain(items, stream)
    return tqdm(items, desc="bench", unit="case", file=stream)


def _plain(items: list, stream: Any) -> Iterable:
    for i, item in enumerate(items, 1):
        print(f"bench [{i}/{len(items)}] {item[0]} B={item[1]} {item[2]}", file=stream, flush=True)
        yield item


def machine(device: str, quick: bool) -> dict:
    """Where and when the figures were measured."""
    import torch

    from jacmode import __version__

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
        cpu = found.group(1).strip() if found else cpu
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"{cpu}, {os.cpu_count()} cores",
        "torch": torch.__version__, "jacmode": __version__, "python": platform.python_version(),
        "platform": platform.platform(), "torch_threads": torch.get_num_threads(), "quick": quick,
    }


def main(args: argparse.Namespace) -> int:
    """Run the cases, print the table, write the JSON and the plot if asked."""
    import torch

    from .baselines import preload
    from .bench_report import add_ratios, check_plotting, plot, table

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench: --device cuda, but torch.cuda.is_available() is False; use --device cpu.",
              file=sys.stderr)
        return 2
    if args.plot and not check_plotting():
        return 2
    fork = args.device == "cpu" and sys.platform.startswith("linux")
    memory: MemoryProbe = _cuda_peak if args.device == "cuda" else (_rss_peak if fork else _maxrss_growth)
    kind = {_cuda_peak: "cuda max_memory_allocated", _rss_peak: "peak RSS above set-up (VmHWM)",
            _maxrss_growth: "ru_maxrss growth (lower bound)"}[memory]
    budget = 0.02 if args.tiny else 0.25 if args.quick else 1.0
    threads = 1 if args.tiny else args.threads  # tests: one thread, steady on a busy machine
    if threads is not None:
        if threads < 1:
            print(f"bench: --threads expects a positive number, got {threads}.", file=sys.stderr)
            return 2
        torch.set_num_threads(threads)
    preload()
    load = [_load()]
    rows = []
    for item in _progress(cases(args.quick, args.tiny)):
        call = (*item, args.device, budget, memory)
        row = _in_fresh_process(call) if fork else _child_inline(call)
        rows.append({"problem": item[0], "B": item[1], "method": item[2], **row})
        if args.device == "cuda":
            torch.cuda.empty_cache()
    add_ratios(rows)
    m: dict[str, Any] = {**machine(args.device, args.quick), "load_average": load + [_load()]}
    report = {"machine": m, "memory": kind, "results": rows}
    print(table(rows, kind))
    n_threads = f"{m['torch_threads']} thread" + ("s" if m["torch_threads"] != 1 else "")
    print(f"\n{m['device']}; torch {m['torch']}, {n_threads}; {m['date']}; "
          f"1-minute load average {m['load_average'][0]} before, {m['load_average'][1]} after "
          "(other processes slow the timings)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    return 1 if any("error" in r for r in rows) else 0


def _load() -> Optional[float]:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _child_inline(call: tuple) -> dict:
    try:
        return measure(*call)
    except Exception as err:  # e.g. out of memory on the device: a row, and the run goes on
        return {"error": f"{type(err).__name__}: {err}"}


def cli(argv: Optional[list[str]] = None) -> int:
    """``python -m bench.bench [--quick] [--plot FILE.png] [--json FILE] ...``."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench", description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
