"""Forward mode over a captured program with the directions last in memory ([Directions last] in
``_rules/linear.py``): many input directions into narrow linear layers, against float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import jacmode as jm
from jacmode._rules import linear as _linear
from conftest import ref_input_jacobian


class Narrow(nn.Module):
    """Many inputs, narrow hidden layers, a reshape and a wide layer after a narrow one."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, 12), nn.Linear(12, 40), nn.Linear(40, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.b(h).reshape(x.shape[0], 8, 5).flatten(1)  # a wider layer after a narrow one
        return self.c(torch.relu(h) * 2.0)


class Functional(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, d) / d**0.5), nn.Parameter(torch.randn(3, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.sin(F.linear(x, self.w1)), self.w2, None)


def _mlp(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 20), nn.ReLU(), nn.Linear(20, 10))


def _wide(d: int) -> nn.Module:
    """A wide output (300) after a hidden layer wider than many inputs' directions."""
    return nn.Sequential(nn.Linear(d, 48), nn.GELU(), nn.Linear(48, 300))


MODELS = {"mlp": _mlp, "narrow": Narrow, "functional": Functional, "wide": _wide}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("d, batch", [(64, 2), (100, 3), (784, 2), (70, 100)])
def test_forward_columns_match_reference(name: str, d: int, batch: int) -> None:
    torch.manual_seed(0)
    f = MODELS[name](d).double()
    x = torch.randn(batch, d, dtype=torch.float64)
    want = ref_input_jacobian(f, x)
    for _ in range(4):  # first call, the profile's (made by the second call: _guard.py) and its hits
        got = jm.jacobian(f, x, mode="forward")
        assert got.is_contiguous()
        torch.testing.assert_close(got, want)


def test_the_last_layer_writes_the_jacobians_layout() -> None:
    """Problem 1's class at B = 2: the engine's result is already (B, Y, D) in memory."""
    from jacmode import _profile
    from jacmode._checks import check_options
    from jacmode._problem import again
    from jacmode._structure import run

    f = _mlp(784)
    x = torch.randn(2, 784)
    jm.jacobian(f, x, mode="forward")  # the first call caches nothing (_guard.py)
    jm.jacobian(f, x, mode="forward")  # the second makes the profile
    [prof] = _profile._PROFILES.get(f, {}).values()
    problem, decision = prof.facts.problem, prof.facts.decision
    opts = check_options(wrt="inputs", mode="forward", batched=True, structure="auto", chunk_size=None,
                         create_graph=False, flatten=True)
    with torch.no_grad():
        flat = run(again(problem, f, x, opts), decision.plan)
    assert flat.shape == (2, 10, 784) and flat.is_contiguous()
    torch.testing.assert_close(flat, ref_input_jacobian(f, x), rtol=1e-5, atol=1e-6)


def test_chunked_directions_and_create_graph() -> None:
    torch.manual_seed(1)
    f = _mlp(100).double()
    x = torch.randn(3, 100, dtype=torch.float64)
    want = ref_input_jacobian(f, x)
    torch.testing.assert_close(jm.jacobian(f, x, mode="forward", chunk_size=70), want)  # 70 and 30 directions
    got = jm.jacobian(f, x, mode="forward", create_graph=True)
    torch.testing.assert_close(got, want)
    g = torch.autograd.grad(got.square().sum(), f[2].weight)[0]
    xx = x.clone()

    def per_sample(w: torch.Tensor) -> torch.Tensor:
        def one(v: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(f, {"2.weight": w}, (v.unsqueeze(0),)).squeeze(0)

        return torch.func.vmap(torch.func.jacrev(one))(xx).square().sum()

    torch.testing.assert_close(g, torch.func.grad(per_sample)(f[2].weight.detach()))


def test_few_directions_keep_the_plain_product() -> None:
    """Below LAST_MIN_DIRECTIONS the coefficients stay (k, B, Y)."""
    assert _linear.LAST_MIN_DIRECTIONS > 8
    torch.manual_seed(2)
    f = _mlp(8).double()
    x = torch.randn(500, 8, dtype=torch.float64)
    torch.testing.assert_close(jm.jacobian(f, x, mode="forward"), ref_input_jacobian(f, x))
