"""Input Jacobians over captured graphs: seeds taken as columns of the first linear map, reverse rows
per sample in the result's layout, and the planner's decision for problem 1's class.

Oracles: torch.func's per-sample ``vmap(jacrev)`` in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import jacrev, vmap

import jacmode as jm
from jacmode import _guard
from jacmode._capture import capture as _capture
from jacmode._capture import taylor as _taylor
from jacmode._rules.base import Seed
from jacmode._structure import _ROWS_KEY

MODES = ("forward", "reverse", "auto")


def oracle(f, x: Tensor) -> Tensor:
    """(B, *out, *in) per sample, torch.func."""
    return vmap(jacrev(lambda xb: f(xb.unsqueeze(0))[0]))(x)


class Functional(nn.Module):
    """F.linear, a matmul with a constant matrix and one with a vector, a sum over features."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, d))
        self.m = nn.Parameter(torch.randn(d, 5))
        self.v = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        a = torch.tanh(F.linear(x, self.w))
        b = torch.sin(x @ self.m)
        c = (x @ self.v).unsqueeze(1) + x.sum(1, keepdim=True) + x.mean(-1, keepdim=True)
        return torch.cat([a, b, c * c], dim=1)


class Skip(nn.Module):
    """The input read twice: by a Linear and by an elementwise map (the seed is then built)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x)) + x * x


def models(d: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        "mlp": nn.Sequential(nn.Linear(d, 20), nn.ReLU(), nn.Linear(20, 10)),
        "tanh-first": nn.Sequential(nn.Tanh(), nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 3)),
        "functional": Functional(d),
        "skip": Skip(d),
        "one-hidden-unit": nn.Sequential(nn.Linear(d, 1), nn.ReLU(), nn.Linear(1, 3)),
    }


@pytest.mark.parametrize("name", sorted(models(6)))
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("mode", MODES)
def test_input_jacobians_over_captured_graphs_are_exact(name: str, batch: int, mode: str) -> None:
    net = models(6)[name].double()
    x = torch.randn(batch, 6, dtype=torch.float64)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    got = jm.jacobian(net, x, mode=mode)
    torch.testing.assert_close(got, oracle(net, x), rtol=1e-12, atol=1e-12)
    assert got.is_contiguous()
    for k, v in net.state_dict().items():  # the columns of a weight are copies: nothing writes into it
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("mode", MODES)
def test_a_flatten_before_the_first_linear_keeps_the_seed_unbuilt(mode: str) -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x = torch.randn(3, 1, 3, 4, dtype=torch.float64)
    for _ in range(2):  # the first call caches nothing; the second caches the program (_guard.py)
        torch.testing.assert_close(jm.jacobian(net, x, mode=mode), oracle(net, x), rtol=1e-12, atol=1e-12)
    program = _guard.scoped_call(net, (x,), {}, lambda: _capture.program_for(net))  # in a scope of net(x)
    assert not isinstance(program, str)
    assert not _taylor.seed_built(program, (1, 3, 4), x)


def test_the_check_records_whether_the_seed_is_built() -> None:
    nets = models(6)
    x = torch.randn(4, 6)
    for name, built in (("mlp", False), ("functional", False), ("tanh-first", True), ("skip", True)):
        program = _capture.program_for(nets[name])
        assert not isinstance(program, str)
        _taylor.value(program, x)
        assert _taylor.seed_built(program, (6,), x) is built, name
    assert _taylor.seed_built(program, (99,), x)  # never checked: assume built


def test_forward_columns_in_chunks_and_with_a_graph() -> None:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(9, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(4, 9, dtype=torch.float64)
    ref = oracle(net, x)
    torch.testing.assert_close(jm.jacobian(net, x, mode="forward", chunk_size=4), ref, rtol=1e-12, atol=1e-12)
    got = jm.jacobian(net, x, mode="forward", create_graph=True)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(got.square().sum(), net[0].weight)
    (want,) = torch.autograd.grad(oracle(net, x).square().sum(), net[0].weight)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)


def test_first_takes_columns_at_any_directions() -> None:
    """``taylor.first`` along directions that are not consecutive (index_select of the weight)."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    program = _capture.program_for(net)
    assert not isinstance(program, str)
    x = torch.randn(2, 8, dtype=torch.float64)
    dims = [6, 1, 3]
    got = _taylor.first(program, x, (8,), dims)  # (k, B, Y)
    torch.testing.assert_close(got, oracle(net, x)[:, :, dims].permute(2, 0, 1), rtol=1e-12, atol=1e-12)
    w = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(Seed([1, 2], lambda c: {}).index(w, 1), w[:, 1:3])
    assert torch.equal(Seed([3, 0], lambda c: {}).index(w, 1), w[:, [3, 0]])


@pytest.mark.parametrize("chunk", [None, 3])
def test_reverse_rows_per_sample_are_exact_in_the_results_layout(chunk) -> None:
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    x = torch.randn(6, 7, dtype=torch.float64)
    ref = oracle(net, x)
    got = jm.jacobian(net, x, mode="reverse", chunk_size=chunk)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    got = jm.jacobian(net, x, mode="reverse", create_graph=True)
    (g,) = torch.autograd.grad(got.sum(), net[2].weight)
    (want,) = torch.autograd.grad(oracle(net, x).sum(), net[2].weight)
    torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    with torch.inference_mode():
        torch.testing.assert_close(jm.jacobian(net, x, mode="reverse"), ref, rtol=1e-12, atol=1e-12)


def test_reverse_rows_fall_back_to_the_batch_when_f_fails_on_one_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """When f cannot run on one sample under vmap, the broadcast engine over the batch serves, exactly,
    and the calls of that shape after the one that remembers it (the second: _guard.py) go there at once."""
    from jacmode import _structure

    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    calls = []

    def failing(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("vmap: f needs the whole batch")

    monkeypatch.setattr(_structure, "sample_rows", failing)
    for _ in range(3):
        torch.testing.assert_close(jm.jacobian(net, x, mode="reverse"), oracle(net, x), rtol=1e-12, atol=1e-12)
    # the first call caches nothing (_guard.py): it and the second try the rows; the third goes to the batch
    assert len(calls) == 2
    program = _guard.scoped_call(net, (x,), {}, lambda: _capture.program_for(net))  # in a scope of net(x)
    assert not isinstance(program, str)
    assert "whole batch" in program.checked[_ROWS_KEY + ((8,), torch.float64, "cpu")]


def test_the_plan_for_problem_1s_class_at_2_64_and_1024_samples() -> None:
    """MLP(784, 20, 10): at B = 2 forward mode takes the first layer's columns (no 784 x 784 seed)
    and wins; at B = 64 and 1024 reverse mode's 10 directions win. A net whose first operation reads
    the seed as a tensor (tanh) pays for the (784, 1, 784) seed: reverse mode at every size."""
    from bench.baselines import MLP

    torch.manual_seed(6)
    net = MLP(784, 20, 10)
    tanh_first = nn.Sequential(nn.Tanh(), nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))
    for batch, mode in ((2, "forward"), (64, "reverse"), (1024, "reverse")):
        x = torch.randn(batch, 784)
        p = jm.plan(net, x)
        assert (p.mode, p.strategy) == (mode, "broadcast"), (batch, p)
        assert jm.plan(tanh_first, x).mode == "reverse", batch
    x = torch.randn(2, 784, dtype=torch.float64)
    torch.testing.assert_close(jm.jacobian(net.double(), x), oracle(net, x), rtol=1e-12, atol=1e-12)
