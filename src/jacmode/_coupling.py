"""The probe that tells independent samples from coupled ones, and its cache.

NOTE: [Coupling probe]
Per-sample Jacobians exist only when sample b of the output depends on sample b of the input
alone. The probe evaluates ``f`` (without differentiating) on a few samples S spread over the batch
and again on the first half of S: for independent samples the rows they share agree, while any
coupling through the batch (BatchNorm in training mode, ``x - x.mean(0)``, attention across dim 0)
changes them. It costs two forward passes over at most four samples, far less than one batched
pass. The verdict and the output shape are cached per function, per-sample shape, dtype, device
and training flags, so later calls run nothing before differentiating.
BatchNorm layers in training mode are reported by name without running anything. Dropout layers
are switched to eval mode for the probe only (they never couple samples, but their random masks
would differ between the two passes). NaNs compare equal to NaNs, so a NaN in one sample does not
trip the probe. The first probe pass also yields the per-sample output shape for planning.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from ._cache import WeakCache
from ._errors import CoupledBatchError

_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
# function -> {(per-sample shape, dtype, device, training flags): (output shape, verdict)}
_CACHE = WeakCache("coupling")
_WAYS_OUT = (
    "Ways out: call model.eval() if training-mode statistics are not what you want to "
    "differentiate; pass batched=False to get the full Jacobian of the whole batch as one point; "
    "pass structure='coupled' for the exact diagonal blocks of the whole-batch Jacobian (slower, "
    "about B times the work); or, if you know the samples are independent and the probe is "
    "misled (e.g. by randomness in f), pass structure='independent' to skip the check."
)


def _cache_key(f: Any, x: Tensor) -> tuple:
    flags = tuple(m.training for m in f.modules()) if isinstance(f, nn.Module) else ()
    return (tuple(x.shape[1:]), x.dtype, x.device, flags)


def coupled_batchnorms(f: Any) -> list[str]:
    """Names of BatchNorm layers in training mode (they couple the samples of a batch)."""
    if not isinstance(f, nn.Module):
        return []
    return [
        name or type(m).__name__
        for name, m in f.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


@contextlib.contextmanager
def _dropout_off(f: Any) -> Iterator[None]:
    if not isinstance(f, nn.Module):
        yield
        return
    layers = [m for m in f.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for m in layers:
        m.training = False
    try:
        yield
    finally:
        for m in layers:
            m.training = True


def probe_indices(batch: int) -> Tensor:
    """At most four sample indices spread over the batch, first and last included."""
    k = min(batch, 4)
    return torch.linspace(0, batch - 1, k).round().long().unique()


def probe(
    f: Callable[[Tensor], Tensor],
    x: Tensor,
    *,
    check: bool,
    validate: Callable[[Any, int], Tensor],
    ident: Any = None,
) -> tuple[int, ...]:
    """Run ``f`` on a few samples; return the per-sample output shape.

    Args:
        f: the user's function of a batch.
        x: the batch, shape (B, *in).
        check: also verify that samples are independent; raise ``CoupledBatchError`` if not.
        validate: ``validate(output, n_samples)`` checks the output and returns it.
        ident: the object the verdict is cached under (defaults to ``f``).

    Raises:
        CoupledBatchError: when ``check`` and the samples are coupled.
    """
    batch = x.shape[0]
    ident = f if ident is None else ident
    if check:
        names = coupled_batchnorms(ident)
        if names:
            raise CoupledBatchError(
                f"f: BatchNorm layer(s) {', '.join(repr(n) for n in names[:3])} are in training "
                "mode, so each sample's output depends on the whole batch through the batch "
                f"statistics and per-sample Jacobians are not defined. {_WAYS_OUT}"
            )
    key = _cache_key(ident, x)
    entry = _CACHE.get(ident, key)
    if entry is None or (check and entry[1] is None):
        entry = _run_probe(f, x, check=check and batch > 1, validate=validate, ident=ident)
        _CACHE.put(ident, key, entry)
    shape, independent = entry
    if check and independent is False:
        raise CoupledBatchError(
            "f: the samples of the batch are coupled: evaluating f on a subset of the samples "
            "changed the outputs of the samples it kept, so each sample's output depends on other "
            "samples (e.g. x - x.mean(0), batch statistics, attention across dim 0) and per-sample "
            f"Jacobians are not defined. {_WAYS_OUT}"
        )
    return shape


def _run_probe(
    f: Callable[[Tensor], Tensor], x: Tensor, *, check: bool, validate: Callable[[Any, int], Tensor], ident: Any
) -> tuple[tuple[int, ...], Optional[bool]]:
    """(per-sample output shape, verdict: True independent, False coupled, None not checked)."""
    batch = x.shape[0]
    idx = probe_indices(batch).to(x.device) if batch > 0 else None
    with torch.no_grad(), _dropout_off(ident):
        rows = validate(f(x[idx] if idx is not None else x), len(idx) if idx is not None else 0)
        if not check or idx is None or len(idx) < 2:
            return tuple(rows.shape[1:]), None
        half = len(idx) // 2
        sub = validate(f(x[idx[:half]]), half)
    return tuple(rows.shape[1:]), _agree(rows[:half], sub)


def _agree(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape:
        return False
    tol = _TOLERANCE.get(a.dtype, 2e-2)
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = a[finite].abs().max().item() if bool(finite.any()) else 1.0
    same_nonfinite = bool(((a == b) | (a.isnan() & b.isnan()) | finite).all())
    close = torch.allclose(a[finite], b[finite], rtol=tol, atol=tol * max(scale, 1e-30))
    return same_nonfinite and close
