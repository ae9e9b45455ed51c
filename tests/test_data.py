"""Data sets in one process: jm.jacobians, products over batches, memmap out=, faults, progress, checks."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import jacmode as jm
from conftest import assert_unchanged, ref_param_jacobian, snapshot
from jacmode._streams.batches import LocalPieces, check_split
from jacmode._streams.pages import file_region, release
from bench.baselines import MLP, NetX

N = 23


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1)


@pytest.fixture
def problem() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return MLP(6, 5, 3).double(), torch.randn(N, 6, dtype=torch.float64), torch.randn(N, 3, dtype=torch.float64)


def loaders(x: torch.Tensor, y: torch.Tensor) -> list:
    """The shapes data sets come in: DataLoader of (x, y), of x, a list of (x,) tuples, a generator."""
    return [DataLoader(TensorDataset(x, y), batch_size=4), DataLoader(TensorDataset(x), batch_size=5),
            [(b,) for b in x.split(7)], (b for b in x.split(6))]


# --- jacobians: iterator and out=, against the users' loop in float64 ---

@pytest.mark.parametrize("kind", range(4))
def test_jacobians_match_the_users_loop(problem, kind: int) -> None:
    net, x, y = problem
    ref = ref_param_jacobian(net, x)
    before = snapshot(net)
    got = torch.cat(list(jm.jacobians(net, loaders(x, y)[kind])))
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    out = torch.full_like(ref, float("nan"))
    assert jm.jacobians(net, loaders(x, y)[kind], out=out) is out
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert_unchanged(net, before)


def test_jacobians_of_problem_2_and_a_parameter_subset() -> None:
    torch.manual_seed(1)
    net, t = NetX().double(), torch.rand(9, 1, dtype=torch.float64)
    got = torch.cat(list(jm.jacobians(net, iter(t.split(4)), wrt=["out.weight", "out.bias"], mode="forward")))
    torch.testing.assert_close(got, ref_param_jacobian(net, t, ["out.weight", "out.bias"]))


def test_jacobians_is_lazy_and_validates_eagerly(problem) -> None:
    net, x, _ = problem
    calls = []
    it = jm.jacobians(net, map(lambda b: calls.append(1) or b, x.split(5)))
    assert calls == []
    next(it)
    assert calls == [1]
    with pytest.raises(TypeError, match="batches: expected an iterable of batches"):
        jm.jacobians(net, x)
    with pytest.raises(TypeError, match="wrt='params' needs an nn.Module"):
        jm.jacobians(lambda v: v, iter([x]))


# --- out= backed by a NumPy memmap ---

@pytest.mark.parametrize("as_tensor", [True, False])
def test_memmap_out_holds_the_whole_data_set(problem, tmp_path, as_tensor: bool) -> None:
    net, x, _ = problem
    ref = ref_param_jacobian(net, x)
    path = str(tmp_path / "J.npy")
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=tuple(ref.shape))
    out = torch.from_numpy(mm) if as_tensor else mm
    assert file_region(torch.from_numpy(mm)) is not None and file_region(torch.empty(100)) is None
    jm.jacobians(net, iter(x.split(4)), out=out)
    del out, mm
    torch.testing.assert_close(torch.from_numpy(np.load(path)), ref, rtol=1e-10, atol=1e-12)


def test_releasing_pages_keeps_the_values(tmp_path) -> None:
    mm = np.lib.format.open_memmap(str(tmp_path / "a.npy"), mode="w+", dtype=np.float32, shape=(4, 4096))
    t = torch.from_numpy(mm)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))
    release(t)
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))


# --- faults: which batch, which rows ---

class Flaky(TensorDataset):
    def __getitem__(self, i: int):
        if i == 9:
            raise OSError("unreadable sample 9")
        return super().__getitem__(i)


def test_a_failing_batch_names_itself_and_the_final_rows(problem) -> None:
    net, x, y = problem
    out = torch.zeros(N, 3, sum(p.numel() for p in net.parameters()), dtype=torch.float64)
    with pytest.raises(jm.BatchError, match=r"batch 2 failed: OSError: unreadable sample 9\. out= "
                       r"holds final values in rows 0\.\.7; later rows do not") as info:
        jm.jacobians(net, DataLoader(Flaky(x, y), batch_size=4), out=out)
    assert (info.value.batch, info.value.rank, info.value.rows_written) == (2, 0, 8)
    assert isinstance(info.value.__cause__, OSError)
    torch.testing.assert_close(out[:8], ref_param_jacobian(net, x[:8]))
    with pytest.raises(jm.BatchError, match="batch 0 failed: .*No row of out= holds a final value"):
        jm.jacobians(net, DataLoader(Flaky(x, y), batch_size=12), out=out)
    with pytest.raises(jm.BatchError, match="batch 1 failed: OSError") as info:
        jm.ggn(net, DataLoader(Flaky(x, y), batch_size=5), diagonal=True)
    assert info.value.rows_written is None


def test_out_with_too_few_or_too_many_rows(problem) -> None:
    net, x, _ = problem
    shape = (3, sum(p.numel() for p in net.parameters()))
    with pytest.raises(jm.BatchError, match="batch 2 failed: ValueError: out: has 10 rows but the data "
                       "set has more samples") as info:
        jm.jacobians(net, iter(x.split(4)), out=torch.zeros(10, *shape, dtype=torch.float64))
    assert info.value.rows_written == 8
    with pytest.warns(jm.JacmodeWarning, match="out: has 30 rows but the data set had 23 samples; rows 23.."):
        jm.jacobians(net, iter(x.split(4)), out=torch.zeros(30, *shape, dtype=torch.float64))


def test_bad_batches_and_out_are_reported(problem, tmp_path) -> None:
    net, x, y = problem
    with pytest.raises(jm.BatchError, match="batch 1 failed: TypeError: batches: item 1 is str"):
        list(jm.jacobians(net, [(x,), "x"]))
    with pytest.raises(jm.BatchError, match="item 0 has 4 inputs but 3 targets"):
        list(jm.jacobians(net, [(x[:4], y[:3])]))
    with pytest.raises(jm.BatchError, match="second entry is str"):
        list(jm.jacobians(net, [(x[:4], "y")]))
    with pytest.raises(TypeError, match="out: expected a torch.Tensor or a NumPy array"):
        jm.jacobians(net, [(x,)], out=[1, 2])
    with pytest.raises(ValueError, match="out: expected a contiguous tensor"):
        jm.jacobians(net, [(x,)], out=torch.zeros(N, 58, 3).transpose(1, 2))
    readonly = np.zeros((N, 3, 58))
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out: the NumPy array is read-only"):
        jm.jacobians(net, [(x,)], out=readonly)
    with pytest.raises(TypeError, match="progress: expected None, True or False"):
        jm.jacobians(net, [(x,)], progress="yes")
    with pytest.raises(ValueError, match="out: only supported for parameter Jacobians"):
        jm.jacobians(net, [(x,)], wrt="inputs", out=torch.zeros(N, 3, 6))
    got = torch.cat(list(jm.jacobians(net, iter(x.split(10)), wrt="inputs")))
    torch.testing.assert_close(got, jm.jacobian(net, x))


# --- products over data sets equal one big batch ---

def test_products_over_batches_equal_one_batch(problem) -> None:
    net, x, y = problem
    data = DataLoader(TensorDataset(x, y), batch_size=4)
    same = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.ggn(net, data, diagonal=True), jm.ggn(net, x, diagonal=True), **same)
    torch.testing.assert_close(jm.ggn(net, data, "cross_entropy"), jm.ggn(net, x, "cross_entropy"), **same)
    torch.testing.assert_close(jm.per_sample_grads(net, data, mse), jm.per_sample_grads(net, x, mse, y=y), **same)
    split = jm.per_sample_grads(net, data, mse, flatten=False)
    whole = jm.per_sample_grads(net, x, mse, y=y, flatten=False)
    assert split.keys() == whole.keys() and all(torch.allclose(split[k], whole[k]) for k in whole)
    k = jm.ntk(net, x, x[:9])
    torch.testing.assert_close(jm.ntk(net, data, [(x[:5],), (x[5:9],)]), k, **same)
    torch.testing.assert_close(jm.ntk(net, data, x[:9]), k, **same)
    torch.testing.assert_close(jm.ntk(net, x, [(x[:5],), (x[5:9],)]), k, **same)
    torch.testing.assert_close(jm.ntk(net, data, trace=True), jm.ntk(net, x, trace=True), **same)
    torch.testing.assert_close(jm.ntk(net, x[:9], data, trace=True), jm.ntk(net, x[:9], x, trace=True), **same)


def test_product_arguments_are_checked_before_reading_data(problem) -> None:
    net, x, y = problem
    with pytest.raises(ValueError, match="y: with a data set as x, the targets come from"):
        jm.per_sample_grads(net, [(x,)], mse, y=y)
    with pytest.raises(ValueError, match="x1: a one-shot iterator cannot be read once per block"):
        jm.ntk(net, (b for b in x.split(5)))
    with pytest.raises(TypeError, match="progress: expected None, True or False"):
        jm.ggn(net, [(x,)], progress=1)


# --- progress bar ---

def test_progress_shows_samples_per_second_or_nothing(problem, capsys, monkeypatch) -> None:
    pytest.importorskip("tqdm")
    net, x, _ = problem
    jm.ggn(net, [(b,) for b in x.split(5)], diagonal=True, progress=True)
    err = capsys.readouterr().err
    assert "ggn: 100%" in err and "23/23" in err and "samples/s" in err
    jm.ggn(net, iter(x.split(5)), diagonal=True)  # stderr is not a terminal here
    jm.ggn(net, iter(x.split(5)), diagonal=True, progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    list(jm.jacobians(net, [(b,) for b in x.split(5)]))  # None on a terminal: the bar
    assert "jacobians: 100%" in capsys.readouterr().err


def test_progress_without_tqdm(problem, capsys, monkeypatch) -> None:
    net, x, _ = problem
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match=r"progress=True needs tqdm.*pip install 'jacmode\[progress\]'"):
        jm.ggn(net, iter(x.split(5)), diagonal=True, progress=True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jm.ggn(net, iter(x.split(5)), diagonal=True)  # None on a terminal without tqdm: no bar, no noise
    assert capsys.readouterr().err == ""


# --- the split by rank, without a process group ---

@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), batch=st.integers(1, 7), world=st.integers(1, 4), shuffle=st.booleans())
def test_a_distributed_sampler_split_gives_each_sample_one_row(n: int, batch: int, world: int,
                                                               shuffle: bool) -> None:
    """Rank r's pieces cover rows of the one-process order exactly once, padding dropped."""
    x = torch.arange(n, dtype=torch.float64)[:, None]
    order = list(DistributedSampler(TensorDataset(x), num_replicas=1, rank=0, shuffle=shuffle, seed=3))
    seen: list[int] = []
    for rank in range(world):
        sampler = DistributedSampler(TensorDataset(x), num_replicas=world, rank=rank, shuffle=shuffle, seed=3)
        for piece in LocalPieces(DataLoader(TensorDataset(x), batch_size=batch, sampler=sampler), world, rank):
            rows = [piece.start + piece.step * j for j in range(piece.count)]
            assert [order[r] for r in rows] == piece.x[:, 0].long().tolist()
            seen += rows
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("world", [2, 3])
def test_a_plain_loader_split_loads_only_each_ranks_batches(world: int) -> None:
    x = torch.arange(N, dtype=torch.float64)[:, None]
    loaded: list[int] = []

    class Counting(TensorDataset):
        def __getitem__(self, i: int):
            loaded.append(i)
            return super().__getitem__(i)

    seen = []
    for rank in range(world):
        loaded.clear()
        pieces = list(LocalPieces(DataLoader(Counting(x), batch_size=4), world, rank))
        assert [p.index for p in pieces] == list(range(rank, 6, world))
        assert sorted(loaded) == [int(v) for p in pieces for v in p.x[:, 0]]  # nothing else loaded
        for p in pieces:
            assert p.x[:, 0].tolist() == list(range(p.start, p.start + p.count))
            seen += p.x[:, 0].tolist()
    assert sorted(seen) == x[:, 0].tolist()


def test_splits_that_would_be_wrong_are_refused() -> None:
    data = TensorDataset(torch.zeros(8, 2))
    with pytest.raises(ValueError, match="DistributedSampler has num_replicas=2, rank=1, but this process is rank 0 of 1"):
        check_split(DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1)), 1, 0)
    with pytest.raises(ValueError, match="a shuffling DataLoader yields a different order on every rank"):
        check_split(DataLoader(data, shuffle=True), 2, 0)
    check_split(DataLoader(data, shuffle=True), 1, 0)


def test_the_worked_example_runs_in_one_process(capsys) -> None:
    """examples/datasets_distributed.py without torchrun: one process, the same code path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "datasets_distributed.py"
    spec = importlib.util.spec_from_file_location("datasets_distributed", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    res = module.main(samples=300, batch_size=100, progress=False)
    assert res["ggn_diag"].shape == (15910,) and res["grads"].shape == (300, 15910)
    assert res["ntk_trace"].shape == (300, 50)
    assert "1 process(es), 1 thread(s) each: ggn diagonal over 300 samples" in capsys.readouterr().out
    torch.set_num_threads(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_model_streams_into_a_cpu_memmap(problem, tmp_path) -> None:
    net, x, y = problem
    ref = ref_param_jacobian(net, x)
    mm = np.lib.format.open_memmap(str(tmp_path / "J.npy"), mode="w+", dtype=np.float64, shape=tuple(ref.shape))
    jm.jacobians(net.cuda(), DataLoader(TensorDataset(x.cuda(), y.cuda()), batch_size=4), out=mm)
    torch.testing.assert_close(torch.from_numpy(np.array(mm)), ref, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(jm.ggn(net, [(x.cuda(),)], diagonal=True).cpu(), jm.ggn(net.cpu(), x, diagonal=True))
