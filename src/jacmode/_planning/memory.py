"""Memory: how much there is, how much a pass of k directions needs, and chunk sizes that fit.

NOTE: [Memory model]
The result is allocated once (or given as ``out=``); what the planner controls is the workspace of
one vectorised pass, which grows with the directions (and, per-sample, the samples) it holds. From
the footprint of ``f`` (see ``_planning/footprint.py``: bytes produced per sample ``act``, largest tensor
``peak``) the workspace of a pass of k directions over s samples is estimated as

* forward:  ``jvp_live * (k + 1) * s * peak`` (tangents of the live activations; no tape)
  plus the seeds and the block of products;
* reverse:  ``vjp_tape * s * act`` (the tape, kept for all chunks) plus ``vjp_live * k * s * peak``
  (cotangents of the live activations) plus the seeds and the block of products; per-sample
  parameter Jacobians use ``sample_live`` instead of ``vjp_live`` (vmap over samples keeps more
  alive) and add ``param_copies`` copies of k * s * P gradient entries.

The multipliers are measured (peak resident memory of subprocesses, see ``bench.calibrate``);
chunk sizes are the largest whose estimate fits the budget. The budget is :func:`budget`'s, the
same for every entry point that takes ``max_memory``: the workspace on top of the result, by
default half of the memory available on the device (psutil, /proc/meminfo or sysconf on the host;
``torch.cuda.mem_get_info`` on CUDA) less the result.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from .._cache import register
from .calibrated import MEMORY

DEFAULT_FRACTION = 0.5


_RECENT: dict[torch.device, tuple[float, int]] = register({}, "free memory read")  # device -> (time, free bytes)
RECENT_S = 0.5


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device`` (RAM, or free CUDA memory), re-read at most every ``RECENT_S``."""
    now = time.monotonic()
    hit = _RECENT.get(device)  # the device itself: str(device) costs more than the look-up
    if hit is not None and now - hit[0] < RECENT_S:
        return hit[1]
    free = _read_available(device)
    _RECENT[device] = (now, free)
    return free


def _read_available(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil  # type: ignore[import-untyped]

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - exotic platforms
        return 2**62


def budget(max_memory: Optional[int], device: torch.device, result_bytes: int,
           out_given: bool = False) -> Optional[int]:
    """The workspace budget of a call, on top of its result; None when the result cannot fit.

    One meaning for every entry point: ``max_memory`` bounds the workspace, never the result;
    without it the budget is ``DEFAULT_FRACTION`` of the free memory on ``device`` less the result
    (nothing subtracted for a result written into the caller's ``out=``). None means the result
    alone is larger than the free memory: the caller raises :func:`too_large` before allocating,
    or (a repeated call's fast path) plans anew. Cheap: the free memory is read at most every
    ``RECENT_S``, and nothing is formatted.

    Args:
        max_memory: the user's ``max_memory`` in bytes (validated), or None for the default.
        device: where the result and the workspace live.
        result_bytes: the size of the result.
        out_given: the result goes into a buffer the caller allocated (``out=``).

    Example:
        >>> cpu = torch.device("cpu")
        >>> budget(1000, cpu, 10), budget(None, cpu, 0) > 0, budget(None, cpu, 2**62)
        (1000, True, None)
    """
    free = available_bytes(device)
    if not out_given and result_bytes > free:
        return None
    if max_memory is not None:
        return max_memory
    return max(0, int(DEFAULT_FRACTION * free) - (0 if out_given else result_bytes))


def too_large(result_bytes: int, device: torch.device, what: str, layout: str, fix: str) -> MemoryError:
    """The error for a result larger than the free memory (raise it before allocating).

    Args:
        result_bytes: the size of the result.
        device: where it would live.
        what: the result, named for the user ("the result", "ntk: the (B1, B2) result").
        layout: its shape and dtype, e.g. "(100, 4, 544) torch.float32".
        fix: what to pass instead.

    Example:
        >>> str(too_large(2**40, torch.device("cpu"), "the result", "(2, 3) torch.float32", "Split x."))[:44]
        'the result needs 1024.0 GiB ((2, 3) torch.fl'
    """
    return MemoryError(
        f"{what} needs {fmt_bytes(result_bytes)} ({layout}) but only {fmt_bytes(available_bytes(device))} is "
        f"free on {device}: it cannot fit, so nothing was computed. {fix}"
    )


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def workspace(
    mode: str,
    *,
    k: int,
    samples: int,
    act: float,
    peak: float,
    seed_bytes: float,
    block_bytes: float,
    param_bytes: float = 0.0,
    per_sample: bool = False,
) -> float:
    """Estimated workspace in bytes of one pass of ``k`` directions over ``samples`` samples.

    Args:
        mode: "forward" or "reverse".
        k: directions in the pass.
        samples: samples in the pass (B, or the per-sample chunk).
        act: bytes produced by the forward pass per sample; peak: its largest tensor per sample.
        seed_bytes: bytes of one direction's seed; block_bytes: of one direction's products.
        param_bytes: per-sample parameter Jacobians: bytes of one gradient of all parameters
            that the engine copies (0 when blocks are written straight into the result).
        per_sample: a per-sample parameter Jacobian (activations counted with ``sample_live``).

    Example:
        >>> workspace("forward", k=0, samples=1, act=0, peak=0, seed_bytes=0, block_bytes=0)
        0.0
    """
    io = k * (seed_bytes + block_bytes)
    if mode == "forward":
        return float(MEMORY["jvp_live"] * (k + 1) * samples * peak + io) if k else 0.0
    if per_sample:  # per-sample parameter Jacobians: vmap over samples of vmap over directions
        live = MEMORY["sample_live"] * k * samples * peak + MEMORY["param_copies"] * k * samples * param_bytes
    else:
        live = MEMORY["vjp_live"] * k * samples * peak
    return float(MEMORY["vjp_tape"] * samples * act + live + io)


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest k in 1..upper with fits(k) (fits is monotone); 0 if not even 1 fits."""
    if upper < 1 or not fits(1):
        return 0
    if fits(upper):
        return upper
    lo, hi = 1, upper  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
