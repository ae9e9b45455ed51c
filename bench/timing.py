"""Timing helpers shared by the demo and the bench command: medians over repeats within a budget."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def _sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def repeat_ms(
    fn: Callable[[], Any],
    *,
    budget_s: float = 1.0,
    min_repeats: int = 1,
    max_repeats: int = 200,
    device: torch.device | str | None = None,
) -> list[float]:
    """Wall times of ``fn()`` in milliseconds, sorted, repeating until ``budget_s`` is spent.

    Example:
        >>> len(repeat_ms(lambda: None, budget_s=0.0, min_repeats=3))
        3
    """
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)


def median_ms(
    fn: Callable[[], Any],
    *,
    budget_s: float = 1.0,
    min_repeats: int = 3,
    max_repeats: int = 200,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> float:
    """Median wall time of ``fn()`` in milliseconds, repeating until ``budget_s`` is spent.

    Example:
        >>> median_ms(lambda: sum(range(100)), budget_s=0.01) > 0
        True
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    times = repeat_ms(fn, budget_s=budget_s, min_repeats=min_repeats, max_repeats=max_repeats, device=device)
    return statistics.median(times)
