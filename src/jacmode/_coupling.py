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
samples, integer inputs (token ids) by other values seen in the batch (a changed sample that would be a
permutation of its own ids, the same bag to EmbeddingBag's sum or mean, changes its first entry
otherwise); both from a private generator. Where f raises on those changes though it ran on the
probed samples (float token ids cast with ``.long()`` that noise moves off the embedding table, a
range check), the value check is redone with the batch's own samples as the changes: each changed
sample takes the input (and per-sample riders) of another sample of the batch whose input differs,
so f sees only values the user passed. On an accelerator the batch's own samples are the changes
from the start (an index moved off its table there is a device-side assert, which no error handler
survives); noise is used there only where the batch has no distinct samples. If some probed sample
has no such other sample (every sample the same), jacmode cannot tell and says so (a ValueError)
rather than guess; if f fails on a selection of its own samples it is not a function of each
sample alone (a ValueError too).
Values alone miss a dependency that only the derivative has (``z + m - m.detach()`` with
``m = z.mean(0)``, an ``autograd.Function`` whose backward mixes samples), so for floating inputs
the first pass records an autograd graph and, for each part, a random cotangent on C alone must pull
back to a zero gradient on A (non-finite entries, 0 * inf, are ignored). Where autograd cannot
run f (inside torch.func transforms, under inference mode, no backward) the value check stands
alone. Inside ``torch.func.vmap`` the probe compares the values of all vmap slices at once, and
draws its changes outside the transforms (see ``_transforms.py``).
Every pass replays the same random state (same batch size, same draws), so randomness in f
(dropout masks, ``torch.randn`` in forward) is identical in all passes and raises no false alarm;
Dropout layers are also switched off, and the random state is left as found. NaNs compare equal
to NaNs. BatchNorm layers in training mode are reported by name without running anything.
The verdict and the per-sample output shape are cached per function, per-sample shape, dtype,
device, training flags (of the module, or of the modules a plain function refers to) and inference
mode, so later calls run nothing before differentiating.
What the probe cannot see: a coupling that shows only for values that the probed samples and
their changes do not reach (ids: a sample that holds every id of the batch's range, pooled so that
no change within that range moves it, e.g. bags of ids {0, 1} with padding_idx 0 and mode mean), or only at other batch sizes (f runs on k samples), and, since the
verdict is cached, only in later batches.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor, nn

from ._args import Flat, batched_riders, take, with_riders
from ._cache import Kind, _flags, register, rng_kept
from ._errors import CoupledBatchError
from ._state import RngReplay, used_modules
from ._transforms import in_transform, outside, plain, samples_first

SAMPLES = 8  # samples the probe runs f on
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}  # relative to the largest output; else 1e-2
# function -> {(per-sample shape, dtype, device, training flags, inference mode): (output shape, verdict)}
_CACHE = Kind("coupling")
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
    # a plain function's verdict also depends on the training flags of the modules it refers to
    modules = f.modules() if isinstance(f, nn.Module) else (m for u in used_modules(f) for m in u.modules())
    flags = tuple(_flags(m) for m in modules)  # training flags, and hooks (one added later may couple)
    return (tuple(x.shape[1:]), x.dtype, x.device, flags, torch.is_inference_mode_enabled())


def coupled_batchnorms(f: Any) -> list[str]:
    """Names of BatchNorm layers in training mode (they couple the samples of a batch), in ``f`` or
    in the modules a plain function refers to (``_state.used_modules``: a lambda, functional_call)."""
    return [
        name or type(m).__name__
        for root in used_modules(f)
        for name, m in root.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


@contextlib.contextmanager
def _dropout_off(f: Any) -> Iterator[None]:
    f = f.f if isinstance(f, Flat) else f
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


def probe_indices(x: Tensor) -> list[int]:
    """At most ``SAMPLES`` sample indices spread over the batch, rows with NaN or inf avoided."""
    batch = x.shape[0]
    values = samples_first(x) if x.is_floating_point() else x  # (B, *vmapped, *in) inside vmap
    if batch <= SAMPLES and (not x.is_floating_point() or bool(torch.isfinite(values).all())):
        return list(range(batch))
    n = min(batch, 4 * SAMPLES)
    cand = sorted({round(i * (batch - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]
    k = min(len(cand), SAMPLES)
    if x.is_floating_point():
        rows = values if len(cand) == batch else values[cand]
        ok = torch.isfinite(rows.reshape(len(cand), -1)).all(1).tolist()
    else:
        ok = [True] * len(cand)
    finite = [c for c, good in zip(cand, ok) if good]
    if len(finite) >= k:
        return [finite[round(i * (len(finite) - 1) / (k - 1))] for i in range(k)] if k > 1 else finite[:1]
    return sorted(finite + [c for c, good in zip(cand, ok) if not good][: k - len(finite)])


@functools.lru_cache(maxsize=64)
def parts(k: int, device: torch.device = torch.device("cpu")) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Parts (A, C) of k positions such that every ordered pair (i, i') has one with i' in A and i in C."""
    out = []
    for j in range(math.ceil(math.log2(k))):
        ones = tuple(i for i in range(k) if (i >> j) & 1)
        zeros = tuple(i for i in range(k) if not (i >> j) & 1)
        out += [(ones, zeros), (zeros, ones)]
    return tuple(out)


@functools.partial(register, name="coupling masks (tensors on the inputs' devices)")
@functools.lru_cache(maxsize=64)
def _masks(k: int, device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """(membership in A (parts, k), the positions C of each part as an index tensor), on ``device``."""
    split = parts(k)
    member = torch.zeros(len(split), k, dtype=torch.bool)
    for j, (a, _) in enumerate(split):
        member[j, list(a)] = True
    return member.to(device), [torch.tensor(c, device=device) for _, c in split]


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
        entry = _run_probe(f, x, check=check and batch > 1, validate=validate, ident=ident, ways_out=ways_out)
        _CACHE.put(ident, key, entry)
    shape, verdict = entry
    if check and isinstance(verdict, str):
        raise CoupledBatchError(
            f"f: the samples of the batch are coupled: {verdict}, so each sample's output depends "
            "on other samples (e.g. x - x.mean(0), torch.cumsum(x, 0), batch statistics, an RNN or "
            f"attention run over dim 0) and per-sample Jacobians are not defined. {ways_out}"
        )
    return shape


_BATCH_STATISTICS = ("Expected more than 1 value per channel",)  # torch's batch_norm on one sample


def _guarded(f: Callable[[Tensor], Tensor], batch: int, ways_out: str) -> Callable[[Tensor], Tensor]:
    """``f`` for the probe: an error on fewer samples than the user's batch becomes jacmode's.

    The probe runs f on a few samples of the batch; a function that works on the whole batch but
    not on a part of it needs the whole batch (batch statistics, a fixed batch size), so its
    samples are coupled or it is not a function of each sample. Errors on the whole batch are f's.
    """
    def run(z: Tensor) -> Tensor:
        try:
            return f(z)
        except Exception as exc:
            if z.shape[0] >= batch or isinstance(exc, CoupledBatchError):
                raise
            what = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__
            if any(s in str(exc) for s in _BATCH_STATISTICS):
                raise CoupledBatchError(
                    f"f: raised {what} when jacmode's independence check ran it on {z.shape[0]} of the "
                    f"{batch} samples: f normalises with batch statistics (e.g. BatchNorm in training mode), "
                    f"so each sample's output depends on the whole batch. {ways_out}"
                ) from exc
            raise ValueError(
                f"f: raised {what} when jacmode's independence check ran it on {z.shape[0]} of the {batch} "
                "samples, so f is not a function of each sample alone: "
                "per-sample results need f to run on any number of samples. Pass structure='coupled' for "
                "the diagonal blocks of the whole-batch Jacobian, batched=False for the whole batch as "
                "one point, or make f accept any batch size."
            ) from exc
    return run


def _run_probe(
    f: Callable[[Tensor], Tensor], x: Tensor, *, check: bool, validate: Callable[[Any, int], Tensor], ident: Any,
    ways_out: str = WAYS_OUT,
) -> tuple[tuple[int, ...], Verdict]:
    """(per-sample output shape, verdict); see the note."""
    if x.shape[0] == 0:
        with torch.no_grad(), _dropout_off(ident):
            return tuple(validate(f(x), 0).shape[1:]), None
    idx = probe_indices(x)
    xs = (x if len(idx) == x.shape[0] else x[idx]).detach()
    k = len(idx)
    whole = f
    f = take(f, idx)  # a call of several arguments: the batched riders of those samples
    with rng_kept(x.device), _dropout_off(ident):
        replay = RngReplay(x.device)
        if not check or k < 2:
            with torch.no_grad():
                try:
                    out = f(xs.clone())
                except Exception:  # noqa: BLE001 -- the structure was given: f may need the whole batch
                    if k == x.shape[0]:
                        raise
                    replay.reset()
                    xs, k, f = x.detach(), x.shape[0], whole
                    out = f(xs.clone())
                return tuple(validate(out, k).shape[1:]), None
        fk, batch = f, x.shape[0]
        f = _guarded(f, batch, ways_out)
        rows, pull = _first_pass(f, xs, replay)
        shape = tuple(validate(rows, k).shape[1:])
        split = parts(k)
        member, kept = _masks(k, x.device)
        gen = torch.Generator(device=x.device).manual_seed(0)
        changed = torch.where(member.view(*member.shape, *[1] * (xs.dim() - 1)), _changes(xs, x, len(split), gen), xs)
        others = _changed_riders(fk, member, gen)  # per-sample riders change with their samples
        own = None if _noise_is_safe(x) else _swapped_rows(x, idx, member, gen)
        drift_of = None
        if own is not None:
            drift_of = _swapped_passes(whole, x, idx, rows, member, kept, gen, replay, validate, None, ways_out, own)
        else:
            try:
                for j, (a, c) in enumerate(split):
                    replay.reset()
                    with torch.no_grad():
                        moved = validate(_changed_pass(fk if others is None else with_riders(fk, others[j]),
                                                       changed[j]), k)
                    drift = _moved(rows, moved, c, kept[j])
                    if drift is not None:
                        return shape, (f"changing the input of sample(s) {_names(idx, a)} (of those probed) "
                                       f"changed the output of sample {idx[drift]}")
            except _ChangedFailed as failed:  # f refuses the changed values (float ids cast to long, a range check)
                drift_of = _swapped_passes(whole, x, idx, rows, member, kept, gen, replay, validate, failed, ways_out)
        if drift_of is not None:
            a, drift = drift_of
            return shape, (f"changing the input of sample(s) {_names(idx, a)} (of those probed) to that of "
                           f"other samples of the batch changed the output of sample {idx[drift]}")
        if pull is not None:
            keep = (~member).view(*member.shape, *[1] * (rows.dim() - 1))
            cotangents = _randn((len(split), *rows.shape), gen, rows).where(keep, 0.0)
            inside = member.view(*member.shape, *[1] * (xs.dim() - 1))
            for j, (a, c) in enumerate(split):
                bad = _nonlocal_gradient(pull, cotangents[j], inside[j], a, c)
                if bad is not None:
                    return shape, (f"the outputs of sample(s) {_names(idx, c)} have a nonzero derivative with "
                                   f"respect to the input of sample {idx[bad]}")
    return shape, True


def _noise_is_safe(x: Tensor) -> bool:
    """Whether f may see noise on ``x``: on an accelerator, an index that noise moves off its table
    (float ids cast with ``.long()``) is a device-side assert that no error handler survives, so the
    batch's own samples are the changes there, from the start (noise only where the batch has no
    distinct samples)."""
    return not x.is_floating_point() or x.device.type in ("cpu", "meta")


class _ChangedFailed(Exception):
    """f raised on the changed inputs of the probe though it ran on the probed samples themselves."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _changed_pass(f: Callable[[Tensor], Tensor], z: Tensor) -> Any:
    """f on changed inputs; an error there is :class:`_ChangedFailed` (f ran on the samples as given)."""
    try:
        return f(z)
    except CoupledBatchError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the values the probe made, not the user's: try the batch's own
        raise _ChangedFailed(exc) from exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else type(exc).__name__


def _swapped_rows(x: Tensor, idx: list[int], member: Tensor, gen: torch.Generator) -> Optional[Tensor]:
    """The batch rows the probed samples take in each part (parts, k): a sample in A takes the row of
    another sample of the batch whose input differs from its own, a sample in C keeps its row.

    The candidates are at most ``4 * SAMPLES`` samples spread over the batch (rows with NaN or inf
    left out). None when a probed sample has no candidate that differs from it: the batch's own
    samples cannot change it, so this check cannot tell.
    """
    batch = x.shape[0]
    with outside():
        values = samples_first(x) if x.is_floating_point() else plain(x)
        n = min(batch, 4 * SAMPLES)
        cand = sorted({round(i * (batch - 1) / (n - 1)) for i in range(n)} | set(idx)) if n > 1 else [0]
        flat = values[cand].reshape(len(cand), -1)
        own = values[idx].reshape(len(idx), -1)
        usable = torch.isfinite(flat).all(1) if flat.is_floating_point() else torch.ones(len(cand), dtype=torch.bool)
        differ = (flat[None] != own[:, None]).any(-1) & usable.to(flat.device)[None]  # (k, candidates)
        if not bool(differ.any(1).all()):
            return None
        pick = torch.multinomial(differ.double().cpu(), member.shape[0], replacement=True, generator=_cpu(gen))
        rows = torch.as_tensor(cand, device="cpu")[pick].T  # (parts, k)
        own_rows = torch.as_tensor(idx, device="cpu").expand_as(rows)
        return torch.where(member.cpu(), rows, own_rows).to(x.device)


def _cpu(gen: torch.Generator) -> torch.Generator:
    """A CPU generator seeded from ``gen`` (multinomial draws on the CPU here, whatever the device)."""
    if gen.device.type == "cpu":
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device).item())
    return torch.Generator().manual_seed(seed)


def _swapped_passes(
    whole: Any, x: Tensor, idx: list[int], rows: Tensor, member: Tensor, kept: list[Tensor],
    gen: torch.Generator, replay: RngReplay, validate: Callable[[Any, int], Tensor],
    failed: Optional[_ChangedFailed], ways_out: str, chosen: Optional[Tensor] = None,
) -> Optional[tuple[tuple[int, ...], int]]:
    """The value check with the batch's own samples as the changes: after f refused the made-up ones
    (``failed``), or on an accelerator from the start (``chosen``, the rows already drawn).

    Each part's changed samples take the inputs (and per-sample riders) of other samples of the
    batch, so f sees only values the user passed. Returns (the changed positions, the first watched
    position that moved), or None when no output moved.

    Raises:
        ValueError: when the batch has no other distinct sample for some probed sample (the check
            cannot tell), or when f fails on a selection of the batch's own samples.
    """
    k = len(idx)
    split = parts(k)
    if chosen is None:
        chosen = _swapped_rows(x, idx, member, gen)
    if chosen is None:
        assert failed is not None  # (with chosen given, rows were found)
        raise ValueError(
            f"f: raised {_describe(failed.error)} when jacmode's independence check changed the inputs of "
            "some samples, and the batch has too few distinct samples to check with its own samples instead, "
            "so jacmode cannot tell whether the samples are independent. Pass a batch whose samples differ; "
            f"or make f accept inputs near the given ones. {ways_out}"
        ) from failed.error
    for j, (a, c) in enumerate(split):
        sel = chosen[j]
        replay.reset()
        try:
            with torch.no_grad():
                out = take(whole, sel.tolist())(x[sel].detach().clone())
        except CoupledBatchError:
            raise
        except Exception as exc:  # noqa: BLE001 -- real samples of the batch: f is not per-sample
            raise ValueError(
                f"f: raised {_describe(exc)} when jacmode's independence check ran it on {k} samples of the "
                f"{x.shape[0]}, some of them repeated, so f is not a function of each sample alone: per-sample "
                "results need f to run on any selection of its samples. Pass structure='coupled' for the "
                "diagonal blocks of the whole-batch Jacobian, batched=False for the whole batch as one point, "
                "or make f accept any selection of samples."
            ) from exc
        drift = _moved(rows, validate(out, k), c, kept[j])
        if drift is not None:
            return a, drift
    return None


def _changed_riders(fk: Any, member: Tensor, gen: torch.Generator) -> Optional[list[list[Tensor]]]:
    """For each part j, the batched riders of the probed samples (``_args.batched_riders``) with
    those in A changed as their inputs are (noise, flipped flags, other ids): sample c's output
    must not follow the mask or the time of sample a either. None without batched riders."""
    riders = batched_riders(fk)
    if not riders:
        return None
    out: list[list[Tensor]] = [[] for _ in range(member.shape[0])]
    for r in riders:
        with outside():
            if r.is_floating_point():
                scale = float(plain(r).abs().nan_to_num(0.0, 0.0, 0.0).mean()) or 1.0
                new = r + _randn((member.shape[0], *r.shape), gen, r).mul_(scale)
            elif r.dtype == torch.bool:
                new = (~r).expand(member.shape[0], *r.shape)
            else:
                new = _other_ids(r, r, member.shape[0], gen)
        where = member.view(*member.shape, *[1] * (r.dim() - 1))
        for j, v in enumerate(torch.where(where, new, r).unbind(0)):
            out[j].append(v)
    return out


def _first_pass(f: Callable[[Tensor], Tensor], xs: Tensor,
                replay: RngReplay) -> tuple[Any, Optional[Callable[[Tensor], Optional[Tensor]]]]:
    """f(xs), and its pullback where f is floating and autograd can differentiate it.

    Plain autograd rather than ``torch.func.vjp``: the first functorch backward of a process
    imports seconds of modules that the engines may never need. Not inside torch.func transforms
    nor under inference mode, where autograd records nothing: there the value check stands alone.
    """
    if xs.is_floating_point() and not torch.is_inference_mode_enabled() and not in_transform():
        try:
            with torch.enable_grad():
                leaf = xs.detach().clone().requires_grad_(True)
                out = f(leaf.clone())
            if isinstance(out, Tensor) and out.is_floating_point() and out.requires_grad:
                def pull(v: Tensor) -> Optional[Tensor]:
                    return torch.autograd.grad(out, leaf, v, retain_graph=True, allow_unused=True)[0]

                return out.detach(), pull
        except Exception:  # noqa: BLE001 -- autograd cannot run f: the value check stands alone
            pass
        replay.reset()
    with torch.no_grad():
        return f(xs.clone()), None


def _changes(xs: Tensor, x: Tensor, n: int, gen: torch.Generator) -> Tensor:
    """n changed copies of ``xs`` (n, k, *in): noise at the samples' scale, or other values of x.

    The draws are plain tensors made outside torch.func transforms (vmap refuses random ops in
    its default randomness mode); inside vmap every slice gets the same changes.
    """
    if not xs.is_floating_point() and not in_transform():
        return _other_ids(xs, x, n, gen)
    with outside():
        if xs.is_floating_point():
            scale = float(plain(xs).abs().nan_to_num(0.0, 0.0, 0.0).mean()) or 1.0  # the samples' magnitude
            noise = _randn((n, *xs.shape), gen, xs).mul_(scale)
        else:
            pick = torch.randint(0, x.shape[0], (n, xs.shape[0]), generator=gen, device=x.device)
    return xs + noise if xs.is_floating_point() else x[pick].to(xs.dtype)


def _other_ids(xs: Tensor, x: Tensor, n: int, gen: torch.Generator) -> Tensor:
    """Integers (token ids): every entry takes another value seen in x, so a changed sample always
    differs (the rows of other samples may all hold the same ids); 0 and a neighbour when x has one value."""
    pool = torch.unique(x.reshape(-1).long())
    if pool.numel() < 2:
        v = int(pool[0]) if pool.numel() else 0
        pool = torch.tensor(sorted({0, v, v - 1 if v > 0 else v + 1}), device=x.device)
    where = torch.searchsorted(pool, xs.long())
    size = pool.numel()
    step = torch.randint(1, size, (n, *xs.shape), generator=gen, device=x.device)
    if xs.dim() > 1 and xs[0].numel() > 1:
        # a changed sample that is a permutation of its ids is the same bag to a pooling layer (EmbeddingBag's
        # sum / mean): its first entry takes a third value (or, of two values, keeps its own), so the bag changes
        flat = (where + step) % size
        rows = flat.reshape(n, xs.shape[0], -1)
        same = (rows.sort(-1).values == where.reshape(1, xs.shape[0], -1).sort(-1).values).all(-1)  # (n, k)
        if bool(same.any()):
            first = step.reshape(n, xs.shape[0], -1)[..., 0]
            bump = torch.where(first + 1 == size, first + 2, first + 1) % size if size > 2 else torch.zeros_like(first)
            step = step.reshape(n, xs.shape[0], -1).clone()
            step[..., 0] = torch.where(same, bump, first)
            step = step.reshape(n, *xs.shape)
    out = pool[(where + step) % size]
    if xs.dim() > 1 and xs[0].numel() > 1:
        out = _uniform_rows(out, xs.long(), pool, gen)
    return out.to(xs.dtype)


def _uniform_rows(out: Tensor, xs: Tensor, pool: Tensor, gen: torch.Generator) -> Tensor:
    """Changed samples (n, k, *in) with every entry one id absent from the sample, where there is one.

    Every position then changes, and the bag too, whatever the pooling makes equal: a permutation
    (sum), proportional counts (mean) or the padding id, which changes neither sum nor mean. The
    absent id is a value of x or one between its smallest minus one and its largest, so a valid index
    of any table that x indexes. Samples that hold every such value keep the changes of ``_other_ids``.
    """
    k, length = xs.shape[0], xs[0].numel()
    lo, hi = max(int(pool[0]) - 1, 0), int(pool[-1])
    candidates = torch.unique(torch.cat([pool, torch.arange(lo, min(hi, lo + length) + 1, device=pool.device)]))
    rows = out.reshape(out.shape[0], k, length).clone()
    for i in range(k):
        absent = candidates[~torch.isin(candidates, xs[i].reshape(-1))]
        if absent.numel():
            pick = absent[torch.randint(0, absent.numel(), (rows.shape[0],), generator=gen, device=pool.device)]
            rows[:, i, :] = pick[:, None]
    return rows.reshape(out.shape)


def _randn(shape: tuple[int, ...], gen: torch.Generator, like: Tensor) -> Tensor:
    if like.dtype in (torch.float32, torch.float64):
        return torch.randn(shape, generator=gen, device=like.device, dtype=like.dtype)
    return torch.randn(shape, generator=gen, device=like.device).to(like.dtype)


def _tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE.get(dtype, 1e-2)


def _moved(before: Tensor, after: Tensor, keep: tuple[int, ...], rows: Tensor) -> Optional[int]:
    """The first position in ``keep`` (``rows`` as a tensor) whose output moved (NaN equals NaN), or None."""
    if before.shape != after.shape:
        return keep[0]
    a, b = before.index_select(0, rows), after.index_select(0, rows)
    wrapped = in_transform()
    if not wrapped and torch.equal(a, b):  # the usual verdict for independent samples, in one comparison
        return None
    # elementwise ops only, so that inside vmap this runs per slice; Python reads plain values
    a, b = a.reshape(len(a), -1), b.reshape(len(b), -1)
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = torch.where(finite, a, 0.0).abs().amax().where(finite.any(), 1.0).clamp_min(1e-30)
    tol = _tolerance(a.dtype)
    same = (a == b) | (a.isnan() & b.isnan()) | (finite & ((a - b).abs() <= tol * (b.abs() + scale)))
    moved = samples_first((~same).any(1))  # (k, *vmapped)
    moved = moved.reshape(len(moved), -1).any(1).nonzero()
    return keep[int(moved[0])] if len(moved) else None


def _nonlocal_gradient(pull: Callable[[Tensor], Optional[Tensor]], v: Tensor, inside: Tensor,
                       a: tuple[int, ...], c: tuple[int, ...]) -> Optional[int]:
    """The first position in ``a`` with a gradient from the cotangent ``v`` on the rows ``c`` alone."""
    try:
        g = pull(v)
    except Exception:  # noqa: BLE001 -- f has no backward here: the value check stands alone
        return None
    if g is None or not bool((g * inside).any()):  # exact zeros: the usual verdict
        return None
    g = g.reshape(g.shape[0], -1)
    outside, kept = g[list(a)], g[list(c)]
    ref = kept[torch.isfinite(kept)].abs().max().item() if bool(torch.isfinite(kept).any()) else 0.0
    limit = _tolerance(g.dtype) * max(ref, torch.finfo(g.dtype).tiny)
    bad = (torch.isfinite(outside) & (outside.abs() > limit)).any(1).nonzero()
    return a[int(bad[0])] if len(bad) else None


def _names(idx: list[int], positions: tuple[int, ...]) -> str:
    chosen = [str(idx[i]) for i in positions]
    return ", ".join(chosen[:4]) + (", ..." if len(chosen) > 4 else "")
