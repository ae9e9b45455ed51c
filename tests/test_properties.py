"""Property-based tests: random MLPs, shapes, chunk sizes and dtypes, every mode against the reference.

The reference is always the float64 autograd.grad loop of conftest.py, run on a float64 copy of the
same weights and inputs, so a float32 result differs from it by float32 rounding only. The
tolerances per dtype are published in docs/coverage.md.
"""

from __future__ import annotations

import copy

import torch
from conftest import ref_input_jacobian, ref_param_jacobian
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import jacmode as jm
from _zoo_models import one_intra_op_thread  # noqa: F401 -- autouse fixture

# max |J - J_ref| <= TOLERANCE * max |J_ref|, elementwise within rtol = TOLERANCE: the criterion
# and the values of tests/test_dtypes.py and docs/coverage.md.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _assert_within(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")

ACTIVATIONS = {
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "softplus": nn.Softplus,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "elu": nn.ELU,
}


@st.composite
def problems(draw: st.DrawFn) -> dict:
    depth = draw(st.integers(1, 3))
    widths = [draw(st.integers(1, 6)) for _ in range(depth - 1)]
    dims = dict(B=draw(st.integers(1, 4)), D=draw(st.integers(1, 5)), Y=draw(st.integers(1, 4)))
    return dict(
        seed=draw(st.integers(0, 2**16)),
        sizes=[dims["D"], *widths, dims["Y"]],
        activation=draw(st.sampled_from(sorted(ACTIVATIONS))),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, 8))),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        batched=draw(st.booleans()),
        **dims,
    )


def _mlp(sizes: list[int], activation: str) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


def _reference(model: nn.Module, x: torch.Tensor, wrt: str, batched: bool) -> torch.Tensor:
    model64, x64 = copy.deepcopy(model).double(), x.double()
    if wrt == "inputs":
        return ref_input_jacobian(model64, x64, batched=batched)
    if batched:
        return ref_param_jacobian(model64, x64)
    params = list(model64.parameters())
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
            for o in model64(x64).reshape(-1)]
    return torch.stack(rows)


@settings(max_examples=30, deadline=None)
@given(problems())
def test_every_mode_matches_the_reference(p: dict) -> None:
    torch.manual_seed(p["seed"])
    model = _mlp(p["sizes"], p["activation"]).to(p["dtype"])
    x = torch.randn(p["B"], p["D"], dtype=p["dtype"])
    for wrt in ("inputs", "params"):
        want = _reference(model, x, wrt, p["batched"])
        for mode in ("auto", "forward", "reverse"):
            got = jm.jacobian(model, x, wrt=wrt, mode=mode, chunk_size=p["chunk_size"], batched=p["batched"])
            assert got.dtype == p["dtype"] and got.shape == want.shape, (wrt, mode)
            _assert_within(got, want, p["dtype"], f"{wrt} {mode}")


@settings(max_examples=25, deadline=None)
@given(problems(), st.sampled_from(["auto", "forward", "reverse"]))
def test_chunking_never_changes_the_result(p: dict, mode: str) -> None:
    """Bit-for-bit would be too strict across vmap widths; agreement to rounding is required."""
    torch.manual_seed(p["seed"])
    model = _mlp(p["sizes"], p["activation"]).to(p["dtype"])
    x = torch.randn(p["B"], p["D"], dtype=p["dtype"])
    for wrt in ("inputs", "params"):
        whole = jm.jacobian(model, x, wrt=wrt, mode=mode, batched=p["batched"])
        for chunk in (1, p["chunk_size"] or 2):
            got = jm.jacobian(model, x, wrt=wrt, mode=mode, chunk_size=chunk, batched=p["batched"])
            _assert_within(got, whole, p["dtype"], f"{wrt} chunk_size={chunk}")
