"""Exceptions and warnings raised by jacmode."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

__all__ = ["BatchError", "CoupledBatchError", "JacmodeWarning"]


class CoupledBatchError(ValueError):
    """The samples of the batch are coupled, so per-sample Jacobians are not defined.

    Raised when the function mixes samples along the batch dimension (BatchNorm in training
    mode, ``x - x.mean(0)``, attention across the batch). The message names the cause and the
    ways out: ``model.eval()``, ``batched=False``, or ``structure="coupled"`` for the exact
    diagonal blocks of the whole-batch Jacobian.
    """


class JacmodeWarning(UserWarning):
    """A warning from jacmode: a fallback was taken, or a result may be slower than expected."""


class BatchError(RuntimeError):
    """A batch of a data set failed (loading it or differentiating it); the cause is chained.

    Attributes:
        batch: index of the failed batch in the order the iterable yields it (on its rank).
        rank: the ``torch.distributed`` rank that failed (0 without a process group).
        rows_written: when results go into ``out=``, rows ``0 .. rows_written - 1`` hold their
            final values and no later row was written; ``None`` when there is no ``out=``.
    """

    def __init__(self, batch: int, rank: int, cause: str) -> None:
        super().__init__(batch, rank, cause)
        self.batch, self.rank, self.cause = batch, rank, cause.rstrip(". ")
        self.rows_written: Optional[int] = None

    def __str__(self) -> str:
        where = f"batch {self.batch}" + (f" on rank {self.rank}" if self.rank else "")
        text = f"{where} failed: {self.cause}"
        if self.rows_written is not None:
            text += (f". out= holds final values in rows 0..{self.rows_written - 1}; later rows do not"
                     if self.rows_written else ". No row of out= holds a final value")
        return text + ". Fix that batch, or resume from the first row not written."


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this function, point
    at the first frame outside jacmode (and contextlib): the user's line, however deep the call."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                        or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
        level += 1
    return level
