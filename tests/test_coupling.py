"""Coupled samples never give silently wrong per-sample results; the probe is cheap and cached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmode as jm
from conftest import assert_unchanged, ref_input_jacobian, snapshot


def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()


def whole_batch_blocks(f, x: torch.Tensor) -> torch.Tensor:
    full = torch.autograd.functional.jacobian(f, x)  # (B, *out, B, *in)
    return torch.stack([full[b, :, b] for b in range(x.shape[0])])


@pytest.mark.parametrize("wrt", ["inputs", "params"])
def test_batchnorm_training_raises_and_leaves_model(wrt: str) -> None:
    net = bn_net()
    before = snapshot(net)
    with pytest.raises(jm.CoupledBatchError, match=r"BatchNorm layer\(s\) '1' are in training mode.*model.eval\(\).*batched=False.*structure='coupled'"):
        jm.jacobian(net, torch.randn(5, 3, dtype=torch.float64), wrt=wrt)
    assert_unchanged(net, before)
    assert isinstance(jm.CoupledBatchError("x"), ValueError)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_batchnorm_training_exact_blocks(mode: str) -> None:
    net = bn_net()
    x = torch.randn(5, 3, dtype=torch.float64)
    before = snapshot(net)
    got = jm.jacobian(net, x, mode=mode, structure="coupled")
    assert_unchanged(net, before)  # running statistics not updated
    want = whole_batch_blocks(net, x)  # the reference itself updates the running statistics
    torch.testing.assert_close(got, want)


def test_batchnorm_eval_is_independent() -> None:
    net = bn_net()
    with torch.no_grad():
        net[1].running_mean.uniform_(-1, 1)
        net[1].running_var.uniform_(0.5, 2)
    net.eval()
    x = torch.randn(4, 3, dtype=torch.float64)
    before = snapshot(net)
    torch.testing.assert_close(jm.jacobian(net, x), ref_input_jacobian(net, x))
    assert_unchanged(net, before)


def test_batchnorm_training_unbatched_full_jacobian() -> None:
    net = bn_net()
    x = torch.randn(4, 3, dtype=torch.float64)
    before = snapshot(net)
    got = jm.jacobian(net, x, batched=False)
    assert_unchanged(net, before)
    assert got.shape == (4, 2, 4, 3)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_mean_subtraction_is_detected(mode: str) -> None:
    f = lambda z: torch.tanh(z - z.mean(0))  # noqa: E731
    x = torch.randn(6, 2, dtype=torch.float64)
    with pytest.raises(jm.CoupledBatchError, match="samples of the batch are coupled"):
        jm.jacobian(f, x, mode=mode)
    torch.testing.assert_close(jm.jacobian(f, x, mode=mode, structure="coupled"), whole_batch_blocks(f, x))


def test_independent_skips_the_probe() -> None:
    calls = []

    def f(z: torch.Tensor) -> torch.Tensor:
        calls.append(z.shape[0])
        return z - z.mean(0)

    jm.jacobian(f, torch.randn(20, 2), structure="independent")
    # graph capture traces f once (with a proxy for z) and checks the graph on 3 samples (it
    # declines: z.mean(0) mixes samples); the probe runs f once on its 8 samples for the output
    # shape and never on the changed copies that the check compares
    sizes = [c for c in calls if isinstance(c, int)]
    assert sizes.count(8) == 1


def test_probe_is_cached_and_cheap() -> None:
    sizes: list[int] = []

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            # plain passes only; not in the guard's TorchDynamo trace (_guard.py), which cannot trace
            # the functorch checks: a function it cannot trace whole would never be cached
            if not torch.compiler.is_dynamo_compiling() and not torch._C._functorch.is_batchedtensor(z) \
                    and not torch._C._functorch.is_gradtrackingtensor(z):
                sizes.append(z.shape[0])
            return self.lin(z)

    net = Net()
    x = torch.randn(1000, 2)
    jm.jacobian(net, x)
    first = list(sizes)
    # the probe: one pass recording a graph and 2 log2(8) = 6 passes over 8 samples with parts of
    # them changed; then one single-sample pass measuring the footprint
    assert first == [8] * 7 + [1]
    sizes.clear()
    jm.jacobian(net, x)  # the first call cached nothing (_guard.py): the second probes again and caches
    assert sizes == first
    sizes.clear()
    jm.jacobian(net, x)
    assert sizes == []  # verdict and output shape cached: nothing runs before differentiating
    net.eval()  # a change of mode invalidates the verdict (and the footprint)
    sizes.clear()
    jm.jacobian(net, x)
    assert len(sizes) == 8
    jm.clear_cache()
    sizes.clear()
    jm.jacobian(net, x)
    assert len(sizes) == 8


def test_dropout_training_is_not_coupled() -> None:
    net = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    before = snapshot(net)
    assert jm.jacobian(net, torch.randn(6, 3)).shape == (6, 2, 3)
    assert_unchanged(net, before)


def test_identical_samples_still_detected() -> None:
    """Spread probe samples: coupling is found even if most samples are equal."""
    x = torch.zeros(10, 2, dtype=torch.float64)
    x[-1] = 1.0
    with pytest.raises(jm.CoupledBatchError):
        jm.jacobian(lambda z: z - z.mean(0), x)


def test_forward_raising_midway_leaves_model() -> None:
    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.lin = nn.Linear(3, 3)
            self.calls = 0

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom")
            return self.lin(self.bn(z))

    net = Flaky()
    before = snapshot(net)
    with pytest.raises(RuntimeError, match="boom"):
        jm.jacobian(net, torch.randn(4, 3), structure="coupled")
    assert_unchanged(net, before)
    assert net.bn.running_mean is not None and net.bn.track_running_stats
