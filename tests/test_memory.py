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


class Generic(nn.Module):
    """An MLP the probes are switched off for: the generic vmap engines, not the layer-wise ones."""

    def __init__(self, d: int, h: int, y: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, y))
        self._jacmode_no_probes = True

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


# --- one meaning of max_memory in every entry point: the workspace on top of the result ---

BUDGET = 60_000  # bytes: below every result of the calls below, above the workspace of one of their passes


def _conv(z: torch.Tensor) -> torch.Tensor:
    """A banded Jacobian: 15 nonzeros per row, 15 colours."""
    return torch.tanh(torch.nn.functional.conv1d(z.reshape(1, 1, -1), torch.linspace(-1, 1, 15, dtype=z.dtype)
                                                 .reshape(1, 1, -1)).reshape(-1))


def _spy(monkeypatch, module, name: str, chunks: list):
    """Record the samples per pass (the ``chunk`` argument) that an engine function receives."""
    import inspect

    original = getattr(module, name)
    signature = inspect.signature(original)

    def spy(*a, **k):
        chunks.append(signature.bind(*a, **k).arguments["chunk"])
        return original(*a, **k)

    monkeypatch.setattr(module, name, spy)


def test_the_same_max_memory_bounds_the_workspace_of_every_entry_point(monkeypatch):
    from jacmode._probes import products as _engine
    from jacmode._sparse.api import result_bytes

    torch.manual_seed(0)
    net = Generic(5, 16, 3).double()  # the generic engines, which chunk samples by the budget
    P = sum(p.numel() for p in net.parameters())
    x = torch.randn(80, 5, dtype=torch.float64)
    sq = lambda out: (out ** 2).sum(1)  # noqa: E731

    # jacobian: the (B, Y, P) result is larger than the budget, one pass's workspace is not
    p = jm.plan(net, x[:40], wrt="params", max_memory=BUDGET, mode="reverse")
    assert p.result_bytes > BUDGET and p.workspace_bytes <= p.budget_bytes == BUDGET
    assert p.sample_chunk < jm.plan(net, x[:40], wrt="params", mode="reverse").sample_chunk
    torch.testing.assert_close(jm.jacobian(net, x[:40], wrt="params", max_memory=BUDGET, mode="reverse"),
                               jm.jacobian(net, x[:40], wrt="params"))

    # per_sample_grads: (B, P) result over the budget; fewer samples per vmap(grad) pass
    assert 80 * P * 8 > BUDGET
    chunks: list = []
    _spy(monkeypatch, _engine, "per_sample_grads_generic", chunks)
    tight = jm.per_sample_grads(net, x, sq, max_memory=BUDGET)
    torch.testing.assert_close(tight, jm.per_sample_grads(net, x, sq))
    assert chunks[0] < chunks[1] == 80

    # ntk: (B1, B2, Y, Y) result over the budget; fewer samples per Jacobian block
    assert 40 * 40 * 3 * 3 * 8 > BUDGET
    tight_plan = jm.ntk_plan(net, x[:40], method="contraction", max_memory=BUDGET)
    assert tight_plan.sample_chunk < jm.ntk_plan(net, x[:40], method="contraction").sample_chunk == 40
    torch.testing.assert_close(jm.ntk(net, x[:40], method="contraction", max_memory=BUDGET),
                               jm.ntk(net, x[:40], method="contraction"))

    # ggn: (P, P) result over the budget; fewer samples per Jacobian block
    assert P * P * 8 > BUDGET
    chunks.clear()
    _spy(monkeypatch, _engine, "ggn_generic", chunks)
    torch.testing.assert_close(jm.ggn(net, x, max_memory=BUDGET), jm.ggn(net, x))
    assert chunks[0] < chunks[1] == 80

    # sparse_jacobian: the nonzeros over the budget; fewer colours per pass
    z = torch.rand(400, dtype=torch.float64)
    assert result_bytes(jm.sparsity(_conv, z), z) > BUDGET
    sp = jm.plan(_conv, z, batched=False, structure="sparse", max_memory=BUDGET)
    assert sp.budget_bytes == BUDGET and sp.workspace_bytes <= BUDGET
    assert sp.chunk_size < jm.plan(_conv, z, batched=False, structure="sparse").chunk_size == sp.directions
    torch.testing.assert_close(jm.sparse_jacobian(_conv, z, max_memory=BUDGET, layout="dense"),
                               jm.jacobian(_conv, z, batched=False))


def test_the_default_budget_is_the_same_in_every_entry_point(monkeypatch):
    from jacmode._sparse.api import result_bytes

    monkeypatch.setattr(_memory, "available_bytes", lambda device: 1_000_000)
    cpu = torch.device("cpu")
    assert _memory.budget(None, cpu, 100_000) == 400_000  # half of the free memory less the result
    assert _memory.budget(None, cpu, 100_000, out_given=True) == 500_000  # out= is the caller's
    assert _memory.budget(123, cpu, 100_000) == 123  # max_memory bounds the workspace only
    assert _memory.budget(123, cpu, 2_000_000) is None  # the result cannot fit the free memory
    assert _memory.budget(123, cpu, 2_000_000, out_given=True) == 123
    z = torch.rand(400, dtype=torch.float64)
    sp = jm.plan(_conv, z, batched=False, structure="sparse")
    assert sp.budget_bytes == 500_000 - result_bytes(jm.sparsity(_conv, z), z)
    net = Generic(5, 16, 3).double()
    x = torch.randn(80, 5, dtype=torch.float64)
    per_sample = 3 * 147 * 8  # a Jacobian block of one sample, (Y, P)
    assert jm.ntk_plan(net, x, method="contraction").sample_chunk == (500_000 - 80 * 80 * 9 * 8) // (4 * per_sample)


@pytest.mark.parametrize("call, match", [
    (lambda net, x: jm.per_sample_grads(net, x, lambda out: out.sum(1)),
     r"per_sample_grads: the \(B, P\) result needs .* \(\(80, 147\) torch.float64\) but only 1000 B is free "
     r"on cpu: it cannot fit, so nothing was computed. Pass a smaller batch or fewer parameters"),
    (lambda net, x: jm.ntk(net, x),
     r"ntk: the \(B1, B2, Y, Y\) result needs .* \(\(80, 80, 3, 3\) torch.float64\).*cannot fit.*trace=True"),
    (lambda net, x: jm.ggn(net, x),
     r"ggn: the \(P, P\) matrix needs .* \(\(147, 147\) torch.float64\).*cannot fit.*diagonal=True"),
    (lambda net, x: jm.ggn(net, x, diagonal=True),
     r"ggn: the \(P,\) diagonal needs .* \(\(147,\) torch.float64\).*cannot fit.*wrt=\[...\]"),
    (lambda net, x: jm.jacobian(net, x, wrt="params", max_memory="1GB"),
     r"the result needs .* \(\(80, 3, 147\) torch.float64\).*cannot fit.*out="),
    (lambda net, x: jm.sparse_jacobian(_conv, x[:, 0], layout="dense"),
     r"the result needs .* \(\(66, 80\) torch.float64, dense, 990 nonzeros\).*cannot fit.*layout='csr'"),
    (lambda net, x: jm.sparse_jacobian(_conv, x[:, 0], max_memory="1GB"),
     r"the result needs .* \(\(66, 80\) torch.float64, csr, 990 nonzeros\).*cannot fit.*smaller x"),
])
def test_a_result_larger_than_the_free_memory_raises_in_every_entry_point(monkeypatch, call, match):
    net = Generic(5, 16, 3).double()
    x = torch.randn(80, 5, dtype=torch.float64)
    jm.sparsity(_conv, x[:, 0])  # the pattern, detected with the real free memory
    monkeypatch.setattr(_memory, "available_bytes", lambda device: 1000)
    with pytest.raises(MemoryError, match=match):
        call(net, x)
