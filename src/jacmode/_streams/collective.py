"""torch.distributed for data sets: who am I, exchange each round's status, gather, sum.

Only ``torch.distributed`` collectives (gloo on CPU, NCCL on GPU): ``all_gather`` of a small
status row per round, ``all_gather`` of per-sample results, ``all_reduce`` of sums. A rank that
dies leaves the others blocked in a collective until the process group's timeout, which then
raises; that error is re-raised here with what was going on.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .._errors import BatchError

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_DIMS = 6
IDLE, OK, FAILED = 0, 1, 2


def world() -> tuple[int, int]:
    """(world size, rank) of the default process group, or (1, 0) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective(what: str, op: object, *args: object) -> None:
    try:
        op(*args)  # type: ignore[operator]
    except RuntimeError as err:
        _, rank = world()
        raise RuntimeError(
            f"jacmode: {what} failed on rank {rank}: another rank probably died or stopped "
            "calling the same jacmode function (the wait is bounded by the process group's "
            f"timeout, init_process_group(timeout=...)). See the other ranks' logs. Cause: {err}"
        ) from err


def status_row(status: int, batch: int, start: int, step: int, count: int,
               value: Optional[Tensor]) -> list[int]:
    """The row every rank shares each round: status, batch, rows, the value's dtype and shape.

    Layout: ``[status, batch, start, step, count, dtype, ndim, *shape, 0 ...]``.
    """
    shape = list(value.shape) if value is not None else []
    if len(shape) > MAX_DIMS:
        raise ValueError(f"results with more than {MAX_DIMS} dims cannot be gathered, got {shape}.")
    dtype = DTYPES.index(value.dtype) if value is not None and value.dtype in DTYPES else -1
    return [status, batch, start, step, count, dtype, len(shape)] + shape + [0] * (MAX_DIMS - len(shape))


def like(table: list[list[int]]) -> Optional[tuple[torch.dtype, list[int]]]:
    """Dtype and shape of the values in a round's table, from any rank that has one."""
    for row in table:
        if row[6] > 0 and row[5] >= 0:
            return DTYPES[row[5]], row[7:7 + row[6]]
    return None


def exchange(row: list[int], error: Optional[BaseException]) -> list[list[int]]:
    """All ranks' status rows; raises :class:`BatchError` on every rank if one rank failed."""
    world_size, rank = world()
    mine = torch.tensor(row, dtype=torch.long, device=_device())
    rows = [torch.empty_like(mine) for _ in range(world_size)]
    _collective("all_gather of the round's status", dist.all_gather, rows, mine)
    table = [r.tolist() for r in rows]
    for r, (status, batch, *_rest) in enumerate(table):
        if status == FAILED:
            cause = (f"{type(error).__name__}: {error}" if r == rank and error is not None
                     else f"an error on rank {r} (see its traceback)")
            raise BatchError(batch, r, cause) from (error if r == rank else None)
    return table


def gather(table: list[list[int]], value: Optional[Tensor]) -> list[tuple[list[int], Tensor]]:
    """Every rank's per-sample result of this round: (status row, value) for ranks with one."""
    found = like(table)
    if found is None:
        return []
    dtype, shape = found
    busy = [row for row in table if row[0] == OK and row[6] > 0]
    buf = torch.zeros((max(row[7] for row in busy), *shape[1:]), dtype=dtype, device=_device())
    if value is not None:
        buf[: len(value)] = value
    parts = [torch.empty_like(buf) for _ in table]
    _collective("all_gather of per-sample results", dist.all_gather, parts, buf)
    return [(row, part[: row[7]]) for row, part in zip(table, parts) if row[0] == OK and row[6]]


def sum_over_ranks(total: Tensor) -> Tensor:
    """``all_reduce`` (sum) of one rank's partial sum; every rank gets the total."""
    device = _device()
    buf = total.to(device).contiguous()
    _collective("all_reduce of partial sums", dist.all_reduce, buf)
    return buf.to(total.device)
