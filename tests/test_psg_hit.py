"""per_sample_grads' repeated calls (from the third call of a signature the profile's ``hot`` facts
serve: options, selection, sizes, dtype, loss kind): every change gives the new answer, checked
against torch.func's vmap(grad), and options a first call refuses are refused on a hit too."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import jacmode as jm


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1)


def _other_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out * y).sum(1) ** 2


def _oracle(net: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Callable[..., torch.Tensor],
            names: Any = None) -> torch.Tensor:
    params = {n: p.detach() for n, p in net.named_parameters() if (p.requires_grad if names is None else n in names)}
    frozen = {n: p.detach() for n, p in net.named_parameters() if n not in params}

    def one(ps: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = functional_call(net, {**frozen, **ps}, (xb.unsqueeze(0),))
        value = loss(out, yb.unsqueeze(0))
        return value.reshape(()) if isinstance(loss, nn.Module) else value[0]

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[n].reshape(x.shape[0], -1) for n in params], 1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _warm(net: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> None:
    for _ in range(3):  # the first call, the first hit (which keeps the hot facts), a hot hit
        jm.per_sample_grads(net, x, _loss, y=y, **kw)


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)


def test_hot_hits_match_the_oracle() -> None:
    net, (x, y) = _net(), _xy()
    for _ in range(4):
        torch.testing.assert_close(jm.per_sample_grads(net, x, _loss, y=y), _oracle(net, x, y, _loss))


@pytest.mark.parametrize("change", ["in place", "reassigned", "frozen", "layer swapped", "dtype", "train/eval",
                                    "hook"])
def test_a_change_after_hot_hits_gives_the_new_answer(change: str) -> None:
    net, (x, y) = _net(), _xy()
    _warm(net, x, y)
    if change == "in place":
        with torch.no_grad():
            net[0].weight.mul_(3.0)
    elif change == "reassigned":
        net[2].weight = nn.Parameter(torch.randn(3, 7, dtype=torch.float64))
    elif change == "frozen":
        net[0].bias.requires_grad_(False)
    elif change == "layer swapped":
        net[2] = nn.Linear(7, 3).double()
    elif change == "dtype":
        net.float()
        x, y = x.float(), y.float()
    elif change == "train/eval":
        net.eval()
    elif change == "hook":
        net[1].register_forward_hook(lambda m, a, out: out * 2.0)
    got = jm.per_sample_grads(net, x, _loss, y=y)
    torch.testing.assert_close(got, _oracle(net, x, y, _loss))
    assert got.dtype == x.dtype


def test_other_options_loss_and_shapes_after_hot_hits() -> None:
    net, (x, y) = _net(), _xy()
    _warm(net, x, y)
    torch.testing.assert_close(jm.per_sample_grads(net, x, _other_loss, y=y), _oracle(net, x, y, _other_loss))
    names = ["2.weight", "0.bias"]
    for _ in range(3):  # a list of names: not hashable, validated every call
        torch.testing.assert_close(jm.per_sample_grads(net, x, _loss, y=y, wrt=names),
                                   _oracle(net, x, y, _loss, names))
    got = jm.per_sample_grads(net, x, _loss, y=y, flatten=False)
    assert set(got) == {n for n, _ in net.named_parameters()}
    x2, y2 = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    torch.testing.assert_close(jm.per_sample_grads(net, x2, _loss, y=y2), _oracle(net, x2, y2, _loss))
    mse = nn.MSELoss(reduction="sum")
    for _ in range(3):
        torch.testing.assert_close(jm.per_sample_grads(net, x, mse, y=y), _oracle(net, x, y, mse))


@pytest.mark.parametrize("bad, error, match", [
    (dict(flatten=1), TypeError, "flatten: expected True or False"),
    (dict(chunk_size=True), TypeError, "chunk_size: expected a positive int"),
    (dict(max_memory=-1), ValueError, "max_memory: expected a positive amount"),
])
def test_options_refused_on_a_first_call_are_refused_on_a_hit(bad: dict[str, Any], error: type, match: str) -> None:
    net, (x, y) = _net(), _xy()
    good = {k: {"flatten": True, "chunk_size": 1, "max_memory": None}[k] for k in bad}
    for _ in range(3):
        jm.per_sample_grads(net, x, _loss, y=y, **good)
    with pytest.raises(error, match=match):
        jm.per_sample_grads(net, x, _loss, y=y, **bad)


def test_targets_of_another_batch_are_refused_on_a_hit() -> None:
    net, (x, y) = _net(), _xy()
    _warm(net, x, y)
    with pytest.raises(ValueError, match="y: expected one target per sample"):
        jm.per_sample_grads(net, x, _loss, y=torch.randn(3, 3, dtype=torch.float64))


def test_attention_models_keep_the_kernel_flags_on_hot_hits() -> None:
    from jacmode import _state

    torch.manual_seed(4)
    net = nn.Sequential(nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True), nn.Flatten(),
                        nn.Linear(18, 3)).double()
    x, y = torch.randn(4, 3, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    fast = torch.backends.mha.get_fastpath_enabled()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # the oracle's vmap: the kernel it batches
        want = _oracle(net, x, y, _loss)
    for _ in range(4):
        torch.testing.assert_close(jm.per_sample_grads(net, x, _loss, y=y), want)
        assert torch.backends.mha.get_fastpath_enabled() == fast and _state._KERNELS["users"] == 0
