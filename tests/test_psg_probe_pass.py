"""per_sample_grads by the probe engine: one reverse pass from the loss to the probes, the model on
x itself once its first call showed that it leaves its input alone, the blocks written last layer
first. Oracles: float64 autograd loops over samples and torch.func's vmap(grad)."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import jacmode as jm
from jacmode import _guard
from bench.baselines import MLP
from conftest import assert_unchanged, snapshot


def loop_psg(model: nn.Module, x: torch.Tensor, loss: Callable, y: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, P) by one forward and one autograd.grad per sample, on a copy of each sample."""
    params = list(model.parameters())
    rows = []
    for b in range(x.shape[0]):
        out = model(x[b : b + 1].clone())
        value = loss(out) if y is None else loss(out, y[b : b + 1])
        grads = torch.autograd.grad(value.sum(), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)]))
    return torch.stack(rows)


def vmap_psg(model: nn.Module, x: torch.Tensor, loss: Callable, y: torch.Tensor) -> torch.Tensor:
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, p, (xb.unsqueeze(0),)), yb.unsqueeze(0)).sum()

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([t.reshape(x.shape[0], -1) for t in g.values()], 1)


def ce(out: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, yy, reduction="none")


def test_problem_class_cross_entropy_matches_vmap_grad_repeatedly() -> None:
    """The benchmarked case: the first call profiles (a copy of x), the later ones run on x itself."""
    torch.manual_seed(0)
    model = MLP(20, 7, 4).double()
    x, y = torch.randn(16, 20, dtype=torch.float64), torch.randint(0, 4, (16,))
    values, version = x.clone(), x._version
    want = vmap_psg(model, x, ce, y)
    before = snapshot(model)
    for _ in range(3):
        torch.testing.assert_close(jm.per_sample_grads(model, x, ce, y=y), want)
    assert_unchanged(model, before)
    assert torch.equal(x, values) and x._version == version
    assert all(p.grad is None for p in model.parameters())


class InPlaceInput(nn.Module):
    """Doubles its input in place before its first layer (a user's normalisation written in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 6), nn.Linear(6, 3)
        self.mutate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mutate:
            x.mul_(2.0)
        return self.fc2(torch.tanh(self.fc1(x)))


def _plain_twin(model: InPlaceInput) -> InPlaceInput:
    twin = InPlaceInput().double()
    twin.load_state_dict(model.state_dict())
    twin.mutate = False
    return twin


def test_a_model_that_modifies_its_input_runs_on_a_copy_every_call() -> None:
    torch.manual_seed(0)
    model = InPlaceInput().double()
    x = torch.randn(6, 5, dtype=torch.float64)
    values = x.clone()
    loss = lambda out: (out**2).sum(1)  # noqa: E731
    want = loop_psg(_plain_twin(model), 2.0 * values, loss, None)
    for _ in range(3):
        torch.testing.assert_close(jm.per_sample_grads(model, x, loss), want)
        assert torch.equal(x, values)


def _guard_misses_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, every state passes the guard of the last one: a change of what the model reads
    that TorchDynamo's guards would not see (``_guard.py``). ``model.mutate`` itself is guarded (a new
    state is profiled afresh, on a copy: see the test below); this reaches the defence behind the
    guard, the check of x's version after a call that ran the model on x itself."""
    monkeypatch.setattr(_guard, "_passes", lambda manager, frame: True)


def test_a_model_that_starts_modifying_its_input_gives_exact_rows_then_copies_again(monkeypatch) -> None:
    """The profile said 'leaves its input alone' (so the model ran on x itself); a later call that
    modifies x in place, in a state the guard does not tell apart, still gets exact rows (of the
    values the model saw), and the next call runs on a copy again."""
    torch.manual_seed(0)
    model = InPlaceInput().double()
    model.mutate = False
    x = torch.randn(6, 5, dtype=torch.float64)
    loss = lambda out: (out**2).sum(1)  # noqa: E731
    twin = _plain_twin(model)
    torch.testing.assert_close(jm.per_sample_grads(model, x, loss), loop_psg(twin, x, loss, None))
    torch.testing.assert_close(jm.per_sample_grads(model, x, loss), loop_psg(twin, x, loss, None))  # kept
    _guard_misses_changes(monkeypatch)
    model.mutate = True
    values = x.clone()
    got = jm.per_sample_grads(model, x, loss)  # runs on x itself: x is doubled, as model(x) would
    torch.testing.assert_close(got, loop_psg(twin, 2.0 * values, loss, None))
    assert torch.equal(x, 2.0 * values)
    values = x.clone()
    torch.testing.assert_close(jm.per_sample_grads(model, x, loss), loop_psg(twin, 2.0 * values, loss, None))
    assert torch.equal(x, values)  # a copy again


def test_a_model_that_starts_modifying_its_input_in_a_state_the_guard_sees_is_profiled_again() -> None:
    """``model.mutate`` is read by forward, so TorchDynamo's guard tells the states apart: the call
    after the change finds no profile and runs the model on a copy, as a first call does."""
    torch.manual_seed(0)
    model = InPlaceInput().double()
    model.mutate = False
    x = torch.randn(6, 5, dtype=torch.float64)
    loss = lambda out: (out**2).sum(1)  # noqa: E731
    twin = _plain_twin(model)
    for _ in range(3):
        torch.testing.assert_close(jm.per_sample_grads(model, x, loss), loop_psg(twin, x, loss, None))
    model.mutate = True
    values = x.clone()
    for _ in range(3):
        torch.testing.assert_close(jm.per_sample_grads(model, x, loss), loop_psg(twin, 2.0 * values, loss, None))
        assert torch.equal(x, values)


class Scale(nn.Module):
    """A parameter without a per-sample rule: its columns come from the generic engine."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class InPlaceMixed(InPlaceInput):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Scale(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mutate:
            x.mul_(2.0)
        return self.fc2(torch.tanh(self.gate(self.fc1(x))))


def test_a_model_that_starts_modifying_its_input_with_uncovered_parameters_raises(monkeypatch) -> None:
    """As above, in a state the guard does not tell apart: the generic engine's columns cannot be
    completed from the modified x."""
    torch.manual_seed(0)
    model = InPlaceMixed().double()
    model.mutate = False
    x = torch.randn(6, 5, dtype=torch.float64)
    loss = lambda out: (out**2).sum(1)  # noqa: E731
    first = jm.per_sample_grads(model, x, loss)
    torch.testing.assert_close(first, loop_psg(model, x, loss, None))
    jm.per_sample_grads(model, x, loss)  # kept: the first call caches nothing (_guard.py)
    _guard_misses_changes(monkeypatch)
    model.mutate = True
    with pytest.raises(RuntimeError, match=r"modified its input x in place.*x\.clone\(\)"):
        jm.per_sample_grads(model, x, loss)
    values = x.clone()
    model.mutate = False
    torch.testing.assert_close(jm.per_sample_grads(model, x, loss), loop_psg(model, values, loss, None))
    assert torch.equal(x, values)


class Unused(nn.Module):
    """A covered layer that runs but does not reach the output: its probe gets no cotangent."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.side, self.out = nn.Linear(4, 5), nn.Linear(4, 2), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.side(x)
        return self.out(torch.relu(self.fc(x)))


def test_a_layer_that_does_not_reach_the_loss_gets_zero_rows() -> None:
    torch.manual_seed(0)
    model = Unused().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    got = jm.per_sample_grads(model, x, ce, y=y)
    torch.testing.assert_close(got, loop_psg(model, x, ce, y))
    assert got[:, 25:35].abs().max() == 0  # side.weight, side.bias


def test_in_place_activations_after_the_layers() -> None:
    """ReLU(inplace=True) rewrites each layer's output: the cotangents are the probes', not the outputs'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3), nn.ReLU(inplace=True)).double()
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    loss = lambda out, yy: ((out - yy) ** 2).sum(1)  # noqa: E731
    for _ in range(2):
        torch.testing.assert_close(jm.per_sample_grads(model, x, loss, y=y), loop_psg(model, x, loss, y))


def test_x_requiring_grad_or_an_inference_tensor_after_the_profile() -> None:
    """Neither can be the model's input in the probed pass: such calls run on a copy."""
    torch.manual_seed(0)
    model = MLP(6, 5, 3).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    want = loop_psg(model, x, ce, y)
    torch.testing.assert_close(jm.per_sample_grads(model, x, ce, y=y), want)
    xg = x.clone().requires_grad_(True)
    torch.testing.assert_close(jm.per_sample_grads(model, xg, ce, y=y), want)
    assert xg.grad is None and xg.is_leaf
    with torch.inference_mode():
        xi = x.clone()
    torch.testing.assert_close(jm.per_sample_grads(model, xi, ce, y=y), want)


def test_dict_form_and_subset_after_the_profile() -> None:
    torch.manual_seed(0)
    model = MLP(6, 5, 3).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    full = loop_psg(model, x, ce, y)
    for _ in range(2):
        got = jm.per_sample_grads(model, x, ce, y=y, flatten=False)
        torch.testing.assert_close(torch.cat([g.reshape(4, -1) for g in got.values()], 1), full)
        sub = jm.per_sample_grads(model, x, ce, y=y, wrt=["fc2.weight", "fc1.bias"])
        torch.testing.assert_close(sub, full[:, 30:50])  # fc1.bias, fc2.weight in the model's order


def test_a_loss_that_does_not_depend_on_the_output_gives_zero_rows() -> None:
    """As torch.func's grad (no raw autograd error about tensors that do not require grad)."""
    torch.manual_seed(0)
    model = MLP(6, 5, 3).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    loss = lambda out: torch.zeros(out.shape[0], dtype=out.dtype)  # noqa: E731
    params = {n: p.detach() for n, p in model.named_parameters()}
    want = vmap(grad(lambda p, xb: loss(functional_call(model, p, (xb[None],))).sum()), in_dims=(None, 0))(params, x)
    for _ in range(2):
        got = jm.per_sample_grads(model, x, loss)
        torch.testing.assert_close(got, torch.cat([t.reshape(4, -1) for t in want.values()], 1))
        assert got.abs().max() == 0
