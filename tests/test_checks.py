"""Every error path of input validation, with the wording users see."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmode as jm
from conftest import mlp_1_4


@pytest.fixture
def net() -> nn.Module:
    return mlp_1_4()


def test_f_not_callable() -> None:
    with pytest.raises(TypeError, match="f: expected an nn.Module or a callable"):
        jm.jacobian(3, torch.rand(2, 1))


def test_x_not_a_tensor(net: nn.Module) -> None:
    with pytest.raises(TypeError, match=r"x: expected a torch.Tensor, got list .*torch.as_tensor"):
        jm.jacobian(net, [[0.1], [0.2]])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_inputs(net: nn.Module, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=r"x: .*real floating dtype.*integer/bool.*x.float\(\)"):
        jm.jacobian(net, torch.zeros(2, 1, dtype=dtype))


def test_complex_inputs(net: nn.Module) -> None:
    with pytest.raises(TypeError, match="x: .*complex dtype torch.complex64"):
        jm.jacobian(net, torch.zeros(2, 1, dtype=torch.complex64))


def test_missing_batch_dimension(net: nn.Module) -> None:
    with pytest.raises(ValueError, match="x: batched=True needs a batch dimension, got a 0-d tensor"):
        jm.jacobian(lambda x: x * 2, torch.tensor(1.0))


def test_unknown_mode(net: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"mode: expected one of \('auto', 'forward', 'reverse', 'autotune'\), got 'fwd'"):
        jm.jacobian(net, torch.rand(2, 1), mode="fwd")


def test_unknown_wrt(net: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"wrt: expected one of \('inputs', 'params'\).*got 'input'"):
        jm.jacobian(net, torch.rand(2, 1), wrt="input")


def test_wrt_wrong_type(net: nn.Module) -> None:
    with pytest.raises(TypeError, match="wrt: expected 'inputs', 'params' or a list of parameter names"):
        jm.jacobian(net, torch.rand(2, 1), wrt=3)


def test_wrt_empty_list(net: nn.Module) -> None:
    with pytest.raises(ValueError, match="wrt: got an empty list"):
        jm.jacobian(net, torch.rand(2, 1), wrt=[])


def test_unknown_structure(net: nn.Module) -> None:
    with pytest.raises(ValueError, match="structure: expected one of"):
        jm.jacobian(net, torch.rand(2, 1), structure="blockdiag")


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_not_positive(net: nn.Module, chunk_size: int) -> None:
    with pytest.raises(ValueError, match=f"chunk_size: expected a positive number.*got {chunk_size}"):
        jm.jacobian(net, torch.rand(2, 1), chunk_size=chunk_size)


def test_chunk_size_wrong_type(net: nn.Module) -> None:
    with pytest.raises(TypeError, match="chunk_size: expected a positive int or None, got float"):
        jm.jacobian(net, torch.rand(2, 1), chunk_size=2.0)


def test_flag_wrong_type(net: nn.Module) -> None:
    with pytest.raises(TypeError, match="batched: expected True or False, got str"):
        jm.jacobian(net, torch.rand(2, 1), batched="yes")


def test_f_returns_non_tensor() -> None:
    # jacobian returns the matching pytree (tests/test_found_outside.py); the operators take one output
    with pytest.raises(TypeError, match=r"f: expected f\(x\) to return one torch.Tensor, got tuple.*select one"):
        jm.hessian(lambda x: (x, x), torch.rand(2, 1))
    with pytest.raises(TypeError, match=r"f: expected f\(x\) to return one torch.Tensor, got str\.$"):
        jm.jacobian(lambda x: "x", torch.rand(2, 1))


def test_f_returns_integer_tensor() -> None:
    with pytest.raises(TypeError, match="f: expected f\\(x\\) to return a floating tensor"):
        jm.jacobian(lambda x: x.argmax(1), torch.rand(3, 4))


def test_f_drops_batch_dimension() -> None:
    with pytest.raises(ValueError, match=r"f: with batched=True, f\(x\) must keep the batch dimension.*shape \(3,\)"):
        jm.jacobian(lambda x: x.sum(0), torch.rand(5, 3))


def test_f_drops_batch_dimension_to_scalar() -> None:
    with pytest.raises(ValueError, match="must keep the batch dimension"):
        jm.jacobian(lambda x: x.sum(), torch.rand(5, 3), mode="reverse")


def test_diagonal_needs_elementwise_shape() -> None:
    with pytest.raises(ValueError, match="structure: 'diagonal' needs an elementwise f"):
        jm.jacobian(lambda x: x.sum(1), torch.rand(5, 3), structure="diagonal")


def test_diagonal_only_for_inputs(net: nn.Module) -> None:
    with pytest.raises(ValueError, match="structure: 'diagonal' .* applies to wrt='inputs' only"):
        jm.jacobian(net, torch.rand(5, 1), wrt="params", structure="diagonal")


def test_coupled_needs_batch(net: nn.Module) -> None:
    with pytest.raises(ValueError, match="structure: 'coupled' describes a batch"):
        jm.jacobian(net, torch.rand(5, 1), batched=False, structure="coupled")


def test_derivative_t_shape(net: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"t: expected one scalar per sample, shape \(B,\) or \(B, 1\), got \(5, 2\)"):
        jm.derivative(net, torch.rand(5, 2))


def test_derivative_order(net: nn.Module) -> None:
    with pytest.raises(ValueError, match="order: expected a positive int, got 0"):
        jm.derivative(net, torch.rand(5, 1), order=0)


def test_device_mismatch() -> None:
    net = nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="x: is on cpu but parameter 'weight' of the model is on meta"):
        jm.jacobian(net, torch.rand(3, 2))
