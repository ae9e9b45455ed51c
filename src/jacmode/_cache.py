"""The caches of jacmode, keyed weakly by the user's function, and ``clear_cache``.

Every cache maps a function (weakly: entries go when the function does) to a dict keyed by the
generation of the function's state in the call's scope (``_guard.py``: a fact is found again only
under a state that passes the guards of the one it was found under) and by what the cached fact
depends on (see :func:`problem_key`). A call with no generation (a first call, a function that
cannot be guarded or weakly referenced) neither reads nor writes any cache.
"""

from __future__ import annotations

import weakref
from typing import Any, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn

from ._args import Flat, signature
from ._guard import clear as _forget_guards, current

_ALL: list["WeakCache"] = []


class WeakCache:
    """function (weakly) -> {key: value}."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._data: "weakref.WeakKeyDictionary[Any, dict[tuple, Any]]" = weakref.WeakKeyDictionary()
        _ALL.append(self)

    def get(self, ident: Any, key: tuple) -> Optional[Any]:
        ident, key = _resolved(ident, key)
        if key[0] is None:  # no generation in scope: nothing may be reused
            return None
        try:
            return self._data.get(ident, {}).get(key)
        except TypeError:  # not weak-referenceable
            return None

    def put(self, ident: Any, key: tuple, value: Any) -> None:
        ident, key = _resolved(ident, key)
        if key[0] is None:
            return
        try:
            self._data.setdefault(ident, {})[key] = value
        except TypeError:
            pass

    def items(self) -> Iterator[tuple[Any, tuple, Any]]:
        for ident, entries in list(self._data.items()):
            for key, value in list(entries.items()):
                yield ident, key, value

    def clear(self) -> None:
        self._data.clear()


def _resolved(ident: Any, key: tuple) -> tuple[Any, tuple]:
    """The function a cache entry is kept under, and its full key: the generation of that function
    in the call's scope first (None: not to be cached). A flat function of a call with several
    arguments (``_args.Flat``, new per call) is cached under the user's function, with the call's
    structure added to the key."""
    if isinstance(ident, Flat):
        return ident.f, (current(ident.f), signature(ident), *key)
    return ident, (current(ident), *key)


def problem_key(f: Any, x: Tensor, batched: bool, wrt: Any, structure: str, full_shape: bool) -> tuple:
    """What a cached fact about ``f`` depends on: shapes, dtype, device, wrt, structure, flags.

    Inference mode is part of it: autograd records nothing there, so the engines that lean on it
    (the probes, their completeness check) fail their checks and the torch.func engines serve,
    while a fact found outside (coverage verified by a backward pass) must not be used inside.
    """
    if isinstance(f, nn.Module):
        glob = _global_hooks()  # process-wide: read once, not per module
        flags = tuple(_flags(m, glob) for m in f.modules())
    else:
        flags = ()
    shape = tuple(x.shape) if full_shape or not batched else tuple(x.shape[1:])
    wrt_key = wrt if isinstance(wrt, str) else tuple(wrt)
    return (shape, x.dtype, str(x.device), batched, wrt_key, structure, flags, torch.is_inference_mode_enabled())


def _flags(m: nn.Module, glob: Optional[tuple[Any, ...]] = None) -> Any:
    """A module's training flag, and the handles of its hooks when it has any (a hook added later,
    e.g. one that scales an output, must not find the facts found without it); ``glob``: the
    process-wide hooks (:func:`_global_hooks`) when the caller read them for all its modules."""
    if glob is None:
        glob = _global_hooks()
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return (m.training, tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks),
                tuple(m._backward_pre_hooks), glob)
    return (m.training, glob) if any(glob) else m.training


def _global_hooks() -> tuple[Any, ...]:
    from torch.nn.modules import module as _module

    return (tuple(_module._global_forward_hooks), tuple(_module._global_forward_pre_hooks),
            tuple(_module._global_backward_hooks), tuple(_module._global_backward_pre_hooks))


def clear_cache() -> None:
    """Forget everything jacmode cached: profiles, coupling verdicts, footprints, fallbacks, autotuned modes.

    Example:
        >>> import jacmode as jm
        >>> jm.clear_cache()
    """
    for cache in _ALL:  # the profiles (_profile.py) too
        cache.clear()
    _forget_guards()


def rng_kept(device: torch.device) -> ContextManager[None]:
    """A context that leaves the random number generators of ``device`` as it found them."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
