"""Inputs that used to give torch's raw errors: inference mode, 0-d points, tuples."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import jacmode as jm

DT = torch.float64


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.relu(self.fc1(x)))


def loss(out: Tensor) -> Tensor:
    return out.pow(2).sum(1)


CALLS: dict[str, Callable[[nn.Module, Tensor], Tensor]] = {
    "jacobian params": lambda f, x: jm.jacobian(f, x, wrt="params"),
    "jacobian inputs": lambda f, x: jm.jacobian(f, x),
    "per_sample_grads": lambda f, x: jm.per_sample_grads(f, x, loss),
    "ntk": lambda f, x: jm.ntk(f, x),
    "ggn": lambda f, x: jm.ggn(f, x),
    "ggn diagonal": lambda f, x: jm.ggn(f, x, diagonal=True),
    "laplacian": lambda f, x: jm.laplacian(f, x),
}


@pytest.mark.parametrize("first", ["outside", "inside"])
@pytest.mark.parametrize("name", list(CALLS))
def test_inference_mode_computes_as_torch_func_does(name: str, first: str) -> None:
    """torch.func differentiates under inference mode; so does jacmode, whichever call came first."""
    jm.clear_cache()
    torch.manual_seed(0)
    net, x = MLP().to(DT), torch.randn(4, 6, dtype=DT)
    call = CALLS[name]
    if first == "outside":
        want = call(net, x)
    with torch.inference_mode():
        got = call(net, x)
    if first == "inside":
        want = call(net, x)  # and the call inside left nothing behind that breaks the one outside
    torch.testing.assert_close(got, want)
    if name == "jacobian params":
        params = {n: p.detach() for n, p in net.named_parameters()}
        with torch.inference_mode():
            ref = jacrev(lambda p: functional_call(net, p, (x,)))(params)
        torch.testing.assert_close(got, torch.cat([ref[n].reshape(4, 3, -1) for n in params], -1))


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_zero_dim_point_gives_the_full_jacobian(mode: str) -> None:
    x = torch.tensor(0.7, dtype=DT)
    for f in (torch.sin, lambda t: torch.stack([t.sin(), t * t, 2 * t])):
        got = jm.jacobian(f, x, batched=False, mode=mode)
        want = jacrev(f)(x)  # shape (*out,)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_zero_dim_point_and_zero_dim_parameters(mode: str) -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.tensor(1.5, dtype=DT))
            self.w = nn.Parameter(torch.tensor([0.5, -2.0], dtype=DT))

        def forward(self, t: Tensor) -> Tensor:
            return (self.a * t * self.w).sum()  # 0-d in, 0-d out

    net, t = Scale(), torch.tensor(0.3, dtype=DT)
    params = {n: p.detach() for n, p in net.named_parameters()}
    ref = jacrev(lambda p: functional_call(net, p, (t,)))(params)
    got = jm.jacobian(net, t, wrt="params", batched=False, mode=mode, flatten=False)
    for n in params:
        assert got[n].shape == ref[n].shape
        torch.testing.assert_close(got[n], ref[n])
    flat = jm.jacobian(net, t, wrt="params", batched=False, mode=mode)
    torch.testing.assert_close(flat, torch.cat([ref[n].reshape(1, -1) for n in params], -1))


PARAMS_TUPLE = r"x: got a (tuple|list) of 2 items, which jm.jacobian\(model, x, wrt='params'\) would pass"


def test_several_tensors_are_a_pytree_argument_or_told_the_real_fix() -> None:
    """One tuple, list or dict of tensors is one pytree argument, as in torch.func; for
    parameters, a tuple or list is refused with the several-arguments spelling."""
    x, mask = torch.randn(4, 3, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    f = lambda xs: xs[0] * torch.sin(xs[1])  # noqa: E731
    one = lambda xs: f(tuple(v[None] for v in xs))[0]  # noqa: E731
    for given in ((x, mask), [x, mask]):
        got = jm.jacobian(f, given)
        ref = torch.func.vmap(torch.func.jacrev(one))(tuple(given))
        assert isinstance(got, type(given)) and len(got) == 2
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r)
    d = {"x": x, "mask": mask}
    got = jm.jacobian(lambda p: p["x"] * p["mask"], d)
    torch.testing.assert_close(got["mask"], torch.diag_embed(x))
    with pytest.raises(TypeError, match=PARAMS_TUPLE + r".*jm.jacobian\(model, x, mask, wrt='params'\).*not read as a data set"):
        jm.jacobian(MLP(), (x, mask), wrt="params")


def test_other_non_tensors_still_get_as_tensor() -> None:
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got list .*torch\.as_tensor\(x"):
        jm.jacobian(torch.sin, [1.0, 2.0])
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got float .*torch\.as_tensor\(x"):
        jm.jacobian(torch.sin, 1.0)
