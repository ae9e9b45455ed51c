"""Function transforms (``_transform.py``): ``jm.transform(op, f, **options)(x)`` equals the eager call."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import jacrev, vmap

import jacmode as jm


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


X = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
Y = torch.ones(5, 3, dtype=torch.float64)

# (op, options, eager call)
CALLS: dict[str, tuple[Callable[..., Any], dict[str, Any], Callable[[nn.Module], Any]]] = {
    "jacobian": (jm.jacobian, {}, lambda f: jm.jacobian(f, X)),
    "jacobian params": (jm.jacobian, {"wrt": "params", "flatten": False},
                        lambda f: jm.jacobian(f, X, wrt="params", flatten=False)),
    "derivative": (jm.derivative, {"order": 2}, lambda f: jm.derivative(lambda t: f(t.repeat(1, 3)), X[:, :1], order=2)),
    "partial": (jm.partial, {"dims": (0, 1)}, lambda f: jm.partial(f, X, (0, 1))),
    "partials": (jm.partials, {"dims": [(0,), (1, 1)]}, lambda f: jm.partials(f, X, [(0,), (1, 1)])),
    "hessian": (jm.hessian, {}, lambda f: jm.hessian(f, X)),
    "laplacian": (jm.laplacian, {}, lambda f: jm.laplacian(f, X)),
    "divergence": (jm.divergence, {}, lambda f: jm.divergence(f, X)),
    "operator": (jm.operator, {"terms": [(1.0, (0, 0)), (2.0, (1,))]},
                 lambda f: jm.operator(f, X, [(1.0, (0, 0)), (2.0, (1,))])),
    "biharmonic": (jm.biharmonic, {}, lambda f: jm.biharmonic(f, X)),
    "per_sample_grads": (jm.per_sample_grads, {"loss": _loss}, lambda f: jm.per_sample_grads(f, X, _loss, y=Y)),
    "ggn": (jm.ggn, {"diagonal": True}, lambda f: jm.ggn(f, X, diagonal=True)),
    "ntk": (jm.ntk, {"trace": True}, lambda f: jm.ntk(f, X, trace=True)),
}


def _call(name: str, t: jm.Transformed) -> Any:
    if name == "derivative":
        return t(X[:, :1])
    if name == "per_sample_grads":
        return t(X, Y)
    return t(X)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("name", list(CALLS))
def test_a_transform_returns_exactly_what_the_eager_call_returns(name: str) -> None:
    f = _net()
    op, options, eager = CALLS[name]
    target = (lambda t: f(t.repeat(1, 3))) if name == "derivative" else f
    t = jm.transform(op, target, **options)
    assert isinstance(t, jm.Transformed) and t.op == op.__name__ and t.f is target
    for _ in range(3):  # first call, then profile hits
        assert _equal(_call(name, t), eager(f))


def test_jacfn_is_the_jacobian_transform_and_matches_torch_func() -> None:
    f = _net()
    jac = jm.jacfn(f)
    want = vmap(jacrev(lambda xb: f(xb[None])[0]))(X)
    torch.testing.assert_close(jac(X), want, rtol=1e-12, atol=1e-12)
    assert "jacobian" in repr(jac)


def test_keyword_arguments_of_the_call_go_to_f_as_in_torch_func() -> None:
    torch.manual_seed(1)
    w = torch.randn(3, 3, dtype=torch.float64)

    def f(x: Tensor, *, scale: Tensor, shift: float = 0.0) -> Tensor:
        return torch.tanh(x @ w) * scale + shift

    scale = torch.rand(5, 1, dtype=torch.float64)
    want = jacrev(lambda x: f(x, scale=scale, shift=1.0))(X)  # (B, Y, B, D): its diagonal blocks
    want = want.diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    jac = jm.jacfn(f)
    for _ in range(2):
        torch.testing.assert_close(jac(X, scale=scale, shift=1.0), want, rtol=1e-12, atol=1e-12)
    lap = jm.transform(jm.laplacian, f)(X, scale=scale)
    torch.testing.assert_close(lap, jm.laplacian(f, X, kwargs={"scale": scale}), rtol=0, atol=0)  # one path
    torch.testing.assert_close(lap, jm.laplacian(lambda x: f(x, scale=scale), X), rtol=1e-12, atol=1e-12)
    # the two jacmode paths differ by rounding (5e-17); an independent float64 oracle settles both
    hess = torch.func.vmap(torch.func.hessian(lambda xb, sb: f(xb[None], scale=sb[None])[0]))(X, scale)
    torch.testing.assert_close(lap, hess.diagonal(dim1=-2, dim2=-1).sum(-1), rtol=1e-12, atol=1e-12)


def test_per_call_data_goes_to_the_entry_point() -> None:
    f = _net()
    jac = jm.jacfn(f, wrt="params")
    out = torch.empty(5, 3, sum(p.numel() for p in f.parameters()), dtype=torch.float64)
    assert jac(X, out=out) is out
    torch.testing.assert_close(out, jm.jacobian(f, X, wrt="params"), rtol=0, atol=0)
    psg = jm.transform(jm.per_sample_grads, f, loss=_loss)
    assert torch.equal(psg(X, y=Y), psg(X, Y))
    k = jm.transform(jm.ntk, f)
    assert k(X, X[:2]).shape == (5, 2, 3, 3)


def test_compile_runs_the_generated_code_of_the_taylor_operators_compiled() -> None:
    f = _net()
    t = jm.transform(jm.laplacian, f, compile="aot_eager")  # a backend that needs no C++ compiler
    assert t.compile == "aot_eager"
    for _ in range(2):
        torch.testing.assert_close(t(X), jm.laplacian(f, X), rtol=1e-12, atol=1e-12)
    p = jm.transform(jm.partials, f, dims=[(0,), (1, 1)], compile="aot_eager", create_graph=True)
    got, want = p(X), jm.partials(f, X, [(0,), (1, 1)], create_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    params = list(f.parameters())[:-1]  # the last bias does not enter the derivatives
    g1 = torch.autograd.grad(sum(r.sum() for r in got), params)
    g2 = torch.autograd.grad(sum(r.sum() for r in want), params)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_compile_of_an_entry_point_without_generated_code_runs_eagerly_with_a_warning() -> None:
    f = _net()
    with pytest.warns(jm.JacmodeWarning, match="ntk has no generated code.*runs eagerly"):
        t = jm.transform(jm.ntk, f, compile=True)
    assert t.compile
    assert torch.equal(t(X), jm.ntk(f, X))


def test_bad_options_raise_at_creation_with_the_usual_errors() -> None:
    f = _net()
    with pytest.raises(TypeError, match="unknown option 'wtr'"):
        jm.transform(jm.jacobian, f, wtr="params")
    with pytest.raises(ValueError, match="wrt: expected one of"):
        jm.jacfn(f, wrt="parameters")
    with pytest.raises(TypeError, match="missing option 'dims'"):
        jm.transform(jm.partial, f)
    with pytest.raises(TypeError, match="unknown option 'dimz'"):
        jm.transform(jm.partial, f, dimz=(0,))
    with pytest.raises(ValueError, match="order: expected a positive int"):
        jm.transform(jm.derivative, f, order=0)
    with pytest.raises(TypeError, match="dims: expected a list of coordinate tuples"):
        jm.transform(jm.partials, f, dims=(0, 1))
    with pytest.raises(ValueError, match="structure: expected one of"):
        jm.transform(jm.laplacian, f, structure="banded")
    with pytest.raises(TypeError, match="loss: expected a callable"):
        jm.transform(jm.per_sample_grads, f, loss=3)
    with pytest.raises(ValueError, match="wrt: per_sample_grads, ntk and ggn"):
        jm.transform(jm.ggn, f, wrt="inputs")
    with pytest.raises(TypeError, match="'y' is given per call"):
        jm.transform(jm.per_sample_grads, f, loss=_loss, y=Y)
    with pytest.raises(TypeError, match="op: expected one of jacmode's entry points"):
        jm.transform(torch.sin, f)
    with pytest.raises(TypeError, match="f: expected an nn.Module or a callable"):
        jm.jacfn(3)
    with pytest.raises(TypeError, match="compile: expected True, False or a torch.compile backend"):
        jm.jacfn(f, compile="yes")


def test_bad_calls_raise_clear_errors() -> None:
    f = _net()
    jac = jm.jacfn(f)
    with pytest.raises(TypeError, match="takes f's input x as its first argument"):
        jac()
    with pytest.raises(TypeError, match="takes 2 positional arguments"):  # f's own error, as torch.func gives
        jac(X, X)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        jac([1.0, 2.0])


def test_transforms_take_several_arguments_and_keywords_as_the_eager_calls() -> None:
    f = _net()

    def g(x: Tensor, t: Tensor, *, mask: Tensor) -> Tensor:
        return f(x * t) * mask

    t, mask = torch.rand(X.shape[0], 1, dtype=X.dtype), torch.rand(X.shape[0], 1, dtype=X.dtype)
    for argnums in (0, (0, 1)):
        got = jm.jacfn(g, argnums=argnums)(X, t, mask=mask)
        want = jm.jacobian(g, X, t, argnums=argnums, kwargs={"mask": mask})
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref = torch.func.vmap(torch.func.jacrev(lambda xb, tb, mb: g(xb[None], tb[None], mask=mb[None])[0],
                                            argnums=(0, 1)))(X, t, mask)
    got = jm.jacfn(g, argnums=(0, 1))(X, t, mask=mask)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-12)


def test_eager_calls_keep_no_model_alive() -> None:
    f = _net()
    jm.jacobian(f, X, wrt="params")
    jm.laplacian(f, X)
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None
