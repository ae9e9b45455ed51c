"""``python -m bench.gpu``: the GPU checks and timings in one run, one table at the end.

Made for a short lease on a GPU machine: every section is guarded (a failure is a row, the run
goes on), the table is printed last, and the raw figures go to ``--json``. Sections:

* ``repeat``: whether repeated calls keep what the first found (and if not, why), with their times.
* ``check``: each entry point on the device against a float64 CPU reference (float32 and float64).
* ``sync``: host-device synchronisations per repeated call (``torch.cuda.set_sync_debug_mode``),
  with the jacmode line that caused each.
* ``targets``: problem 1's class at B = 2 (eager, transform, ``compile=True``, and
  ``torch.compile(mode="reduce-overhead")`` around the call) and B = 8192 against writing its
  result; problem 2's class at B = 1,000,000 against one forward pass; the Laplacian of
  jet-for-pytorch's benchmark MLP against nested first-order autograd (time and peak memory);
  peak memory of a call that must chunk against ``max_memory`` plus its result.

Run from the repository root: ``PYTHONPATH=src python -m bench.gpu --json gpu.json``;
``--tiny --device cpu`` checks the script itself on small sizes.
"""
# mypy: ignore-errors

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.func import vmap

import jacmode as jm
from bench.baselines import MLP, CNN, NetX, PinnNet, params_hand_rule, params_vmap_jacrev

ROWS: list[dict[str, Any]] = []


def row(section: str, what: str, value: str, target: str = "", **raw: Any) -> None:
    ROWS.append(dict(section=section, what=what, value=value, target=target, **raw))
    print(f"[{section}] {what}: {value} {target}", flush=True)


def guarded(section: str, what: str):
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as err:  # a row, and the run goes on
                row(section, what, f"FAILED {type(err).__name__}: {str(err)[:300]}")
                traceback.print_exc()
        return run
    return deco


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], device: str, budget: float = 1.0, reps: int = 200) -> float:
    """Median wall time of ``fn`` in ms, each call ended by a synchronisation (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (time.perf_counter() - start < budget or len(times) < 5):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mb(fn: Callable[[], Any], device: str) -> float:
    """Peak device memory of one call above what was allocated before it, in MB (CUDA only)."""
    if device != "cuda":
        return float("nan")
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _leaves(t: Any) -> list[torch.Tensor]:
    return torch.utils._pytree.tree_flatten(t)[0]


def _flat(t: Any) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in _leaves(t)])


# ---- check: every entry point on the device against float64 on the CPU ---------------------------

def checks(device: str, tiny: bool) -> None:
    torch.manual_seed(0)
    tol = {torch.float32: 1e-4, torch.float64: 1e-10}
    cases: dict[str, Callable[[nn.Module, torch.Tensor], Any]] = {
        "jacobian inputs": lambda m, x: jm.jacobian(m, x),
        "jacobian params": lambda m, x: jm.jacobian(m, x, wrt="params"),
        "jacobian params reverse": lambda m, x: jm.jacobian(m, x, wrt="params", mode="reverse"),
        "jacobian inputs forward": lambda m, x: jm.jacobian(m, x, mode="forward"),
        "hessian": lambda m, x: jm.hessian(lambda v: m(v)[:, :1], x),
        "laplacian": lambda m, x: jm.laplacian(lambda v: m(v)[:, :1], x),
        "partials": lambda m, x: jm.partials(m, x, [(0,), (0, 0), (0, 1)]),
        "divergence": lambda m, x: jm.divergence(lambda v: m(v)[:, :3], x),
        "per_sample_grads": lambda m, x: jm.per_sample_grads(m, x, lambda o: (o ** 2).sum(1)),
        "ntk": lambda m, x: jm.ntk(m, x),
        "ggn diagonal": lambda m, x: jm.ggn(m, x, "mse", diagonal=True),
        "sparse jacobian": lambda m, x: jm.sparse_jacobian(lambda v: torch.tanh(v) * v.roll(1, -1), x[0]).to_dense(),
        "jvp": lambda m, x: jm.jvp(m, x, torch.ones_like(x))[1],
        "vjp": lambda m, x: jm.vjp(m, x)[1](torch.ones(x.shape[0], 3, dtype=x.dtype, device=x.device))[0],
        "transform laplacian": lambda m, x: jm.transform(jm.laplacian, lambda v: m(v)[:, :1])(x),
    }
    for dtype in (torch.float32, torch.float64):
        ref_model = PinnNet(3, 16, 2, 3).double()
        x64 = torch.randn(5, 3, dtype=torch.float64)
        model = PinnNet(3, 16, 2, 3).to(device, dtype)
        model.load_state_dict(ref_model.state_dict())
        x = x64.to(device, dtype)
        for name, op in cases.items():
            def one(name: str = name, op: Callable = op) -> None:
                for _ in range(3):  # first, second (guard made) and third (generated code) call
                    got = op(model, x)
                want = op(ref_model, x64)
                err = rel(_flat(got), _flat(want))
                ok = err < tol[dtype] and all(v.device.type == device for v in _leaves(got))
                row("check", f"{name} {str(dtype)[6:]}", f"{'ok' if ok else 'WRONG'} rel {err:.1e}", err=err, ok=ok)
            guarded("check", f"{name} {dtype}")(one)()

    @guarded("check", "probes on a CNN")
    def cnn() -> None:
        m64 = CNN().double()
        x64 = torch.randn(4, 1, 28, 28, dtype=torch.float64)
        m = CNN().to(device)
        m.load_state_dict(m64.state_dict())
        m = m.double()
        for _ in range(3):
            got = jm.jacobian(m, x64.to(device), wrt="params")
        err = rel(got, jm.jacobian(m64, x64, wrt="params"))
        row("check", "probes CNN float64", f"{'ok' if err < 1e-10 else 'WRONG'} rel {err:.1e}", err=err)
    cnn()

    @guarded("check", "compile=True laplacian")
    def comp() -> None:
        m64 = PinnNet(2, 32, 2, 1).double()
        m = PinnNet(2, 32, 2, 1).to(device)
        m.load_state_dict(m64.state_dict())
        x64 = torch.randn(64, 2, dtype=torch.float64)
        lap = jm.transform(jm.laplacian, m, compile=True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                got = lap(x64.float().to(device))
        err = rel(got, jm.laplacian(m64, x64))
        fell = [str(v.message)[:120] for v in w if "jacmode" in str(v.message)]
        row("check", "compile=True laplacian float32", f"{'ok' if err < 1e-4 else 'WRONG'} rel {err:.1e}"
            + (f" (warned: {fell[0]})" if fell else ""), err=err)
    comp()


# ---- sync: host-device synchronisations per repeated call ------------------------------------------

def syncs(device: str, tiny: bool) -> None:
    if device != "cuda":
        row("sync", "skipped", "needs CUDA")
        return
    B = 64 if tiny else 4096
    netx = NetX().to(device)
    t = torch.rand(B, 1, device=device)
    mlp = MLP(784, 20, 10).to(device)
    xm = torch.rand(64, 784, device=device)
    pinn = PinnNet(2, 64, 2, 1).to(device)
    xp = torch.rand(B, 2, device=device)
    cases = {
        "derivative net_x": lambda: jm.derivative(netx, t),
        "jacobian net_x": lambda: jm.jacobian(netx, t),
        "jacobian params MLP": lambda: jm.jacobian(mlp, xm, wrt="params"),
        "jacobian params MLP reverse": lambda: jm.jacobian(mlp, xm, wrt="params", mode="reverse"),
        "laplacian PinnNet": lambda: jm.laplacian(pinn, xp),
        "partials PinnNet": lambda: jm.partials(pinn, xp, [(0,), (1, 1)]),
        "per_sample_grads MLP": lambda: jm.per_sample_grads(mlp, xm, lambda o: o.sum(1)),
        "ntk MLP": lambda: jm.ntk(mlp, xm),
        "ggn diag MLP": lambda: jm.ggn(mlp, xm, "cross_entropy", diagonal=True),
    }
    for name, fn in cases.items():
        @guarded("sync", name)
        def one(name: str = name, fn: Callable = fn) -> None:
            for _ in range(4):
                fn()
            sync(device)
            sites: dict[str, int] = {}

            def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
                stack = [f for f in traceback.extract_stack()[:-1] if "jacmode" in f.filename]
                where = f"{stack[-1].filename.split('jacmode/')[-1]}:{stack[-1].lineno} {stack[-1].name}" if stack else "outside jacmode"
                key = f"{where} [{str(message)[:60]}]"
                sites[key] = sites.get(key, 0) + 1

            old = warnings.showwarning
            warnings.showwarning = show
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = show
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(3):
                            fn()
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
            finally:
                warnings.showwarning = old
            n = sum(sites.values()) / 3
            top = "; ".join(f"{k} x{v}" for k, v in sorted(sites.items(), key=lambda kv: -kv[1])[:4])
            row("sync", name, f"{n:.1f} per call" + (f" ({top})" if top else ""), "0 avoidable", per_call=n, sites=sites)
        one()


# ---- repeat: whether repeated calls reuse what the first found, and what that saves -------------------

def repeats(device: str, tiny: bool) -> None:
    from jacmode import _guard, _profile

    torch.manual_seed(0)
    mlp, xm = MLP(784, 20, 10).to(device), torch.rand(2, 784, device=device)
    netx, t = NetX().to(device), torch.rand(100, 1, device=device)
    pinn, xp = PinnNet(2, 64, 2, 1).to(device), torch.rand(256, 2, device=device)
    cases = {
        "jacobian params MLP B=2": (mlp, lambda: jm.jacobian(mlp, xm, wrt="params")),
        "jacobian net_x B=100": (netx, lambda: jm.jacobian(netx, t)),
        "derivative net_x B=100": (netx, lambda: jm.derivative(netx, t)),
        "laplacian PinnNet B=256": (pinn, lambda: jm.laplacian(pinn, xp)),
        "partials PinnNet B=256": (pinn, lambda: jm.partials(pinn, xp, [(0,), (1, 1)])),
        "per_sample_grads MLP B=2": (mlp, lambda: jm.per_sample_grads(mlp, xm, lambda o: o.sum(1))),
        "compile=True jacobian params MLP B=2": (mlp, (lambda tr: lambda: tr(xm))(
            jm.transform(jm.jacobian, mlp, wrt="params", compile=True))),
        "compile=True laplacian PinnNet B=256": (pinn, (lambda tr: lambda: tr(xp))(
            jm.transform(jm.laplacian, pinn, compile=True))),
    }
    for name, (f, fn) in cases.items():
        @guarded("repeat", name)
        def one(name: str = name, f: Any = f, fn: Callable = fn) -> None:
            times = []
            for _ in range(6):
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
            ms = median_ms(fn, device, budget=1.0)
            kept = bool(_profile._LAST.get(f))
            why = _guard.why_not(f)
            row("repeat", name, f"calls 1-6 {', '.join(f'{v:.1f}' for v in times)} ms, then {ms:.3f} ms; "
                f"profile kept: {kept}" + (f"; unguarded: {why[:160]}" if why else ""), "profile kept", ms=ms,
                first=times, kept=kept, why=why)
        one()


# ---- targets ---------------------------------------------------------------------------------------

def _problem1(batch: int, device: str) -> tuple[nn.Module, torch.Tensor, int]:
    """Problem 1's class, a batch of B inputs and P."""
    model = MLP(784, 20, 10).to(device)
    return model, torch.rand(batch, 784, device=device), sum(p.numel() for p in model.parameters())


def targets(device: str, tiny: bool) -> None:
    torch.manual_seed(0)

    @guarded("target", "problem 1, B=2")
    def p1_small() -> None:
        model = MLP(784, 20, 10).to(device)
        x = torch.rand(2, 784, device=device)
        ref = params_hand_rule(model, x)
        fns = {
            "jm.jacobian": lambda: jm.jacobian(model, x, wrt="params"),
            "jm.transform": (lambda tr: lambda: tr(x))(jm.transform(jm.jacobian, model, wrt="params")),
            "hand rule": lambda: params_hand_rule(model, x),
            "vmap(jacrev)": lambda: params_vmap_jacrev(model, x),
        }
        try:
            tr = jm.transform(jm.jacobian, model, wrt="params", compile=True)
            fns["compile=True"] = lambda: tr(x)
        except Exception as err:
            row("target", "p1 B=2 compile=True", f"FAILED {err}")
        try:
            ro = torch.compile(lambda v: jm.jacobian(model, v, wrt="params"), mode="reduce-overhead")
            fns["torch.compile reduce-overhead"] = lambda: ro(x)
        except Exception as err:
            row("target", "p1 B=2 reduce-overhead", f"FAILED {err}")
        for name, fn in fns.items():
            @guarded("target", f"p1 B=2 {name}")
            def one(name: str = name, fn: Callable = fn) -> None:
                err = rel(fn(), ref)
                ms = median_ms(fn, device, budget=1.5)
                row("target", f"p1 B=2 {name}", f"{ms:.3f} ms (rel err {err:.0e})",
                    "<= 0.5 ms" if name.startswith("jm") or "compile" in name else "", ms=ms, err=err)
            one()

    @guarded("target", "problem 1, B=8192")
    def p1_large() -> None:
        B = 64 if tiny else 8192
        model, x, P = _problem1(B, device)
        j_ms = median_ms(lambda: jm.jacobian(model, x, wrt="params"), device, budget=3, reps=20)
        w_ms = median_ms(lambda: torch.empty(B, 10, P, device=device).fill_(1.0), device, budget=3, reps=20)
        h_ms = median_ms(lambda: params_hand_rule(model, x), device, budget=3, reps=20)
        row("target", f"p1 B={B} jm.jacobian / write result", f"{j_ms:.2f} / {w_ms:.2f} ms = {j_ms / w_ms:.2f}x "
            f"(hand rule {h_ms:.2f} ms)", "<= 2x", jac_ms=j_ms, write_ms=w_ms, hand_ms=h_ms)
        if not tiny:
            v_ms = median_ms(lambda: params_vmap_jacrev(model, x), device, budget=3, reps=10)
            row("target", f"p1 B={B} vmap(jacrev)", f"{v_ms:.2f} ms", ms=v_ms)

    @guarded("target", "problem 2, B=1e6")
    def p2() -> None:
        B = 1000 if tiny else 1_000_000
        net = NetX().to(device)
        t = torch.linspace(0, 10, B, device=device).unsqueeze(1)
        d_ms = median_ms(lambda: jm.derivative(net, t), device, budget=3)

        def fwd() -> torch.Tensor:
            with torch.no_grad():
                return net(t)

        f_ms = median_ms(fwd, device, budget=3)
        ones = torch.ones_like(t)
        jvp_ms = median_ms(lambda: torch.func.jvp(net, (t,), (ones,))[1], device, budget=3)
        row("target", f"p2 B={B} jm.derivative / forward", f"{d_ms:.3f} / {f_ms:.3f} ms = {d_ms / f_ms:.2f}x "
            f"(jvp with ones {jvp_ms:.3f} ms)", "<= 2x", deriv_ms=d_ms, fwd_ms=f_ms, jvp_ms=jvp_ms)

    def jet_mlp() -> nn.Module:
        layers: list[nn.Module] = []
        sizes = [50, 768, 768, 512, 512]
        for a, b in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers, nn.Linear(512, 1))

    @guarded("target", "laplacian jet MLP")
    def lap() -> None:
        net = jet_mlp().to(device)
        for B in ((8,) if tiny else (256, 2048)):
            x = torch.randn(B, 50, device=device)
            f = lambda v: net(v).squeeze(-1)  # noqa: E731

            def nested() -> torch.Tensor:  # jet's "hessian_trace": vmap of forward-over-reverse
                return vmap(lambda v: torch.func.jacfwd(torch.func.jacrev(f))(v).diagonal().sum())(x)

            def autograd_loop() -> torch.Tensor:  # nested first-order autograd, one input coordinate at a time
                xx = x.detach().requires_grad_(True)
                (g,) = torch.autograd.grad(net(xx).sum(), xx, create_graph=True)
                out = torch.zeros(B, device=device)
                for d in range(50):
                    (h,) = torch.autograd.grad(g[:, d].sum(), xx, retain_graph=True)
                    out = out + h[:, d]
                return out

            ref = nested()
            got = jm.laplacian(net, x).reshape(-1)
            err = rel(got, ref)
            figs = {}
            for name, fn in (("jm.laplacian", lambda: jm.laplacian(net, x)), ("nested (vmap jacfwd jacrev)", nested),
                             ("autograd loop", autograd_loop)):
                figs[name] = (median_ms(fn, device, budget=2, reps=50), peak_mb(fn, device))
            j, n, a = figs["jm.laplacian"], figs["nested (vmap jacfwd jacrev)"], figs["autograd loop"]
            row("target", f"laplacian jet MLP B={B}", f"jm {j[0]:.2f} ms {j[1]:.0f} MB; nested {n[0]:.2f} ms "
                f"{n[1]:.0f} MB ({j[0] / n[0]:.2f}x time, {j[1] / n[1]:.2f}x mem); autograd loop {a[0]:.2f} ms "
                f"{a[1]:.0f} MB (rel err {err:.0e})", "jet: ~0.5x time, 0.7-0.8x mem", figs=figs, err=err)

    @guarded("target", "chunked memory")
    def chunk() -> None:
        B = 64 if tiny else 4096
        model, x, P = _problem1(B, device)
        result_mb = B * 10 * P * 4 / 2**20
        budget_mb = max(1, int(result_mb / 8))
        for mode in ("forward", "reverse", "auto"):
            fn = lambda mode=mode: jm.jacobian(model, x, wrt="params", mode=mode, max_memory=f"{budget_mb}MB")  # noqa: E731
            fn()
            pk = peak_mb(fn, device)
            row("target", f"chunked params B={B} {mode}, max_memory {budget_mb} MB",
                f"peak {pk:.0f} MB vs budget + result {budget_mb + result_mb:.0f} MB", "peak <= budget + result",
                peak=pk, limit=budget_mb + result_mb)

    for fn in (p1_small, p1_large, p2, lap, chunk):
        fn()


def asv_suites(device: str) -> None:
    """Every asv suite's benchmarks, set up and run once at their smallest parameters, on ``device``."""
    import importlib
    import os
    import pkgutil
    import sys

    os.environ["JACMODE_ASV_DEVICE"] = device
    sys.path.insert(0, "asv_benchmarks")
    import benchmarks

    ok, failed = 0, []
    for info in pkgutil.iter_modules(benchmarks.__path__):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"benchmarks.{info.name}")
        for cls in [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == mod.__name__]:
            methods = [m for m in dir(cls) if m.startswith(("time_", "peakmem_", "track_", "mem_"))]
            if not methods:
                continue
            params = getattr(cls, "params", [])
            if params and not isinstance(params[0], (list, tuple)):
                params = [params]
            first = [p[0] for p in params] if params else []
            for m in methods:
                try:
                    obj = cls()
                    if hasattr(obj, "setup"):
                        obj.setup(*first)
                    getattr(obj, m)(*first)
                    sync(device)
                    ok += 1
                except NotImplementedError:
                    ok += 1  # asv's skip
                except Exception as err:
                    failed.append(f"{info.name}.{cls.__name__}.{m}: {type(err).__name__}: {str(err)[:100]}")
    row("asv", f"suites on {device}, smallest parameters", f"{ok} ran, {len(failed)} failed"
        + (f": {'; '.join(failed[:5])}" if failed else ""), failed=failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--sections", default="repeat,check,sync,targets,asv")
    args = parser.parse_args()
    device = args.device
    env = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor())
    print(env, flush=True)
    sections = args.sections.split(",")
    for name, fn in (("repeat", repeats), ("check", checks), ("sync", syncs), ("targets", targets)):
        if name in sections:
            t0 = time.perf_counter()
            guarded(name, "section")(lambda fn=fn: fn(device, args.tiny))()
            print(f"-- {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if "asv" in sections:
        guarded("asv", "suites")(lambda: asv_suites(device))()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(env=env, rows=ROWS), fh, indent=1, default=str)
    print(f"\n{env}")
    print("| section | what | measured | target |\n|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['section']} | {r['what']} | {r['value']} | {r['target']} |")


if __name__ == "__main__":
    main()
