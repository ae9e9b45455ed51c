"""Shared fixtures and independent float64 references built from plain torch.autograd.grad loops."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Callable, Optional, Sequence

import pytest
import torch
from torch import Tensor, nn

# Tests compare numbers, not speed: one intra-op thread keeps them fast and steady on a busy
# 2-core machine (and makes float reductions deterministic).
torch.set_num_threads(1)

# JACMODE_TEST_DEVICE=cuda runs the whole suite with CUDA as torch's default device (tensors and
# modules made without a device land there); bench/gpu.py runs it so on a GPU machine.
if os.environ.get("JACMODE_TEST_DEVICE"):
    torch.set_default_device(os.environ["JACMODE_TEST_DEVICE"])

# TorchDynamo (jacmode's guards trace f with it) writes structured traces at DEBUG to the logger
# "torch.__trace"; pytest's log capture would format every record of every trace.
logging.getLogger("torch.__trace").propagate = False

# The differential harness (tests/differential) keeps its tally here for the summary line.
DIFFERENTIAL: pytest.StashKey[Any] = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak", type=float, default=None, metavar="MINUTES",
        help="run random differential cases (tests/differential) for MINUTES; also JACMODE_SOAK=<minutes>",
    )


@pytest.fixture
def soak_minutes(request: pytest.FixtureRequest) -> Optional[float]:
    """Minutes of soak asked for with --soak or JACMODE_SOAK, None for the CI run."""
    value = request.config.getoption("--soak")
    if value is None and os.environ.get("JACMODE_SOAK"):
        value = float(os.environ["JACMODE_SOAK"])
    return value


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    tally = config.stash.get(DIFFERENTIAL, None)
    if tally is not None and tally.runs:
        terminalreporter.section("differential harness")
        for line in tally.summary():
            terminalreporter.write_line(line)


def ref_input_jacobian(f: Callable[[Tensor], Tensor], x: Tensor, batched: bool = True) -> Tensor:
    """Per-sample (B, *out, *in) or full (*out, *x.shape) Jacobian, one autograd.grad per entry.

    Batched: every sample is evaluated alone (f(x[b:b+1])), as a user's loop would.
    """
    if not batched:
        xx = x.detach().clone().requires_grad_(True)
        out = f(xx)
        rows = [torch.autograd.grad(o, xx, retain_graph=True, allow_unused=True)[0] for o in out.reshape(-1)]
        rows = [torch.zeros_like(xx) if r is None else r for r in rows]
        return torch.stack(rows).reshape(*out.shape, *x.shape)
    blocks = []
    for b in range(x.shape[0]):
        xb = x[b : b + 1].detach().clone().requires_grad_(True)
        out = f(xb)[0]
        rows = [torch.autograd.grad(o, xb, retain_graph=True, allow_unused=True)[0] for o in out.reshape(-1)]
        rows = [torch.zeros_like(xb) if r is None else r for r in rows]
        blocks.append(torch.stack(rows).reshape(*out.shape, *x.shape[1:]))
    return torch.stack(blocks)


def ref_param_jacobian(model: nn.Module, x: Tensor, names: Optional[Sequence[str]] = None) -> Tensor:
    """The users' loop of problems.md: (B, Y, P), one forward and one grad per sample and output."""
    named = [(n, p) for n, p in model.named_parameters() if (names is None and p.requires_grad) or (names is not None and n in names)]
    params = [p for _, p in named]
    rows_b = []
    for b in range(x.shape[0]):
        out = model(x[b : b + 1])[0].reshape(-1)
        rows = []
        for o in out:
            gs = torch.autograd.grad(o, params, retain_graph=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
        rows_b.append(torch.stack(rows))
    return torch.stack(rows_b)


def mlp_1_4() -> nn.Module:
    """The network of problem 2: Linear(1, 20) -> tanh -> Linear(20, 20) -> tanh -> Linear(20, 4)."""
    return nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 4))


class Wide(nn.Module):
    """2-D per-sample input (3, 5) to 3-D per-sample output (2, 3, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(15, 12)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.sin(self.lin(x.flatten(1)))
        return (h * h.roll(1, dims=1)).reshape(-1, 2, 3, 2)


def mnist_mlp() -> nn.Module:
    """The model of problem 1: Linear(784, 20) -> ReLU -> Linear(20, 10), P = 15,910."""
    return nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def snapshot(model: nn.Module) -> dict:
    """Everything a call must leave unchanged."""
    return {
        "state": copy.deepcopy(model.state_dict()),
        "flags": [p.requires_grad for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "training": [m.training for m in model.modules()],
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for m in model.modules()
        ],
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    for k in before["state"]:
        torch.testing.assert_close(after["state"][k], before["state"][k], rtol=0, atol=0)
    assert after["flags"] == before["flags"]
    assert after["training"] == before["training"]
    assert after["hooks"] == before["hooks"]
    for g0, g1 in zip(before["grads"], after["grads"]):
        assert (g0 is None) == (g1 is None)
        if g0 is not None:
            torch.testing.assert_close(g1, g0, rtol=0, atol=0)


class Opaque:
    """A callable object that is neither a module nor a Python function: never captured, so
    the generic (nested forward mode) engine runs."""

    def __init__(self, f: Callable[[Tensor], Tensor]) -> None:
        self.f = f

    def __call__(self, x: Tensor) -> Tensor:
        return self.f(x)
