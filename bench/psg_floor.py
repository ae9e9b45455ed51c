"""per_sample_grads of problem 1's class against the floor: allocating and filling its (B, P) result.

Benchmark tooling, not part of the package. One torch thread; the methods are timed round-robin
(a load spike on the shared machine hits all of them alike) and the medians printed, with the
ratios to ``torch.empty(B, P).fill_(1.0)`` (the target: <= 1.5x at B = 512) and the
page faults each call paid.

    PYTHONPATH=src:. python -m bench.psg_floor [--repeats 200] [--batch 512] [--parts] [--jacobians]
        [--traced] [--clock wall|cpu] [--unpinned]

Rows: ``after`` is ``jm.per_sample_grads(m, x, ce, y=y)`` as it is; ``before`` the same call with
the probe engine's steps in their earlier form (a probed forward on a copy
of x, ``autograd.grad`` of the loss to the output, then a second reverse pass from the output to
the probes; the blocks written in forward order, each Linear's weight before its bias), swapped
in for the timed call only (the probed forward itself is today's). ``--parts`` adds the probed
forward and reverse pass alone, the write of the blocks alone (``layerwise.write_rows``, as the
call runs it, and the K = 1 ``layerwise.write`` it replaced), a no-grad forward, and the first
layer's product as ``F.linear`` runs it against the same product taken transposed
(``addmm(b[:, None], W, x^T)^T``, made contiguous), which nn.Linear does not run. ``--traced``
adds the same probe step traced by ``make_fx`` into an fx graph of its aten calls, run without the
interpreted engine's module calls, hooks and autograd engine (not a jacmode path: a measure of
what they cost). ``--jacobians`` adds section 11's parameter Jacobians
(the CNN class at B = 64, problem 1's class at B = 512) before and after, whose blocks go through
the same write: run it apart from the psg rows, its (B, Y, P) results change the allocator's state.

By default the script reruns itself with glibc's mmap and trim thresholds fixed high: otherwise
which method pays page faults for 32 MB of fresh memory (about as much as the fill itself)
depends on the order of the frees, and changes from run to run (``--unpinned`` shows it). In
``bench/targets.py``'s two-method rotation neither pays them.
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
from bench.baselines import CNN, MLP
from jacmode._probes import layerio, layerwise, probes
from jacmode._probes import products as engine
from jacmode._rules.base import NotCovered
from jacmode._rules.linear import LinearRule

NEW_WRITE, NEW_LINEAR_WRITE = layerwise.write, LinearRule.write


# The "before" baselines below are frozen copies of the old code (layerwise.write, LinearRule.write and
# the two-pass probe step in their earlier form), kept on purpose for the before/after rows:
# they repeat lines of the current engine and must not be replaced by calls to it.


def before_write(rec, Gs, cov, named, result):
    """``layerwise.write`` in its earlier form: the calls in forward order."""
    batch, k = result.shape[0], result.shape[1]
    cols, shapes = layerwise.columns(named), {n: p.shape for n, p in named}
    seen = set()
    with torch.no_grad():
        for call, G in zip(rec.calls, Gs):
            targets = {}
            for attr, name in cov.modules[call.module].items():
                lo, n = cols[name]
                targets[attr] = result.narrow(-1, lo, n).view(batch, k, *shapes[name])
            call.rule.write(call.module, call.inputs, G, targets, accumulate=id(call.module) in seen)
            seen.add(id(call.module))
        for name, (module, _) in cov.covered.items():
            if id(module) not in seen:
                lo, n = cols[name]
                result.narrow(-1, lo, n).zero_()


def before_linear_write(self, module, inputs, G, targets, accumulate):
    """``LinearRule.write`` in its earlier form: the weight, then the bias."""
    a, g = self._factors(inputs, G)
    w = targets.get("weight")
    if w is not None and not accumulate and a.shape[1] == 1:
        torch.mul(g[:, :, 0].transpose(0, 1).unsqueeze(-1), a[:, None, 0, None, :], out=w)
    elif w is not None:
        block = g.permute(1, 0, 3, 2) @ a.unsqueeze(1)
        w.add_(block) if accumulate else w.copy_(block)
    b = targets.get("bias")
    if b is not None:
        block = g[:, :, 0] if g.shape[2] == 1 else g.sum(2)
        b.add_(block.transpose(0, 1)) if accumulate else b.copy_(block.transpose(0, 1))


def as_before(fn):
    """``fn`` run with the probe engine's steps as they were (the write order, the psg pass)."""
    def run():
        engine.per_sample_grads_layers, layerwise.write, LinearRule.write = (
            before_layers, before_write, before_linear_write)
        try:
            return fn()
        finally:
            engine.per_sample_grads_layers, layerwise.write, LinearRule.write = (
                AFTER_LAYERS, NEW_WRITE, NEW_LINEAR_WRITE)
    return run


def before_layers(model, cov, x, losses, named, result, clone=True):
    """The probe step in its earlier form: two reverse passes, the model on a copy of x."""
    with torch.enable_grad():
        rec = probes.record(model, x, cov)
        loss = losses(rec.output)
        g_out = torch.autograd.grad(loss.sum(), rec.output, retain_graph=True)[0]
        gs = rec.pullback(g_out.unsqueeze(0))
    if any(c.stale for c in rec.calls):
        raise NotCovered("a module input was modified in place after the call")
    before_write(rec, gs, cov, named, result.unsqueeze(1))
    return True  # "modifies its input": every call clones, as before


AFTER_LAYERS = engine.per_sample_grads_layers


def traced_step(m, x, y, ce, B, P):
    """The probe step of ``after`` (a fresh (B, P) result, the probed forward, the reverse pass to
    the probes, the writes) traced by ``make_fx`` with the parameters as inputs, the probes dropped
    as ``_probes/generated.py`` drops them; checked bit for bit against the call."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.utils.stateless import _reparametrize_module

    from jacmode._probes.generated import _drop_probes

    named = list(m.named_parameters())
    names = [n for n, _ in named]
    cov = layerio.usable(m, x, named)

    def step(xx, yy, *ts):
        swap = dict(zip(names, ts))
        held = probes.Coverage(cov.covered, cov.uncovered, cov.rules, swap)
        res = torch.empty(B, P)
        with _reparametrize_module(m, swap), torch.enable_grad():
            AFTER_LAYERS(m, held, xx, lambda o: ce(o, yy), [(n, swap[n]) for n in names], res, clone=False)
        return res

    ts = [p.detach() for p in m.parameters()]
    gm = make_fx(step, tracing_mode="fake")(x, y, *ts)
    _drop_probes(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()

    def run():
        with torch.no_grad():
            return gm(x, y, *ts)

    assert torch.equal(run(), jm.per_sample_grads(m, x, ce, y=y))
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--jacobians", action="store_true",
                    help="also the parameter Jacobians of section 11 (CNN class B=64, problem 1's class B=512), "
                         "whose blocks go through the same write")
    ap.add_argument("--unpinned", action="store_true",
                    help="keep glibc's malloc thresholds: a method may then pay page faults for memory that another "
                         "method's free gave back to the system, as the counts show (by default the script reruns "
                         "itself with the mmap and trim thresholds fixed high, so that no method does)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time.process_time, which leaves out the time the process waited for a core "
                         "(a machine shared by several people)")
    ap.add_argument("--traced", action="store_true",
                    help="also the same probe step traced once by make_fx and run as an fx graph of aten calls "
                         "(no module calls, hooks, autograd engine or Python between the kernels): not a jacmode path, "
                         "the measure of what the interpreted engine's own cost is")
    args = ap.parse_args()
    if not args.unpinned and "GLIBC_TUNABLES" not in os.environ:
        env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296")
        os.execve(sys.executable, [sys.executable, "-m", "bench.psg_floor", *sys.argv[1:]], env)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    B = args.batch
    m = MLP(784, 20, 10)
    x, y = torch.rand(B, 784), torch.randint(0, 10, (B,))
    P = sum(p.numel() for p in m.parameters())
    ce = lambda out, yy: F.cross_entropy(out, yy, reduction="none")  # noqa: E731

    def after():
        return jm.per_sample_grads(m, x, ce, y=y)

    before = as_before(after)

    def fill():
        return torch.empty(B, P).fill_(1.0)

    methods = {"before": before, "after": after, "alloc+fill": fill}
    floors = dict.fromkeys(methods, "alloc+fill")
    if args.jacobians:
        cnn, xc = CNN(), torch.rand(64, 1, 28, 28)
        pc = sum(p.numel() for p in cnn.parameters())
        jac_cnn = lambda: jm.jacobian(cnn, xc, wrt="params")  # noqa: E731
        jac_mlp = lambda: jm.jacobian(m, x, wrt="params")  # noqa: E731
        methods.update({
            "CNN B=64 jacobian before": as_before(jac_cnn), "CNN B=64 jacobian after": jac_cnn,
            "CNN alloc+fill (B,Y,P)": lambda: torch.empty(64, 10, pc).fill_(1.0),
            "MLP B=512 jacobian before": as_before(jac_mlp), "MLP B=512 jacobian after": jac_mlp,
            "MLP alloc+fill (B,Y,P)": lambda: torch.empty(B, 10, P).fill_(1.0),
        })
        floors.update({k: "CNN alloc+fill (B,Y,P)" for k in methods if k.startswith("CNN")})
        floors.update({k: "MLP alloc+fill (B,Y,P)" for k in methods if k.startswith("MLP")})
        assert torch.equal(as_before(jac_cnn)(), jac_cnn()) and torch.equal(as_before(jac_mlp)(), jac_mlp())
    if args.parts:
        named = list(m.named_parameters())
        cov = layerio.usable(m, x, named)
        res = torch.empty(B, P)
        with torch.enable_grad():
            rec = probes.record(m, x, cov, clone=False)
            zs = [c.probe for c in rec.calls]
            gs = [g.unsqueeze(0) for g in torch.autograd.grad(ce(rec.output, y).sum(), zs)]

        def fwd_bwd():  # as the call runs it: the layers' outputs stand for the probes
            with torch.no_grad(), torch.enable_grad():
                r = probes.record(m, x, cov, clone=False, outputs=True)
                torch.autograd.grad(ce(r.output, y).sum(), [c.probe for c in r.calls])

        rows = [g[0] for g in gs]

        def write():
            layerwise.write_rows(rec, rows, cov, named, res)

        def write_k():
            layerwise.write(rec, gs, cov, named, res.unsqueeze(1))

        def forward():
            with torch.no_grad():
                m(x)

        w1, b1 = m.fc1.weight.detach(), m.fc1.bias.detach()

        def fc1():
            with torch.no_grad():
                F.linear(x, w1, b1)

        def fc1_t():  # the same product as (W x^T)^T, made contiguous: not what nn.Linear runs
            with torch.no_grad():
                torch.addmm(b1.unsqueeze(1), w1, x.t()).t().contiguous()

        parts = {"probed fwd+bwd": fwd_bwd, "write (existing result)": write, "write, K=1 (write)": write_k,
                 "no-grad forward": forward, "fc1 F.linear": fc1, "fc1 addmm(b,W,x^T)^T": fc1_t}
        methods.update(parts)
        floors.update(dict.fromkeys(parts, "alloc+fill"))
    if args.traced:
        methods["traced step"] = traced_step(m, x, y, ce, B, P)
        floors["traced step"] = "alloc+fill"
    first = after()  # the profile is found by the first call (before's would say 'modifies its input')
    assert torch.equal(before(), first)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times: dict[str, list[float]] = {k: [] for k in methods}
    faults = dict.fromkeys(methods, 0)
    for _ in range(3):
        for fn in methods.values():
            fn()
    for _ in range(args.repeats):
        for k, fn in methods.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = clock()
            fn()
            times[k].append(clock() - t0)
            faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    print(f"per_sample_grads, problem 1's MLP(784, 20, 10), B = {B}, P = {P}, cross-entropy, 1 thread, "
          f"{args.repeats} rounds, medians of {args.clock} time{', malloc pinned' if 'GLIBC_TUNABLES' in os.environ else ''}")
    for k, ts in times.items():
        t, floor = statistics.median(ts), statistics.median(times[floors[k]])
        print(f"  {k:<26} {1e3 * t:8.3f} ms  {t / floor:5.2f}x {floors[k]:<22} "
              f"({faults[k] / args.repeats:.0f} page faults per call)")


if __name__ == "__main__":
    main()
