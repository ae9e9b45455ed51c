"""per_sample_grads of problem 1's class against the floor: allocating and filling its (B, P) result.

Benchmark tooling, not part of the package. One torch thread; the methods are timed round-robin
(a load spike on the shared machine hits all of them alike) and the medians of wall time printed,
with the ratios to ``torch.empty(B, P).fill_(1.0)`` (the target of issue 19: <= 1.5x at B = 512).

    PYTHONPATH=src:. python bench/psg_floor.py [--repeats 200] [--batch 512] [--parts]

Rows: ``after`` is ``jm.per_sample_grads(m, x, ce, y=y)`` as it is; ``before`` the same call with
the probe engine's step as it was before this bench was written (a probed forward on a copy of x,
``autograd.grad`` of the loss to the output, then a second reverse pass from the output to the
probes), swapped in for the timed call only. ``--parts`` adds the probed forward and reverse
pass alone and the write of the blocks alone.
"""
# mypy: ignore-errors

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import jacmode as jm
from bench.baselines import MLP
from jacmode._probes import layerio, layerwise, probes
from jacmode._probes import products as engine
from jacmode._rules.base import NotCovered


def before_layers(model, cov, x, losses, named, result, clone=True):
    """The probe step before issue 19's work: two reverse passes, the model on a copy of x."""
    with torch.enable_grad():
        rec = probes.record(model, x, cov)
        loss = losses(rec.output)
        g_out = torch.autograd.grad(loss.sum(), rec.output, retain_graph=True)[0]
        gs = rec.pullback(g_out.unsqueeze(0))
    if any(c.stale for c in rec.calls):
        raise NotCovered("a module input was modified in place after the call")
    layerwise.write(rec, gs, cov, named, result.unsqueeze(1))
    return True  # "modifies its input": every call clones, as before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--pin-malloc", action="store_true",
                    help="rerun with glibc's mmap and trim thresholds fixed high, so that no method pays page faults "
                         "for memory that another method's free gave back to the system")
    args = ap.parse_args()
    if args.pin_malloc and "GLIBC_TUNABLES" not in os.environ:
        env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296")
        os.execve(sys.executable, [sys.executable, "-m", "bench.psg_floor", *sys.argv[1:]], env)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    B = args.batch
    m = MLP(784, 20, 10)
    x, y = torch.rand(B, 784), torch.randint(0, 10, (B,))
    P = sum(p.numel() for p in m.parameters())
    ce = lambda out, yy: F.cross_entropy(out, yy, reduction="none")  # noqa: E731
    after_layers = engine.per_sample_grads_layers

    def after():
        return jm.per_sample_grads(m, x, ce, y=y)

    def before():
        engine.per_sample_grads_layers = before_layers
        try:
            return jm.per_sample_grads(m, x, ce, y=y)
        finally:
            engine.per_sample_grads_layers = after_layers

    def fill():
        return torch.empty(B, P).fill_(1.0)

    methods = {"before": before, "after": after, "alloc+fill": fill}
    if args.parts:
        named = list(m.named_parameters())
        cov = layerio.usable(m, x, named)
        res = torch.empty(B, P)
        with torch.enable_grad():
            rec = probes.record(m, x, cov, clone=False)
            zs = [c.probe for c in rec.calls]
            gs = [g.unsqueeze(0) for g in torch.autograd.grad(ce(rec.output, y).sum(), zs)]

        def fwd_bwd():
            with torch.no_grad(), torch.enable_grad():
                r = probes.record(m, x, cov, clone=False)
                torch.autograd.grad(ce(r.output, y).sum(), [c.probe for c in r.calls])

        def write():
            layerwise.write(rec, gs, cov, named, res.unsqueeze(1))

        def forward():
            with torch.no_grad():
                m(x)

        methods.update({"probed fwd+bwd": fwd_bwd, "write (existing result)": write, "no-grad forward": forward})
    first = after()  # the profile is found by the first call (before's would say 'modifies its input')
    assert torch.equal(before(), first)
    times: dict[str, list[float]] = {k: [] for k in methods}
    faults = dict.fromkeys(methods, 0)
    for _ in range(3):
        for fn in methods.values():
            fn()
    for _ in range(args.repeats):
        for k, fn in methods.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
            faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    floor = statistics.median(times["alloc+fill"])
    print(f"per_sample_grads, problem 1's MLP(784, 20, 10), B = {B}, P = {P}, cross-entropy, 1 thread, "
          f"{args.repeats} rounds, medians{', malloc pinned' if 'GLIBC_TUNABLES' in os.environ else ''}")
    for k, ts in times.items():
        t = statistics.median(ts)
        print(f"  {k:<26} {1e3 * t:8.3f} ms  {t / floor:5.2f}x alloc+fill  "
              f"({faults[k] / args.repeats:.0f} page faults per call)")


if __name__ == "__main__":
    main()
