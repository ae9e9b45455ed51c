"""The check that samples are independent, and its cache.

NOTE: [Coupling probe]
Per-sample Jacobians exist only when sample b of the output depends on sample b of the input
alone. The probe takes k <= 8 samples S of the batch (spread over it, rows with non-finite values
avoided), evaluates f on them, then again with the inputs of a part A of S changed, and requires
that the outputs of the other samples C = S - A did not move. The parts are the bit partitions of
the positions, A_j = {i : bit j of i is 1} and its complement for j < ceil(log2 k): for every
ordered pair (i, i') of probed samples some pass changes i' and keeps i, so a dependency in any
direction is seen: causal (``torch.cumsum(z, 0)``, ``z - z[:1]``, an RNN run over dim 0),
anti-causal, or through batch statistics (``z - z.mean(0)``). That is 2 ceil(log2 k) passes of k
samples, 6 for k = 8. Floating inputs are changed by Gaussian noise at the scale of the probed
samples, integer inputs (token ids) by the rows of other samples; both from a private generator.
Values alone miss a dependency that only the derivative has (``z + m - m.detach()`` with
``m = z.mean(0)``, an ``autograd.Function`` whose backward mixes samples), so for floating inputs
the first pass is a ``torch.func.vjp`` and, for each part, a random cotangent on C alone must pull
back to a zero gradient on A (non-finite entries, 0 * inf, are ignored). Where f cannot be run
under ``vjp`` the value check stands alone.
Every pass replays the same random state (same batch size, same draws), so randomness in f
(dropout masks, ``torch.randn`` in forward) is identical in all passes and raises no false alarm;
Dropout layers are also switched off, and the random state is left as found. NaNs compare equal
to NaNs. BatchNorm layers in training mode are reported by name without running anything.
The verdict and the per-sample output shape are cached per function, per-sample shape, dtype,
device, training flags and inference mode, so later calls run nothing before differentiating.
What the probe cannot see: a coupling that shows only for values that the probed samples and
their changes do not reach, or only at other batch sizes (f runs on k samples), and, since the
verdict is cached, only in later batches.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from ._cache import WeakCache, rng_kept
from ._errors import CoupledBatchError
from ._state import RngReplay

SAMPLES = 8  # samples the probe runs f on
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}  # relative to the largest output; else 1e-2
# function -> {(per-sample shape, dtype, device, training flags, inference mode): (output shape, verdict)}
_CACHE = WeakCache("coupling")
Verdict = Union[bool, None, str]  # True independent, None not checked, str: coupled, and why
WAYS_OUT = (
    "Ways out: call model.eval() if training-mode statistics are not what you want to "
    "differentiate; pass batched=False to get the full Jacobian of the whole batch as one point; "
    "pass structure='coupled' for the exact diagonal blocks of the whole-batch Jacobian (slower, "
    "about B times the work); or, if you know the samples are independent and the probe is "
    "misled (e.g. by randomness in f that torch's generators do not drive), pass "
    "structure='independent' to skip the check."
)
PRODUCT_WAYS_OUT = (
    "Ways out: call model.eval() if training-mode statistics are not what you want to "
    "differentiate; or take the rows of the whole-batch Jacobian, "
    "jm.jacobian(f, x, wrt='params', structure='coupled') (B, Y, P), and form the product from them."
)
OPERATOR_WAYS_OUT = (
    "Ways out: call model.eval() if training-mode statistics are not what you want to "
    "differentiate; pass structure='coupled' for the exact derivatives of each sample's output with "
    "respect to its own input, the other samples held fixed (about B times the work); or, if you "
    "know the samples are independent and the probe is misled, pass structure='independent' to "
    "skip the check."
)


def _cache_key(f: Any, x: Tensor) -> tuple:
    flags = tuple(m.training for m in f.modules()) if isinstance(f, nn.Module) else ()
    return (tuple(x.shape[1:]), x.dtype, x.device, flags, torch.is_inference_mode_enabled())


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


def probe_indices(x: Tensor) -> Tensor:
    """At most ``SAMPLES`` sample indices spread over the batch, rows with NaN or inf avoided."""
    batch = x.shape[0]
    cand = torch.linspace(0, batch - 1, min(batch, 4 * SAMPLES)).round().long().unique().to(x.device)
    k = min(len(cand), SAMPLES)
    if x.is_floating_point():
        ok = torch.isfinite(x[cand].reshape(len(cand), -1)).all(1)
        finite, rest = cand[ok], cand[~ok]
    else:
        finite, rest = cand, cand[:0]
    if len(finite) >= k:
        return finite[torch.linspace(0, len(finite) - 1, k).round().long().to(x.device)]
    return torch.cat([finite, rest[: k - len(finite)]]).sort().values


def parts(k: int, device: torch.device) -> list[Tensor]:
    """Masks A over k positions such that every ordered pair (i, i') has an A with i' in, i out."""
    pos = torch.arange(k, device=device)
    masks = []
    for j in range(math.ceil(math.log2(k))):
        bit = ((pos >> j) & 1).bool()
        masks += [bit, ~bit]
    return masks


def probe(
    f: Callable[[Tensor], Tensor],
    x: Tensor,
    *,
    check: bool,
    validate: Callable[[Any, int], Tensor],
    ident: Any = None,
    ways_out: str = WAYS_OUT,
) -> tuple[int, ...]:
    """Run ``f`` on a few samples; return the per-sample output shape.

    Args:
        f: the user's function of a batch.
        x: the batch, shape (B, *in).
        check: also verify that samples are independent; raise ``CoupledBatchError`` if not.
        validate: ``validate(output, n_samples)`` checks the output and returns it.
        ident: the object the verdict is cached under (defaults to ``f``).
        ways_out: the sentence of the error that says what the caller can do instead.

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
                f"statistics and per-sample Jacobians are not defined. {ways_out}"
            )
    key = _cache_key(ident, x)
    entry = _CACHE.get(ident, key)
    if entry is None or (check and entry[1] is None):
        entry = _run_probe(f, x, check=check and batch > 1, validate=validate, ident=ident)
        _CACHE.put(ident, key, entry)
    shape, verdict = entry
    if check and isinstance(verdict, str):
        raise CoupledBatchError(
            f"f: the samples of the batch are coupled: {verdict}, so each sample's output depends "
            "on other samples (e.g. x - x.mean(0), torch.cumsum(x, 0), batch statistics, an RNN or "
            f"attention run over dim 0) and per-sample Jacobians are not defined. {ways_out}"
        )
    return shape


def _run_probe(
    f: Callable[[Tensor], Tensor], x: Tensor, *, check: bool, validate: Callable[[Any, int], Tensor], ident: Any
) -> tuple[tuple[int, ...], Verdict]:
    """(per-sample output shape, verdict); see the note."""
    if x.shape[0] == 0:
        with torch.no_grad(), _dropout_off(ident):
            return tuple(validate(f(x), 0).shape[1:]), None
    idx = probe_indices(x)
    xs = x[idx].detach()
    k = len(idx)
    with rng_kept(x.device), _dropout_off(ident):
        replay = RngReplay(x.device)
        if not check or k < 2:
            with torch.no_grad():
                return tuple(validate(f(xs.clone()), k).shape[1:]), None
        rows, pull = _first_pass(f, xs, replay)
        shape = tuple(validate(rows, k).shape[1:])
        gen = torch.Generator(device=x.device).manual_seed(0)
        masks = parts(k, x.device)
        for a in masks:
            replay.reset()
            with torch.no_grad():
                moved = validate(f(_changed(xs, a, x, gen)), k)
            drift = _moved(rows, moved, ~a)
            if drift is not None:
                return shape, (f"changing the input of sample(s) {_names(idx, a)} (of those probed) changed "
                               f"the output of sample {int(idx[~a][drift])}")
        if pull is not None:
            for a in masks:
                bad = _nonlocal_gradient(pull, rows, a, gen)
                if bad is not None:
                    return shape, (f"the outputs of sample(s) {_names(idx, ~a)} have a nonzero derivative with "
                                   f"respect to the input of sample {int(idx[a][bad])}")
    return shape, True


def _first_pass(f: Callable[[Tensor], Tensor], xs: Tensor,
                replay: RngReplay) -> tuple[Any, Optional[Callable[[Tensor], tuple[Tensor, ...]]]]:
    """f(xs), and its pullback where f is floating and torch.func.vjp can run it."""
    if xs.is_floating_point():
        try:
            out, pull = torch.func.vjp(lambda z: f(z.clone()), xs)
            if isinstance(out, Tensor) and out.is_floating_point():
                return out, pull
        except Exception:  # noqa: BLE001 -- no reverse mode for f: the value check stands alone
            pass
        replay.reset()
    with torch.no_grad():
        return f(xs.clone()), None


def _changed(xs: Tensor, a: Tensor, x: Tensor, gen: torch.Generator) -> Tensor:
    """``xs`` with the rows in ``a`` changed: noise at the samples' scale, or other samples' rows."""
    out = xs.clone()
    n = int(a.sum())
    if xs.is_floating_point():
        finite = xs.nan_to_num(0.0, 0.0, 0.0)
        scale = finite.std(0) + 0.1 * finite.abs().mean(0)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        noise = torch.randn((n, *xs.shape[1:]), generator=gen, device=xs.device).to(xs.dtype)
        out[a] = xs[a] + noise * scale
    else:
        out[a] = x[torch.randint(0, x.shape[0], (n,), generator=gen, device=x.device)].to(xs.dtype)
    return out


def _tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE.get(dtype, 1e-2)


def _moved(before: Tensor, after: Tensor, keep: Tensor) -> Optional[int]:
    """The first of the rows ``keep`` whose output moved (NaN equals NaN), or None."""
    a, b = before[keep], after[keep]
    if a.shape != b.shape:
        return 0
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = a[finite].abs().max().item() if bool(finite.any()) else 1.0
    tol = _tolerance(a.dtype)
    same = (a == b) | (a.isnan() & b.isnan()) | (finite & ((a - b).abs() <= tol * (b.abs() + max(scale, 1e-30))))
    rows = (~same).any(1).nonzero()
    return int(rows[0]) if len(rows) else None


def _nonlocal_gradient(pull: Callable[[Tensor], tuple[Tensor, ...]], rows: Tensor, a: Tensor,
                       gen: torch.Generator) -> Optional[int]:
    """The first row of ``a`` with a gradient from a cotangent on the other rows alone, or None."""
    keep = (~a).to(rows.dtype).reshape(-1, *[1] * (rows.dim() - 1))
    v = torch.randn(rows.shape, generator=gen, device=rows.device).to(rows.dtype) * keep
    try:
        (g,) = pull(v)
    except Exception:  # noqa: BLE001 -- f has no backward here: the value check stands alone
        return None
    g = g.reshape(g.shape[0], -1)
    inside, outside = g[~a], g[a]
    ref = inside[torch.isfinite(inside)].abs().max().item() if bool(torch.isfinite(inside).any()) else 0.0
    limit = _tolerance(g.dtype) * max(ref, torch.finfo(g.dtype).tiny)
    bad = (torch.isfinite(outside) & (outside.abs() > limit)).any(1).nonzero()
    return int(bad[0]) if len(bad) else None


def _names(idx: Tensor, mask: Tensor) -> str:
    chosen = [str(int(i)) for i in idx[mask]]
    return ", ".join(chosen[:4]) + (", ..." if len(chosen) > 4 else "")
