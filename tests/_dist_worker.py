"""Worker processes of the torch.distributed tests (spawned; gloo on loopback)."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import jacmode as jm
from jacmode import _data
from bench.baselines import MLP

N, D, H, Y = 23, 6, 5, 3


def problem() -> tuple[torch.nn.Module, TensorDataset]:
    """Problem 1's class, small, float64, seeded: the same on every process."""
    torch.manual_seed(0)
    net = MLP(D, H, Y).double()
    data = TensorDataset(torch.randn(N, D, dtype=torch.float64), torch.randn(N, Y, dtype=torch.float64))
    return net, data


def sq_sum(net: torch.nn.Module) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    return lambda x, y: (jm.jacobian(net, x, wrt="params") ** 2).sum((0, 1))


def results() -> dict[str, torch.Tensor]:
    """Everything the distributed test compares with one process."""
    net, data = problem()
    plain = DataLoader(data, batch_size=4)
    sampled = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False)) \
        if dist.is_initialized() else plain
    P = sum(p.numel() for p in net.parameters())
    out = torch.full((N, Y, P), float("nan"), dtype=torch.float64)
    res = {
        "out_plain": jm.jacobians(net, plain, out=out).clone(),
        "out_sampled": jm.jacobians(net, sampled, out=out.fill_(float("nan"))).clone(),
        "iter_plain": torch.cat(list(jm.jacobians(net, plain))),
        "iter_sampled": torch.cat(list(jm.jacobians(net, sampled))),
        "list": torch.cat(list(jm.jacobians(net, [(x,) for x, _ in plain]))),
        "sum_plain": _data.sum_over(plain, sq_sum(net), progress=False, desc="t"),
        "sum_sampled": _data.sum_over(sampled, sq_sum(net), progress=False, desc="t"),
        "rows_sampled": _data.rows_over(sampled, lambda x, y: net(x) - y, progress=False, desc="t"),
        "ggn_diag": jm.ggn(net, plain, diagonal=True),
        "ggn_sampled": jm.ggn(net, sampled, "cross_entropy"),
        "psg": jm.per_sample_grads(net, sampled, lambda o, y: ((o - y) ** 2).sum(1)),
        "ntk": jm.ntk(net, plain, [(data.tensors[0][:7],), (data.tensors[0][7:9],)]),
        "ntk_trace": jm.ntk(net, sampled, plain, trace=True),
    }
    return res


class _Flaky(TensorDataset):
    """Sample 12 cannot be loaded on rank 1 (batch 3 of 4-sample batches)."""

    def __getitem__(self, i: int) -> Any:
        if i == 12 and dist.get_rank() == 1:
            raise OSError("unreadable sample 12")
        return super().__getitem__(i)


def failing() -> dict[str, torch.Tensor]:
    """Rank 1 fails on batch 3: every rank must raise BatchError, none may hang."""
    net, data = problem()
    P = sum(p.numel() for p in net.parameters())
    jm.jacobians(net, DataLoader(_Flaky(*data.tensors), batch_size=4),
                 out=torch.zeros(N, Y, P, dtype=torch.float64))
    return {}


class _Dying(TensorDataset):
    """Rank 1's process dies (os._exit) while loading sample 12."""

    def __getitem__(self, i: int) -> Any:
        if i == 12 and dist.get_rank() == 1:
            os._exit(3)
        return super().__getitem__(i)


def dying() -> dict[str, torch.Tensor]:
    """Rank 1 dies on batch 3: rank 0 must raise within the group's timeout, not hang."""
    net, data = problem()
    list(jm.jacobians(net, DataLoader(_Dying(*data.tensors), batch_size=4)))
    return {}


def results_then_failing() -> dict[str, torch.Tensor]:
    """Both in one process group (one launch): the group stays usable after a BatchError."""
    res = results()
    try:
        failing()
    except jm.BatchError as err:
        res["error"] = torch.tensor(list(str(err).encode()), dtype=torch.uint8)
    net, data = problem()
    try:  # a sum: the ranks work apart, then one status exchange
        jm.ggn(net, DataLoader(_Flaky(*data.tensors), batch_size=4), diagonal=True)
    except jm.BatchError as err:
        res["sum_error"] = torch.tensor(list(str(err).encode()), dtype=torch.uint8)
    return res


CASES = {"results": results_then_failing, "dying": dying}


def main(rank: int, world: int, port: int, cases: str, outdir: str) -> None:
    """Run the cases named in ``cases`` ("results+dying": in turn, in one process group, so that
    the tests pay for one launch), each writing ``<rank>.<case>.pt`` or ``<rank>.<case>.err``; a
    case that fails ends the run ("dying" last: rank 1 does not come back from it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=8))
    names = cases.split("+")
    for name in names:
        try:
            torch.save(CASES[name](), os.path.join(outdir, f"{rank}.{name}.pt"))
        except BaseException as err:
            with open(os.path.join(outdir, f"{rank}.{name}.err"), "w") as fh:
                fh.write(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
            break
    if "dying" not in names:
        dist.destroy_process_group()
