"""PINN operators against float64 references built from nested torch.autograd.grad loops.

Every operator runs on both engines: the Taylor fast path (an ``nn.Sequential`` of Linear and
known activations) and nested forward mode (the same network behind a lambda, or with an activation
the fast path does not know, such as sin). References differentiate one sample at a time.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import jacmode as jm
from jacmode import _derivatives, _problem
from jacmode._autodiff import nested as _nested
from jacmode._capture import taylor as _taylor
from conftest import Opaque, assert_unchanged, snapshot

DT = torch.float64


class Sin(nn.Module):
    """sin activation: unknown to the fast path, so always the nested forward path."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x)


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh,
    "sin": Sin,
    "softplus": lambda: nn.Softplus(beta=1.5),
}


def mlp(d_in: int, d_out: int, act: str = "tanh", width: int = 7) -> nn.Sequential:
    a = ACTIVATIONS[act]
    return nn.Sequential(nn.Linear(d_in, width), a(), nn.Linear(width, width), a(),
                         nn.Linear(width, d_out)).to(DT)


def as_generic(net: nn.Module, generic: bool) -> Callable[[Tensor], Tensor]:
    return Opaque(net) if generic else net


# --- references: one sample at a time, nested torch.autograd.grad with create_graph ---------


def _leaf(x: Tensor) -> Tensor:
    return x if x.requires_grad else x.detach().requires_grad_(True)


def _grad(out: Tensor, x: Tensor) -> Tensor:
    if not out.requires_grad:  # a constant (the previous derivative was already zero)
        return torch.zeros_like(x)
    g = torch.autograd.grad(out, x, create_graph=True, allow_unused=True)[0]
    return torch.zeros_like(x) if g is None else g


def ref_partial(f: Callable[[Tensor], Tensor], x: Tensor, dims: Sequence[int]) -> Tensor:
    """(B, *out): for each sample and output, one grad per entry of dims."""
    x, rows = _leaf(x), []
    for b in range(x.shape[0]):
        xb = x[b : b + 1]
        out = f(xb)[0]
        vals = []
        for o in out.reshape(-1):
            g = o
            for d in dims:
                g = _grad(g, xb).reshape(-1)[d]
            vals.append(g)
        rows.append(torch.stack(vals).reshape(out.shape))
    return torch.stack(rows)


def ref_hessian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """(B, Y, D, D) for x of shape (B, D)."""
    x, rows = _leaf(x), []
    for b in range(x.shape[0]):
        xb = x[b : b + 1]
        out = f(xb)[0].reshape(-1)
        per_out = []
        for o in out:
            g = _grad(o, xb)[0]
            per_out.append(torch.stack([_grad(gd, xb)[0] for gd in g]))
        rows.append(torch.stack(per_out))
    return torch.stack(rows)


def ref_divergence(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    x, rows = _leaf(x), []
    for b in range(x.shape[0]):
        xb = x[b : b + 1]
        out = f(xb)[0]
        rows.append(sum(_grad(out[d], xb)[0, d] for d in range(x.shape[1])))
    return torch.stack(rows)


def grads(loss: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    gs = torch.autograd.grad(loss, list(tensors), allow_unused=True, retain_graph=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, tensors)]


def check_training(model: nn.Module, ours: Tensor, ref: Tensor, x: Tensor) -> None:
    """The same loss built from ours and from the reference has the same gradients."""
    w = torch.randn_like(ref)
    targets = [*model.parameters(), x]
    for g, r in zip(grads((ours * w).sum(), targets), grads((ref * w).sum(), targets)):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-10)


SHAPES = [(1, 1), (2, 3), (3, 2), (5, 1)]


# --- derivative and partial -----------------------------------------------------------------


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_derivative_orders(act: str, generic: bool, order: int) -> None:
    net = mlp(1, 3, act)
    f = as_generic(net, generic)
    t = torch.randn(4, 1, dtype=DT, requires_grad=True)
    ours = jm.derivative(f, t, order, create_graph=True)
    ref = ref_partial(f, t, (0,) * order)
    assert ours.shape == (4, 3)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-10)
    check_training(net, ours, ref, t)


def test_derivative_of_flat_t() -> None:
    net = mlp(1, 2)
    f = lambda t: net(t.unsqueeze(1))  # noqa: E731
    t = torch.randn(5, dtype=DT)
    ours = jm.derivative(f, t, 2)
    torch.testing.assert_close(ours, ref_partial(f, t, (0, 0)))
    assert ours.shape == (5, 2) and not ours.requires_grad


CASES = [((1, 1), (0,)), ((2, 3), (1, 1)), ((2, 1), (0, 1)), ((3, 2), (0, 2, 2)),
         ((5, 1), (4, 0)), ((3, 3), (1, 1, 2, 0)), ((4, 2), (3,))]


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
@pytest.mark.parametrize("shape,dims", CASES)
def test_partial(act: str, generic: bool, shape: tuple[int, int], dims: tuple[int, ...]) -> None:
    net = mlp(*shape, act)
    f = as_generic(net, generic)
    x = torch.randn(3, shape[0], dtype=DT, requires_grad=True)
    ours = jm.partial(f, x, dims, create_graph=True)
    ref = ref_partial(f, x, dims)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-10)
    check_training(net, ours, ref, x)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=4))
def test_taylor_matches_nested_for_any_dims(dims: list[int]) -> None:
    torch.manual_seed(1)
    net = mlp(3, 2)
    x = torch.randn(4, 3, dtype=DT)
    torch.testing.assert_close(jm.partial(net, x, dims), jm.partial(Opaque(net), x, dims))


# --- hessian, laplacian, divergence ----------------------------------------------------------


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
@pytest.mark.parametrize("shape", SHAPES)
def test_hessian_and_laplacian(act: str, generic: bool, shape: tuple[int, int]) -> None:
    net = mlp(*shape, act)
    f = as_generic(net, generic)
    x = torch.randn(3, shape[0], dtype=DT, requires_grad=True)
    ref = ref_hessian(f, x)
    hess = jm.hessian(f, x, create_graph=True)
    assert hess.shape == (3, shape[1], shape[0], shape[0])
    torch.testing.assert_close(hess, ref, rtol=1e-9, atol=1e-10)
    check_training(net, hess, ref, x)
    lap = jm.laplacian(f, x, create_graph=True)
    ref_lap = ref.diagonal(dim1=-2, dim2=-1).sum(-1)
    torch.testing.assert_close(lap, ref_lap, rtol=1e-9, atol=1e-10)
    check_training(net, lap, ref_lap, x)


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
@pytest.mark.parametrize("d", [1, 2, 5])
def test_divergence(act: str, generic: bool, d: int) -> None:
    net = mlp(d, d, act)
    f = as_generic(net, generic)
    x = torch.randn(4, d, dtype=DT, requires_grad=True)
    ours = jm.divergence(f, x, create_graph=True)
    ref = ref_divergence(f, x)
    assert ours.shape == (4,)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-10)
    check_training(net, ours, ref, x)


def test_shapes_of_multi_dimensional_inputs_and_outputs() -> None:
    lin = nn.Linear(4, 6).to(DT)
    f = lambda x: torch.tanh(lin(x.flatten(1))).reshape(-1, 2, 3)  # noqa: E731  (B, 2, 2) -> (B, 2, 3)
    x = torch.randn(3, 2, 2, dtype=DT)
    hess = jm.hessian(f, x)
    assert hess.shape == (3, 2, 3, 2, 2, 2, 2)
    flat = ref_hessian(lambda z: f(z.reshape(-1, 2, 2)).flatten(1), x.flatten(1))
    torch.testing.assert_close(hess.reshape(3, 6, 4, 4), flat)
    lap = jm.laplacian(f, x)
    torch.testing.assert_close(lap, flat.diagonal(dim1=-2, dim2=-1).sum(-1).reshape(3, 2, 3))
    torch.testing.assert_close(jm.partial(f, x, (3, 1)), flat[:, :, 3, 1].reshape(3, 2, 3))


# --- the fast path: every activation it knows, against the nested path ----------------------

KNOWN = {
    "Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid, "SiLU": nn.SiLU, "ReLU": nn.ReLU, "GELU": nn.GELU,
    "LeakyReLU": lambda: nn.LeakyReLU(0.2), "Identity": nn.Identity,
    "Softplus": lambda: nn.Softplus(beta=2.0, threshold=1.0),  # threshold hit by some samples
}


@pytest.mark.parametrize("name", list(KNOWN))
def test_fast_path_activations(name: str) -> None:
    act = KNOWN[name]()
    net = nn.Sequential(nn.Linear(2, 6), act, nn.Linear(6, 6), act, nn.Linear(6, 2)).to(DT)  # act shared
    assert _problem.captured(net, torch.zeros(3, 2, dtype=DT))[0] is not None
    x = torch.randn(5, 2, dtype=DT) * 2
    for dims in [(0,), (1, 1), (0, 1, 1), (1, 1, 1, 1)]:
        expected = ref_partial(net, x, dims)
        torch.testing.assert_close(jm.partial(net, x, dims), expected, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(jm.hessian(net, x), ref_hessian(net, x), rtol=1e-9, atol=1e-10)


def test_fast_path_is_declined_when_it_would_be_wrong() -> None:
    net = mlp(2, 1)
    x2, x3 = torch.zeros(3, 2, dtype=DT), torch.zeros(3, 3, dtype=DT)
    assert _problem.captured(net, x2)[0] is not None
    assert _problem.captured(lambda x: net(x), x2)[0] is not None
    assert _problem.captured(net, x3)[0] is None  # width does not match: f itself fails
    assert "no rule for Tensor.cumsum" in _problem.captured(lambda x: net(x).cumsum(1), x2)[1]
    handle = net[1].register_forward_hook(lambda m, i, o: o * 2)
    assert "has hooks" in _problem.captured(net, x2)[1]
    x = torch.randn(3, 2, dtype=DT)
    torch.testing.assert_close(jm.partial(net, x, (0, 0)), ref_partial(net, x, (0, 0)))
    handle.remove()


def test_zero_derivatives_and_empty_batch() -> None:
    relu = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3)).to(DT)
    x = torch.randn(3, 2, dtype=DT)
    assert torch.equal(jm.partial(relu, x, (0, 1)), torch.zeros(3, 3, dtype=DT))
    assert torch.equal(jm.laplacian(nn.Sequential(nn.Linear(2, 3)).to(DT), x), torch.zeros(3, 3, dtype=DT))
    assert jm.partial(relu, x[:0], (0,)).shape == (0, 3)
    assert jm.hessian(relu, x[:0]).shape == (0, 3, 2, 2)


def test_reverse_fallback_for_ops_without_forward_mode() -> None:
    # silu_backward has no forward-mode rule, so nested jvp cannot differentiate SiLU twice.
    lin1, lin2 = nn.Linear(3, 5).to(DT), nn.Linear(5, 2).to(DT)
    f = lambda x: lin2(nn.functional.silu(lin1(x)))  # noqa: E731
    x = torch.randn(4, 3, dtype=DT)
    torch.testing.assert_close(jm.partial(f, x, (0, 2, 2)), ref_partial(f, x, (0, 2, 2)))
    ref = ref_hessian(f, x)
    torch.testing.assert_close(jm.hessian(f, x, chunk_size=2), ref)
    torch.testing.assert_close(jm.laplacian(f, x), ref.diagonal(dim1=-2, dim2=-1).sum(-1))


# --- chunks, coupling, state -----------------------------------------------------------------


@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
def test_chunks_give_the_same_results(generic: bool) -> None:
    net = mlp(3, 3)
    f = as_generic(net, generic)
    x = torch.randn(5, 3, dtype=DT)
    for chunk in (1, 2):
        torch.testing.assert_close(jm.partial(f, x, (0, 1), chunk_size=chunk), jm.partial(f, x, (0, 1)))
        torch.testing.assert_close(jm.hessian(f, x, chunk_size=chunk), jm.hessian(f, x))
        torch.testing.assert_close(jm.laplacian(f, x, chunk_size=chunk), jm.laplacian(f, x))
        torch.testing.assert_close(jm.divergence(f, x, chunk_size=chunk), jm.divergence(f, x))


def test_coupled_samples() -> None:
    net = mlp(2, 2)
    f = lambda x: net(x - x.mean(0, keepdim=True))  # noqa: E731
    x = torch.randn(4, 2, dtype=DT)
    jm.clear_cache()
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        jm.partial(f, x, (0,))
    # exact per-sample derivatives with the other samples held fixed, from the whole batch
    xx = x.clone().requires_grad_(True)
    out = f(xx)
    ref = torch.zeros(4, 2, dtype=DT)
    for b in range(4):
        for y in range(2):
            g = _grad(out[b, y], xx)[b, 1]
            ref[b, y] = _grad(g, xx)[b, 1]
    for chunk in (None, 3):
        torch.testing.assert_close(jm.partial(f, x, (1, 1), structure="coupled", chunk_size=chunk), ref)
        lap = jm.laplacian(f, x, structure="coupled", chunk_size=chunk)
        parts = [jm.partial(f, x, (d, d), structure="coupled")[:, 0] for d in range(2)]
        torch.testing.assert_close(lap[:, 0], parts[0] + parts[1])


def test_batchnorm_in_training_is_refused() -> None:
    net = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).to(DT)
    before = snapshot(net)
    with pytest.raises(jm.CoupledBatchError, match="BatchNorm"):
        jm.laplacian(net, torch.randn(8, 2, dtype=DT))
    assert_unchanged(net, before)


def test_model_left_unchanged_and_no_graph_by_default() -> None:
    net = mlp(2, 1)
    net[0].weight.grad = torch.ones_like(net[0].weight)
    before = snapshot(net)
    x = torch.randn(3, 2, dtype=DT, requires_grad=True)
    for out in (jm.partial(net, x, (0, 1)), jm.hessian(net, x), jm.laplacian(net, x),
                jm.derivative(lambda t: net(t.expand(-1, 2)), x[:, :1], 2)):
        assert not out.requires_grad
    assert_unchanged(net, before)


# --- argument errors -------------------------------------------------------------------------


def test_argument_errors() -> None:
    net = mlp(2, 1)
    x = torch.randn(3, 2, dtype=DT)
    with pytest.raises(ValueError, match=r"t: expected one scalar per sample, shape \(B,\) or \(B, 1\)"):
        jm.derivative(net, x)
    with pytest.raises(ValueError, match="order: expected a positive int"):
        jm.derivative(net, x[:, :1], order=0)
    with pytest.raises(TypeError, match="order: expected a positive int, got float"):
        jm.derivative(net, x[:, :1], order=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="order: expected a positive int, got bool"):
        jm.derivative(net, x[:, :1], order=True)
    with pytest.raises(TypeError, match="t: expected a torch.Tensor"):
        jm.derivative(net, [0.0, 1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dims: expected a tuple of input coordinates"):
        jm.partial(net, x, "xx")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dims: expected a tuple of input coordinates"):
        jm.partial(net, x, (0.5,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dims: expected at least one coordinate"):
        jm.partial(net, x, ())
    with pytest.raises(ValueError, match=r"dims: coordinate 2 is out of range.*D = 2"):
        jm.partial(net, x, (0, 2))
    with pytest.raises(ValueError, match="structure: 'diagonal' does not apply"):
        jm.laplacian(net, x, structure="diagonal")
    with pytest.raises(ValueError, match="structure: expected one of"):
        jm.hessian(net, x, structure="banded")  # "sparse" is a valid structure
    with pytest.raises(ValueError, match="chunk_size: expected a positive number"):
        jm.laplacian(net, x, chunk_size=0)
    with pytest.raises(TypeError, match="create_graph: expected True or False"):
        jm.divergence(net, x, create_graph="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="f: expected an nn.Module or a callable"):
        jm.hessian("net", x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x: differentiating with respect to the inputs needs a real"):
        jm.laplacian(net, torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"f: divergence needs a vector field.*\(2,\) to \(1,\)"):
        jm.divergence(net, x)


def test_negative_dims_count_from_the_end() -> None:
    net = mlp(3, 1)
    x = torch.randn(2, 3, dtype=DT)
    torch.testing.assert_close(jm.partial(net, x, (-1, 0)), jm.partial(net, x, (2, 0)))
    torch.testing.assert_close(jm.partial(net, x, 1), jm.partial(net, x, (1,)))


def test_worked_example_trains() -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pinn_oscillator.py"
    spec = importlib.util.spec_from_file_location("pinn_oscillator", path)
    example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    t = torch.linspace(0, 1, 16).unsqueeze(1)

    def loss(steps: int) -> float:
        pde, ic = example.losses(example.train(steps)[0], t, torch.zeros(1, 1))
        return (pde + 10 * ic).item()

    assert loss(30) < 0.1 * loss(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
def test_cuda_matches_cpu(generic: bool) -> None:
    import copy

    net = mlp(3, 2)
    f_cpu, f_gpu = as_generic(net, generic), as_generic(copy.deepcopy(net).cuda(), generic)
    x = torch.randn(6, 3, dtype=DT)
    for op in (lambda f, x: jm.partial(f, x, (0, 1, 1)), jm.hessian, jm.laplacian):
        gpu = op(f_gpu, x.cuda())
        assert gpu.device.type == "cuda"
        torch.testing.assert_close(gpu.cpu(), op(f_cpu, x))


def test_default_passes_stay_within_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from jacmode import _operands

    net = mlp(4, 1, width=8)
    x = torch.randn(16, 4, dtype=DT)
    expected = jm.hessian(net, x)
    calls = []
    original = _taylor.pairs
    monkeypatch.setattr(_taylor, "pairs", lambda *a: calls.append(len(a[3])) or original(*a))
    monkeypatch.setattr(_operands, "DEFAULT_PASS_BYTES", 3 * 16 * 8 * 8)  # three pairs of width 8
    monkeypatch.setattr(_derivatives, "ROW_COST", 1e30)  # the pairs (D = 4 would take the rows)
    torch.testing.assert_close(jm.hessian(net, x), expected)
    assert calls == [3, 3, 3, 1]
    # the rows (forward over reverse, see [Rows or pairs]): three rows of width 8 per pass, as well
    rows, original_rows = [], _nested.rows
    monkeypatch.setattr(_nested, "rows", lambda *a: rows.append(len(a[2])) or original_rows(*a))
    monkeypatch.setattr(_derivatives, "ROW_COST", 0.0)
    torch.testing.assert_close(jm.hessian(net, x), expected)
    assert rows == [3, 1]
