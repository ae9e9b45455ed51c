"""jm.hessian's two engines (see the note [Rows or pairs] in _derivatives.py) against float64 oracles.

The pairs (Taylor mode or nested forward mode, D (D + 1) / 2 directions) and the rows (forward over
reverse, D directions per output) are each forced through ``_derivatives.ROW_COST`` and compared
with torch.func's ``vmap(hessian)`` or, for LayerNorm (whose torch higher derivatives are wrong),
with nested autograd over the op written by hand and with the Taylor pairs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import jacmode as jm
from jacmode import _derivatives, _problem
from conftest import Opaque
from _zoo_models import CubeNoJvp

DT = torch.float64
ENGINES = {"pairs": 1e30, "rows": 0.0}  # ROW_COST, which scales both rules


@pytest.fixture(params=sorted(ENGINES))
def engine(request: Any) -> Iterator[str]:
    saved = _derivatives.ROW_COST
    _derivatives.ROW_COST = ENGINES[request.param]
    try:
        yield request.param
    finally:
        _derivatives.ROW_COST = saved


def forced(name: str) -> Any:
    class Forced:
        def __enter__(self) -> None:
            self.saved = _derivatives.ROW_COST
            _derivatives.ROW_COST = ENGINES[name]

        def __exit__(self, *exc: Any) -> None:
            _derivatives.ROW_COST = self.saved

    return Forced()


def mlp(d: int, y: int, act: Callable[[], nn.Module] = nn.Tanh, width: int = 6) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, width), act(), nn.Linear(width, width), act(), nn.Linear(width, y)).to(DT)


def reference(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """torch.func's vmap(hessian) of one sample at a time: (B, Y, D, D)."""
    return torch.func.vmap(torch.func.hessian(lambda v: f(v[None])[0]))(x)


class Sin(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.sin(x)


def test_the_rule_keeps_the_pairs_for_small_inputs_and_takes_the_rows_for_wide_ones() -> None:
    assert not _derivatives.by_rows(2, 1) and not _derivatives.by_rows(3, 1)
    assert _derivatives.by_rows(4, 1) and _derivatives.by_rows(100, 1)
    assert not _derivatives.by_rows(8, 4) and _derivatives.by_rows(16, 4)
    assert not _derivatives.by_rows(100, 64)  # many outputs: the pairs give all outputs at once
    # the generic engine's pairs (nested jvps) cost more than Taylor mode's: the rows sooner
    assert _derivatives.by_rows(1, 1, captured=False) and _derivatives.by_rows(3, 1, captured=False)
    assert not _derivatives.by_rows(2, 4, captured=False) and _derivatives.by_rows(3, 4, captured=False)


@settings(max_examples=12, deadline=None)
@given(d=st.integers(1, 12), y=st.integers(1, 3), b=st.integers(1, 4), generic=st.booleans(),
       sin=st.booleans(), rows=st.booleans())
def test_both_engines_match_torch_func(d: int, y: int, b: int, generic: bool, sin: bool, rows: bool) -> None:
    torch.manual_seed(d * 31 + y)
    net = mlp(d, y, Sin if sin else nn.Tanh)
    f = Opaque(net) if generic else net
    x = torch.randn(b, d, dtype=DT)
    with forced("rows" if rows else "pairs"):
        got = jm.hessian(f, x)
    assert got.shape == (b, y, d, d)
    torch.testing.assert_close(got, reference(net, x), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, got.transpose(-1, -2), rtol=0, atol=0)


@pytest.mark.parametrize("generic", [False, True], ids=["module", "opaque"])
def test_default_engine_above_the_crossover(generic: bool) -> None:
    torch.manual_seed(0)
    net = mlp(24, 1)
    x = torch.randn(3, 24, dtype=DT)
    assert _derivatives.by_rows(24, 1)
    f = Opaque(net) if generic else net
    torch.testing.assert_close(jm.hessian(f, x), reference(net, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("generic", [False, True], ids=["module", "opaque"])
def test_chunks_coupled_and_input_shapes(engine: str, generic: bool) -> None:
    torch.manual_seed(1)
    net = mlp(6, 2)
    f = Opaque(net) if generic else net
    x = torch.randn(4, 6, dtype=DT)
    ref = reference(net, x)
    for chunk in (1, 4):
        torch.testing.assert_close(jm.hessian(f, x, chunk_size=chunk), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.hessian(f, x, structure="coupled"), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.hessian(f, x, structure="coupled", chunk_size=7), ref, rtol=1e-10, atol=1e-12)
    g = lambda v: net(v.reshape(v.shape[0], 6)).reshape(v.shape[0], 1, 2)  # noqa: E731
    got = jm.hessian(g, x.reshape(4, 2, 3))
    assert got.shape == (4, 1, 2, 2, 3, 2, 3)
    torch.testing.assert_close(got.reshape(4, 2, 6, 6), ref, rtol=1e-10, atol=1e-12)
    assert jm.hessian(f, x[:0]).shape == (0, 2, 6, 6)


def test_coupled_samples_get_their_own_blocks(engine: str) -> None:
    torch.manual_seed(2)
    net = mlp(5, 1)
    f = lambda v: net(v) + net(v).mean(0, keepdim=True)  # noqa: E731  couples the samples
    x = torch.randn(3, 5, dtype=DT)
    got = jm.hessian(f, x, structure="coupled")
    full = torch.func.hessian(lambda v: f(v))(x)  # (B, Y, B, D, B, D)
    blocks = torch.stack([full[b, :, b, :, b, :] for b in range(3)])  # each sample's own block
    torch.testing.assert_close(got, blocks, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("generic", [False, True], ids=["module", "opaque"])
def test_create_graph_gradients_to_parameters(engine: str, generic: bool) -> None:
    torch.manual_seed(3)
    net = mlp(7, 2)
    f = Opaque(net) if generic else net
    x = torch.randn(3, 7, dtype=DT, requires_grad=True)
    w = torch.randn(3, 2, 7, 7, dtype=DT)
    got = jm.hessian(f, x, create_graph=True)
    params = [*net.parameters(), x]
    g_got = torch.autograd.grad((got * w).sum(), params, allow_unused=True, materialize_grads=True)
    g_ref = torch.autograd.grad((reference(net, x) * w).sum(), params, allow_unused=True, materialize_grads=True)
    for a, b in zip(g_got, g_ref):  # (the last bias does not reach the Hessian: zeros)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_several_arguments(engine: str) -> None:
    torch.manual_seed(4)
    net = mlp(6, 1)
    f = lambda a, t: net(torch.cat([a, t], 1))  # noqa: E731
    a, t = torch.randn(3, 4, dtype=DT), torch.randn(3, 2, dtype=DT)
    (haa, hat), (hta, htt) = jm.hessian(f, a, t, argnums=(0, 1))
    ref = reference(net, torch.cat([a, t], 1))
    torch.testing.assert_close(haa, ref[..., :4, :4], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hat, ref[..., :4, 4:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hta, ref[..., 4:, :4], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(htt, ref[..., 4:, 4:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["silu", "function without jvp"])
def test_operations_without_forward_mode_go_reverse_over_reverse(engine: str, op: str) -> None:
    torch.manual_seed(5)
    lin1, lin2 = nn.Linear(5, 6).to(DT), nn.Linear(6, 2).to(DT)
    act = F.silu if op == "silu" else CubeNoJvp.apply
    f = lambda x: lin2(act(lin1(x)))  # noqa: E731
    x = torch.randn(4, 5, dtype=DT)
    loops = torch.stack([torch.stack([torch.autograd.functional.hessian(lambda v: f(v[None])[0, y], x[b])
                                      for y in range(2)]) for b in range(4)])
    torch.testing.assert_close(jm.hessian(f, x, chunk_size=2), loops, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.hessian(f, x, structure="coupled"), loops, rtol=1e-10, atol=1e-12)


def _ln_ref(h: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5) -> Tensor:
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    return (h - mu) / torch.sqrt(var + eps) * w + b


class Branchy(nn.Module):
    """A LayerNorm behind a value-dependent branch: torch.fx cannot trace it (the generic engine)."""

    def __init__(self, d: int, by_hand: bool = False) -> None:
        super().__init__()
        self.by_hand = by_hand
        self.inp, self.norm, self.out = nn.Linear(d, 8), nn.LayerNorm(8), nn.Linear(8, 1)
        with torch.no_grad():
            self.norm.weight.normal_(), self.norm.bias.normal_()
        self.to(DT)

    def forward(self, x: Tensor) -> Tensor:
        if not self.by_hand and x.sum() > 1e9:  # never taken (the reference skips it: vmap)
            return x
        h = torch.tanh(self.inp(x))
        n = _ln_ref(h, self.norm.weight, self.norm.bias) if self.by_hand else self.norm(h)
        return self.out(torch.tanh(n))


@pytest.mark.parametrize("captured", [False, True], ids=["generic", "captured"])
def test_layer_norm_is_exact_on_both_engines(engine: str, captured: bool) -> None:
    torch.manual_seed(6)
    model = Branchy(6)
    if captured:  # the same network as a Sequential: Taylor mode's own LayerNorm rule for the pairs
        f: Any = nn.Sequential(model.inp, nn.Tanh(), model.norm, nn.Tanh(), model.out)
        assert _problem.captured(f, torch.zeros(2, 6, dtype=DT))[0] is not None
    else:
        f = model
        assert _problem.captured(f, torch.zeros(2, 6, dtype=DT))[0] is None
    x = torch.randn(3, 6, dtype=DT, requires_grad=True)
    by_hand = Branchy(6, by_hand=True)
    by_hand.load_state_dict(model.state_dict())
    loops = torch.stack([torch.autograd.functional.hessian(lambda v: by_hand(v[None])[0, 0], x[b].detach())
                         for b in range(3)])[:, None]
    got = jm.hessian(f, x, create_graph=True)
    torch.testing.assert_close(got, loops, rtol=1e-9, atol=1e-11)
    with forced("pairs"):  # and the Taylor pairs (or nested forward mode) agree with the rows
        torch.testing.assert_close(jm.hessian(f, x), got.detach(), rtol=1e-9, atol=1e-11)
    # create_graph: gradients to LayerNorm's weight as by hand
    g = torch.autograd.grad(got.pow(2).sum(), [model.norm.weight, x])
    ref = torch.func.vmap(torch.func.hessian(lambda v: by_hand(v[None])[0]))(x)
    g_ref = torch.autograd.grad(ref.pow(2).sum(), [by_hand.norm.weight, x])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
