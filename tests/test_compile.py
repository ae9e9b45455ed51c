"""jacmode's operators inside a user's torch.compile region (``_autodiff/traceable.py``).

Backends "eager" and "aot_eager" need no C++ compiler and are fast; the few inductor tests are
marked ``compile`` and skip where no compiler is found. Oracles: float64 eager jacmode results
and plain torch.func.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch import nn

import jacmode as jm

BACKENDS = ["eager", "aot_eager"]


class Pinn(nn.Module):
    def __init__(self, d: int = 2, h: int = 12) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.out(x)


def _compiled(fn, backend, fullgraph=True):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.compile(fn, backend=backend, fullgraph=fullgraph)


def _grads(net):
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pinn_training_step_inside_compile(backend):
    torch.manual_seed(0)
    net = Pinn().double()
    x = torch.rand(16, 2, dtype=torch.float64)

    def residual(x):
        u_t, u_xx = jm.partials(net, x, [(0,), (1, 1)], create_graph=True)
        return (u_t - 0.1 * u_xx).square().mean()

    compiled = _compiled(residual, backend)
    for _ in range(2):  # the second time after an optimizer step: the compiled code follows the parameters
        net.zero_grad()
        want = residual(x)
        want.backward()  # the backward pass of a compiled loss runs outside the compiled region
        g_want = _grads(net)
        net.zero_grad()
        got = compiled(x)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for a, b in zip(_grads(net), g_want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            for p in net.parameters():
                p.mul_(1.1)


@pytest.mark.parametrize("backend", ["eager"])  # aot_eager: see the training step (CI time)
def test_operators_inside_compile_match_eager(backend):
    torch.manual_seed(1)
    net = Pinn(3).double()
    net1 = Pinn(1).double()
    x = torch.rand(6, 3, dtype=torch.float64)
    t = torch.rand(6, dtype=torch.float64)
    w = torch.rand(3, 2, dtype=torch.float64)

    def all_of(x, t):
        return (jm.laplacian(net, x), jm.laplacian(net, x, weight=w), jm.derivative(net1, t, order=3),
                jm.partial(lambda z: torch.sin(z[:, :1]) * net(z), x, (2, 0)),
                jm.jacobian(net, x), jm.jacobian(net, x, mode="reverse"), jm.jacobian(net, x, batched=False))

    for got, want in zip(_compiled(all_of, backend)(x, t), all_of(x, t)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["eager"])
def test_parameter_jacobians_and_per_sample_grads_inside_compile(backend):
    torch.manual_seed(2)
    net = Pinn(3).double()
    x, y = torch.rand(5, 3, dtype=torch.float64), torch.rand(5, 1, dtype=torch.float64)
    loss = lambda out, y: ((out - y) ** 2).sum(1)  # noqa: E731

    def all_of(x, y):
        return (jm.jacobian(net, x, wrt="params"), jm.jacobian(net, x, wrt="params", mode="forward"),
                jm.jacobian(net, x, wrt=["fc2.weight"], flatten=False)["fc2.weight"],
                jm.per_sample_grads(net, x, loss, y=y))

    got, want = _compiled(all_of, backend)(x, y), all_of(x, y)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_without_fullgraph_and_clear_errors():
    net = Pinn().double()
    x = torch.rand(4, 2, dtype=torch.float64)
    lap = _compiled(lambda x: jm.laplacian(net, x), "eager", fullgraph=False)
    torch.testing.assert_close(lap(x), jm.laplacian(net, x), rtol=1e-10, atol=1e-12)
    # what the traceable path refuses: under fullgraph an error naming the cause (Dynamo wraps it in
    # its Unsupported), without fullgraph Dynamo runs the frame eagerly, so the eager engines serve it
    bn = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)).double().train()
    coupled = lambda x: jm.laplacian(net, x, structure="coupled")  # noqa: E731
    with pytest.raises(Exception, match="structure='coupled'"):
        _compiled(coupled, "eager")(x)
    torch.testing.assert_close(_compiled(coupled, "eager", fullgraph=False)(x), coupled(x), rtol=1e-10, atol=1e-12)
    with pytest.raises(Exception, match="BatchNorm in training mode"):
        _compiled(lambda x: jm.partial(bn, x, (0,)), "eager")(x)
    with pytest.raises(jm.CoupledBatchError, match="BatchNorm"):  # the eager call's own error
        _compiled(lambda x: jm.partial(bn, x, (0,)), "eager", fullgraph=False)(x)
    est = lambda x: jm.laplacian(net, x, samples=4, generator=torch.Generator().manual_seed(0))  # noqa: E731
    torch.testing.assert_close(_compiled(est, "eager", fullgraph=False)(x), est(x))


def _has_compiler() -> bool:
    if shutil.which("g++") is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        return False
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # noqa: BLE001 -- no usable compiler
        return False
    return True


@pytest.mark.compile
@pytest.mark.skipif(not _has_compiler(), reason="no C++ compiler for inductor")
def test_pinn_loss_inside_inductor():
    torch.manual_seed(3)
    net = Pinn(2, 8)
    x = torch.rand(32, 2)

    def loss(x):
        u_t, u_xx = jm.partials(net, x, [(0,), (1, 1)], create_graph=True)
        return (u_t - 0.1 * u_xx).square().mean()

    got = _compiled(loss, "inductor")(x)
    (g,) = torch.autograd.grad(got, [net.fc1.weight])
    want = loss(x)
    (g_want,) = torch.autograd.grad(want, [net.fc1.weight])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-5)


def test_dropout_inside_compile_runs():
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 1)).double().train()
    x = torch.rand(6, 3, dtype=torch.float64)
    lap = _compiled(lambda x: jm.laplacian(net, x), "eager")(x)
    jac = _compiled(lambda x: jm.jacobian(net, x), "eager")(x)
    assert lap.shape == (6, 1) and jac.shape == (6, 1, 3)
    assert torch.isfinite(lap).all() and torch.isfinite(jac).all()
    net.eval()
    torch.testing.assert_close(_compiled(lambda x: jm.laplacian(net, x), "eager")(x), jm.laplacian(net, x))
