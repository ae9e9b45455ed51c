"""Every speed target of the release, measured side by side on the problems' own classes.

``python -m bench.targets [threads] [sections]`` prints one row per target: two methods timed
alternately in one process (medians), their ratio and the target it is held to. Sections: 10 (input
derivatives by graph capture), 11 (parameter Jacobians by probes), 13 (per-sample gradients, NTK,
GGN); e.g. ``python -m bench.targets 1 10,13``. docs/benchmarks.md keeps one run.
"""
# mypy: ignore-errors

from __future__ import annotations

import gc
import statistics
import sys
import time

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

import jacmode as jm
from bench.baselines import (
    CNN,
    MLP,
    NetX,
    PinnNet,
    mnist_mlp_sequential,
    time_mlp_sequential,
)

ONLY = None


def pair(fa, fb, budget=3.0):
    """Medians of fa and fb timed alternately (drift and allocator state hit both alike)."""
    fa()
    fb()
    t0 = time.perf_counter()
    fa()
    fb()
    one = time.perf_counter() - t0
    reps = max(5, min(300, int(budget / max(one, 1e-6))))
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        ta.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fb()
        tb.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def med(fn, reps=None, budget=1.5):
    fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    reps = reps or max(3, min(200, int(budget / max(one, 1e-6))))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


rows = []


def row(section_no, what, a, b, target):
    if callable(a):
        a, b = pair(a, b)
    rows.append((section_no, what, a, b, a / b, target))
    print(f"{section_no:>3} | {what:<60} | {a:9.3f} | {b:9.3f} | {a / b:6.2f}x | {target}", flush=True)


def section(name):
    return ONLY is None or name in ONLY


def fill(shape):
    return lambda: torch.empty(shape).fill_(1.0)


def vmap_jacrev(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xb):
        return functional_call(model, p, (xb.unsqueeze(0),)).squeeze(0)

    j = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    return torch.cat([v.reshape(x.shape[0], v.shape[1], -1) for v in j.values()], -1)


def main() -> None:
    """Run the sections named on the command line (all by default)."""
    global ONLY
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    torch.manual_seed(0)
    ONLY = sys.argv[2].split(",") if len(sys.argv) > 2 else None

    # ---- section 10: input derivatives by graph capture
    if section("10"):
        for label, net in (("NetX class", NetX()), ("Sequential twin", time_mlp_sequential())):
            t = torch.linspace(0, 10, 100_000).unsqueeze(1)

            def fwd(net=net, t=t):
                with torch.no_grad():
                    return net(t)

            row(10, f"{label} B=1e5 jacobian / forward", lambda: jm.jacobian(net, t), fwd, "<= 1.5x (class)")
            row(
                10,
                f"{label} B=1e5 derivative(order=2) / forward",
                lambda: jm.derivative(net, t, order=2),
                fwd,
                "<= 2.5x (class)",
            )
        for label, net in (("PinnNet class", PinnNet(2, 64, 2)),):
            x = torch.rand(10_000, 2)

            def idiom():
                xx = x.clone().requires_grad_(True)
                u = net(xx)
                g = torch.autograd.grad(u, xx, torch.ones_like(u), create_graph=True)[0]
                u_t, u_x = g[:, :1], g[:, 1:2]
                u_xx = torch.autograd.grad(u_x, xx, torch.ones_like(u_x), create_graph=True)[0][:, 1:2]
                loss = ((u_t - 0.1 * u_xx) ** 2).mean()
                loss.backward()

            def two_partial():
                u_t = jm.partial(net, x, (0,), create_graph=True)
                u_xx = jm.partial(net, x, (1, 1), create_graph=True)
                loss = ((u_t - 0.1 * u_xx) ** 2).mean()
                loss.backward()

            def partials():
                u_t, u_xx = jm.partials(net, x, [(0,), (1, 1)], create_graph=True)
                loss = ((u_t - 0.1 * u_xx) ** 2).mean()
                loss.backward()

            i = idiom
            row(10, f"{label} B=1e4 train step: idiom / jm.partials", i, partials, ">= 1.5x")
            row(10, f"{label} B=1e4 train step: idiom / two jm.partial", i, two_partial, ">= 1.0x")
        net = PinnNet(10, 64, 2)
        x = torch.rand(4096, 10)

        def nested():
            xx = x.clone().requires_grad_(True)
            u = net(xx)
            g = torch.autograd.grad(u.sum(), xx, create_graph=True)[0]
            lap = sum(torch.autograd.grad(g[:, i].sum(), xx, create_graph=True)[0][:, i] for i in range(10))
            return lap

        row(
            10,
            "PinnNet(10,64,2) B=4096 laplacian: nested backprop / jm",
            nested,
            lambda: jm.laplacian(net, x, create_graph=True),
            ">= 3x",
        )

    # ---- section 11: parameter Jacobians by probes
    if section("11"):
        from bench import baselines as bl

        m = MLP(784, 20, 10)
        x2 = torch.rand(2, 784)
        hd = bl.params_hand_rule
        row(
            11,
            "MLP class B=2: jacmode / hand-derived",
            lambda: jm.jacobian(m, x2, wrt="params"),
            lambda: hd(m, x2),
            "<= 1.5x",
        )
        row(
            11,
            "MLP class B=2: users' loop / jacmode",
            lambda: bl.params_loop(m, x2),
            lambda: jm.jacobian(m, x2, wrt="params"),
            ">= 10x",
        )
        row(
            11,
            "MLP class B=2: vmap(jacrev) / jacmode",
            lambda: vmap_jacrev(m, x2),
            lambda: jm.jacobian(m, x2, wrt="params"),
            "(info)",
        )
        x = torch.rand(512, 784)
        for label, net, target in (("MLP class", m, "<= 1.25x"), ("Sequential twin", mnist_mlp_sequential(), "(info)")):
            row(
                11,
                f"{label} B=512: jacmode / alloc+fill",
                lambda net=net: jm.jacobian(net, x, wrt="params"),
                fill((512, 10, 15910)),
                target,
            )
        buf = torch.empty(512, 10, 15910)
        src = torch.ones(512, 10, 15910)
        row(
            11,
            "MLP class B=512 out=: jacmode / copy into buffer",
            lambda: jm.jacobian(m, x, wrt="params", out=buf),
            lambda: buf.copy_(src),
            "<= 2.5x",
        )
        del buf, src
        gc.collect()

        class ResMLP(nn.Module):
            def __init__(self, d=64, n=3):
                super().__init__()
                self.inp = nn.Linear(32, d)
                self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(n))
                self.out = nn.Linear(d, 10)

            def forward(self, x):
                h = self.inp(x)
                for b in self.blocks:
                    h = h + torch.nn.functional.gelu(b(h))
                return self.out(h)

        for name, model, xin in (
            ("CNN class B=64", CNN(), torch.rand(64, 1, 28, 28)),
            ("ResMLP class B=256", ResMLP(), torch.rand(256, 32)),
        ):
            P = sum(p.numel() for p in model.parameters())
            row(
                11,
                f"{name}: jacmode / alloc+fill",
                lambda: jm.jacobian(model, xin, wrt="params"),
                fill((xin.shape[0], 10, P)),
                "<= 1.5x",
            )
            row(
                11,
                f"{name}: vmap(jacrev) / jacmode",
                lambda: vmap_jacrev(model, xin),
                lambda: jm.jacobian(model, xin, wrt="params"),
                "(info)",
            )
        tel = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()

        class Tr(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = tel
                self.head = nn.Linear(32, 4)

            def forward(self, x):
                return self.head(self.enc(x).mean(1))

        tr = Tr()
        xt = torch.rand(32, 8, 32)
        row(
            11,
            "TransformerEncoderLayer B=32: vmap(jacrev) / jacmode",
            lambda: vmap_jacrev(tr, xt),
            lambda: jm.jacobian(tr, xt, wrt="params"),
            ">= 2x",
        )

    # ---- section 13: per-sample gradients, NTK, GGN
    if section("13"):
        m = MLP(784, 20, 10)
        x = torch.rand(512, 784)
        y = torch.randint(0, 10, (512,))
        P = 15910
        ce = lambda out, yy: torch.nn.functional.cross_entropy(out, yy, reduction="none")
        params = {k: v.detach() for k, v in m.named_parameters()}

        def vgrad():
            def one(p, xb, yb):
                return ce(functional_call(m, p, (xb.unsqueeze(0),)), yb.unsqueeze(0)).sum()

            g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
            return torch.cat([v.reshape(512, -1) for v in g.values()], 1)

        psg = lambda: jm.per_sample_grads(m, x, ce, y=y)
        row(13, "psg MLP B=512: vmap(grad) / jacmode", vgrad, psg, ">= 2x")
        row(13, "psg MLP B=512: jacmode / alloc+fill (B,P)", psg, fill((512, P)), "<= 1.5x")
        x1 = torch.rand(256, 784)

        def contraction():
            j = vmap_jacrev(m, x1)
            return torch.einsum("aip,bjp->abij", j, j)

        row(
            13,
            "ntk MLP B=256 full: two vmap(jacrev) contracted / jacmode",
            contraction,
            lambda: jm.ntk(m, x1),
            ">= 3x",
        )
        xg = torch.rand(1000, 784)
        row(
            13,
            "ggn(diagonal) MLP B=1000 / psg same batch",
            lambda: jm.ggn(m, xg, diagonal=True),
            lambda: jm.per_sample_grads(m, xg, lambda o: 0.5 * (o**2).sum(1)),
            "<= 2x",
        )

    print("\nthreads", torch.get_num_threads(), "torch", torch.__version__)


if __name__ == "__main__":
    main()
