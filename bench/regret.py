"""The regret of ``mode="auto"`` on drawn problems: ``python -m bench.regret``.

Cases are drawn (numpy RNG, seeded), not picked: a model class (MLP written as a module class or
as ``nn.Sequential``, 1 to 4 hidden layers of drawn widths, an activation, LayerNorm or BatchNorm
in eval mode, a residual connection, a convolutional front), a batch B, input features D, outputs
Y, what is differentiated (the inputs, all parameters, or a subset: the first, a middle or the last
layer, its weight or bias) and the entry point (a batched or unbatched ``jm.jacobian``). Each case
times ``mode="auto"``, ``"forward"`` and ``"reverse"`` side by side (rounds of blocks of repeated
calls, medians, 1 thread: see ``time_modes``) and reports the regret -- auto's time over the faster explicit mode -- and the
prediction error of the engine auto chose (predicted seconds over measured). A mode the cost model
predicts ``HOPELESS`` (100) times slower than the other is not timed: one call of it can take
minutes, and it cannot be the faster mode unless the model is wrong a hundredfold.

Commands:
    python -m bench.regret [--cases 64] [--seed 0] [--json FILE] [--device cuda]

Example:
    >>> case = draw(3, seed=0)[0]
    >>> model, x = case.build()
    >>> tuple(model(x).shape)[0] == (case.b if case.batched else model(x).shape[0])
    True
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .timing import placed, synced, use_device

ACTS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "sigmoid": nn.Sigmoid}


class Drawn(nn.Module):
    """An MLP written as a module class: optional conv front, norms, a residual hidden layer."""

    def __init__(self, d: int, widths: Sequence[int], y: int, act: str, norm: str, residual: bool,
                 conv: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, conv, 3, padding=1) if conv else None
        d_in = conv * d if conv else d  # conv: x is (B, 1, 1, d) -> (B, conv, 1, d)
        sizes = [d_in, *widths]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.norm = {"layer": nn.LayerNorm(widths[0]), "batch": nn.BatchNorm1d(widths[0]), "none": None}[norm]
        self.act = ACTS[act]()
        self.residual = residual and len(widths) > 1 and widths[-1] == widths[-2]
        self.head = nn.Linear(widths[-1], y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv is not None:
            x = self.act(self.conv(x)).flatten(1)
        h = x
        for i, layer in enumerate(self.layers):
            z = layer(h)
            if i == 0 and self.norm is not None:
                z = self.norm(z)
            z = self.act(z)
            h = h + z if self.residual and i == len(self.layers) - 1 else z
        return self.head(h)


@dataclass(frozen=True)
class Case:
    """One drawn problem."""

    d: int
    widths: tuple[int, ...]
    y: int
    b: int
    act: str
    norm: str
    residual: bool
    conv: int
    sequential: bool
    wrt: Any  # "inputs", "params" or a list of names
    batched: bool
    seed: int

    def build(self) -> tuple[nn.Module, torch.Tensor]:
        """The model (eval mode) and the input: (B, D), (B, 1, 1, D) with a conv front, (D,) unbatched."""
        torch.manual_seed(self.seed)
        model = Drawn(self.d, self.widths, self.y, self.act, self.norm, self.residual, self.conv)
        if self.sequential and not self.conv and not self.residual and self.norm == "none":
            mods: list[nn.Module] = []
            for layer in model.layers:
                mods += [layer, ACTS[self.act]()]
            model = nn.Sequential(*mods, model.head)  # type: ignore[assignment]
        model.eval()
        shape = (1, 1, self.d) if self.conv else (self.d,)
        x = torch.randn(self.b, *shape) if self.batched else torch.randn(*shape)
        if not self.batched and self.conv:
            x = torch.randn(1, 1, 1, self.d)  # one sample, kept 4-d for the conv
        return model, x

    def kwargs(self) -> dict[str, Any]:
        return {"wrt": self.wrt, "batched": self.batched}

    @property
    def label(self) -> str:
        kind = "seq" if self.sequential and not self.conv and not self.residual and self.norm == "none" else "cls"
        front = f" conv{self.conv}" if self.conv else ""
        extras = (f" {self.norm}norm" if self.norm != "none" else "") + (" res" if self.residual else "")
        wrt = self.wrt if isinstance(self.wrt, str) else "+".join(self.wrt)
        return (f"{kind}{front} d={self.d} h={'x'.join(map(str, self.widths))} y={self.y} {self.act}{extras} "
                f"B={self.b}{'' if self.batched else ' unbatched'} wrt={wrt}")


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


def draw(n: int, seed: int = 0, max_entries: int = 4 * 10**7) -> list[Case]:
    """``n`` cases drawn with numpy's RNG from ``seed`` (see the module docstring), each with a
    result of at most ``max_entries`` (B * Y * N) entries."""
    rng = np.random.default_rng(seed)
    cases: list[Case] = []
    while len(cases) < n:
        depth = int(rng.integers(1, 5))
        widths = tuple(int(rng.choice([4, 8, 16, 32, 64, 128])) for _ in range(depth))
        if rng.random() < 0.3 and depth > 1:
            widths = (*widths[:-1], widths[-2])  # residual-ready
        d = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]))
        y = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]))
        b = int(rng.choice([1, 4, 16, 64, 256, 1024]))
        conv = int(rng.choice([0, 0, 0, 2, 4])) if d >= 4 else 0
        norm = str(rng.choice(["none", "none", "layer", "batch"]))
        residual = bool(rng.random() < 0.3)
        sequential = bool(rng.random() < 0.4)
        batched = bool(rng.random() < 0.85) or norm == "batch"  # BatchNorm1d refuses one 1-d sample
        wrt_kind = str(rng.choice(["inputs", "inputs", "params", "first", "middle", "last"]))
        case = Case(d, widths, y, b if batched else 1, str(rng.choice(list(ACTS))), norm, residual, conv,
                    sequential, "inputs", batched, int(rng.integers(1 << 30)))
        wrt: Any = wrt_kind
        if wrt_kind not in ("inputs", "params"):
            names = _names(case.build()[0])
            linear = [n for n in names if n.endswith((".weight", ".bias")) and "norm" not in n]
            layers = sorted({n.rsplit(".", 1)[0] for n in linear}, key=lambda s: [n.rsplit(".", 1)[0] for n in linear].index(s))
            layer = {"first": layers[0], "middle": layers[len(layers) // 2], "last": layers[-1]}[wrt_kind]
            which = str(rng.choice(["weight", "bias", "both"]))
            wrt = [f"{layer}.weight", f"{layer}.bias"] if which == "both" else [f"{layer}.{which}"]
        case = Case(**{**case.__dict__, "wrt": wrt})
        work = case.b * max(case.y, 1) * _n_in(case)  # result entries: keep each case under ~0.5 s
        if work > max_entries:
            continue
        cases.append(case)
    return cases


def _n_in(case: Case) -> int:
    model, x = placed(case.build())
    if case.wrt == "inputs":
        return x[0].numel() if case.batched else x.numel()
    names = _names(model) if case.wrt == "params" else case.wrt
    return sum(p.numel() for n, p in model.named_parameters() if n in names)


def time_modes(case: Case, modes: Sequence[str] = ("auto", "forward", "reverse"), reps: int = 9,
               budget_s: float = 3.0) -> dict[str, float]:
    """Median seconds per call of ``jm.jacobian`` in each mode: rounds of blocks of repeated calls.

    Each round runs every mode (in a new order each round, drawn with a fixed seed: a fixed or
    alternating order favours whichever mode follows itself at the rounds' ends, by 1-2% on
    sub-millisecond calls) as a block of consecutive calls of about 20 ms
    (1 to 100 calls: a block of ten 0.2 ms calls would still carry the cold first call after another
    mode's block) and keeps the block's mean: the steady state of a loop that repeats one call, as
    a training loop does. Single interleaved calls would time each small call right after
    another mode's large one, whose freed memory and evicted caches it then pays for.
    """
    import jacmode as jm

    model, x = placed(case.build())
    calls = {m: synced(functools.partial(jm.jacobian, model, x, mode=m, **case.kwargs()), x) for m in modes}
    slow: dict[str, float] = {}  # a mode whose one call takes over 1 s: timed once, not in the rounds
    block: dict[str, int] = {}
    for m, call in calls.items():  # first calls: captures, caches, generated code (third call, steady by the sixth)
        t0 = time.perf_counter()
        for _ in range(6):
            t1 = time.perf_counter()
            call()
            one = time.perf_counter() - t1
            if one > 1.0:  # once more: a first call's one-time work is no verdict
                t2 = time.perf_counter()
                call()
                if time.perf_counter() - t2 > 1.0:
                    slow[m] = time.perf_counter() - t2
                    break
            if time.perf_counter() - t0 > 2.0:
                break
        block[m] = max(1, min(100, int(0.02 / max(one, 1e-6))))
    modes = [m for m in modes if m not in slow]
    times: dict[str, list[float]] = {m: [] for m in modes}
    start = time.perf_counter()
    order = random.Random(0)
    for r in range(reps):
        for m in order.sample(modes, len(modes)):
            t0 = time.perf_counter()
            for _ in range(block[m]):
                calls[m]()
            times[m].append((time.perf_counter() - t0) / block[m])
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {**{m: statistics.median(v) for m, v in times.items()}, **slow}


def results_agree(case: Case) -> Optional[str]:
    """None when auto's result equals both explicit modes' (float64), else what differs."""
    import jacmode as jm

    model, x = placed(case.build())
    model, x = model.double(), x.double()
    got: dict[str, torch.Tensor] = {m: jm.jacobian(model, x, mode=m, **case.kwargs())  # type: ignore[misc]
                                    for m in ("auto", "forward", "reverse")}  # one tensor: one argument
    for m in ("forward", "reverse"):
        if not torch.allclose(got["auto"], got[m], rtol=1e-9, atol=1e-11):
            return f"{case.label}: auto differs from {m} by {float((got['auto'] - got[m]).abs().max()):.3g}"
    return None


HOPELESS = 100.0  # predictions are within a few times of the truth; 100x slower cannot be the best mode


def measure(cases: Sequence[Case], log: Any = print, recheck: float = 1.1) -> list[dict[str, Any]]:
    """Regret and prediction error per case; doubtful points are timed again, longer."""
    import jacmode as jm

    out = []
    for i, case in enumerate(cases):
        model, x = placed(case.build())
        plan = jm.plan(model, x, **case.kwargs())
        best = min(plan.costs.values())
        # a mode predicted HOPELESS times slower than the other is not timed (one call can take minutes)
        modes = ("auto", *(m for m in ("forward", "reverse") if plan.costs.get(m, math.inf) <= HOPELESS * best))
        t = time_modes(case, modes)
        regret = t["auto"] / min(t[m] for m in modes[1:])
        if regret > recheck:  # a loaded machine: look again before believing it
            t = time_modes(case, modes, reps=21, budget_s=8.0)
            regret = t["auto"] / min(t[m] for m in modes[1:])
        predicted = plan.costs.get(plan.mode, math.nan)
        engine = getattr(plan, "engine", plan.mode)
        engines = {c.mode: c.engine for c in plan.candidates if c.feasible}
        out.append({"case": case.label, "seconds": t, "regret": regret, "mode": plan.mode, "engine": engine,
                    "engines": engines, "predicted": predicted, "predicted_modes": dict(plan.costs),
                    "error": predicted / t["auto"]})
        shown = ", ".join(f"{m} {t[m] * 1e3:.3g}" if m in t else f"{m} not timed (predicted "
                          f"{plan.costs[m] / best:.0f}x)" for m in ("forward", "reverse"))
        log(f"[{i + 1}/{len(cases)}] {case.label}: auto={engine} {t['auto'] * 1e3:.3g} ms (predicted "
            f"{predicted * 1e3:.3g}), {shown} -> regret {regret:.3f}")
    return out


def summary(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Median, 95th percentile and worst regret; the share of predictions within 2x."""
    rs = sorted(r["regret"] for r in records)
    errs = [r["error"] for r in records]
    return {
        "cases": len(rs),
        "median": statistics.median(rs),
        "p95": rs[math.ceil(0.95 * len(rs)) - 1],
        "worst": rs[-1],
        "within_1.25": sum(r <= 1.25 for r in rs) / len(rs),
        "predicted_within_2x": sum(0.5 <= e <= 2.0 for e in errs) / len(errs),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.regret", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="save the records and the summary")
    parser.add_argument("--device", default="cpu", help="build and time the cases on this device (e.g. cuda)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    use_device(args.device)
    records = measure(draw(args.cases, args.seed))
    s = summary(records)
    print(json.dumps(s, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": s, "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
