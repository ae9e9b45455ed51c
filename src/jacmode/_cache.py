"""The caches of jacmode: one registry that ``clear_cache`` empties, and the one table per function.

NOTE: [The registry of caches]
Every table that remembers something found by a call (a fact about a function, a colouring,
generated code, a warning given) calls :func:`register` where it is defined, and
:func:`clear_cache` empties every registered one, so that the next call behaves as the first call
of a fresh process. A module-level table that is *not* a cache (a rule table fixed at import, the
state of calls in flight, pure arithmetic memoised by small integers) is named in
:data:`NOT_CACHES` with the reason; ``tests/test_clear_cache.py`` fails for any module-level dict,
set, list, weak table or ``lru_cache`` of the package that is in neither, so a new cache cannot be
missed.

Threads: no lock is held against running calls. A call looks a cache up with one ``get`` or
``setdefault`` and keeps what it found; emptying a table in another thread only makes that call's
stores land in a table nobody reads again. What a running call cannot lose (the tensors bound
for it, the kernels' guard) is call state, not a cache, and is never cleared.

NOTE: [One table per function]
What jacmode finds out about a function is kept in one place: ``_guard._MEMOS`` maps the function
(weakly: everything goes when the function does) to its ``Memo``, whose typed fields hold
every fact found about it (:class:`Kind`: coupling verdicts, captured programs, coverage,
footprints, capabilities, autotuned modes, sparsity patterns, ...), its profiles, the profile its
last repeated call served, its eager calls' transforms and the guard's count of its calls. A
call reads this table once: its guard finds f's Memo there, and the call's scope holds it
(``_guard.held``) for the look-ups that follow. Every fact is keyed by the generation of f's
state in the call's scope
(``_guard.py``: a fact is found again only under a state that passes the guards of the one it was
found under) and by what it depends on (see :func:`problem_key`); a call with no generation (a
first call, a function that cannot be guarded or weakly referenced) neither reads nor writes one.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, ContextManager, Iterator, Optional, TypeVar

import torch
from torch import Tensor, nn

from . import _guard
from ._guard import _MEMOS, _memos, current, memo, peek
from ._state import Keyed

T = TypeVar("T")

# name -> the registered object (the registry itself is not a cache: see NOT_CACHES)
_REGISTERED: list[tuple[str, Any]] = []
_CLEARING = threading.Lock()  # one clear_cache at a time (two would only repeat the work)


def register(obj: T, name: str) -> T:
    """Make ``obj`` one of the caches that :func:`clear_cache` empties; returns ``obj``.

    ``obj``: a dict, set, list, ``weakref`` table, :class:`Kind` or :class:`Field` (which register
    themselves) or a ``functools.lru_cache`` function. Call it where the cache is defined.

    Args:
        obj: the cache.
        name: what it holds, for errors and tests.

    Returns:
        ``obj`` itself.

    Example:
        >>> from jacmode import _cache
        >>> seen = _cache.register({}, "example: things seen")
        >>> seen["x"] = 1
        >>> _cache.clear_cache()
        >>> seen
        {}
        >>> _cache.unregister(seen)
    """
    if not (callable(getattr(obj, "cache_clear", None)) or callable(getattr(obj, "clear", None))):
        raise TypeError(f"register: {name!r} is a {type(obj).__name__}, which clear_cache cannot empty.")
    _REGISTERED.append((name, obj))
    return obj


def unregister(obj: Any) -> None:
    """Forget a cache registered with :func:`register` (one made for a test, a doctest)."""
    _REGISTERED[:] = [(n, o) for n, o in _REGISTERED if o is not obj]


def registered() -> list[tuple[str, Any]]:
    """(name, cache) of every registered cache, in the order of registration."""
    return list(_REGISTERED)


def _empty(obj: Any) -> None:
    """Empty one registered cache (a weak table pops item by item: each pop is atomic, and its
    pending removals stay consistent)."""
    if hasattr(obj, "cache_clear"):
        obj.cache_clear()
    else:
        obj.clear()


_RULES = "a rule table, filled at import and never changed by a call"
_CONSTANT = "a constant table of names or numbers, fixed at import"
_MATH = "pure arithmetic memoised by small integer keys: the same answer in every process, no user object held"
_IN_FLIGHT = "the state of calls in flight, emptied by the calls themselves: clearing it would break them"
_NO_ARGS = "an empty dict passed where a call has no keyword arguments, never written"

# Module-level tables of the package that are not caches: where defined -> why clear_cache leaves
# them (tests/test_clear_cache.py: every other module-level table must be registered).
NOT_CACHES: dict[str, str] = {
    "jacmode._cache._REGISTERED": "the registry of caches itself",
    "jacmode._cache.NOT_CACHES": "this list",
    "jacmode.__main__._MOVED": _CONSTANT,
    "jacmode._functional._PRODUCTS": _CONSTANT + " (the products that take the functional style)",
    "jacmode._args.params._ROWS_OF": _IN_FLIGHT + " (the call a module of sample rows reads, rows_bound)",
    "jacmode._args.params._CLAIMS": _IN_FLIGHT + " (the thread that picked a module of rows, until it binds it)",
    "jacmode._state._BOUND": _IN_FLIGHT + " (the tensors bound into a copy of a model for the call, bind)",
    "jacmode._functional._IN_USE": _IN_FLIGHT + " (the copies of models that calls with wrt a dict run on now)",
    "jacmode._state._KERNELS": _IN_FLIGHT + " (how many calls hold the attention kernels' guard, the flags to restore)",
    "jacmode._state._MKLDNN": _IN_FLIGHT + " (how many calls hold the mkldnn guard, the flag to restore)",
    "jacmode._state._SDP_FLAGS": "torch's scaled-dot-product flags (getters and setters), read at import",
    "jacmode._threads._PLACED": _IN_FLIGHT + " (how many calls have hooks of their own on the user's modules)",
    "jacmode._threads._BEGUN": "the number of binds of dicts into models begun, ever: calls compare it with their stamp",
    "jacmode._threads._BINDS": _IN_FLIGHT + " (the binds of dicts into models in flight)",
    "jacmode._threads._RECENT": "the last binds of dicts into models, by number: a call in flight reads those since "
                                "its stamp (clearing it would hide them; it holds ids, no object)",
    "jacmode._planning.engines.BY_MODE": _CONSTANT,
    "jacmode._planning.engines.WHAT": _CONSTANT,
    "jacmode._planning.footprint.flop_registry": "torch's table of flop formulas (imported)",
    "jacmode._transform._SPECS": "the entry points' specs: registered at import (and derived from the signature alone)",
    "jacmode._profile._TOKENS": "interned option sets -> the token in profile keys, which live Transformed objects "
                                "and the entry points' fixed tokens hold: numbered by its length, so clearing it "
                                "would give a new option set a token in use (plain values only, a few per entry point)",
    "jacmode._transform._DATA": _CONSTANT,
    "jacmode._jacobian._DEFAULTS": "jacobian's option defaults (for the token), fixed",
    "jacmode._jacobian._NO_DATA": _NO_ARGS,
    "jacmode._probes.probes._NO_KWARGS": _NO_ARGS,
    "jacmode._operands._TARGET_TOKEN": "the derivative operators' fixed tokens (structure, create_graph) -> int",
    "jacmode._autodiff.traceable.REASONS": _CONSTANT,
    "jacmode._autodiff.traceable._EAGER": "one compiler-disabled function per reason, made at import",
    "jacmode._checks._UNITS": _CONSTANT,
    "jacmode._coupling._TOLERANCE": _CONSTANT,
    "jacmode._coupling.parts": _MATH,
    "jacmode._capture.taylor._terms": _MATH + " (Faa di Bruno's terms of a multi-index)",
    "jacmode._capture.taylor._sub_keys": _MATH,
    "jacmode._capture.taylor._leibniz": _MATH,
    "jacmode._rules.elementwise._ratio": _MATH + " (polynomials of the rule table's coefficients)",
    "jacmode._capture.bindings._RENAMED": _CONSTANT,
    "jacmode._capture.bound._LIBRARIES": _CONSTANT,
    "jacmode._capture.bound._META": _CONSTANT,
    "jacmode._capture.bound._RANDOM": _CONSTANT,
    "jacmode._capture.capture._IN_PLACE": _CONSTANT,
    "jacmode._capture.codegen._ELEMENTWISE": _CONSTANT,
    "jacmode._capture.codegen._IN_PLACE": _CONSTANT,
    "jacmode._capture.codegen._VIEWS": _CONSTANT,
    "jacmode._capture.rewrites._FACTORIES": _CONSTANT,
    "jacmode._capture.rewrites._TANH_P": _CONSTANT,
    "jacmode._capture.rewrites._TANH_Q": _CONSTANT,
    "jacmode._capture.rewrites._TANH_ONE": _CONSTANT,
    "jacmode._probes.generated._VIEW_OPS": _CONSTANT,
    "jacmode._structure._SEEDS": "layout builders per strategy, fixed",
    "jacmode._planning.calibrated.COST": "the calibrated cost model, read at import",
    "jacmode._planning.calibrated._BY_DEVICE": "the calibrated cost models per device type, each read once",
    "jacmode._planning.calibrated.MEMORY": "the calibrated memory model, read at import",
    "jacmode._planning.calibrated.NTK_COST": "the calibrated NTK cost model, read at import",
    "jacmode._sparse.api._PARTITION": _CONSTANT,
    "jacmode._sparse.detect._R_OPS": _CONSTANT,
    "jacmode._sparse.detect._DUNDER": _CONSTANT,
    "jacmode._sparse.detect._INPLACE_CONSTANT": _CONSTANT,
    **{f"jacmode._sparse.rules.{n}": _RULES for n in (
        "LINEAR", "PIECEWISE_LINEAR", "PRODUCTS", "QUOTIENTS", "NONLINEAR", "ELEMENTWISE", "SUMS", "REDUCTIONS",
        "ALONG", "_DIM_AT", "STRUCTURAL", "RULES", "ZERO_DERIVATIVE", "CONSTANT", "BRANCHES", "VALUE_READS", "RANDOM")},
    **{f"jacmode._rules.{n}": _RULES for n in (
        "table.TABLE", "table._META", "arithmetic.TABLE", "arithmetic._SPELLINGS", "batchnorm.TABLE", "conv.RULES",
        "conv.TABLE", "decompositions.DECOMPOSITIONS", "elementwise.FUNCTIONS", "elementwise.SELU",
        "elementwise.RULES", "embedding.RULES", "linear.TABLE", "linear.RULES", "losses.TABLE", "modules.RULES",
        "norm.TABLE", "norm.RULES", "pooling._AVG", "pooling._MAX", "pooling._MAX_DIMS", "pooling.TABLE",
        "shape.TABLE", "softmax.TABLE")},
}



class Field:
    """One field of every ``_guard.Memo`` (``profiles``, ``last``, ``eager``, ...) seen as a table of its
    own: registered under its name (its entries are cleared with the Memo table's), sized and
    listed for tests and tools (a set's elements as keys, with the value True)."""

    def __init__(self, attr: str, name: str) -> None:
        self.attr, self.name = attr, name
        register(self, name)

    def get(self, f: Any, default: Any = None) -> Any:
        """f's dict in this field, or ``default`` where f has no Memo."""
        m = peek(f)
        return default if m is None else getattr(m, self.attr)

    def __getitem__(self, f: Any) -> dict[Any, Any]:
        m = peek(f)
        if m is None:
            raise KeyError(f)
        return getattr(m, self.attr)  # type: ignore[no-any-return]

    def items(self) -> Iterator[tuple[Any, Any, Any]]:
        for f, m in _memos():
            table = getattr(m, self.attr)
            for key, value in list(table.items()) if isinstance(table, dict) else [(k, True) for k in list(table)]:
                yield f, key, value

    def clear(self) -> None:
        for _, m in _memos():
            getattr(m, self.attr).clear()


class Kind:
    """One kind of fact kept per function, in its ``_guard.Memo``'s ``facts``: ``get``/``put`` by the
    function and a key, under the generation of the function's state in the call's scope (None:
    nothing is read or kept). Registered under its name (its entries are cleared with the Memo
    table's), sized and listed for tests and tools."""

    def __init__(self, name: str) -> None:
        self.name = name
        register(self, name)

    def get(self, ident: Any, key: tuple) -> Optional[Any]:
        ident, key = _resolved(ident, key)
        if key[0] is None:  # no generation in scope: nothing may be reused
            return None
        m = peek(ident)
        return None if m is None else m.facts.get((self, *key))

    def put(self, ident: Any, key: tuple, value: Any) -> None:
        ident, key = _resolved(ident, key)
        if key[0] is None:
            return
        m = memo(ident)
        if m is not None:
            m.facts[(self, *key)] = value

    def items(self) -> Iterator[tuple[Any, tuple, Any]]:
        for ident, m in _memos():
            for key, value in list(m.facts.items()):
                if key[0] is self:
                    yield ident, key[1:], value

    def clear(self) -> None:
        for _, m in _memos():
            for key in [k for k in list(m.facts) if k[0] is self]:
                m.facts.pop(key, None)


register(_MEMOS, "what is kept per function")
register(_guard._STATES, "guards: the states of each kind of function")
register(_guard._OWNERS, "guards: wrappers jacmode made of a function")

# function -> the messages already given for it (see warn_once): Memo.warned
_WARNED = Field("warned", "warnings given, per function")


def warn_once(f: Any, message: str) -> None:
    """Give ``message`` as a :class:`~jacmode.JacmodeWarning` once per function ``f``.

    NOTE: [Warnings once per function]
    A warning is a message to the user, not a fact found about ``f`` that a change of its state
    could make stale, so it is remembered outside the generation-keyed caches: per function
    (weakly; a flat function of several arguments and a wrapper jacmode made of ``f`` count as
    ``f``) and message, from the first call on, whether or not ``f`` can be guarded (a function
    TorchDynamo cannot trace whole is warned about once too). A message that differs (another
    operation, another gap) is given again. ``clear_cache`` forgets what was given, so the next
    call warns as the first call of a fresh process does. A function that cannot be weakly
    referenced is warned about on every call: remembering it by ``id`` would either keep it
    alive or, once it is gone, silence the warnings of an unrelated function given its ``id``
    (Python's own filter still shows a warning once per line of the caller's code by default).

    Example:
        >>> import warnings
        >>> from jacmode import _cache
        >>> def f(x): return x
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(3):
        ...         _cache.warn_once(f, "jacmode: an example")
        >>> len(caught)
        1
        >>> _cache.clear_cache()
    """
    kept = memo(_owner(f))
    given = None if kept is None else kept.warned  # (None: not weakly referenceable, warned every time)
    if given is not None:
        if message in given:
            return
        given.add(message)
    from ._errors import JacmodeWarning, user_stacklevel

    warnings.warn(message, JacmodeWarning, stacklevel=user_stacklevel())


def _owner(f: Any) -> Any:
    """The user's function behind ``f``: the function of a flat call, the owner of a wrapper."""
    if isinstance(f, Keyed):
        f = f.f
    for _ in range(8):  # a wrapper of a wrapper; bounded against a cycle
        try:
            ref = _guard._OWNERS.get(f)
        except TypeError:
            return f
        owner = None if ref is None else ref()
        if owner is None:
            return f
        f = owner
    return f


def _resolved(ident: Any, key: tuple) -> tuple[Any, tuple]:
    """The function a cache entry is kept under, and its full key: the generation of that function
    in the call's scope first (None: not to be cached). A flat function of a call with several
    arguments (:class:`Keyed`, new per call) is cached under the user's function, with the call's
    structure added to the key."""
    if isinstance(ident, Keyed):
        return ident.f, (current(ident.f), ident.subkey(), *key)
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
    """Forget everything jacmode cached: the next call of any entry point is a first call again.

    Every cache registered with :func:`register` is emptied: the profiles of repeated calls and
    the code generated on them, the eager calls' transforms, captured programs and their checks,
    coupling verdicts, probe coverage, footprints, capabilities and fallbacks (the fallback
    warnings already given and the functions marked as having no forward mode too), autotuned
    modes, sparsity patterns, colourings and their seeds, the output structures and signatures
    of functions called with several arguments, the modules of sample rows (of models called
    with several arguments and of functions of shared parameters), checked options and the free-memory reading. Objects held only by
    those (programs, profiles and what they keep) go with them. Left alone: the tables that
    are not caches (:data:`NOT_CACHES`: rule tables, the state of calls in flight) and
    ``torch.compile``'s own caches (``torch._dynamo.reset()`` empties those).

    Safe while other threads run jacmode calls: a call in flight keeps what it already looked up
    and finishes as it began (see the note [The registry of caches]).

    Example:
        >>> import torch, jacmode as jm
        >>> from jacmode import _profile
        >>> net, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
        >>> _ = jm.jacobian(net, x); _ = jm.jacobian(net, x)   # the second call keeps a profile
        >>> _profile.count(net)
        1
        >>> jm.clear_cache()
        >>> _profile.count(net)
        0
    """
    with _CLEARING:
        # a copy (a module imported meanwhile may register); the table of Memos last, so that the
        # kinds and fields see every Memo as they empty it (the profiles' field marks each one dropped)
        for _, cache in sorted(_REGISTERED, key=lambda entry: entry[1] is _MEMOS):
            _empty(cache)


def rng_kept(device: torch.device) -> ContextManager[None]:
    """A context that leaves the random number generators of ``device`` as it found them."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
