"""The fast engines differentiate the tensors f actually uses.

Parameters handed in through ``torch.func.functional_call`` (or torch.nn.utils.stateless's), closure
and global tensors rebound between calls, torch.func transforms around a jacmode call, and a
forward that swaps a layer's weight: each is compared with a float64 torch.func oracle that
differentiates the same ``functional_call`` sample by sample, values and gradients with respect
to the parameters.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, jvp, vmap

import jacmode as jm
from jacmode import _guard
from jacmode._capture import capture as _capture
from jacmode._capture.program import Program
from _zoo_models import one_intra_op_thread  # noqa: F401 -- tiny tensors: one thread

DT = torch.float64
Params = dict[str, Tensor]


def mlp(d_in: int = 2, d_out: int = 2, width: int = 6, depth: int = 1, act: Callable[[], nn.Module] = nn.Tanh) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, width), act()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), act()]
    return nn.Sequential(*layers, nn.Linear(width, d_out)).to(DT)


def other(net: nn.Module, shift: float = 0.3) -> Params:
    """Parameters with other values than the module's own."""
    return {k: (v.detach() + shift * torch.randn_like(v)) for k, v in net.named_parameters()}


def same(net: nn.Module) -> Params:
    """Copies with the module's own values: the case the old capture check let through."""
    return {k: v.detach().clone() for k, v in net.named_parameters()}


# Each entry point as (jacmode call, oracle); f maps (B, D) -> (B, Y), u one sample (D,) -> (Y,).
def _hess(u: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return vmap(torch.func.hessian(u))(x)  # (B, Y, D, D)


ENTRY: dict[str, tuple[Callable[[Any, Tensor], Tensor], Callable[[Any, Tensor], Tensor]]] = {
    "jacobian": (lambda f, x: jm.jacobian(f, x, create_graph=True), lambda u, x: vmap(jacrev(u))(x)),
    "jacobian-forward": (lambda f, x: jm.jacobian(f, x, mode="forward", create_graph=True),
                         lambda u, x: vmap(jacrev(u))(x)),
    "hessian": (lambda f, x: jm.hessian(f, x, create_graph=True), _hess),
    "laplacian": (lambda f, x: jm.laplacian(f, x, create_graph=True),
                  lambda u, x: _hess(u, x).diagonal(dim1=-2, dim2=-1).sum(-1)),
    "divergence": (lambda f, x: jm.divergence(f, x, create_graph=True),
                   lambda u, x: vmap(jacrev(u))(x).diagonal(dim1=-2, dim2=-1).sum(-1)),
    "partial": (lambda f, x: jm.partial(f, x, (0, 1), create_graph=True), lambda u, x: _hess(u, x)[..., 0, 1]),
    "partials": (lambda f, x: torch.cat(jm.partials(f, x, [(0,), (1, 1)], create_graph=True), -1),
                 lambda u, x: torch.cat([vmap(jacrev(u))(x)[..., 0], _hess(u, x)[..., 1, 1]], -1)),
}


def jm_loss(net: nn.Module, name: str, x: Tensor) -> Callable[[Params], Tensor]:
    return lambda p: ENTRY[name][0](lambda x: functional_call(net, p, (x,)), x).pow(2).sum()


def oracle_value(net: nn.Module, name: str, p: Params, x: Tensor) -> Tensor:
    return ENTRY[name][1](lambda xb: functional_call(net, p, (xb.unsqueeze(0),)).squeeze(0), x)


def oracle_loss(net: nn.Module, name: str, x: Tensor) -> Callable[[Params], Tensor]:
    return lambda p: oracle_value(net, name, p, x).pow(2).sum()


def close(a: Params, b: Params) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-11) for k in a)


@pytest.fixture
def net() -> nn.Module:
    torch.manual_seed(0)
    return mlp()


@pytest.fixture
def x() -> Tensor:
    torch.manual_seed(1)
    return torch.randn(5, 2, dtype=DT)


@pytest.mark.parametrize("name", sorted(ENTRY))
@pytest.mark.parametrize("values", [same, other])
def test_functional_call_values_and_grad(net: nn.Module, x: Tensor, name: str, values: Any) -> None:
    p = values(net)
    got = ENTRY[name][0](lambda x: functional_call(net, p, (x,)), x)
    assert torch.allclose(got, oracle_value(net, name, p, x).reshape(got.shape), rtol=1e-10, atol=1e-12)
    g, want = grad(jm_loss(net, name, x))(p), grad(oracle_loss(net, name, x))(p)
    assert max(v.abs().max() for v in want.values()) > 1e-3  # the gradient is not trivially zero
    assert close(g, want)


@pytest.mark.parametrize("name", ["laplacian", "jacobian", "hessian"])
def test_leaf_params_get_the_gradient_and_the_module_none(net: nn.Module, x: Tensor, name: str) -> None:
    p = {k: v.requires_grad_() for k, v in same(net).items()}
    jm_loss(net, name, x)(p).backward()
    want = grad(oracle_loss(net, name, x))({k: v.detach() for k, v in p.items()})
    assert close({k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in p.items()}, want)
    assert all(q.grad is None for q in net.parameters())


@pytest.mark.parametrize("name", ["laplacian", "partials"])
def test_transforms_over_a_jacmode_call(net: nn.Module, x: Tensor, name: str) -> None:
    p, L, R = other(net), jm_loss(net, name, x), oracle_loss(net, name, x)
    stacked = {k: torch.stack([v, 0.5 * v]) for k, v in p.items()}
    assert torch.allclose(vmap(L)(stacked), vmap(R)(stacked), rtol=1e-10)
    t = {k: torch.randn_like(v) for k, v in p.items()}
    assert torch.allclose(jvp(L, (p,), (t,))[1], jvp(R, (p,), (t,))[1], rtol=1e-10)
    assert close(jacrev(L)(p), jacrev(R)(p))
    assert close(vmap(grad(L))(stacked), vmap(grad(R))(stacked))


@pytest.mark.parametrize("name", ["jacobian", "hessian", "divergence"])
def test_grad_jacrev_jvp_over_a_jacmode_call(net: nn.Module, x: Tensor, name: str) -> None:
    p, L, R = other(net), jm_loss(net, name, x), oracle_loss(net, name, x)
    t = {k: torch.randn_like(v) for k, v in p.items()}
    assert torch.allclose(jvp(L, (p,), (t,))[1], jvp(R, (p,), (t,))[1], rtol=1e-10)
    assert close(jacrev(L)(p), jacrev(R)(p))


def test_vmap_over_jacobian(net: nn.Module, x: Tensor) -> None:
    p = other(net)
    stacked = {k: torch.stack([v, 0.5 * v]) for k, v in p.items()}
    L, R = jm_loss(net, "jacobian", x), oracle_loss(net, "jacobian", x)
    assert torch.allclose(vmap(L)(stacked), vmap(R)(stacked), rtol=1e-10)


@pytest.mark.parametrize("order", [1, 2, 3])
def test_derivative_grad_wrt_functional_params(order: int) -> None:
    torch.manual_seed(2)
    net = mlp(1, 1, width=8)
    t = torch.randn(6, dtype=DT)
    p = same(net)

    def L(p: Params) -> Tensor:
        u = lambda t: functional_call(net, p, (t[:, None],)).squeeze(-1)  # noqa: E731
        return jm.derivative(u, t, order=order, create_graph=True).pow(2).sum()

    def R(p: Params) -> Tensor:
        d: Callable[[Tensor], Tensor] = lambda tb: functional_call(net, p, (tb.reshape(1, 1),)).squeeze()  # noqa: E731
        for _ in range(order):
            d = grad(d)
        return vmap(d)(t).pow(2).sum()

    assert close(grad(L)(p), grad(R)(p))


def test_stateless_functional_call(net: nn.Module, x: Tensor) -> None:
    p = other(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of torch.func's
        got = jm.laplacian(lambda x: torch.nn.utils.stateless.functional_call(net, p, (x,)), x)
    assert torch.allclose(got, oracle_value(net, "laplacian", p, x), rtol=1e-10)


def test_functional_sgd_trains_as_torch_func_does() -> None:
    """20 functional SGD steps on a PINN-style loss over jm.laplacian."""
    torch.manual_seed(3)
    net = mlp(2, 1, width=16)
    x = torch.randn(32, 2, dtype=DT)
    target = torch.sin(x[:, :1]) * x[:, 1:]
    loss = lambda p: (jm.laplacian(lambda x: functional_call(net, p, (x,)), x, create_graph=True)  # noqa: E731
                      - target).pow(2).mean()
    ref = lambda p: (oracle_value(net, "laplacian", p, x) - target).pow(2).mean()  # noqa: E731
    curves = []
    for fn in (loss, ref):
        p, curve = same(net), []
        for _ in range(20):
            value, g = fn(p), grad(fn)(p)
            curve.append(float(value))
            p = {k: v - 0.5 * g[k] for k, v in p.items()}
        curves.append(curve)
    assert curves[1][-1] < 0.5 * curves[1][0]  # the oracle's training works
    assert curves[0] == pytest.approx(curves[1], rel=1e-8)


# Closures and globals rebound between calls.

W_GLOBAL = torch.randn(2, 3, dtype=DT)


def u_global(x: Tensor) -> Tensor:
    return torch.tanh(x @ W_GLOBAL)


def ref_jac(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return vmap(jacrev(lambda xb: fn(xb.unsqueeze(0)).squeeze(0)))(x)


def test_rebound_closure_and_global_are_read_per_call(x: Tensor) -> None:
    global W_GLOBAL
    W = torch.randn(2, 3, dtype=DT)

    def u(x: Tensor) -> Tensor:
        return torch.tanh(x @ W)

    for fn in (u, u_global):
        for step in range(3):
            assert torch.allclose(jm.jacobian(fn, x), ref_jac(fn, x), rtol=1e-10)
            assert torch.allclose(jm.laplacian(fn, x), ref_lap(fn, x), rtol=1e-10)
            if fn is u:
                W = W - 0.3 * torch.ones_like(W)  # rebinds the cell: W = W - lr * g
            else:
                W_GLOBAL = W_GLOBAL * 1.5
        program = _capture.program_for(fn)
        assert isinstance(program, Program) and [b.where for b in program.bound] == ["W" if fn is u else "W_GLOBAL"]


SCALE = torch.tensor([0.5, -1.0, 2.0], dtype=DT)
OPS = {"scaled": lambda h: torch.tanh(h * SCALE)}  # a helper whose global the forward reaches


class HelperNet(nn.Module):
    """A module whose forward reaches a global tensor only through a helper function in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3, dtype=DT)

    def forward(self, x: Tensor) -> Tensor:
        return OPS["scaled"](self.lin(x))


def test_tensors_behind_helpers_and_module_forwards_are_read_per_call(x: Tensor) -> None:
    global SCALE
    torch.manual_seed(5)
    net = HelperNet()
    for fn in (net, lambda x: net(x)):
        for _ in range(2):
            assert torch.allclose(jm.laplacian(fn, x), ref_lap(fn, x), rtol=1e-10)
            assert torch.allclose(jm.jacobian(fn, x), ref_jac(fn, x), rtol=1e-10)
            SCALE = SCALE * 1.5  # rebinds the helper's global
        program = _capture.program_for(fn)
        assert isinstance(program, Program) and [b.where.split(": ")[-1] for b in program.bound] == ["SCALE"]


def ref_lap(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    return _hess(lambda xb: fn(xb.unsqueeze(0)).squeeze(0), x).diagonal(dim1=-2, dim2=-1).sum(-1)


def test_dict_entries_replaced_and_shapes_changed(x: Tensor) -> None:
    torch.manual_seed(4)
    net = mlp()
    p = other(net)
    f = lambda x: functional_call(net, p, (x,))  # noqa: E731
    for _ in range(2):  # the first call caches nothing, the second captures and caches (_guard.py)
        assert torch.allclose(jm.laplacian(f, x), ref_lap(f, x), rtol=1e-10)
    p["0.weight"] = p["0.weight"] * 2  # an entry replaced
    assert torch.allclose(jm.laplacian(f, x), ref_lap(f, x), rtol=1e-10)
    # the program, in the scope of a call f(x) as entry points make it (the generation of f's state)
    program_of_f = lambda: _guard.scoped_call(f, (x,), {}, lambda: _capture.program_for(f))  # noqa: E731
    first = program_of_f()
    W = {"w": torch.randn(2, 3, dtype=DT)}
    g = lambda x: torch.tanh(x @ W["w"]).sum(-1, keepdim=True)  # noqa: E731
    for _ in range(2):
        assert torch.allclose(jm.laplacian(g, x), ref_lap(g, x), rtol=1e-10)
    W["w"] = torch.randn(2, 5, dtype=DT)  # another shape: captured again
    assert torch.allclose(jm.laplacian(g, x), ref_lap(g, x), rtol=1e-10)
    assert program_of_f() is first  # unchanged tensors: the same program


def test_captured_programs_do_not_keep_f_alive(net: nn.Module, x: Tensor) -> None:
    p = other(net)
    f = lambda x: functional_call(net, p, (x,))  # noqa: E731
    g = mlp()
    jm.laplacian(f, x), jm.laplacian(g, x)
    assert isinstance(_capture.program_for(f), Program) and isinstance(_capture.program_for(g), Program)
    refs = [weakref.ref(f), weakref.ref(g)]
    del f, g
    gc.collect()
    assert [r() for r in refs] == [None, None]


NU = 1.0


def test_python_values_frozen_into_the_graph_are_guarded(x: Tensor) -> None:
    """Numbers in closures, globals and the attributes of traced-through modules: a change re-traces."""
    global NU
    nu = {"nu": 1.0}

    def u(x: Tensor) -> Tensor:
        return torch.tanh(nu["nu"] * x * NU).sum(-1, keepdim=True)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.scale, self.skip = nn.Linear(2, 1).to(DT), 1.0, False

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.scale * x)
            return self.fc(h + x if self.skip else h)

    net = Scaled()
    for change in (lambda: nu.update(nu=2.0), lambda: globals().update(NU=3.0), lambda: setattr(net, "scale", 0.5),
                   lambda: setattr(net, "skip", True)):
        for fn in (u, net):
            assert torch.allclose(jm.laplacian(fn, x), ref_lap(fn, x), rtol=1e-10)
        change()
    for fn in (u, net):
        assert torch.allclose(jm.laplacian(fn, x), ref_lap(fn, x), rtol=1e-10)
    NU = 1.0


def test_tensors_the_graph_cannot_reread_take_the_generic_engine(x: Tensor) -> None:
    W = torch.randn(3, 2, dtype=DT)

    class Holder:
        pass

    h = Holder()
    h.w = torch.randn(2, 3, dtype=DT)  # type: ignore[attr-defined]
    eager = lambda x: torch.tanh(x @ W.T)  # noqa: E731 -- W.T computed while tracing
    hidden = lambda x: torch.tanh(x @ h.w)  # noqa: E731 -- reached through an object
    made = lambda x: torch.tanh(x * torch.tensor([1.0, 2.0], dtype=DT))  # noqa: E731 -- made inside f
    assert "eagerly from a tensor" in str(_capture.program_for(eager))
    assert "cannot read again on each call" in str(_capture.program_for(hidden))
    assert isinstance(_capture.program_for(made), Program)
    for fn in (eager, hidden, made):
        assert torch.allclose(jm.jacobian(fn, x), ref_jac(fn, x), rtol=1e-10)
    h.w = h.w * 3
    W = W * 3
    for fn in (eager, hidden):
        assert torch.allclose(jm.jacobian(fn, x), ref_jac(fn, x), rtol=1e-10)
    assert "generic engine: forward computes T eagerly" in str(jm.plan(eager, x, mode="forward"))


def test_plan_names_the_tensors_read_per_call(net: nn.Module, x: Tensor) -> None:
    p = other(net)
    text = str(jm.plan(lambda x: functional_call(net, p, (x,)), x, mode="forward"))
    assert "captured graph of F.linear, nn.Tanh" in text
    assert "reads f's tensors p['0.weight'], p['0.bias'], p['2.weight'] and 1 more on each call" in text


# A forward that swaps a layer's weight: the probe engine (wrt="params", the products).

class Swapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(2, 4), nn.Linear(4, 3)
        self.alt: Any = None  # {name: tensor} swapped into fc when set

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x) if self.alt is None else functional_call(self.fc, self.alt, (x,))
        return self.out(torch.tanh(h))


def ref_params(m: nn.Module, x: Tensor) -> Tensor:
    p = {n: t.detach() for n, t in m.named_parameters()}
    J = vmap(jacrev(lambda p, xb: functional_call(m, p, (xb[None],)).reshape(-1)), in_dims=(None, 0))(p, x)
    return torch.cat([J[n].reshape(x.shape[0], -1, p[n].numel()) for n in p], -1)


def test_probes_see_a_weight_swapped_after_the_completeness_check(x: Tensor) -> None:
    torch.manual_seed(5)
    m = Swapper().to(DT)
    for _ in range(2):
        assert torch.allclose(jm.jacobian(m, x, wrt="params", mode="reverse"), ref_params(m, x), rtol=1e-10)
        m.alt = {"weight": torch.randn(4, 2, dtype=DT), "bias": torch.randn(4, dtype=DT)}
        assert torch.allclose(jm.jacobian(m, x, wrt="params", mode="reverse"), ref_params(m, x), rtol=1e-10)
        J = ref_params(m, x)
        K = jm.ntk(m, x)
        assert torch.allclose(K, torch.einsum("ayp,bzp->abyz", J, J).reshape(K.shape), rtol=1e-10)
        m.alt = None


@settings(max_examples=12, deadline=None)
@given(width=st.integers(2, 6), depth=st.integers(1, 2), d=st.integers(1, 3),
       act=st.sampled_from([nn.Tanh, nn.Sigmoid, nn.SiLU]),
       name=st.sampled_from(["jacobian", "laplacian", "hessian", "divergence"]), shift=st.sampled_from([0.0, 0.5]))
def test_property_functional_params(width: int, depth: int, d: int, act: Any, name: str, shift: float) -> None:
    torch.manual_seed(width * 7 + depth)
    net = mlp(d, d, width=width, depth=depth, act=act)
    x = torch.randn(3, d, dtype=DT)
    p = other(net, shift)
    got = ENTRY[name][0](lambda x: functional_call(net, p, (x,)), x)
    assert torch.allclose(got, oracle_value(net, name, p, x).reshape(got.shape), rtol=1e-9, atol=1e-11)
    assert close(grad(jm_loss(net, name, x))(p), grad(oracle_loss(net, name, x))(p))
