"""max_memory: parsing, results that cannot fit, chunk sizes that respect the budget."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn

import jacmode as jm
from jacmode._planning import decide as _decide, memory as _memory
from jacmode._checks import check_max_memory
from conftest import mlp_1_4, ref_param_jacobian


@pytest.mark.parametrize("text, expected", [
    ("2GB", 2 * 10**9), ("200MB", 200 * 10**6), ("512MiB", 512 * 2**20), ("1.5 GiB", int(1.5 * 2**30)),
    ("100kb", 100_000), ("4096", 4096), (10**6, 10**6), (2.5e6, 2_500_000), (None, None),
])
def test_max_memory_parsing(text, expected):
    assert check_max_memory(text) == expected


@pytest.mark.parametrize("bad, err, match", [
    ("lots", ValueError, r"max_memory: could not read 'lots'.*'2GB'"),
    ("2 GiBs", ValueError, r"could not read"),
    ("-5MB", ValueError, r"could not read"),
    (0, ValueError, r"max_memory: expected a positive amount"),
    (-1, ValueError, r"positive"),
    (float("nan"), ValueError, r"positive"),
    (True, TypeError, r"max_memory: expected a number of bytes or a string.*bool"),
    ([1], TypeError, r"got list"),
])
def test_max_memory_errors(bad, err, match):
    with pytest.raises(err, match=match):
        jm.jacobian(mlp_1_4(), torch.randn(3, 1), max_memory=bad)


def test_result_that_cannot_fit_raises_before_allocating(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 10_000)

    def must_not_run(*a, **k):
        raise AssertionError("computed although the result cannot fit")

    monkeypatch.setattr(_decide, "run", must_not_run)
    x = torch.randn(100, 1)
    with pytest.raises(MemoryError, match=r"the result needs 850.0 KiB .*\(100, 4, 544\).*cannot fit"):
        jm.jacobian(mlp_1_4(), x, wrt="params", max_memory="1GB")
    with pytest.raises(MemoryError, match="cannot fit"):
        jm.plan(mlp_1_4(), x, wrt="params")


def test_budget_below_one_direction_raises():
    with pytest.raises(ValueError, match=r"max_memory: even one direction per pass needs about .* over the budget of 10 B"):
        jm.jacobian(mlp_1_4(), torch.randn(100, 1), wrt="params", max_memory=10)


class OwnLinear(nn.Linear):
    """A Linear subclass: no per-module rule."""


class Generic(nn.Module):
    """An MLP of layers without rules: the generic vmap engines, not the layer-wise ones."""

    def __init__(self, d: int, h: int, y: int) -> None:
        super().__init__()
        self.net = nn.Sequential(OwnLinear(d, h), nn.Tanh(), OwnLinear(h, y))

    def forward(self, x):
        return self.net(x)


def test_per_sample_chunks_shrink_to_fit_the_budget():
    net = Generic(20, 64, 6)
    x = torch.randn(300, 20)
    free = jm.plan(net, x, wrt="params", max_memory="4GB", mode="reverse")
    assert (free.chunk_size, free.sample_chunk) == (6, 300)
    chunks = []
    for share in (0.5, 0.1, 0.02):
        budget = int(share * free.workspace_bytes)
        p = jm.plan(net, x, wrt="params", max_memory=budget, mode="reverse")
        assert p.workspace_bytes <= budget and p.budget_bytes == budget
        chunks.append(p.sample_chunk)
    assert chunks == sorted(chunks, reverse=True) and chunks[0] < 300
    one = jm.plan(net, x, wrt="params", max_memory=10**9, mode="reverse", chunk_size=1)
    tight = jm.plan(net, x, wrt="params", max_memory=int(one.workspace_bytes * 3), mode="reverse")
    assert tight.sample_chunk == 1 and 1 <= tight.chunk_size < 6 and tight.workspace_bytes <= one.workspace_bytes * 3


def test_direction_chunks_shrink_to_fit_the_budget():
    net = nn.Sequential(nn.Linear(200, 256), nn.Tanh(), nn.Linear(256, 3))
    x = torch.randn(64, 200)
    whole = jm.plan(net, x, mode="forward", max_memory="1GB")
    assert whole.chunk_size == 200
    sizes = []
    for share in (0.5, 0.2, 0.05):
        budget = int(share * whole.workspace_bytes)
        p = jm.plan(net, x, mode="forward", max_memory=budget)
        assert p.workspace_bytes <= budget
        sizes.append(p.chunk_size)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] < 200
    p = jm.plan(net, x, mode="forward", max_memory=int(0.05 * whole.workspace_bytes))
    assert re.search(rf"{p.chunk_size} directions? per pass to stay inside the memory budget", p.reason)


@pytest.mark.parametrize("layerwise", [True, False])
def test_chunked_result_is_the_same(layerwise):
    torch.manual_seed(0)
    net = (nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)) if layerwise else Generic(5, 16, 3)).double()
    x = torch.randn(40, 5, dtype=torch.float64)
    budget = jm.plan(net, x, wrt="params", mode="reverse").workspace_bytes // 4
    tight = jm.plan(net, x, wrt="params", max_memory=budget, mode="reverse")
    assert tight.sample_chunk < 40
    J = jm.jacobian(net, x, wrt="params", max_memory=budget, mode="reverse")
    torch.testing.assert_close(J, ref_param_jacobian(net, x))
    budget = jm.plan(net, x, mode="forward").workspace_bytes // 3
    assert jm.plan(net, x, mode="forward", max_memory=budget).chunk_size < 5
    Jf = jm.jacobian(net, x, mode="forward", max_memory=budget)
    torch.testing.assert_close(Jf, jm.jacobian(net, x))


def test_default_budget_is_half_the_free_memory_less_the_result(monkeypatch):
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 100_000_000)
    p = jm.plan(mlp_1_4(), torch.randn(100, 1), wrt="params")
    assert p.budget_bytes == 50_000_000 - p.result_bytes


def test_available_memory_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    assert _memory._read_available(torch.device("cpu")) > 0


def test_available_memory_is_reread_after_a_while(monkeypatch):
    reads = []
    monkeypatch.setattr(_memory, "_read_available", lambda device: reads.append(1) or 123)
    monkeypatch.setattr(_memory, "_RECENT", {})
    assert _memory.available_bytes(torch.device("cpu")) == 123
    assert _memory.available_bytes(torch.device("cpu")) == 123 and len(reads) == 1
    monkeypatch.setattr(_memory, "RECENT_S", 0.0)
    _memory.available_bytes(torch.device("cpu"))
    assert len(reads) == 2


def test_workspace_estimate_grows_with_directions_and_samples():
    kw = dict(act=1000.0, peak=100.0, seed_bytes=8.0, block_bytes=8.0)
    for mode in ("forward", "reverse"):
        a = _memory.workspace(mode, k=1, samples=4, **kw)
        assert _memory.workspace(mode, k=8, samples=4, **kw) > a
        assert _memory.workspace(mode, k=1, samples=40, **kw) > a
    assert _memory.largest_fitting(lambda k: k * k <= 50, 100) == 7
    assert _memory.largest_fitting(lambda k: False, 100) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_budget_comes_from_free_device_memory():
    net = mlp_1_4().cuda()
    x = torch.randn(64, 1, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    p = jm.plan(net, x, wrt="params")
    assert 0 < p.budget_bytes <= free
    J = jm.jacobian(net, x, wrt="params", max_memory="1MB")
    assert J.device.type == "cuda"
    torch.testing.assert_close(J.cpu(), jm.jacobian(net.cpu(), x.cpu(), wrt="params"), rtol=1e-4, atol=1e-5)
