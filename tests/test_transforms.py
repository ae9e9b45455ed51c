"""jacmode called inside torch.func transforms: exact, or a clear error.

Every entry point runs with ``create_graph=False`` (the default) inside ``grad``, ``jacrev``,
``jacfwd`` and ``vmap`` (see the note in ``_transforms.py``), on a model torch.fx traces (the
captured graph) and on one it cannot (the generic path, with the coupling probe), against
float64 torch.func oracles on the same per-sample function.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vmap

import jacmode as jm
from _zoo_models import one_intra_op_thread  # noqa: F401 -- tiny tensors: one thread

DT = torch.float64
torch.manual_seed(0)
NET = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)  # x (B, 2) -> (B, 2)
NET1 = nn.Sequential(nn.Linear(1, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)  # t (B, 1) -> (B, 2)


def per_row(net: nn.Module) -> Callable[[Tensor], Tensor]:
    """``net`` sample by sample: torch.fx cannot trace it, so jacmode takes the generic path."""
    return lambda x: torch.cat([net(x[b : b + 1]) for b in range(x.shape[0])])


def one(net: nn.Module) -> Callable[[Tensor], Tensor]:
    return lambda xb: net(xb[None])[0]


def _hess(u: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return vmap(torch.func.hessian(u))


def _param_jacobian(net: nn.Module, x: Tensor) -> Tensor:
    p = {k: v.detach() for k, v in net.named_parameters()}
    J = vmap(jacrev(lambda q, xb: functional_call(net, q, (xb[None],))[0]), in_dims=(None, 0))(p, x)
    return torch.cat([J[k].reshape(x.shape[0], 2, -1) for k in p], -1)


# name: (jacmode call of (f, x), oracle of (per-sample u, x), the model, wrt params)
ENTRY: dict[str, tuple[Callable[[Any, Tensor], Tensor], Callable[[Any, Tensor], Tensor], nn.Module]] = {
    "jacobian": (lambda f, x: jm.jacobian(f, x), lambda u, x: vmap(jacrev(u))(x), NET),
    "jacobian-forward": (lambda f, x: jm.jacobian(f, x, mode="forward"), lambda u, x: vmap(jacrev(u))(x), NET),
    "jacobian-forward-1": (lambda f, t: jm.jacobian(f, t, mode="forward"), lambda u, t: vmap(jacrev(u))(t), NET1),
    "jacobian-reverse": (lambda f, x: jm.jacobian(f, x, mode="reverse"), lambda u, x: vmap(jacrev(u))(x), NET),
    "jacobian-unbatched": (lambda f, x: jm.jacobian(f, x, batched=False), None, NET),
    "derivative": (lambda f, t: jm.derivative(f, t), lambda u, t: vmap(jacrev(u))(t)[..., 0], NET1),
    "derivative-2": (lambda f, t: jm.derivative(f, t, order=2), lambda u, t: _hess(u)(t)[..., 0, 0], NET1),
    "partial": (lambda f, x: jm.partial(f, x, (0, 1)), lambda u, x: _hess(u)(x)[..., 0, 1], NET),
    "partials": (lambda f, x: torch.cat(jm.partials(f, x, [(0,), (1, 1)]), -1),
                 lambda u, x: torch.cat([vmap(jacrev(u))(x)[..., 0], _hess(u)(x)[..., 1, 1]], -1), NET),
    "hessian": (lambda f, x: jm.hessian(f, x), lambda u, x: _hess(u)(x), NET),
    "laplacian": (lambda f, x: jm.laplacian(f, x), lambda u, x: _hess(u)(x).diagonal(dim1=-2, dim2=-1).sum(-1), NET),
    "divergence": (lambda f, x: jm.divergence(f, x),
                   lambda u, x: vmap(jacrev(u))(x).diagonal(dim1=-2, dim2=-1).sum(-1), NET),
}
PARAMS: dict[str, Callable[[nn.Module, Tensor], Tensor]] = {
    "jacobian-params": lambda net, x: jm.jacobian(net, x, wrt="params"),
    "jacobian-params-forward": lambda net, x: jm.jacobian(net, x, wrt="params", mode="forward"),
}


def _weights(r: Tensor) -> Tensor:
    """Fixed weights, no random op (vmap refuses those in its default randomness mode)."""
    return torch.arange(r.numel(), dtype=DT).mul(1.7).cos().add(0.3).reshape(r.shape)


def _transformed(how: str, value: Callable[[Tensor], Tensor], z: Tensor) -> Tensor:
    """``how`` (a torch.func transform) of a weighted sum of ``value``, at ``z``."""
    scalar = lambda v: (value(v) * _weights(value(v))).sum()  # noqa: E731
    if how == "grad":
        return grad(scalar)(z)
    if how == "jacrev":
        return jacrev(lambda v: (value(v) * _weights(value(v))).reshape(v.shape[0], -1).sum(1))(z)
    if how == "jacfwd":
        return jacfwd(scalar)(z)
    if how == "jvp":
        return jvp(scalar, (z,), (torch.ones_like(z),))[1]
    stack = torch.stack([z, 0.7 * z + 0.1])
    if how == "vmap":
        return vmap(value)(stack)
    return vmap(grad(scalar))(stack)  # vmap-grad


TRANSFORMS = ["grad", "jacrev", "jacfwd", "jvp", "vmap", "vmap-grad"]


@pytest.mark.parametrize("how", TRANSFORMS)
@pytest.mark.parametrize("path", ["captured", "generic"])
@pytest.mark.parametrize("name", sorted(ENTRY))
def test_input_derivatives_inside_transforms(name: str, path: str, how: str) -> None:
    call, oracle, net = ENTRY[name]
    f = net if path == "captured" else per_row(net)
    z = torch.randn(3, net[0].in_features, dtype=DT, generator=torch.Generator().manual_seed(3))
    want_of = (lambda v: jacrev(net)(v)) if oracle is None else (lambda v: oracle(one(net), v))
    got = _transformed(how, lambda v: call(f, v), z)
    want = _transformed(how, want_of, z)
    assert want.abs().max() > 1e-3  # not trivially zero
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", TRANSFORMS)
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_jacobians_inside_transforms(name: str, how: str) -> None:
    x = torch.randn(3, 2, dtype=DT, generator=torch.Generator().manual_seed(4))
    got = _transformed(how, lambda v: PARAMS[name](NET, v), x)
    want = _transformed(how, lambda v: _param_jacobian(NET, v), x)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_vmap_over_a_coupled_function_is_a_coupled_batch_error() -> None:
    """Inside vmap the coupling probe still runs (on all slices at once), never skipped."""
    f = lambda x: per_row(NET)(x).cumsum(0)  # noqa: E731 -- causal coupling, not traceable per row
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        vmap(lambda x: jm.jacobian(f, x))(torch.randn(2, 3, 2, dtype=DT))
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        vmap(lambda x: jm.laplacian(f, x))(torch.randn(2, 3, 2, dtype=DT))


def test_coupling_seen_in_one_vmap_slice_only() -> None:
    """A slice of the stacked batch that couples its samples is caught with the others clean."""
    def f(x: Tensor) -> Tensor:
        out = per_row(NET)(x)
        return out + 0.5 * out.sum(0, keepdim=True) * x[:, :1].sum().clamp(min=0)  # coupled only if sum > 0
    xs = torch.stack([-torch.ones(3, 2, dtype=DT), torch.ones(3, 2, dtype=DT)])
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        vmap(lambda x: jm.jacobian(f, x))(xs)


@pytest.mark.parametrize("how", ["grad", "jacfwd", "vmap"])
@pytest.mark.parametrize("name", ["ntk", "ggn", "sparse_jacobian", "sparse_hessian",  # per_sample_grads: test_funcparams
                                  "hessian-sparse", "sparsity"])
def test_products_and_sparse_inside_transforms_raise_clearly(name: str, how: str) -> None:
    y = torch.zeros(3, 2, dtype=DT)
    calls: dict[str, Callable[[Tensor], Tensor]] = {
        "per_sample_grads": lambda v: jm.per_sample_grads(NET, v, lambda o, t: ((o - t) ** 2).sum(-1), y=y),
        "ntk": lambda v: jm.ntk(NET, v),
        "ggn": lambda v: jm.ggn(NET, v, "mse"),
        "sparse_jacobian": lambda v: jm.sparse_jacobian(torch.sin, v.reshape(-1)).values(),
        "sparse_hessian": lambda v: jm.sparse_hessian(lambda u: u.pow(3).sum(), v.reshape(-1)).values(),
        "hessian-sparse": lambda v: jm.hessian(lambda u: u.pow(3).sum(), v.reshape(-1), structure="sparse").values(),
        "sparsity": lambda v: v * jm.sparsity(torch.sin, v.reshape(-1)).nnz,
    }
    x = torch.randn(3, 2, dtype=DT)
    with pytest.raises(ValueError, match=r"^f: jm\.\w+ cannot run inside a torch\.func transform.*outside"):
        _transformed(how, calls[name], x)


def test_ntk_of_an_input_that_requires_grad() -> None:
    """The footprint measurement ran f under no_grad on x requiring grad: torch's module tracker raised."""
    x = torch.randn(3, 2, dtype=DT, requires_grad=True)
    J = _param_jacobian(NET, x.detach())
    torch.testing.assert_close(jm.ntk(NET, x), torch.einsum("ayp,bzp->abyz", J, J), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_create_graph_false_outside_transforms_is_detached(name: str) -> None:
    """Plain autograd keeps torch's convention (autograd.grad, autograd.functional.jacobian): a
    create_graph=False result is a constant, never a partly connected graph."""
    call, _, net = ENTRY[name]
    x = torch.randn(3, net[0].in_features, dtype=DT, requires_grad=True)
    for f in (net, per_row(net)):
        assert not call(f, x).requires_grad


LINEAR = nn.Linear(2, 2).to(DT)
CONSTANT: dict[str, Callable[[Tensor], Any]] = {
    "laplacian": lambda x: jm.laplacian(LINEAR, x, create_graph=True),
    "hessian": lambda x: jm.hessian(LINEAR, x, create_graph=True),
    "partial": lambda x: jm.partial(LINEAR, x, (0, 1), create_graph=True),
    "partials": lambda x: jm.partials(LINEAR, x, [(0, 0), (1, 1)], create_graph=True)[1],
    "derivative": lambda x: jm.derivative(lambda t: 3.0 * t, x[:, :1], order=2, create_graph=True),
    "divergence": lambda x: jm.divergence(lambda z: 2.0 * z, x, create_graph=True),
    "jacobian": lambda x: jm.jacobian(lambda z: 2.0 * z, x, create_graph=True),
}


@pytest.mark.parametrize("name", sorted(CONSTANT))
def test_constant_create_graph_results_are_connected_zeros(name: str) -> None:
    """As torch.func does: a constant derivative still requires grad and backpropagates zeros."""
    x = torch.randn(3, 2, dtype=DT, requires_grad=True)
    r = CONSTANT[name](x)
    assert r.requires_grad
    r.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))
    assert all(p.grad is None or torch.equal(p.grad, torch.zeros_like(p)) for p in LINEAR.parameters())
    LINEAR.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["grad", "jacfwd", "vmap"])
@pytest.mark.parametrize("wrt", ["inputs", "params"])
def test_jacobians_of_a_data_set_inside_transforms(wrt: str, how: str) -> None:
    x = torch.randn(4, 2, dtype=DT, generator=torch.Generator().manual_seed(5))
    got = _transformed(how, lambda v: torch.cat(list(jm.jacobians(NET, iter([v[:2], v[2:]]), wrt=wrt))), x)
    want_of = (lambda v: vmap(jacrev(one(NET)))(v)) if wrt == "inputs" else (lambda v: _param_jacobian(NET, v))
    torch.testing.assert_close(got, _transformed(how, want_of, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("batch", [1, 3])
def test_vmap_over_a_coupled_jacobian(mode: str, batch: int) -> None:
    """Found by the harness soak: the whole-batch strategy wrote batched blocks into a preallocated
    result under vmap (a raw shape error, or wrong numbers: off by 0.022 at B = 1)."""
    f = lambda x: torch.sigmoid(torch.sigmoid(x))  # noqa: E731
    xs = torch.randn(2, batch, 2, dtype=torch.float64)
    got = torch.func.vmap(lambda x: jm.jacobian(f, x, mode=mode, structure="coupled"))(xs)
    ref = torch.stack([torch.stack([torch.func.jacrev(lambda v, x=x, b=b: f(torch.cat([x[:b], v[None], x[b + 1:]]))[b])(x[b])
                                    for b in range(batch)]) for x in xs])
    torch.testing.assert_close(got, ref)


class _PerRow(nn.Module):
    """``net`` sample by sample: torch.fx cannot trace the loop, so the generic engines run."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.net(x[b : b + 1]) for b in range(x.shape[0])])


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("generic", [False, True], ids=["module", "lambda"])
def test_vmap_over_a_chunked_parameter_jacobian(mode: str, chunk: int, generic: bool) -> None:
    """Found by the harness (KNOWN "jacobian(wrt='params') under vmap with a chunk_size"): a chunk
    wrote its block, batched by the user's vmap, into a result allocated from the unbatched
    parameters; vmap refused the in-place write, the fallback's autograd loops then ended in a raw
    'does not require grad'. The blocks now go in out of place under a transform."""
    f: Any = NET if not generic else _PerRow(NET)
    xs = torch.randn(4, 3, 2, dtype=DT, generator=torch.Generator().manual_seed(7))
    got = vmap(lambda x: jm.jacobian(f, x, wrt="params", mode=mode, chunk_size=chunk))(xs)
    want = torch.stack([_param_jacobian(NET, x) for x in xs])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_vmap_over_partials_through_group_norm() -> None:
    """Found by the harness soak: torch's group_norm kernel needs a contiguous input, which the
    generic engine's batched tangents under vmap need not be (a raw "Expected X.is_contiguous");
    the generic engines now run group_norm in primitive ops inside transforms."""
    torch.manual_seed(0)
    gn = torch.nn.GroupNorm(2, 4)

    def f(x: torch.Tensor) -> torch.Tensor:
        return gn(x.reshape(x.shape[0], 4)).relu().reshape(x.shape[0], 2, 2)

    xs = torch.randn(2, 2, 2, 2)
    got = torch.func.vmap(lambda x: jm.partials(f, x, [(1,)], chunk_size=1)[0])(xs)
    ref = torch.stack([torch.stack([torch.func.jacrev(lambda v: f(v[None])[0])(x[b]).reshape(4, 4)[:, 1].reshape(2, 2)
                                    for b in range(2)]) for x in xs])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # float32: the kernel's failure shows there
