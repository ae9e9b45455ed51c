"""Raw torch errors on recurrent layers and BatchNorm become results or clear errors.

* nn.LSTM in float32 on CPU runs mkldnn's kernel, which keeps no workspace for its backward when
  grad mode is off; the reverse engines used to run torch.func.vjp under torch.no_grad() and
  surfaced torch's "Expected a proper Tensor but got None ... workspace". Results are compared
  with a float64 copy of the model (torch's native kernel) differentiated by torch.func / autograd.
* BatchNorm in training mode behind a lambda or functional_call: named before anything runs, and
  f raising on the probe's few samples is reported as jacmode's error, not torch's.
* structure="coupled" through a BatchNorm with running statistics behind a lambda: the modules a
  function refers to are left as found (running statistics untouched, nothing mutated under
  the transforms), and the blocks are those of float64 whole-batch torch.func.jacrev.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import jacmode as jm


class Seq(nn.Module):
    """LSTM -> last step -> Linear, inputs (B, T, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(2, 3, batch_first=True), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def _lstm() -> tuple[nn.Module, nn.Module, Tensor]:
    torch.manual_seed(0)
    net = Seq()
    return net, copy.deepcopy(net).double(), torch.randn(3, 4, 2)


def _input_blocks(net64: nn.Module, x: Tensor) -> Tensor:
    x64 = x.double()
    return torch.stack([jacrev(lambda xb: net64(xb[None])[0])(x64[b]) for b in range(x.shape[0])])


def _param_rows(net64: nn.Module, x: Tensor) -> Tensor:
    params = list(net64.parameters())
    rows = []
    for b in range(x.shape[0]):
        out = net64(x[b:b + 1].double())[0]
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
                                 for o in out]))
    return torch.stack(rows)  # (B, Y, P)


def _close(got: Tensor, want: Tensor) -> None:
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["auto", "reverse"])
@pytest.mark.parametrize("as_lambda", [False, True])
def test_lstm_float32_input_jacobian(mode: str, as_lambda: bool) -> None:
    net, net64, x = _lstm()
    f = (lambda z: net(z)) if as_lambda else net
    _close(jm.jacobian(f, x, mode=mode), _input_blocks(net64, x))
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("mode", ["auto", "reverse"])
def test_lstm_float32_param_jacobian(mode: str) -> None:
    net, net64, x = _lstm()
    _close(jm.jacobian(net, x, wrt="params", mode=mode), _param_rows(net64, x))


def test_lstm_float32_products() -> None:
    net, net64, x = _lstm()
    J = _param_rows(net64, x)
    _close(jm.ntk(net, x), torch.einsum("byp,czp->bcyz", J, J))
    _close(jm.ggn(net, x, "mse"), torch.einsum("byp,byq->pq", J, J))
    g = jm.per_sample_grads(net, x, lambda out: out.pow(2).sum(1))
    _close(g, torch.einsum("byp,by->bp", J, 2 * net64(x.double())))


def test_lstm_float32_under_inference_mode() -> None:
    """Grad mode cannot be switched on there: the engines take torch's native kernels instead."""
    net, net64, x = _lstm()
    with torch.inference_mode():
        got = jm.jacobian(net, x, mode="reverse")
    _close(got.clone(), _input_blocks(net64, x))


def test_lstm_float32_create_graph() -> None:
    net, net64, x = _lstm()
    got = jm.jacobian(net, x, mode="reverse", create_graph=True)
    assert got.requires_grad
    torch.testing.assert_close(got.detach().double(), _input_blocks(net64, x), rtol=1e-4, atol=1e-5)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.BatchNorm1d(3), nn.Linear(3, 2)).double().train()


@pytest.mark.parametrize("batch", [2, 20])
@pytest.mark.parametrize("spelling", ["lambda", "functional_call"])
def test_batchnorm_training_behind_a_function_is_named(batch: int, spelling: str) -> None:
    net = _bn_net()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    f = (lambda z: net(z)) if spelling == "lambda" else (lambda z: functional_call(net, params, (z,)))
    x = torch.randn(batch, 2, dtype=torch.float64)
    with pytest.raises(jm.CoupledBatchError, match=r"BatchNorm layer\(s\) '2' are in training mode"):
        jm.jacobian(f, x)
    with pytest.raises(jm.CoupledBatchError, match="training mode"):
        jm.laplacian(f, x)


def test_f_failing_on_the_probes_samples_is_a_clear_error() -> None:
    """The probe runs f on 8 of 20 samples; f that needs exactly 20 (a reshape to the batch size)
    is reported as jacmode's error naming f and the check, and the way out it names works."""
    w = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(20, 3, dtype=torch.float64)

    def fixed(z: Tensor) -> Tensor:
        return z.view(20, 3) @ w

    with pytest.raises(ValueError, match=r"f: raised RuntimeError: .* when jacmode's independence check ran it "
                                         r"on 8 of the 20 samples.*structure='coupled'"):
        jm.jacobian(fixed, x)
    want = jacrev(fixed)(x)
    got = jm.jacobian(fixed, x, structure="coupled")  # the way out it names works
    torch.testing.assert_close(got, torch.stack([want[b, :, b] for b in range(20)]), rtol=1e-12, atol=1e-12)


def test_one_sample_batch_statistics_error_becomes_coupled_batch_error() -> None:
    from jacmode._coupling import _guarded

    def bn(z: Tensor) -> Tensor:
        return torch.nn.functional.batch_norm(z, None, None, training=True)

    with pytest.raises(jm.CoupledBatchError, match=r"f: raised ValueError: Expected more than 1 value per channel.*"
                                                   r"on 1 of the 4 samples: f normalises with batch statistics"):
        _guarded(bn, 4, "Ways out.")(torch.randn(1, 3))


def _state(net: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def _whole_batch_blocks(net: nn.Module, x: Tensor, order: int) -> Tensor:
    f = torch.func.replace_all_batch_norm_modules_(copy.deepcopy(net))
    if order == 1:
        full = jacrev(f)(x)  # (B, Y, B, D)
        return torch.stack([full[b, :, b] for b in range(x.shape[0])])
    full = jacrev(jacrev(f))(x)  # (B, Y, B, D, B, D): reverse-over-reverse, right for batch_norm
    return torch.stack([full[b, :, b, :, b] for b in range(x.shape[0])])


@pytest.mark.parametrize("spelling", ["module", "lambda", "functional_call"])
def test_coupled_structure_through_batchnorm_with_running_statistics(spelling: str) -> None:
    net = _bn_net()
    assert net[2].track_running_stats
    x = torch.randn(4, 2, dtype=torch.float64)
    f = {"module": net, "lambda": lambda z: net(z),
         "functional_call": lambda z: functional_call(net, dict(net.named_parameters()), (z,))}[spelling]
    before = _state(net)
    buffers = [net[2].running_mean, net[2].running_var, net[2].num_batches_tracked]
    J, H = _whole_batch_blocks(net, x, 1), _whole_batch_blocks(net, x, 2)
    for mode in ("auto", "forward", "reverse"):
        torch.testing.assert_close(jm.jacobian(f, x, structure="coupled", mode=mode), J, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(jm.hessian(f, x, structure="coupled"), H, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(jm.laplacian(f, x, structure="coupled"), H.diagonal(dim1=-2, dim2=-1).sum(-1),
                               rtol=1e-9, atol=1e-9)
    after = net.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running statistics left as found
    assert [net[2].running_mean, net[2].running_var, net[2].num_batches_tracked] == buffers  # same objects
    assert net[2].track_running_stats and net.training


def test_a_functions_modules_are_left_as_found_when_it_raises() -> None:
    net = _bn_net()
    before = _state(net)

    def broken(z: Tensor) -> Tensor:
        net(z)
        raise KeyError("halfway")

    with pytest.raises(KeyError, match="halfway"):
        jm.jacobian(broken, torch.randn(4, 2, dtype=torch.float64), structure="coupled")
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net[2].track_running_stats and net[2].running_mean is not None


def test_used_modules_finds_closures_globals_methods_and_partials() -> None:
    import functools

    from jacmode._state import used_modules

    net, other = nn.Linear(2, 2), nn.Tanh()

    def outer(z: Tensor) -> Tensor:
        return other(net(z))

    assert {id(m) for m in used_modules(lambda z: outer(z))} == {id(other), id(net)}
    assert used_modules(net.forward) == [net]
    assert used_modules(functools.partial(functional_call, net)) == [net]
    assert used_modules(torch.tanh) == []


def test_forward_mode_create_graph_through_softmax_backpropagates() -> None:
    """Found by the differential harness: the dual-tensor fast path of a one-direction chunk ran
    torch's dual softmax, which modifies its exp output in place, so backward through a
    create_graph=True forward-mode Jacobian raised torch's raw "modified by an inplace operation"."""
    torch.manual_seed(0)
    lin, out = nn.Linear(1, 3, dtype=torch.float64), nn.Linear(3, 2, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        if float(h.sum()) > -1e9:  # not traceable: the generic forward engine
            h = torch.softmax(h, -1)
        return out(h)

    x = torch.randn(2, 1, dtype=torch.float64, requires_grad=True)
    J = jm.jacobian(f, x, mode="forward", create_graph=True)
    (gx,) = torch.autograd.grad(J.sum(), x)
    rows = []
    for b in range(x.shape[0]):  # the oracle: autograd.grad loops, one sample alone
        xb = x[b : b + 1].detach().clone().requires_grad_(True)
        yb = f(xb)[0]
        jb = sum(torch.autograd.grad(o, xb, create_graph=True)[0].sum() for o in yb)
        rows.append(torch.autograd.grad(jb, xb)[0])
    torch.testing.assert_close(gx, torch.cat(rows))


def test_an_op_without_higher_derivatives_in_torch_is_a_clear_error() -> None:
    """torch.cdist has no derivative above first order in either mode: the generic engine's
    reverse nesting raised torch's raw "not implemented" error."""
    c = torch.randn(3, 2, dtype=torch.float64)

    def f(x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > -1e9:  # not traceable
            return torch.cdist(x, c)
        return x

    x = torch.randn(4, 2, dtype=torch.float64)
    assert jm.partial(f, x, (0,)).shape == (4, 3)
    with pytest.raises(ValueError, match="f: torch has no derivative of the order asked"):
        jm.laplacian(f, x)
