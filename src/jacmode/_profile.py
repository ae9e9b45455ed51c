"""One profile per function and call signature: what the first call found, looked up by the next ones.

NOTE: [Profiles]
A training loop calls the same operator on the same model with inputs of the same shape thousands
of times; everything a call *finds out* before it differentiates (the problem's facts, the coupling
verdict, the captured program and its check, the probe coverage, the footprint, capabilities,
plan, the derivative operators' engine choice, per_sample_grads' coverage) is the same every
time. The first call per (function, signature) stores it in one :class:`Profile`; a later call
with the same :func:`key` looks it up and only runs the engine, so a profile hit bypasses every
first-call cache (``_coupling``, capture, coverage, footprint, fallback, autotune).

The key is built in one place, :func:`key`, from

* the entry point and its options (:func:`token`: one small integer per entry point, or path of
  one, and distinct set of plain option values, in one token space for every entry point),
* the call's signature (:func:`call_signature`: shapes, dtypes, devices and ``requires_grad`` of
  the tensors, names and hashable values of the other arguments; never a tensor's values),
* the modules the function is made of (:func:`_walk`): their identity and order, training
  flags, the handles of their forward / backward hooks (a hook added later is a new key) and the
  process-wide module hooks, dropout probabilities, every parameter's slot name, identity,
  ``requires_grad``, dtype, shape and device, and every buffer's name, dtype, shape and device,
* whether a ``torch.func`` transform is active, whether inference mode is on, and grad mode.

A hit with a captured program also checks that the program is still fresh (:func:`fresh`: the
Python values and tensors it took from f's closure, globals and modules, which the key does not
name), as the capture cache itself does.

Values never enter it: an optimizer step (in-place updates of the same parameters) keeps the
profile. A profile holds the modules and parameters of its key, so that their ``id`` cannot be
reused by new objects while the profile lives (f itself excepted: it is the weak key, and its
``id`` cannot be reused while it lives); at most ``PER_FUNCTION`` profiles are kept per
function (the oldest goes first). ``jm.clear_cache()`` forgets all of them.
"""

from __future__ import annotations

import itertools
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Optional, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.nn.modules.dropout import _DropoutNd

from . import _state
from ._cache import Field, _resolved
from ._guard import held, memo, peek
from ._state import Survey, modules_of
from ._transforms import _PEEK, in_transform
from ._capture.bound import Source

PER_FUNCTION = 16


class _Profiles(Field):
    """The profiles (each function's ``Memo.profiles``): one dropped by ``clear_cache`` is no longer
    :attr:`Profile.live`."""

    def clear(self) -> None:
        with _LOCK:
            for _, _, p in list(self.items()):
                _dead(p)
            _LAST.clear()
            super().clear()


_PROFILES = _Profiles("profiles", "profiles")
_LOCK = threading.Lock()  # keep / forget from several threads (a look-up needs none)


E = TypeVar("E")


@dataclass
class Profile(Generic[E]):
    """What the first call of an entry point with a key found (see the note above).

    Attributes:
        facts: what that entry point needs to run again without describing, as its own type:
            ``_jacobian.JacobianEntry`` (the problem's facts and the decision), ``_operands.TargetEntry``
            (the derivative operators' engine choice and shapes), ``_products.SampleGradsEntry``
            (per_sample_grads' coverage and split).
        holds: the modules and parameters of the key, kept alive so their ids stay unique.
        runs: what a repeated call of this profile runs straight away, per entry point and
            arguments (the derivative operators: ``_operands.ReadyRun``, the generated code and how
            its result is assembled; ``jacobian``: its generated probe code, or its generated
            Taylor code, ``codegen.Ready``); it re-checks what the key does not hold.
    """

    facts: E
    holds: tuple[Any, ...] = ()
    runs: dict[Any, Any] = field(default_factory=dict)
    live: bool = True  # False once dropped from the cache (forget, a newer profile, clear_cache)
    generation: Optional[int] = None  # of f's state when it was kept (_guard.py): it serves that one only
    check: Any = None  # :func:`recheck`'s test of its key, a :class:`Check` (False: none can be made)


# ---- tokens: the entry point and its options, as the first part of every key ----

_TOKENS: dict[Hashable, int] = {}
_FRESH = itertools.count(1 << 40)
_ATOMS = frozenset({str, int, float, bool, type(None)})


def freeze(v: Any) -> Hashable:
    """Options as a hashable value: lists and tuples recursively; anything unhashable raises TypeError."""
    kind = type(v)
    if kind in _ATOMS:  # most options: one look-up
        return (kind, v)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(freeze(e) for e in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, freeze(e)) for k, e in v.items())))
    if isinstance(v, Tensor):
        raise TypeError("a tensor")
    hash(v)
    return (type(v), v)


def _plain_values(v: Any) -> bool:
    if isinstance(v, tuple):
        return all(_plain_values(e) for e in v)
    return v is None or isinstance(v, (str, int, float, bool, type))


def token(name: str, options: dict[str, Any]) -> tuple[int, Optional[Hashable]]:
    """The one token space of profile keys: a small integer naming an entry point (or one of its
    paths) and its options (equal options share it), and the options frozen; a fresh integer when
    the options hold unhashable values or tensors (never reused).

    Example:
        >>> token("laplacian", {"create_graph": False}) == token("laplacian", {"create_graph": False})
        True
    """
    try:
        frozen: Optional[Hashable] = (name, freeze(options))
    except TypeError:
        return next(_FRESH), None
    if not _plain_values(frozen):  # kept forever: only plain values (no loss modules, generators)
        return next(_FRESH), frozen
    number = _TOKENS.get(frozen)
    if number is None:
        number = _TOKENS[frozen] = len(_TOKENS)
    return number, frozen


def _value_key(v: Any) -> Hashable:
    """A non-tensor argument in a key: itself when hashable, else its type and identity."""
    try:
        hash(v)
    except TypeError:
        return (type(v).__name__, id(v))
    return (type(v), v)


def tensor_key(t: Tensor) -> tuple[Any, ...]:
    """What a profile may depend on of a tensor: never its values."""
    return (t.shape, t.dtype, t.device, t.requires_grad, t.layout)


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's arguments in a profile's key: one entry per positional argument, then the keywords.

    Today every entry point takes one tensor x (and keyword arguments passed through to f); the
    several-arguments work extends this one function (pytrees: their structure and each leaf).
    """
    out: list[Any] = [tensor_key(a) if isinstance(a, Tensor) else _value_key(a) for a in args]
    for name in sorted(kwargs):
        v = kwargs[name]
        out.append((name, tensor_key(v) if isinstance(v, Tensor) else _value_key(v)))
    return tuple(out)


def _hooks(m: nn.Module) -> tuple[Any, ...]:
    return (tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks),
            tuple(m._backward_pre_hooks))


def _fields(m: nn.Module) -> tuple[bool, dict[str, Any], dict[str, Any], bool]:
    """A module's training flag, parameters, buffers and whether it has hooks, read from its
    ``__dict__`` without attribute look-ups (every call walks)."""
    d = m.__dict__
    try:
        return (d["training"], d["_parameters"], d["_buffers"],
                bool(d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]))
    except KeyError:  # a module keeping them elsewhere (a ScriptModule): its attributes
        return (m.training, m._parameters, m._buffers,
                bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks))


def _walk(modules: list[nn.Module], guard: bool = True) -> tuple[tuple[Any, ...], Optional[Survey]]:
    """The structure, flags, hooks, parameters and buffers of ``modules`` (see the note), and the
    guard's :class:`~jacmode._state.Survey` of them, in one walk (a repeated call reads every
    module and parameter once, for both); ``guard=False``: the same key, and no survey (None)."""
    parts: list[Any] = []
    add = parts.append
    # a dict's tensors bound in by jacmode (wrt=dict, _state.bind) are new at every step of a
    # functional optimiser: they count by their place (slot, shape, dtype, device), not identity
    bound = {id(t) for stack in _state._BOUND.values() for t in stack[-1].values()} if _state._BOUND else ()
    training: list[bool] = []
    slots: list[tuple[nn.Module, str, Any]] = []
    params: dict[int, Any] = {}
    flags: list[bool] = []
    buffers: list[tuple[nn.Module, str, Any]] = []
    for m in modules:
        flag, own, buf, hooked = _fields(m)
        training.append(flag)
        add(id(m))
        add(flag)
        if hooked:
            add(_hooks(m))
        if isinstance(m, _DropoutNd):  # p = 0 or not: random layers or none (the problem's facts)
            add(m.p)
        if own:
            add(tuple(own))
            row: list[Any] = []
            for name, p in own.items():
                if guard:
                    slots.append((m, name, p))
                if p is None:
                    row.append(None)
                    continue
                ident = id(p)
                flag = p.requires_grad
                if guard and ident not in params:
                    params[ident] = p
                    flags.append(flag)
                row.append(("bound" if ident in bound else ident, flag, p.dtype, p.shape, p.device))
            add(tuple(row))
        if buf:
            add(tuple(buf))
            row = []
            for name, b in buf.items():
                if b is None:
                    row.append(None)
                    continue
                if guard:
                    buffers.append((m, name, b))
                row.append((b.dtype, b.shape, b.device))
            add(tuple(row))
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks):
        add((tuple(_module._global_forward_hooks), tuple(_module._global_forward_pre_hooks),
             tuple(_module._global_backward_hooks), tuple(_module._global_backward_pre_hooks)))
    if not guard:
        return tuple(parts), None
    return tuple(parts), Survey(tuple(training), slots, list(params.values()), buffers, tuple(flags))


def key(token: int, args: tuple[Any, ...], kwargs: dict[str, Any], modules: list[nn.Module]) -> tuple[Any, ...]:
    """The one key of a profile (see the note): options, call signature, modules, modes."""
    return walked(token, args, kwargs, modules)[0]


def walked(token: int, args: tuple[Any, ...], kwargs: dict[str, Any],
           modules: list[nn.Module], guard: bool = True) -> tuple[tuple[Any, ...], Any]:
    """:func:`key`, and the :class:`~jacmode._state.Survey` of ``modules`` that the same walk
    read, for ``preserved_state(f, modules, survey)`` entered right after (one walk per call);
    ``guard=False``: no survey (None), for a call that likely runs without the guard."""
    mods, found = _walk(modules, guard)
    return (token, call_signature(args, kwargs) if kwargs else (tensor_key(args[0]),) if len(args) == 1 and
            isinstance(args[0], Tensor) else call_signature(args, kwargs), mods, in_transform(),
            torch.is_inference_mode_enabled(), torch.is_grad_enabled()), found


def fresh(program: Any, x: Tensor, signature: Optional[tuple[Any, ...]] = None) -> bool:
    """Whether a captured program a profile holds still serves inputs like ``x``: the tensors it
    binds from f's closure, globals and modules are still there as traced (``_capture/bound.py``;
    the Python values it froze are the generation's, ``_guard.py``), and no engine rejected it for
    this input signature since (``_capture/capture.reject``).
    ``signature``: ``(x.shape[1:], x.dtype, x.device.type)`` when the caller has it (a profile
    hit: the key fixes it)."""
    if program is None:
        return True
    if not isinstance(program.checked.get(signature or (tuple(x.shape[1:]), x.dtype, x.device.type)), tuple):
        return False
    return all(b.fresh() for b in program.bound)  # Python values: the generation (_guard.py)


def checked_key(x: Tensor) -> tuple[Any, ...]:
    """x's input signature in a captured program's ``checked`` table (``_capture/program.py``): the
    ``signature`` of :func:`fresh`."""
    return (tuple(x.shape[1:]), x.dtype, x.device.type)


def find(f: Any, k: tuple[Any, ...]) -> Optional[Profile]:
    """The profile of ``f`` for key ``k`` under the generation of f's state in scope, or None."""
    f, k = _resolved(f, k)
    if k[0] is None:  # no generation: nothing is reused (_guard.py)
        return None
    m = peek(f)  # (None: never profiled, or not weak-referenceable)
    hit = None if m is None else m.profiles.get(k)
    return hit if isinstance(hit, Profile) else None


def keep(f: Any, k: tuple[Any, ...], profile: Profile, modules: list[nn.Module]) -> None:
    """Store ``profile`` for later calls of ``f`` with key ``k`` (at most ``PER_FUNCTION`` per f)."""
    f, k = _resolved(f, k)  # a flat function of several arguments: under the user's f (_cache.py)
    if k[0] is None:  # no generation in scope: nothing is kept (_guard.py)
        return
    profile.generation = k[0]
    bound = {id(t) for stack in _state._BOUND.values() for t in stack[-1].values()} if _state._BOUND else ()
    params = [p for m in modules for p in m._parameters.values() if p is not None and id(p) not in bound]
    profile.holds = (*(m for m in modules if m is not f), *params)  # never f: it is the weak key
    with _LOCK:
        kept = memo(f)
        if kept is None:  # f cannot be weakly referenced: not profiled
            return
        entries = kept.profiles
        if len(entries) >= PER_FUNCTION and k not in entries:
            _dead(entries.pop(next(iter(entries))))
        old = entries.get(k)
        if old is not profile:
            _dead(old)
        entries[k] = profile


def forget(f: Any, k: tuple[Any, ...]) -> None:
    """Drop the profile of ``f`` for ``k`` (an engine found its facts no longer hold)."""
    f, k = _resolved(f, k)
    with _LOCK:
        _dead(_PROFILES.get(f, {}).pop(k, None))


def _dead(p: Any) -> None:
    if isinstance(p, Profile):
        p.live = False


def count(f: Any) -> int:
    """How many profiles ``f`` has (for tests and ``repr``)."""
    return len(_PROFILES.get(f, {}))


# ---- the repeated call: the last hit's key tested in place (see recheck) ----

# f -> {token: the profile its last call of that token found and served straight away} (Memo.last)
_LAST = Field("last", "profiles of the last repeated calls")


class Lookup:
    """One call's look-up (:func:`lookup`): the profile it found (or None), its key, f's modules and
    the state guard's survey of them (None when the look-up was told the guard will not run)."""

    __slots__ = ("found", "key", "modules", "survey", "walked")

    def __init__(self, found: Optional[Profile], key: tuple[Any, ...], modules: list[nn.Module], survey: Any,
                 walked: bool) -> None:
        self.found, self.key, self.modules, self.survey, self.walked = found, key, modules, survey, walked


def lookup(f: Any, token: int, args: tuple[Any, ...], kwargs: Optional[dict[str, Any]] = None,
           guard: bool = True) -> Lookup:
    """The one look-up of every entry point's call ``f(*args, **kwargs)`` with options ``token``.

    First the key of the last call that ``f`` and ``token`` served straight away, tested in place
    (:func:`recheck`, no keyword arguments); else one walk of f's modules (:func:`walked`) and one
    look-up (:func:`find`). ``guard=False``: the caller expects to run without the state guard
    (no survey is made). After the found profile served the call, :func:`served` lets the next
    call test its key in place.
    """
    found = None if kwargs else recheck(f, token, *args)
    if found is not None:
        if guard:
            modules, seen = survey(found, f)
        else:
            modules, seen = [f, *found.check.rest], None
        return Lookup(found, found.check.key, modules, seen, False)
    modules = modules_of(f)
    key, seen = walked(token, args, kwargs or {}, modules, guard)
    return Lookup(find(f, key), key, modules, seen, True)


def served(f: Any, token: int, looked: Lookup, *args: Any) -> None:
    """``looked.found`` served the call ``f(*args)`` (no keyword arguments): the next call of f with
    ``token`` tests its key in place (:func:`recheck`)."""
    if looked.walked and looked.found is not None:
        remember(f, token, looked.found, *args)


def recheck(f: Any, token: int, *args: Any) -> Optional[Profile]:
    """The profile that ``find(f, walked(token, args, {}, modules_of(f))[0])`` would return, where it
    is the one the last such call of f and ``token`` found (:func:`remember`), else None.

    Instead of building the key (one walk of the modules, tuples of every parameter's facts, a
    hash, a deep comparison), the profile's check (:class:`Check`) compares what the key holds
    with the values it held, in place: each tensor argument's shape, dtype, device,
    ``requires_grad`` and layout, the other arguments' types and values; the tree of modules (each
    one's children, the same objects in the same order), their training flags, hooks (none),
    dropout probabilities, parameters (slot names, identity, requires_grad, dtype, shape, device)
    and buffers (names, dtype, shape, device); the process-wide hooks (none), no dict of tensors
    bound in (``_state.bind``), torch.func transforms, inference and grad mode. A profile dropped
    from the cache since (:func:`forget`, a newer one, ``clear_cache``) is not returned. None where
    anything differs: the caller then walks (the key decides).
    """
    scope = held(f)  # f's scope: its generation, and f's Memo as the guard read it (no second look-up)
    if scope is None or scope.memo is None:
        return None
    found = scope.memo.last.get(token)
    if found is None or not found.live or found.generation is None or found.generation != scope.current():
        return None
    return found if found.check.test(f, *args) else None


class Check:
    """:func:`recheck`'s test of a profile's key (``test(f, *args)``), with the key and what the
    guard's walk of it found that the key fixes (:func:`survey`). It never holds f (the profile's
    weak key, which a profile must not keep alive): f's own part is put back per call."""

    __slots__ = ("test", "key", "rest", "training", "own", "slots", "params", "flags", "buffered", "root_buffers")

    def __init__(self, test: Any, key: tuple[Any, ...], f: nn.Module, modules: list[nn.Module], found: Survey) -> None:
        self.test, self.key, self.rest = test, key, modules[1:]  # modules[0] is f
        self.training, self.params, self.flags = found.training, found.params, found.flags
        self.own = [(name, p) for m, name, p in found.slots if m is f]
        self.slots = [s for s in found.slots if s[0] is not f]
        self.buffered = [m for m in self.rest if m._buffers]
        self.root_buffers = bool(f._buffers)


def survey(found: Profile, f: nn.Module) -> tuple[list[nn.Module], Survey]:
    """f's modules (``modules_of(f)``) and the guard's :class:`~jacmode._state.Survey` of them, for
    a profile that :func:`recheck` returned for f: the flags, slots and parameters its key fixes, as
    its check found them; the buffers (which the key does not hold) read now."""
    c: Check = found.check
    slots = [(f, name, p) for name, p in c.own] + c.slots if c.own else c.slots
    buffered = [f, *c.buffered] if c.root_buffers else c.buffered
    buffers = [(m, name, b) for m in buffered for name, b in m._buffers.items() if b is not None]
    return [f, *c.rest], Survey(c.training, slots, c.params, buffers, c.flags)


def remember(f: Any, token: int, found: Profile, *args: Any) -> None:
    """After ``found`` served a call ``(f, *args)`` with ``token`` (found by its walked key, with no
    keyword arguments): :func:`recheck` tries it first on the next call. Makes the profile's
    :class:`Check` once (none where f is not a module or its key holds what the check does not
    test: hooks, tensors bound in, a torch.func transform, inference mode, unhashable arguments)."""
    if found.check is None:
        found.check = _checker(f, args, token, found) or False
    if found.check is False or not found.live:
        return
    kept = memo(f)
    if kept is not None:
        kept.last[token] = found


def _checker(f: Any, args: tuple[Any, ...], token: int, found: Profile) -> Optional[Check]:
    """The generated :class:`Check` of :func:`recheck` for the key f, ``token`` and ``args`` have now
    (which must be ``found``'s), or None."""
    if not isinstance(f, nn.Module) or _state._BOUND or in_transform():
        return None
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks):
        return None
    modules = modules_of(f)
    key, seen = walked(token, args, {}, modules)
    entries = _PROFILES.get(f)
    if entries is None or entries.get(_resolved(f, key)[1]) is not found:  # the key as of now is not found's
        return None

    names = [f"a{i}" for i in range(len(args))]
    src = Source(f"check(f, {', '.join(names)})", _module=_module, _state=_state, _PEEK=_PEEK,
                 _is_not=operator.is_not, _inference=torch.is_inference_mode_enabled, _grad=torch.is_grad_enabled)
    emit, const, on = src.emit, src.const, src.off
    for a, v in zip(names, args):
        if isinstance(v, Tensor):
            emit(f"if {a}.shape != {const(v.shape)} or {a}.dtype is not {const(v.dtype)} or {a}.requires_grad is not "
                 f"{v.requires_grad} or {a}.layout is not {const(v.layout)} or {on(a, v.device)}: return False")
            continue
        try:
            hash(v)
        except TypeError:  # in the key by its identity
            return None
        emit(f"if type({a}) is not {const(type(v))} or ({a} is not {const(v)} and not ({a} == {const(v)})): "
             "return False")
    for i, m in enumerate(modules):
        d = m.__dict__
        try:
            flag, params, buffers, children = d["training"], d["_parameters"], d["_buffers"], d["_modules"]
            hooked = d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]
        except KeyError:  # a module keeping them elsewhere (a ScriptModule): the walk decides
            return None
        if type(flag) is not bool or hooked or any(c is f for c in children.values()):
            return None
        emit(f"d = {'f' if i == 0 else const(m)}.__dict__")
        emit(f"if d['training'] is not {flag} or d['_forward_hooks'] or d['_forward_pre_hooks'] or "
             "d['_backward_hooks'] or d['_backward_pre_hooks']: return False")
        if isinstance(m, _DropoutNd):
            emit(f"if not (d['p'] == {const(m.p)}): return False" if "p" in d else "return False")
        if children:  # the same objects, by identity (a module's own __eq__ does not count, as in the key)
            emit("c = tuple(d['_modules'].values())")
            emit(f"if len(c) != {len(children)} or any(map(_is_not, c, {const(tuple(children.values()))})): return False")
        else:
            emit("if d['_modules']: return False")
        for attr, table in (("_parameters", params), ("_buffers", buffers)):
            if not table:
                emit(f"if d[{attr!r}]: return False")
                continue
            emit(f"t = d[{attr!r}]")
            emit(f"if tuple(t) != {const(tuple(table))}: return False")
            for name, tensor in table.items():
                if tensor is None:
                    emit(f"if t[{name!r}] is not None: return False")
                    continue
                # a parameter by identity and flag (as in the key), a buffer by its place only
                same = (f"v is not {const(tensor)} or v.requires_grad is not {tensor.requires_grad}"
                        if attr == "_parameters" else "v is None")
                emit(f"v = t[{name!r}]")
                emit(f"if {same} or v.dtype is not {const(tensor.dtype)} or v.shape != {const(tensor.shape)} or "
                     f"{on('v', tensor.device)}: return False")
    emit("if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks "
         "or _module._global_backward_pre_hooks or _state._BOUND): return False")
    emit(f"return {'' if _PEEK is None else '_PEEK() is None and '}_inference() is {key[4]} and _grad() is {key[5]}")
    test = src.function("Exception", "return False  # a slot gone, a value that will not compare: the walk decides",
                        f"<jacmode profile check of {type(f).__name__}>")
    return Check(test, key, f, modules, seen) if test(f, *args) else None
