"""Dtypes and devices: tolerances per dtype, results on x's device and dtype, clear device errors.

Low-precision results are compared with the float64 loop run on a float64 copy of the same
(rounded) weights and inputs, so the error measured is the rounding of the computation alone,
relative to the largest Jacobian entry. The tolerances below are published in docs/coverage.md.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch
from conftest import ref_input_jacobian, ref_param_jacobian
from torch import Tensor, nn

import jacmode as jm
from _zoo_models import ZOO, call, check_result, instantiate, one_intra_op_thread  # noqa: F401 -- autouse fixture

# max |J - J_ref| <= TOLERANCE * max |J_ref| (and elementwise within rtol = TOLERANCE).
# Measured worst cases over the models below: float64 3.7e-16, float32 2.9e-7 (random narrow MLPs
# in test_properties.py: 2.7e-6, cancellation through width-1 layers), float16 2.1e-3, bfloat16
# 8.5e-3 (about 4 and 2 units of roundoff); the tolerances leave a margin of 4x or more.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp() -> tuple[nn.Module, Tensor]:
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    return net, torch.randn(3, 4)


def _zoo(name: str) -> Callable[[], tuple[nn.Module, Tensor]]:
    return next(case.build for case in ZOO if case.name == name)


MODELS = {
    "mlp": _mlp,
    "cnn": _zoo("CNN with pooling"),
    "layernorm": _zoo("LayerNorm"),
    "transformer": _zoo("TransformerEncoderLayer (eval)"),
}


@functools.lru_cache(maxsize=None)
def _cached_reference(name: str, dtype: torch.dtype, wrt: str) -> Tensor:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    return _reference(model.to(dtype), x.to(dtype), wrt)


def _reference(model: nn.Module, x: Tensor, wrt: str) -> Tensor:
    model64, x64 = copy.deepcopy(model).double(), x.double()
    return ref_input_jacobian(model64, x64) if wrt == "inputs" else ref_param_jacobian(model64, x64)


def _assert_within(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("wrt", ["inputs", "params"])
@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_every_dtype_within_its_tolerance(dtype: torch.dtype, name: str, wrt: str, mode: str) -> None:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    model, x = model.to(dtype), x.to(dtype)
    got = jm.jacobian(model, x, wrt=wrt, mode=mode)
    assert got.dtype == dtype and got.device == x.device
    _assert_within(got, _cached_reference(name, dtype, wrt), dtype)


def test_parameter_jacobian_takes_the_parameters_dtype_for_integer_inputs() -> None:
    model, ids = instantiate(next(c for c in ZOO if c.name == "Embedding (integer ids)"))
    got = jm.jacobian(model, ids, wrt="params")
    assert got.dtype == torch.float64 and got.device == ids.device


# -------------------------------------------------------------------------------------------
# devices


def test_model_and_input_on_different_devices_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to("meta")
    x = torch.randn(5, 3)
    for wrt in ("inputs", "params"):
        with pytest.raises(ValueError, match=r"x: is on cpu but parameter '0\.weight' of the model is on meta.*\.to\("):
            jm.jacobian(model, x, wrt=wrt)
        with pytest.raises(ValueError, match=r"x: is on meta but parameter 'weight' of the model is on cpu"):
            jm.jacobian(nn.Linear(3, 2), x.to("meta"), wrt=wrt)


@CUDA
@pytest.mark.parametrize("case", [c for c in ZOO if not c.gaps and not c.expect], ids=lambda c: c.name)
@pytest.mark.parametrize("label", ["inputs/auto", "inputs/forward", "inputs/reverse", "params/auto", "params/forward", "params/reverse"])
def test_zoo_on_cuda(case, label: str) -> None:
    """Every zoo model that is correct on the CPU is correct on the GPU, result on the GPU."""
    model, x = instantiate(case)
    model, x = model.cuda(), x.cuda()
    result = call(case, label, model, x)
    assert all(t.is_cuda for t in torch.utils._pytree.tree_flatten(result)[0])
    check_result(case, label, model, x, result)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_low_precision_on_cuda(dtype: torch.dtype, name: str) -> None:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    model, x = model.to("cuda", dtype), x.to("cuda", dtype)
    for wrt in ("inputs", "params"):
        for mode in ("forward", "reverse"):
            try:
                got = jm.jacobian(model, x, wrt=wrt, mode=mode)
            except ValueError as err:
                # exact or a clear error: torch's forward-mode formula of CUDA layer norm in float16 and
                # bfloat16 gives a float32 tangent, which the next matmul refuses (reverse mode runs)
                assert mode == "forward" and dtype != torch.float32 and "forward mode fails here" in str(err)
                continue
            assert got.dtype == dtype and got.is_cuda
            # TF32 and fused kernels on the GPU round differently from the CPU; float32 gets
            # the float16 tolerance there.
            tol_dtype = torch.float16 if dtype == torch.float32 else dtype
            _assert_within(got.cpu(), _reference(copy.deepcopy(model).cpu(), x.cpu(), wrt), tol_dtype)


@CUDA
def test_cuda_model_and_cpu_input_is_a_clear_error() -> None:
    model = nn.Linear(3, 2).cuda()
    with pytest.raises(ValueError, match=r"x: is on cpu but parameter 'weight' of the model is on cuda"):
        jm.jacobian(model, torch.randn(4, 3))


def _default_device_ops() -> dict[str, Callable[[nn.Module, Tensor], Any]]:
    scalar = lambda net: (lambda v: net(v)[:, :1])  # noqa: E731
    y = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    return {
        "jacobian": lambda net, x: jm.jacobian(net, x),
        "jacobian forward": lambda net, x: jm.jacobian(net, x, mode="forward"),
        "jacobian params reverse": lambda net, x: jm.jacobian(net, x, wrt="params", mode="reverse"),
        "jacobian params forward": lambda net, x: jm.jacobian(net, x, wrt="params", mode="forward"),
        "partial": lambda net, x: jm.partial(net, x, 0),
        "hessian": lambda net, x: jm.hessian(scalar(net), x),
        "laplacian": lambda net, x: jm.laplacian(scalar(net), x),
        "laplacian transform": lambda net, x: jm.transform(jm.laplacian, scalar(net))(x),
        "partials": lambda net, x: jm.partials(net, x, [(0,), (0, 1), (2, 2)]),
        "biharmonic": lambda net, x: jm.biharmonic(scalar(net), x),
        "per_sample_grads": lambda net, x: jm.per_sample_grads(net, x, nn.MSELoss(), y=y),
        "ntk": lambda net, x: jm.ntk(net, x),
        "ggn": lambda net, x: jm.ggn(net, x, "mse", diagonal=True),
        "vjp": lambda net, x: jm.vjp(net, x)[1](torch.ones_like(x))[0],
        "sparse_hessian": lambda net, x: jm.sparse_hessian(lambda v: (torch.tanh(v) * v.roll(1)).sum(), x[0]).to_dense(),
    }


@pytest.mark.parametrize("name", list(_default_device_ops()))
def test_a_default_device_elsewhere_changes_nothing(name: str) -> None:
    """jacmode's own seeds, index sets and results follow the inputs' device, never torch's default
    device: under ``with torch.device(...)`` (or ``torch.set_default_device``) naming another device,
    every call of a sequence equals the call made outside it (the meta device stands for a GPU here:
    a tensor jacmode made there would hold no values)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    op = _default_device_ops()[name]
    want = op(net, x)
    with torch.device("meta"):
        got = [op(net, x) for _ in range(4)]
    for g in got:
        torch.testing.assert_close(g, want)
