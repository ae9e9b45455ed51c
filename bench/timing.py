"""Timing helpers shared by the demo, the bench command and the bench scripts: medians over repeats."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable

import torch


def _sync(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


_DEVICE = torch.device("cpu")


def use_device(device: str) -> None:
    """Where :func:`placed` puts the calibrators' cases (their ``--device``). Not a default-device
    context: that is a torch function mode, under which jacmode never runs generated code."""
    global _DEVICE
    _DEVICE = torch.device(device)


def placed(built: tuple[Any, Any]) -> tuple[Any, Any]:
    """A case's (model, input), moved to the device :func:`use_device` chose.

    Example:
        >>> placed((torch.nn.Linear(2, 1), torch.zeros(3, 2)))[1].device.type
        'cpu'
    """
    model, x = built
    if _DEVICE.type == "cpu":
        return model, x
    return model.to(_DEVICE), x.to(_DEVICE)


def synced(fn: Callable[[], Any], x: Any) -> Callable[[], Any]:
    """``fn`` that waits for the device of ``x`` (a tensor) to finish, so a wall-clock timing counts its kernels.

    Example:
        >>> synced(lambda: 3, torch.zeros(1))()
        3
    """
    device = getattr(x, "device", None)
    if device is None or device.type != "cuda":
        return fn

    def call() -> Any:
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call


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


def shuffled_us(
    cases: dict[str, Callable[[], Any]], rounds: int, block: int = 10
) -> tuple[dict[str, float], dict[str, float]]:
    """Median and fastest call per case in microseconds, ``rounds`` calls of each timed.

    Each round runs every case ``block`` times in a row (warm, as a loop calls it), the cases in a
    new random order each round, so that load and cache effects fall alike; the fastest call is
    robust to a loaded machine.

    Example:
        >>> med, mins = shuffled_us({"none": lambda: None}, rounds=4, block=2)
        >>> mins["none"] <= med["none"]
        True
    """
    for fn in cases.values():
        for _ in range(5):
            fn()
    times: dict[str, list[int]] = {k: [] for k in cases}
    order = list(cases)
    rng = random.Random(0)
    for _ in range(max(1, rounds // block)):
        rng.shuffle(order)
        for k in order:
            fn = cases[k]
            fn()
            for _ in range(block):
                t0 = time.perf_counter_ns()
                fn()
                times[k].append(time.perf_counter_ns() - t0)
    return ({k: statistics.median(v) / 1e3 for k, v in times.items()},
            {k: min(v) / 1e3 for k, v in times.items()})
