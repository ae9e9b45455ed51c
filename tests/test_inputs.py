"""Per-sample input Jacobians: every mode x batched/unbatched x function against float64 references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmode as jm
from conftest import Opaque, Wide, mlp_1_4, ref_input_jacobian

MODES = ["auto", "forward", "reverse"]


def elementwise(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * x.exp()


def plain(x: torch.Tensor) -> torch.Tensor:
    """A plain callable with 2 inputs and 3 outputs per sample."""
    a, b = x[:, 0], x[:, 1]
    return torch.stack([a * b, torch.tanh(a) + b**2, torch.log1p(a**2) * b], dim=1)


CASES = {
    "mlp_1_4": (lambda: mlp_1_4().double(), (5, 1)),
    "wide": (lambda: Wide().double(), (3, 3, 5)),
    "elementwise": (lambda: elementwise, (4, 3)),
    "plain": (lambda: plain, (6, 2)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_size", [None, 1, 2])
def test_batched_matches_reference(case: str, mode: str, chunk_size: int | None) -> None:
    make, shape = CASES[case]
    f, x = make(), torch.randn(*shape, dtype=torch.float64)
    got = jm.jacobian(f, x, mode=mode, chunk_size=chunk_size)
    torch.testing.assert_close(got, ref_input_jacobian(f, x))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_unbatched_matches_reference(case: str, mode: str) -> None:
    make, shape = CASES[case]
    f, x = make(), torch.randn(*shape, dtype=torch.float64)
    got = jm.jacobian(f, x, mode=mode, batched=False, chunk_size=3)
    torch.testing.assert_close(got, ref_input_jacobian(f, x, batched=False))


@pytest.mark.parametrize("mode", MODES)
def test_diagonal_structure(mode: str) -> None:
    x = torch.randn(7, 3, dtype=torch.float64)
    got = jm.jacobian(elementwise, x, mode=mode, structure="diagonal")
    full = ref_input_jacobian(elementwise, x.reshape(-1), batched=False)
    torch.testing.assert_close(got, full.diagonal().reshape(x.shape))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_coupled_structure_gives_exact_diagonal_blocks(mode: str, chunk_size: int | None) -> None:
    f = lambda z: torch.tanh(z - z.mean(0)) * z  # noqa: E731
    x = torch.randn(4, 3, dtype=torch.float64)
    got = jm.jacobian(f, x, mode=mode, structure="coupled", chunk_size=chunk_size)
    full = torch.autograd.functional.jacobian(f, x)  # (B, 3, B, 3)
    want = torch.stack([full[b, :, b] for b in range(4)])
    torch.testing.assert_close(got, want)


def test_users_loop_and_full_jacobian_diagonal_reproduced() -> None:
    """Problem 2 of problems.md: the users' loop and the reply's full-Jacobian-then-diagonal."""
    net = mlp_1_4().double()
    t = torch.linspace(0, 2, 9, dtype=torch.float64).unsqueeze(1)
    loop = torch.zeros(9, 4, dtype=torch.float64)
    for i in range(9):
        ti = t[i].clone().requires_grad_(True)
        yi = net(ti)
        for j in range(4):
            loop[i, j] = torch.autograd.grad(yi[j], ti, retain_graph=True)[0][0]
    full = torch.autograd.functional.jacobian(net, t)  # (B, 4, B, 1)
    diag = torch.einsum("bibj->bij", full)[..., 0]
    torch.testing.assert_close(diag, loop)
    torch.testing.assert_close(jm.derivative(net, t), loop)
    torch.testing.assert_close(jm.derivative(lambda s: net(s.unsqueeze(1)), t.squeeze(1)), loop)
    torch.testing.assert_close(jm.jacobian(net, t, mode="reverse")[..., 0], loop)


def test_nan_sample_stays_in_its_rows() -> None:
    net = mlp_1_4().double()
    t = torch.randn(6, 1, dtype=torch.float64)
    t[2] = float("nan")
    for mode in MODES:
        got = jm.jacobian(net, t, mode=mode)
        assert got[2].isnan().all()
        keep = [0, 1, 3, 4, 5]
        torch.testing.assert_close(got[keep], ref_input_jacobian(net, t[keep]))


@pytest.mark.parametrize("mode", MODES)
def test_empty_batch(mode: str) -> None:
    got = jm.jacobian(Wide().double(), torch.zeros(0, 3, 5, dtype=torch.float64), mode=mode)
    assert got.shape == (0, 2, 3, 2, 3, 5)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_create_graph_pinn_loss_gradient(mode: str) -> None:
    """The parameter gradient of a loss on dy/dt equals the one built with autograd.grad."""
    net = mlp_1_4().double()
    t = torch.rand(8, 1, dtype=torch.float64)
    dydt = jm.jacobian(net, t, mode=mode, create_graph=True)[..., 0]
    loss = (dydt - net(t)).square().mean()
    got = torch.autograd.grad(loss, list(net.parameters()))

    tt = t.clone().requires_grad_(True)
    y = net(tt)
    ref_dydt = torch.stack(
        [torch.autograd.grad(y[:, j].sum(), tt, create_graph=True)[0][:, 0] for j in range(4)], dim=1
    )
    ref_loss = (ref_dydt - net(t)).square().mean()
    want = torch.autograd.grad(ref_loss, list(net.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_create_graph_differentiable_wrt_inputs() -> None:
    t = torch.rand(5, 1, dtype=torch.float64, requires_grad=True)
    d = jm.jacobian(lambda s: s**3, t, create_graph=True)  # 3 t^2
    (g,) = torch.autograd.grad(d.sum(), t)
    torch.testing.assert_close(g, 6 * t.detach())


def test_results_are_detached_without_create_graph() -> None:
    net = mlp_1_4()
    t = torch.rand(5, 1, requires_grad=True)
    assert not jm.jacobian(net, t).requires_grad
    assert not jm.jacobian(net, t, wrt="params").requires_grad


def test_plan_agrees_with_jacobian() -> None:
    net = mlp_1_4()
    p = jm.plan(net, torch.rand(100, 1))
    # D = 1, Y = 4: one shared seed either way; the measured cost model decides (a near tie)
    assert p.strategy == "broadcast" and p.directions == {"forward": 1, "reverse": 4}[p.mode]
    assert "forward" in repr(p) and "why" in repr(p)
    total = lambda x: x.sum(1, keepdim=True)  # noqa: E731
    p = jm.plan(Opaque(total), torch.rand(10, 50))  # the generic engines: one vjp beats 50 jvps
    assert (p.mode, p.strategy) == ("reverse", "broadcast")
    p = jm.plan(total, torch.rand(10, 50))  # captured: 50 directions in one op-by-op pass
    assert "captured graph of Tensor.sum" in repr(p)
    assert jm.plan(net, torch.rand(3, 1), batched=False).strategy == "full"
    assert jm.plan(torch.sin, torch.rand(3, 2), structure="diagonal").strategy == "diagonal"
