"""Bugs found by outside testing, each against a float64 oracle: torch.func (jacfwd, hessian,
jacrev) or plain ``torch.autograd.grad`` loops over single samples."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import hessian, jacfwd

import jacmode as jm

DT = torch.float64


# ---- biharmonic's randomised estimator without return_std -------------------------------------


class U(nn.Module):
    """A tanh network of the kind PINN users write (captured: the collapsed Taylor path)."""

    def __init__(self, d: int = 3, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Soft(U):
    """The same network through softsign, which has no Taylor rule: the generic nested forward path."""

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.softsign(self.fc1(x)))


def _biharmonic_oracle(u: nn.Module, x: Tensor) -> Tensor:
    """sum_(i,j) d^4 u / dx_i^2 dx_j^2 per sample (B, Y): the Laplacian of the Laplacian, torch.func."""
    def lap(v: Tensor) -> Tensor:
        return torch.diagonal(hessian(lambda w: u(w[None])[0])(v), dim1=-2, dim2=-1).sum(-1)

    return torch.stack([torch.diagonal(jacfwd(jacfwd(lap))(x[b]), dim1=-2, dim2=-1).sum(-1)
                        for b in range(x.shape[0])])


def test_biharmonic_estimate_of_the_reported_network_has_the_batch_shape() -> None:
    torch.manual_seed(0)
    u = U().double()
    x = torch.randn(9, 3, dtype=DT)
    before = {k: v.clone() for k, v in u.state_dict().items()}
    est = jm.biharmonic(u, x, samples=4)
    assert est.shape == (9, 1) and est.dtype == DT and bool(torch.isfinite(est).all())
    assert all(torch.equal(before[k], v) for k, v in u.state_dict().items())  # the model is left as it was


@pytest.mark.parametrize("cls", [U, Soft], ids=["captured", "generic"])
def test_biharmonic_estimate_is_unbiased_against_torch_func(cls: type) -> None:
    torch.manual_seed(1)
    u = cls().double()
    x = torch.randn(9, 3, dtype=DT)
    exact = _biharmonic_oracle(u, x)
    torch.testing.assert_close(jm.biharmonic(u, x), exact, rtol=1e-9, atol=1e-9)  # the exact mode
    k = 4000 if cls is U else 1000
    est = jm.biharmonic(u, x, samples=k, generator=torch.Generator().manual_seed(3))
    same, err = jm.biharmonic(u, x, samples=k, generator=torch.Generator().manual_seed(3), return_std=True)
    torch.testing.assert_close(est, same, rtol=1e-12, atol=1e-12)  # the same draws, with or without the error
    assert ((est - exact) / err).abs().max() < 4.5  # 9 estimates, each within 4.5 standard errors


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 7), d=st.integers(1, 4), k=st.integers(1, 6), chunk=st.sampled_from([None, 1, 3]),
       generic=st.booleans())
def test_biharmonic_estimate_shapes_and_draws_over_batches_and_dimensions(
    b: int, d: int, k: int, chunk: Optional[int], generic: bool
) -> None:
    torch.manual_seed(b * 100 + d * 10 + k)
    u = (Soft if generic else U)(d, 6).double()
    x = torch.randn(b, d, dtype=DT)
    est = jm.biharmonic(u, x, samples=k, chunk_size=chunk, generator=torch.Generator().manual_seed(5))
    assert est.shape == (b, 1)
    # the estimate is the mean over the K draws of D^4 u[v]^4 / 3: rebuilt from the same directions
    v = torch.randn((k, b, d), generator=torch.Generator().manual_seed(5), dtype=DT)
    rows = []
    for i in range(b):
        def h(t: Tensor, w: Tensor, i: int = i) -> Tensor:
            return u(x[i : i + 1] + t * w)[0, 0]  # u along one direction w of sample i

        d4 = jacfwd(jacfwd(jacfwd(jacfwd(h))))
        rows.append(torch.stack([d4(torch.zeros((), dtype=DT), v[j, i]) for j in range(k)]) / 3.0)
    want = torch.stack([r.mean() for r in rows])[:, None]
    torch.testing.assert_close(est, want, rtol=1e-8, atol=1e-8)
