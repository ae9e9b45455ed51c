"""Repeated calls (``_profile.py``) and the repeated-rows pullback (``_probes/layerwise.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmode as jm
from jacmode import _profile
from jacmode._probes import layerwise
from bench.baselines import MLP


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, Y, P) by plain autograd.grad loops in float64."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(x.shape[0]):
        out = model(x[b : b + 1]).reshape(-1)
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
                                 for o in out]))
    return torch.stack(rows)


def test_repeated_rows_match_the_vectorised_pullback_and_autograd() -> None:
    torch.manual_seed(0)
    model = MLP(12, 7, 3).double()
    x = torch.randn(2, 12, dtype=torch.float64)
    named = list(model.named_parameters())
    cov = jm._problem.describe(model, x, jm._jacobian._options(
        model, x, wrt="params", mode="auto", batched=True, structure="auto", chunk_size=None, max_memory=None,
        create_graph=False, flatten=True)).probes
    assert cov is not None
    a = torch.empty(2, 3, sum(p.numel() for _, p in named), dtype=torch.float64)
    b = torch.empty_like(a)
    with torch.no_grad():
        layerwise.fill(model, x, named, cov, a, repeat=True)
        layerwise.fill(model, x, named, cov, b, repeat=False)
    assert layerwise._repeated_rows(model, x, cov, 3) is not None  # the repeated-rows path ran
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, _reference(model, x))


def test_repeated_calls_reuse_the_plan_and_stay_exact() -> None:
    torch.manual_seed(1)
    model = MLP(10, 6, 4).double()
    x = torch.randn(2, 10, dtype=torch.float64)
    jm.clear_cache()
    jm.jacobian(model, x, wrt="params")  # the first call caches nothing (_guard.py)
    jm.jacobian(model, x, wrt="params")  # the second makes the profile
    assert _profile.count(model) == 1
    x2 = torch.randn(2, 10, dtype=torch.float64)
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # new values, same signature: a hit must use them
    torch.testing.assert_close(jm.jacobian(model, x2, wrt="params"), _reference(model, x2))
    assert _profile.count(model) == 1


def test_the_call_cache_is_invalidated_by_flags_and_shapes() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.0), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    jm.clear_cache()
    jm.jacobian(model, x, wrt="params")  # the first call caches nothing (_guard.py)
    jm.jacobian(model, x, wrt="params")  # the second makes the profile
    model.eval()  # training flags
    jm.jacobian(model, x, wrt="params")
    model[0].bias.requires_grad_(False)  # requires_grad: the selection changes
    J = jm.jacobian(model, x, wrt="params")
    assert J.shape == (3, 3, 40 + 27)
    torch.testing.assert_close(J, _reference(model, x))
    x4 = torch.randn(4, 5, dtype=torch.float64)  # shape
    torch.testing.assert_close(jm.jacobian(model, x4, wrt="params"), _reference(model, x4))
    assert _profile.count(model) == 4
    model[0].bias.requires_grad_(True)


def test_a_cached_call_still_leaves_the_model_as_found_when_f_raises() -> None:
    class Flaky(MLP):
        fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fail:
                raise RuntimeError("boom")
            return super().forward(x)

    model = Flaky(4, 3, 2)
    x = torch.randn(2, 4)
    for _ in range(3):  # cached from the second call (_guard.py), reused by the third
        jm.jacobian(model, x, wrt="params")
    model.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        jm.jacobian(model, x, wrt="params")
    assert all(p.requires_grad for p in model.parameters())
    assert not model.fc1._forward_hooks and not model.fc2._forward_hooks
