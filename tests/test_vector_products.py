"""jm.jvp, jm.vjp, jm.hvp, jm.ggn(..., v=) and jm.linearize against float64 oracles (torch.func idioms,
full Jacobian / Hessian contractions), their errors, and several arguments for per_sample_grads, ggn, ntk."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

import jacmode as jm
from jacmode._probes import probes

DT = torch.float64


def mlp(d: int = 3, h: int = 8, y: int = 2, act: type[nn.Module] = nn.Tanh) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, h), act(), nn.Linear(h, y)).to(DT)


def detached(net: nn.Module) -> dict[str, Tensor]:
    return {k: p.detach() for k, p in net.named_parameters()}


def flat(d: dict[str, Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in d.values()])


def param_jacobian(net: nn.Module, x: Tensor, *rest: Tensor) -> Tensor:
    """(B, Y, P) by torch.func, each sample alone."""
    params = detached(net)

    def one(xb: Tensor, *rb: Tensor) -> Tensor:
        jac = jacrev(lambda p: functional_call(net, p, (xb[None], *[r[None] for r in rb]))[0].reshape(-1))(params)
        return torch.cat([j.reshape(j.shape[0], -1) for j in jac.values()], 1)

    return vmap(one)(x, *rest)


def snapshot(net: nn.Module) -> tuple:
    return ([p.detach().clone() for p in net.parameters()], [p.requires_grad for p in net.parameters()],
            [p.grad for p in net.parameters()], [m.training for m in net.modules()],
            [len(m._forward_hooks) for m in net.modules()])


def same_state(net: nn.Module, snap: tuple) -> bool:
    now = snapshot(net)
    return (all(torch.equal(a, b) for a, b in zip(now[0], snap[0])) and now[1:] == snap[1:])


class Masked(nn.Module):
    """model(x, mask, scale=...): a batched rider and a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
        return self.out(torch.tanh(self.lin(x)) * mask) * scale


class Centered(nn.Module):
    """Couples the samples: x - x.mean(0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x - x.mean(0))


class NoForward(torch.autograd.Function):
    """sin with a backward formula and no forward-mode formula."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return g * x.cos()


# ---- jvp ----------------------------------------------------------------------------------------
ACTS = [nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU, nn.Softplus]


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 7), st.integers(1, 3), st.sampled_from(ACTS))
def test_jvp_inputs_matches_torch_func(b: int, d: int, h: int, y: int, act: type[nn.Module]) -> None:
    net = mlp(d, h, y, act)
    x, v = torch.randn(b, d, dtype=DT), torch.randn(b, d, dtype=DT)
    out, jv = jm.jvp(net, x, v)
    ref_out, ref = jvp(net, (x,), (v,))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(jv, ref, rtol=1e-12, atol=1e-12)
    # row b is J_b v_b
    jac = torch.stack([torch.autograd.functional.jacobian(lambda z: net(z[None])[0], x[i]) for i in range(b)])
    torch.testing.assert_close(jv, torch.einsum("byd,bd->by", jac, v))


def test_jvp_pytrees_aux_and_kwargs() -> None:
    def f(a: Tensor, pair: dict[str, Tensor], *, w: float) -> tuple[dict[str, Tensor], Tensor]:
        out = {"s": (a * pair["p"]).sum(1) * w, "t": torch.tanh(a) + pair["q"]}
        return out, a.detach().mean()

    a, p, q = (torch.randn(4, 3, dtype=DT) for _ in range(3))
    ta, tp, tq = (torch.randn(4, 3, dtype=DT) for _ in range(3))
    out, jv, aux = jm.jvp(f, (a, {"p": p, "q": q}), (ta, {"p": tp, "q": tq}), has_aux=True, kwargs={"w": 2.0})
    ref_out, ref, ref_aux = jvp(lambda a, d: f(a, d, w=2.0), (a, {"p": p, "q": q}), (ta, {"p": tp, "q": tq}),
                                has_aux=True)
    for k in ("s", "t"):
        torch.testing.assert_close(jv[k], ref[k])
        torch.testing.assert_close(out[k], ref_out[k])
    torch.testing.assert_close(aux, ref_aux)


@pytest.mark.parametrize("form", ["dict", "flat", "names", "functional"])
def test_jvp_params(form: str) -> None:
    net = mlp()
    x = torch.randn(5, 3, dtype=DT)
    params = detached(net)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    ref = jvp(lambda p: functional_call(net, p, (x,)), (params,), (v,))[1]
    if form == "dict":
        _, jv = jm.jvp(net, x, v, wrt="params")
    elif form == "flat":
        _, jv = jm.jvp(net, x, flat(v), wrt="params")
    elif form == "names":
        sub = {"2.weight": v["2.weight"]}
        _, jv = jm.jvp(net, x, sub["2.weight"].reshape(-1), wrt=["2.weight"])
        ref = jvp(lambda w: functional_call(net, {"2.weight": w}, (x,)), (params["2.weight"],), (sub["2.weight"],))[1]
    else:
        other = {k: p + 0.1 for k, p in params.items()}
        _, jv = jm.jvp(net, x, v, wrt=other)
        ref = jvp(lambda p: functional_call(net, p, (x,)), (other,), (v,))[1]
    torch.testing.assert_close(jv, ref, rtol=1e-12, atol=1e-12)
    assert jv.shape == (5, 2)


def test_jvp_without_forward_formula_takes_the_reverse_route() -> None:
    def f(z: Tensor) -> Tensor:
        return NoForward.apply(z) * 2

    x, v = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    _, jv = jm.jvp(f, x, v)
    torch.testing.assert_close(jv, 2 * x.cos() * v)
    lin = jm.linearize(f, x)
    torch.testing.assert_close(lin(v), 2 * x.cos() * v)


def test_jvp_create_graph_is_differentiable() -> None:
    net = mlp()
    x = torch.randn(4, 3, dtype=DT)
    v = torch.randn(4, 3, dtype=DT, requires_grad=True)
    _, jv = jm.jvp(net, x, v)
    assert not jv.requires_grad
    _, jv = jm.jvp(net, x, v, create_graph=True)
    (g,) = torch.autograd.grad(jv.sum(), v)
    ref = vjp(lambda t: jvp(net, (x,), (t,))[1], v.detach())[1](torch.ones(4, 2, dtype=DT))[0]
    torch.testing.assert_close(g, ref)


def test_jvp_inside_vmap_follows_the_transform() -> None:
    net = mlp()
    x, vs = torch.randn(4, 3, dtype=DT), torch.randn(6, 4, 3, dtype=DT)
    got = vmap(lambda v: jm.jvp(net, x, v)[1])(vs)
    ref = vmap(lambda v: jvp(net, (x,), (v,))[1])(vs)
    torch.testing.assert_close(got, ref)


# ---- vjp ----------------------------------------------------------------------------------------
def test_vjp_inputs_matches_torch_func() -> None:
    def f(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return (a * b).sum(1), torch.tanh(a - b)

    a, b = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    u = (torch.randn(4, dtype=DT), torch.randn(4, 3, dtype=DT))
    out, fn = jm.vjp(f, a, b)
    ref_out, ref_fn = vjp(f, a, b)
    for got, ref in zip(fn(u), ref_fn(u)):
        torch.testing.assert_close(got, ref)
    for got, ref in zip(fn(u), ref_fn(u)):  # the graph is kept for the next call
        torch.testing.assert_close(got, ref)
    torch.testing.assert_close(out[1], ref_out[1])


@pytest.mark.parametrize("act", [nn.Tanh, nn.ReLU])
def test_vjp_params_per_sample_and_summed(act: type[nn.Module]) -> None:
    net = mlp(act=act)
    x, u = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT)
    jac = param_jacobian(net, x)
    snap = snapshot(net)
    out, fn = jm.vjp(net, x, wrt="params")
    torch.testing.assert_close(out, net(x))
    torch.testing.assert_close(fn(u), torch.einsum("by,byp->bp", u, jac))
    torch.testing.assert_close(fn(2 * u), torch.einsum("by,byp->bp", 2 * u, jac))
    _, summed = jm.vjp(net, x, wrt="params", per_sample=False)
    torch.testing.assert_close(summed(u), torch.einsum("by,byp->p", u, jac))
    _, as_dict = jm.vjp(net, x, wrt="params", flatten=False)
    rows = as_dict(u)
    assert rows["0.weight"].shape == (6, 8, 3)
    assert same_state(net, snap)


def test_vjp_params_probe_engine_fires(monkeypatch: pytest.MonkeyPatch) -> None:
    net = mlp()
    x, u = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    calls = []
    real = probes.record
    monkeypatch.setattr(probes, "record", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, fn = jm.vjp(net, x, wrt="params")
    fn(u)
    fn(u)
    assert len(calls) == 1  # recorded once, applied twice


class Scaled(nn.Module):
    """A parameter used outside any covered layer: the generic per-sample engine serves it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.lin = nn.Linear(3, 2)
        self.gain = nn.Parameter(torch.tensor([1.5, -0.5]))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x)) * self.gain


def test_vjp_params_uncovered_parameter() -> None:
    net = Scaled().to(DT)
    x, u = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    _, fn = jm.vjp(net, x, wrt="params")
    torch.testing.assert_close(fn(u), torch.einsum("by,byp->bp", u, param_jacobian(net, x)))


def test_vjp_params_functional_and_two_live_calls_of_one_form() -> None:
    net = mlp()
    x, u = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    other = {k: p + 0.2 for k, p in detached(net).items()}
    out, fn = jm.vjp(net, x, wrt=other)
    ref_out, ref_fn = vjp(lambda p: functional_call(net, p, (x,)), other)
    torch.testing.assert_close(out, ref_out)
    rows = fn(u)
    assert rows["0.weight"].shape == (5, 8, 3)
    summed = ref_fn(u)[0]
    for k in other:
        torch.testing.assert_close(rows[k].sum(0), summed[k])
    # two per-sample vjps of the same call form (model(x, mask)) alive at once, generic engine included
    model = Scaled().to(DT)
    x1, x2 = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    m1, m2 = torch.rand(4, 2, dtype=DT), torch.rand(4, 2, dtype=DT)

    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, z: Tensor, m: Tensor) -> Tensor:
            return self.inner(z) * m

    wm = WithMask()
    _, fn1 = jm.vjp(wm, x1, m1, wrt="params")
    _, fn2 = jm.vjp(wm, x2, m2, wrt="params")
    u4 = torch.randn(4, 2, dtype=DT)
    torch.testing.assert_close(fn1(u4), torch.einsum("by,byp->bp", u4, param_jacobian(wm, x1, m1)))
    torch.testing.assert_close(fn2(u4), torch.einsum("by,byp->bp", u4, param_jacobian(wm, x2, m2)))
    torch.testing.assert_close(fn1(u4), torch.einsum("by,byp->bp", u4, param_jacobian(wm, x1, m1)))


def test_vjp_params_coupled_samples_refused() -> None:
    net = Centered().to(DT)
    with pytest.raises(jm.CoupledBatchError, match="per_sample=False"):
        jm.vjp(net, torch.randn(6, 3, dtype=DT), wrt="params")
    _, fn = jm.vjp(net, torch.randn(6, 3, dtype=DT), wrt="params", per_sample=False)  # whole batch: fine
    assert fn(torch.randn(6, 2, dtype=DT)).shape == (8,)


# ---- hvp ----------------------------------------------------------------------------------------
@settings(max_examples=8, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 6), st.sampled_from([nn.Tanh, nn.Sigmoid, nn.GELU]))
def test_hvp_inputs_per_sample(b: int, d: int, h: int, act: type[nn.Module]) -> None:
    net = mlp(d, h, 1, act)
    x, v = torch.randn(b, d, dtype=DT), torch.randn(b, d, dtype=DT)

    def f(z: Tensor) -> Tensor:
        return net(z).squeeze(1)

    hess = torch.stack([torch.autograd.functional.hessian(lambda z: f(z[None])[0], x[i]) for i in range(b)])
    ref = torch.einsum("bij,bj->bi", hess, v)
    for mode in ("auto", "forward", "reverse"):
        torch.testing.assert_close(jm.hvp(f, x, v, mode=mode), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.hvp(net, x, v), ref, rtol=1e-10, atol=1e-12)  # (B, 1) outputs
    torch.testing.assert_close(jm.hvp(f, x, v, chunk_size=2), ref, rtol=1e-10, atol=1e-12)


def test_hvp_inputs_whole_scalar() -> None:
    def f(z: Tensor) -> Tensor:
        return (z.sum(0) ** 3).sum()  # couples the rows: one scalar of the whole batch

    x, v = torch.randn(4, 3, dtype=DT), torch.randn(4, 3, dtype=DT)
    ref = jvp(grad(f), (x,), (v,))[1]
    torch.testing.assert_close(jm.hvp(f, x, v, batched=False), ref)


def test_hvp_inputs_coupled_samples_refused() -> None:
    def f(z: Tensor) -> Tensor:
        return ((z - z.mean(0)) ** 2).sum(1)

    x = torch.randn(6, 3, dtype=DT)
    with pytest.raises(jm.CoupledBatchError, match="batched=False"):
        jm.hvp(f, x, torch.randn_like(x))


def test_hvp_params_equals_jvp_of_grad() -> None:
    net = mlp(5, 7, 3)
    x, y = torch.randn(8, 5, dtype=DT), torch.randn(8, 3, dtype=DT)
    params = detached(net)
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def total(p: dict[str, Tensor]) -> Tensor:
        return ((functional_call(net, p, (x,)) - y) ** 2).sum()

    ref = jvp(grad(total), (params,), (v,))[1]
    snap = snapshot(net)
    for mode in ("auto", "forward", "reverse"):
        got = jm.hvp(net, x, v, wrt="params", loss=lambda out, t: ((out - t) ** 2).sum(1), y=y, mode=mode)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-12)
    got_flat = jm.hvp(net, x, flat(v), wrt="params", loss=nn.MSELoss(reduction="sum"), y=y)
    torch.testing.assert_close(got_flat, flat(ref), rtol=1e-12, atol=1e-12)
    got_fn = jm.hvp(total, params, v, wrt="params")  # f a function of the parameters
    for k in ref:
        torch.testing.assert_close(got_fn[k], ref[k], rtol=1e-12, atol=1e-12)
    assert same_state(net, snap)


def test_hvp_params_cross_entropy_mean() -> None:
    net = mlp(4, 6, 3)
    x, y = torch.randn(7, 4, dtype=DT), torch.randint(0, 3, (7,))
    params = detached(net)
    v = {k: torch.randn_like(p) for k, p in params.items()}
    ref = jvp(grad(lambda p: nn.functional.cross_entropy(functional_call(net, p, (x,)), y)), (params,), (v,))[1]
    got = jm.hvp(net, x, v, wrt="params", loss=nn.CrossEntropyLoss(), y=y)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-12, atol=1e-12)


def test_hvp_create_graph_and_inside_grad() -> None:
    x = torch.randn(4, 3, dtype=DT)
    v = torch.randn(4, 3, dtype=DT, requires_grad=True)

    def f(z: Tensor) -> Tensor:
        return (torch.sin(z) ** 3).sum(1)

    hv = jm.hvp(f, x, v, create_graph=True)
    (g,) = torch.autograd.grad(hv.sum(), v)
    ref = grad(lambda t: jvp(grad(lambda z: f(z).sum()), (x,), (t,))[1].sum())(v.detach())
    torch.testing.assert_close(g, ref)
    inside = grad(lambda t: jm.hvp(f, x, t).sum())(v.detach())
    torch.testing.assert_close(inside, ref)
    # with respect to the parameters: differentiable in the model's parameters too
    net = mlp()
    xs = torch.randn(5, 3, dtype=DT)
    p = flat(detached(net))
    hv = jm.hvp(net, xs, p, wrt="params", loss=lambda out: (out ** 3).sum(1), create_graph=True)
    (g_w,) = torch.autograd.grad(hv.sum(), [net[2].bias])
    params = detached(net)
    tangent = {k: t.view(q.shape) for (k, q), t in zip(params.items(), p.split([q.numel() for q in params.values()]))}

    def total(q: dict[str, Tensor]) -> Tensor:
        return (functional_call(net, q, (xs,)) ** 3).sum()

    def summed(q: dict[str, Tensor]) -> Tensor:
        return flat(jvp(grad(total), (q,), (tangent,))[1]).sum()

    torch.testing.assert_close(g_w, grad(summed)(params)["2.bias"])


# ---- Gauss-Newton-vector product ------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "module", "callable"])
def test_ggn_vector_matches_the_matrix(loss: str) -> None:
    net = mlp(4, 6, 3)
    x = torch.randn(7, 4, dtype=DT)
    y = torch.randint(0, 3, (7,)) if loss == "module" else None
    spec: object = {"module": nn.CrossEntropyLoss(), "callable": lambda out: torch.diag_embed(out.exp())}.get(loss, loss)
    G = jm.ggn(net, x, spec, y=y)  # type: ignore[arg-type]
    v = torch.randn(G.shape[0], dtype=DT)
    gv = jm.ggn(net, x, spec, y=y, v=v)  # type: ignore[arg-type]
    torch.testing.assert_close(gv, G @ v, rtol=1e-10, atol=1e-12)
    as_dict = jm.ggn(net, x, spec, y=y, v={k: t.view(p.shape) for (k, p), t in  # type: ignore[arg-type]
                                          zip(net.named_parameters(), v.split([p.numel() for p in net.parameters()]))})
    torch.testing.assert_close(flat(as_dict), G @ v, rtol=1e-10, atol=1e-12)


def test_ggn_vector_against_jacobian() -> None:
    net = mlp(3, 5, 2)
    x = torch.randn(6, 3, dtype=DT)
    jac = param_jacobian(net, x)
    v = torch.randn(jac.shape[-1], dtype=DT)
    torch.testing.assert_close(jm.ggn(net, x, "mse", v=v), torch.einsum("byp,byq,q->p", jac, jac, v))


# ---- linearize ------------------------------------------------------------------------------------
def test_linearize_inputs() -> None:
    net = mlp(3, 8, 3)
    x = torch.randn(5, 3, dtype=DT)
    lin = jm.linearize(net, x)
    torch.testing.assert_close(lin.out, net(x))
    for _ in range(3):
        v = torch.randn(5, 3, dtype=DT)
        torch.testing.assert_close(lin(v), jvp(net, (x,), (v,))[1])
        torch.testing.assert_close(lin.jvp(v), jvp(net, (x,), (v,))[1])
        torch.testing.assert_close(lin.vjp(v)[0], vjp(net, x)[1](v)[0])


def test_linearize_params() -> None:
    net = mlp()
    x = torch.randn(5, 3, dtype=DT)
    jac = param_jacobian(net, x)
    lin = jm.linearize(net, x, wrt="params")
    v, u = torch.randn(jac.shape[-1], dtype=DT), torch.randn(5, 2, dtype=DT)
    torch.testing.assert_close(lin(v), torch.einsum("byp,p->by", jac, v))
    torch.testing.assert_close(lin.vjp(u), torch.einsum("by,byp->bp", u, jac))
    summed = jm.linearize(net, x, wrt="params", per_sample=False)
    torch.testing.assert_close(summed.vjp(u), torch.einsum("by,byp->p", u, jac))


# ---- several arguments ---------------------------------------------------------------------------
def loop_grads(model: nn.Module, x: Tensor, mask: Tensor, y: Tensor, scale: float) -> Tensor:
    rows = []
    for b in range(x.shape[0]):
        value = ((model(x[b:b + 1], mask[b:b + 1], scale=scale) - y[b:b + 1]) ** 2).sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, list(model.parameters()))]))
    return torch.stack(rows)


def test_per_sample_grads_several_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Masked().to(DT)
    x, y = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT)
    mask = (torch.rand(6, 4) > 0.3).to(DT)
    calls = []
    real = probes.record
    monkeypatch.setattr(probes, "record", lambda *a, **k: calls.append(1) or real(*a, **k))
    snap = snapshot(model)
    g = jm.per_sample_grads(model, (x, mask), lambda out, t: ((out - t) ** 2).sum(1), y=y, kwargs={"scale": 2.0})
    torch.testing.assert_close(g, loop_grads(model, x, mask, y, 2.0))
    assert calls  # the probe engine fired
    assert same_state(model, snap)
    # a broadcast rider (in_dims=None) and small chunks of the generic engine
    shared = (torch.rand(1, 4) > 0.5).to(DT)
    g2 = jm.per_sample_grads(model, (x, shared), lambda out, t: ((out - t) ** 2).sum(1), y=y, in_dims=(0, None),
                             chunk_size=2)
    torch.testing.assert_close(g2, loop_grads(model, x, shared.expand(6, 4), y, 1.0))


def test_ntk_and_ggn_several_arguments() -> None:
    model = Masked().to(DT)
    x = torch.randn(5, 3, dtype=DT)
    mask = (torch.rand(5, 4) > 0.3).to(DT)
    jac = param_jacobian(model, x, mask)
    K = jm.ntk(model, (x, mask), (x[:3], mask[:3]))
    torch.testing.assert_close(K, torch.einsum("byp,czp->bcyz", jac, jac[:3]))
    K2 = jm.ntk(model, (x, mask), method="contraction", trace=True)
    torch.testing.assert_close(K2, torch.einsum("byp,cyp->bc", jac, jac))
    G = jm.ggn(model, (x, mask), "mse")
    torch.testing.assert_close(G, torch.einsum("byp,byq->pq", jac, jac))
    v = torch.randn(G.shape[0], dtype=DT)
    torch.testing.assert_close(jm.ggn(model, (x, mask), "mse", v=v), G @ v)
    _, fn = jm.vjp(model, x, mask, wrt="params")
    u = torch.randn(5, 2, dtype=DT)
    torch.testing.assert_close(fn(u), torch.einsum("by,byp->bp", u, jac))
    _, jv = jm.jvp(model, (x, mask), v, wrt="params")
    torch.testing.assert_close(jv, torch.einsum("byp,p->by", jac, v))


class TopLevel(nn.Module):
    """A parameter held by the model itself (the module of sample rows shares the model's dictionaries)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.w = nn.Parameter(torch.randn(3, 2, dtype=DT))

    def forward(self, x: Tensor, m: Tensor) -> Tensor:
        return torch.tanh(x @ self.w) * m


def test_several_arguments_top_level_parameter() -> None:
    model = TopLevel()
    x, m = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    g = jm.per_sample_grads(model, (x, m), lambda o: (o ** 2).sum(1))
    ref = torch.stack([torch.autograd.grad((model(x[b:b + 1], m[b:b + 1]) ** 2).sum(), model.w)[0].reshape(-1)
                       for b in range(5)])
    torch.testing.assert_close(g, ref)
    assert isinstance(model.w, nn.Parameter) and list(dict(model.named_parameters())) == ["w"]


def test_several_arguments_errors() -> None:
    model = Masked().to(DT)
    x = torch.randn(5, 3, dtype=DT)
    with pytest.raises(ValueError, match="in_dims"):
        jm.per_sample_grads(model, (x, torch.ones(4, 4, dtype=DT)), lambda out: out.sum(1))
    with pytest.raises(TypeError, match="x2: give x1 and x2 in the same form"):
        jm.ntk(model, (x, torch.ones(5, 4, dtype=DT)), x)
    with pytest.raises(TypeError, match="reads neither as one input nor as a data set"):
        jm.per_sample_grads(model, [x, torch.ones(5, 4, dtype=DT)], lambda out: out.sum(1))  # a list stays refused


# ---- errors ---------------------------------------------------------------------------------------
def test_errors_name_the_argument() -> None:
    net = mlp()
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(ValueError, match=r"tangents: expected shape \(4, 3\)"):
        jm.jvp(net, x, torch.randn(4, 2, dtype=DT))
    with pytest.raises(TypeError, match="tangents: expected dtype"):
        jm.jvp(net, x, torch.randn(4, 3))
    with pytest.raises(ValueError, match="tangents: expected the structure of primals"):
        jm.jvp(lambda a, b: a + b, (x, x), (x,))
    with pytest.raises(ValueError, match=r"tangents: expected a dict name -> tensor or one flat tensor of shape \(P,\)"):
        jm.jvp(net, x, torch.randn(3, dtype=DT), wrt="params")
    bad = {k: torch.randn(1, dtype=DT) if k == "0.bias" else p for k, p in detached(net).items()}
    with pytest.raises(ValueError, match=r"tangents: entry '0.bias' must be a tensor of shape \(8,\)"):
        jm.jvp(net, x, bad, wrt="params")
    with pytest.raises(ValueError, match="wrt: 'nope' is not a parameter"):
        jm.jvp(net, x, {"nope": torch.randn(3)}, wrt="params")
    with pytest.raises(ValueError, match="wrt: expected 'inputs', 'params'"):
        jm.jvp(net, x, x, wrt="outputs")
    with pytest.raises(TypeError, match="f: wrt='params' differentiates a module's parameters"):
        jm.vjp(lambda z: z, x, wrt="params")
    with pytest.raises(ValueError, match="per_sample: applies to wrt='params'"):
        jm.vjp(net, x, per_sample=True)
    _, fn = jm.vjp(net, x, wrt="params")
    with pytest.raises(ValueError, match=r"u: expected a tensor shaped like f's output \(4, 2\)"):
        fn(torch.randn(4, 3, dtype=DT))
    _, fn_in = jm.vjp(net, x)
    with pytest.raises(ValueError, match=r"u: expected shape \(4, 2\)"):
        fn_in(torch.randn(4, 3, dtype=DT))
    with pytest.raises(ValueError, match=r"f: hvp with respect to the inputs needs one scalar per sample"):
        jm.hvp(net, x, x)
    with pytest.raises(ValueError, match="f: with batched=False, hvp needs f"):
        jm.hvp(net, x, x, batched=False)
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"):
        jm.hvp(lambda z: z.sum(1), x, x, chunk_size=0)
    with pytest.raises(ValueError, match="mode: expected one of"):
        jm.hvp(lambda z: z.sum(1), x, x, mode="sideways")
    with pytest.raises(ValueError, match="loss: applies to wrt='params'"):
        jm.hvp(lambda z: z.sum(1), x, x, loss=nn.MSELoss())
    with pytest.raises(ValueError, match="loss: f's output has shape"):
        jm.hvp(net, x, flat(detached(net)), wrt="params")
    with pytest.raises(ValueError, match="y: hvp with nn.MSELoss needs the targets"):
        jm.hvp(net, x, flat(detached(net)), wrt="params", loss=nn.MSELoss())
    with pytest.raises(TypeError, match="f: has_aux=True expects f to return a pair"):
        jm.jvp(net, x, x, has_aux=True)
    with pytest.raises(TypeError, match="kwargs: expected a dict"):
        jm.jvp(net, x, x, kwargs=[1])
    with pytest.raises(TypeError, match="primals: differentiating needs a real floating dtype"):
        jm.jvp(lambda z: z.float(), torch.ones(3, dtype=torch.long), torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="diagonal: ggn"):
        jm.ggn(net, x, "mse", v=flat(detached(net)), diagonal=True)
    with pytest.raises(ValueError, match="v: expected a dict name -> tensor or one flat tensor"):
        jm.ggn(net, x, "mse", v=torch.randn(2, dtype=DT))
    with pytest.raises(ValueError, match="v: ggn.*takes one batch x; for a data set"):
        jm.ggn(net, iter([x]), "mse", v=flat(detached(net)))
    with pytest.raises(ValueError, match="y: a Hessian callable gets f"):
        jm.ggn(net, x, lambda out: torch.diag_embed(out), y=x, v=flat(detached(net)))


def test_model_left_as_found_when_a_call_raises() -> None:
    net = mlp()
    net.train()
    net.register_forward_hook(lambda m, i, o: None)
    snap = snapshot(net)
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(ValueError):
        jm.hvp(net, x, x)
    with pytest.raises(ValueError):
        jm.jvp(net, x, torch.randn(3, dtype=DT), wrt="params")
    jm.hvp(net, x, flat(detached(net)), wrt="params", loss=lambda out: (out ** 2).sum(1))
    jm.linearize(net, x, wrt="params").vjp(torch.randn(4, 2, dtype=DT))
    assert same_state(net, snap)


def test_copy_of_model_unchanged_numbers() -> None:
    net = mlp()
    before = copy.deepcopy(net)
    x = torch.randn(4, 3, dtype=DT)
    jm.ggn(net, x, "cross_entropy", v=flat(detached(net)))
    for a, b in zip(net.parameters(), before.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["conv", "embedding", "layernorm"])
def test_vjp_params_per_sample_other_layers(kind: str) -> None:
    torch.manual_seed(4)
    if kind == "conv":
        net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).to(DT)
        x = torch.randn(4, 2, 6, 6, dtype=DT)
    elif kind == "embedding":
        net = nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(9, 2)).to(DT)
        x = torch.randint(0, 7, (4, 3))
    else:
        net = nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
        x = torch.randn(4, 3, dtype=DT)
    u = torch.randn(4, 2, dtype=DT)
    jac = jm.jacobian(net, x, wrt="params")
    _, fn = jm.vjp(net, x, wrt="params")
    torch.testing.assert_close(fn(u), torch.einsum("by,byp->bp", u, jac))
    lin = jm.linearize(net, x, wrt="params")
    v = torch.randn(jac.shape[-1], dtype=DT)
    torch.testing.assert_close(lin(v), torch.einsum("byp,p->by", jac, v))
