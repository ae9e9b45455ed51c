"""Exceptions and warnings raised by jacmode."""

from __future__ import annotations

__all__ = ["CoupledBatchError", "JacmodeWarning"]


class CoupledBatchError(ValueError):
    """The samples of the batch are coupled, so per-sample Jacobians are not defined.

    Raised when the function mixes samples along the batch dimension (BatchNorm in training
    mode, ``x - x.mean(0)``, attention across the batch). The message names the cause and the
    ways out: ``model.eval()``, ``batched=False``, or ``structure="coupled"`` for the exact
    diagonal blocks of the whole-batch Jacobian.
    """


class JacmodeWarning(UserWarning):
    """A warning from jacmode: a fallback was taken, or a result may be slower than expected."""
