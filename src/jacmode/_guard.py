"""The one guard: whether the function a call runs is the one an earlier call found out about.

NOTE: [Guards from what was read]
Everything jacmode reuses across calls of ``f`` (captured programs, profiles, generated code, the
verdict that samples are independent, probe coverage, output structure and size, plans) was found
out by running or tracing ``f``, and stays true only while everything that run *read* is
unchanged: attributes, globals, closure cells, container elements, function objects, class
attributes, module structure, buffers (``None`` included), flags. A list of the kinds of state
that might change is never complete, so jacmode does not keep one. TorchDynamo does the work
instead: it traces ``f(*args, **kwargs)`` at the bytecode level, and its guard manager holds one
check per value the trace read (C++, a few microseconds per call). This module traces f once per
state with a backend that runs nothing (:func:`_made`), keeps Dynamo's guard manager, and names
each state that passes it a *generation*, a small integer. Every cache of jacmode keys its entries
by the generation of the call in scope (``_cache.Kind``, ``_profile``), so a fact found under
one state can only be found again under a state that passes the same guards.

Dynamo guards tensors by their metadata (shape, dtype, device, strides, ``requires_grad``), not
their values or identity, because its graph reads them per call; jacmode's engines read f's
tensors per call too (``_capture/bound.py``, the probes), and parameters are in the profile's
key by identity. A value Dynamo does not guard but turns into a graph input that is not a tensor
of f (a numpy scalar, an unspecialised number) makes the state *unguarded*, as does a function
Dynamo cannot trace whole (a graph break: ``.item()``, value-dependent branches, unsupported
calls): then nothing is reused and every call is a first call, exact and slower.

Costs: the guard of a function is made on the *second* call in scope with it (a function called
once never pays for Dynamo: its import, about a second, and a trace, 0.05-0.4 s); the third call
is the first to reuse. A function whose state changes more than ``MAX_STATES`` times (a float
annealed every step, a new batch size every call) stops being guarded: its calls take the first
call's path from then on. ``jm.clear_cache()`` forgets every guard.

Scopes: a public entry point enters a scope for its ``f`` and the arguments f is called with
(:func:`entry`); the generation is computed once, at entry, under the caller's own grad mode and
settings. Nested entry points on the same f share the outer scope; a wrapper jacmode makes of f
(a module of sample rows of a model or of a function) follows f's generation (:func:`derived`),
and an entry point called on it inside f's scope stays in that scope; a cache consulted for any
other function finds no generation and is bypassed. Scopes are per thread. Inside a torch.func
transform (``vmap`` over an ensemble's inputs, ``grad`` of a meta-objective) the generation is the
same as outside: the transforms' stack is cleared while the guard is traced or checked, and each
tensor the transforms wrap is read as the tensor it wraps (:func:`_in_transform`); where f holds
a wrapped tensor itself (``functional_call`` inside the transform), nothing is reused.

Sharing: a guard made for one instance of a class passes for another exactly when everything its
forward reads is the same, so the states are kept per class (per code object for a plain
function) and an ensemble or a test suite traces a class once per state; the caches stay per
instance, since they are keyed by the function too.

Threads: the trace reads a structural clone of a module (``_threads.clone_tree``) whose tensors
share the user's storage but carry no ``.grad`` (TorchDynamo describes ``.grad``, which a backward
pass in another thread may be writing), under ``_threads.SERIAL``, and never while a call in any
thread has hooks of its own on the user's modules (``_threads.transient_hooks``); the guard it
makes is checked against f itself before it is kept. Routing on "inside torch.compile" uses
``torch.compiler.is_dynamo_compiling()``, true only in the frames TorchDynamo traces: the
process-wide ``is_compiling()`` flag is also true in every other thread while any trace runs.
A dict of tensors that another thread binds into a model f reads (``wrt=params``, the functional
style) changes what f computes for the bind's duration: a scope it disturbs has no generation from
then on (nothing found is kept) and its call runs again once no bind is in flight (the note [Binds
and the calls they disturb] in ``_threads.py``).

What is kept per function lives in one table here, :data:`_MEMOS` (function -> :class:`Memo`), so
that the generation and the facts keyed by it are read from one place (the note [One table per
function] in ``_cache.py``).
"""

from __future__ import annotations

import functools
import itertools
import linecache
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
from torch import Tensor

from ._state import modules_of
from ._threads import _BEGUN, BINDING, SERIAL, Stamp, bind_stamp, clone_tree, disturbed, hooks_in_flight

MAX_STATES = 16  # guards made per function before its calls stop reusing anything

_local = threading.local()
_NUMBERS = itertools.count(1)
F = TypeVar("F", bound=Callable[..., Any])


class _Seen:
    """One function's calls: how many guards they made, the last state they passed, and why they
    reuse nothing (once they do not)."""

    __slots__ = ("made", "failed", "reason", "last")

    def __init__(self) -> None:
        self.made = 0
        self.failed = 0
        self.reason = ""
        self.last: Optional[tuple[Any, int]] = None  # (Dynamo's guard manager, generation)


# The states found so far per kind of function (a module's class, a Python function's code), newest
# first. A guard made for one instance passes for another exactly when everything its forward reads
# is the same, so the instances of a class share their states (and a test suite or an ensemble
# traces a class once); the caches stay per instance, since they are keyed by the function too.
_STATES: "weakref.WeakKeyDictionary[Any, list[tuple[Any, int]]]" = weakref.WeakKeyDictionary()
MAX_KIND_STATES = 32


def _kind(f: Any) -> Any:
    if isinstance(f, torch.nn.Module):
        return type(f)
    code = getattr(f, "__code__", None)
    return type(f) if code is None else code


class _Scope:
    """One entry point's scope for ``f`` (see the note): the generation of f's state, and the binds
    of dicts into models (``_threads.bind_stamp``) when it began."""

    __slots__ = ("f", "generation", "memo", "stamp", "hit", "used")

    def __init__(self, f: Any, found: tuple[Optional[int], Optional[Memo]], stamp: Stamp) -> None:
        self.f, self.stamp = f, stamp
        self.generation, self.memo = found  # memo: f's Memo as the guard read it (the call's one look-up)
        self.hit = False
        self.used: Optional[set[int]] = None

    def current(self) -> Optional[int]:
        """The scope's generation, or None once another thread's bind disturbed it (:func:`current`)."""
        stamp = self.stamp  # (no bind since the scope began: its generation, without a call)
        if self.generation is None or (_BEGUN[0] == stamp[0] and not stamp[1]):
            return self.generation
        return None if self.disturbed() else self.generation

    def disturbed(self) -> bool:
        """Whether another thread bound a dict into a model f reads since the scope began (then
        nothing the call finds is kept, and it runs again: see :func:`scoped_call`)."""
        if self.hit:
            return True
        if not disturbed(self.stamp, self._used):
            return False
        self.hit = True
        return True

    def _used(self) -> set[int]:
        if self.used is None:
            self.used = {id(m) for m in modules_of(self.f)}
        return self.used


def _stack() -> list[_Scope]:
    try:
        return _local.stack  # type: ignore[no-any-return]
    except AttributeError:
        _local.stack = []
        return _local.stack  # type: ignore[no-any-return]


# wrapper (weakly) -> its owner, weakly too: a wrapper is kept in a cache under its owner
# (a module of sample rows in its owner's Memo), so a strong owner here would keep both alive
_OWNERS: "weakref.WeakKeyDictionary[Any, weakref.ref[Any]]" = weakref.WeakKeyDictionary()


def derived(obj: Any, owner: Any) -> None:
    """``obj`` (a wrapper jacmode made of ``owner``: a module of sample rows of a model or of a
    function) computes what ``owner`` computes: its cached facts follow the generation of ``owner``,
    and an entry point called on it in ``owner``'s scope stays in that scope."""
    try:
        _OWNERS[obj] = weakref.ref(owner)
    except TypeError:
        pass


def _owner(obj: Any) -> Any:
    """What ``obj`` was :func:`derived` from, or None."""
    try:
        ref = _OWNERS.get(obj)
    except TypeError:
        return None
    return None if ref is None else ref()


class Memo:
    """Everything jacmode keeps about one function, in the one table :data:`_MEMOS` (the note [One
    table per function] in ``_cache.py``): typed fields, each a dict or a set.

    Attributes:
        facts: ``(kind, generation, *key) -> value`` for every :class:`Kind` of fact.
        profiles: a profile's key (its generation first) -> the ``_profile.Profile``.
        last: an entry point's token -> the profile its last repeated call served straight away.
        eager: an eager call's options, frozen -> its ``_transform.Transformed``.
        rows: a call form -> the module of sample rows made of f for it (``_args/params.py``).
        warned: the warnings given about f (:func:`warn_once`).
        declined: the inputs for which ``structure="auto"`` found no sparsity worth using
            (``_sparse/api.py``).
        seen: f's calls as the guard counts them (:class:`_Seen`: guards made, the last state
            passed, why nothing is reused), from its first call on.
        copies: structural copies of a model that calls with ``wrt`` a dict of tensors run on
            (``_functional.bound_copy``).
    """

    __slots__ = ("facts", "profiles", "last", "eager", "rows", "warned", "declined", "seen", "copies")

    def __init__(self) -> None:
        self.facts: dict[tuple, Any] = {}
        self.profiles: dict[tuple, Any] = {}
        self.last: dict[int, Any] = {}
        self.eager: dict[Any, Any] = {}
        self.rows: dict[tuple, Any] = {}
        self.warned: set[str] = set()
        self.declined: set[tuple] = set()
        self.seen: Optional[_Seen] = None
        self.copies: dict[int, Any] = {}


# function (weakly) -> its Memo: the one table of what jacmode keeps per function (registered with
# the caches by _cache.py)
_MEMOS: "weakref.WeakKeyDictionary[Any, Memo]" = weakref.WeakKeyDictionary()


def peek(f: Any) -> Optional[Memo]:
    """f's :class:`Memo`, or None (none yet, or f cannot be weakly referenced): one look-up."""
    try:
        return _MEMOS.data.get(weakref.ref(f))  # type: ignore[attr-defined,no-any-return]
    except TypeError:
        return None


def memo(f: Any) -> Optional[Memo]:
    """f's :class:`Memo`, made on first use; None where f cannot be weakly referenced."""
    found = peek(f)
    if found is None:
        try:
            found = _MEMOS.setdefault(f, Memo())
        except TypeError:
            return None
    return found


def _memos() -> Iterator[tuple[Any, Memo]]:
    """(function, Memo) of every live function: a snapshot taken by single C calls (a clear_cache
    or a store in another thread cannot change the table under it)."""
    for ref, m in list(_MEMOS.data.items()):  # type: ignore[attr-defined]
        f = ref()
        if f is not None:
            yield f, m


def current(ident: Any) -> Optional[int]:
    """The generation of ``ident`` in the calling thread's scope, or None (nothing may be reused;
    also once another thread's bind disturbed the scope, so that nothing found then is kept)."""
    scope = held(ident)
    if scope is not None:
        return scope.current()
    owner = _owner(ident)
    return None if owner is None else current(owner)


def held(f: Any) -> Optional[_Scope]:
    """The calling thread's innermost scope whose function is ``f`` itself, or None: its
    generation (:meth:`_Scope.current`) and the Memo the guard read for it at entry (:attr:`memo`),
    so that a repeated call reads the table :data:`_MEMOS` once."""
    try:
        stack = _local.stack
    except AttributeError:
        return None
    for scope in reversed(stack):
        if scope.f is f:
            return scope
    return None


def why_not(f: Any) -> str:
    """Why calls of ``f`` reuse nothing (empty when they may)."""
    try:
        weakref.ref(f)
    except TypeError:
        return f"{type(f).__name__} objects cannot be weakly referenced"
    m = peek(f)
    return "" if m is None or m.seen is None else m.seen.reason


def generation(f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[int]:
    """The generation of the state ``f(*args, **kwargs)`` reads (see the note), or None."""
    return _found(f, args, kwargs)[0]


def _found(f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Optional[int], Optional[Memo]]:
    """:func:`generation`, and f's Memo (None: none, or f is not weakly referenceable), from one
    read of :data:`_MEMOS`."""
    if torch.compiler.is_dynamo_compiling():
        return None, None  # inside torch.compile: the tensors are the caller's fakes
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return _in_transform(f, args, kwargs)
    try:
        m = _MEMOS.data.get(weakref.ref(f))  # type: ignore[attr-defined]  # (peek, inline: every call)
    except TypeError:  # not weakly referenceable
        return None, None
    seen = None if m is None else m.seen
    if seen is None:  # the first call: nothing to reuse yet, and no guard made for a function called once
        m = memo(f)
        if m is not None:
            m.seen = _Seen()
        return None, m
    return _state_of(f, args, kwargs, seen), m


def _state_of(f: Any, args: tuple[Any, ...], kwargs: dict[str, Any], seen: _Seen) -> Optional[int]:
    """The generation of f's state from its guards (the last one passed first), or of a guard made now."""
    if seen.reason:
        return None
    frame = {"f": f, "args": args, "kwargs": kwargs}
    last = seen.last
    if last is not None and _passes(last[0], frame):
        return last[1]
    try:
        states = _STATES.setdefault(_kind(f), [])
    except TypeError:
        states = []
    for state in list(states):
        if state is not last and _passes(state[0], frame):
            seen.last = state
            return state[1]
    # one trace at a time in the process (the counts and lists below change under this lock only), and
    # none while a call has hooks on the user's modules
    with SERIAL:
        if hooks_in_flight():
            return None
        if seen.made >= MAX_STATES:
            seen.reason = f"its state changed more than {MAX_STATES} times (each change is traced and guarded anew)"
            return None
        seen.made += 1
        made = _made(_view(f), args, kwargs)
        if not isinstance(made, str) and not _passes(made, frame):
            made = "the guard made on a structural clone does not pass for f itself"
        if isinstance(made, str):
            seen.failed += 1
            if seen.failed >= 2:
                seen.reason = made
            return None
        state = (made, next(_NUMBERS))
        states.insert(0, state)
        del states[MAX_KIND_STATES:]
        seen.last = state
        return state[1]


def _in_transform(f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Optional[int], Optional[Memo]]:
    """The generation of a call inside a torch.func transform (vmap over an ensemble's inputs, grad
    of a meta-objective): the same as outside, for f and the tensors the transforms wrap (each
    read as the tensor it wraps), with the transforms' stack cleared while the guard is traced or
    checked. None where f holds a wrapped tensor itself (a ``functional_call`` inside the
    transform swaps them into its slots): the caller's tensors, new at every call."""
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if isinstance(f, torch.nn.Module):
        for m in f.modules():
            for table in (m._parameters, m._buffers):
                for t in table.values():
                    if t is not None and wrapped(t):
                        return None, None

    def plain(v: Any) -> Any:
        if isinstance(v, Tensor):
            while wrapped(v):
                v = torch._C._functorch.get_unwrapped(v)
            return v
        if isinstance(v, (tuple, list)):
            return type(v)(plain(e) for e in v)
        if isinstance(v, dict):
            return {k: plain(e) for k, e in v.items()}
        return v

    with temporarily_clear_interpreter_stack():
        return _found(f, plain(args), plain(kwargs))


def _passes(manager: Any, frame: dict[str, Any]) -> bool:
    try:
        return bool(manager.check(frame))
    except Exception:  # noqa: BLE001 -- a guard that cannot evaluate does not pass
        return False


def _view(f: Any) -> Any:
    """What the guard's trace reads in place of ``f``: for a module, a structural clone
    (``_threads.clone_tree``) whose parameters and buffers are new tensors sharing the user's
    storage, with no ``.grad``. TorchDynamo describes every tensor it meets, ``.grad`` included,
    and reading a ``.grad`` that a backward pass in another thread is writing can crash the
    process; the guard it makes is checked against f itself before it is kept."""
    if not isinstance(f, torch.nn.Module):
        return f
    clone = clone_tree(f)
    for m in clone.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    alias = t.detach()
                    if isinstance(t, torch.nn.Parameter):
                        alias = torch.nn.Parameter(alias, requires_grad=t.requires_grad)
                    table[name] = alias  # type: ignore[assignment]
    return clone


class _Traced(Exception):
    """Raised by the backend's compiled function: the trace is all that was wanted."""


_SENTINEL_SOURCE = "def sentinel(f, args, kwargs):\n    return f(*args, **kwargs)\n"
_SENTINEL_FILE = "<jacmode guard>"


def _sentinel() -> Callable[..., Any]:
    """A new function ``sentinel(f, args, kwargs)``: a code object of its own per trace.

    Its source is registered with ``linecache``, so that ``inspect.getsourcefile`` finds it:
    torch.compile before 2.13 wraps a function without a source file in one shared frame
    (``external_utils.wrap_inline``), where every trace would land on the same code object, its
    guards out of reach of this code object and the recompile limit reached after eight.
    """
    if _SENTINEL_FILE not in linecache.cache:  # (no modification time: linecache.checkcache keeps it)
        linecache.cache[_SENTINEL_FILE] = (len(_SENTINEL_SOURCE), None, _SENTINEL_SOURCE.splitlines(True),
                                           _SENTINEL_FILE)
    namespace: dict[str, Any] = {"__builtins__": __builtins__}
    exec(compile(_SENTINEL_SOURCE, _SENTINEL_FILE, "exec"), namespace)
    return namespace["sentinel"]  # type: ignore[no-any-return]


def _made(f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Dynamo's guard manager for ``f(*args, **kwargs)`` in the present state, or why there is none.

    A new code object per trace (Dynamo caches per code object: one entry each, no recompile
    limits); the backend checks that every graph input is a tensor that f reads (else a value the
    guards do not cover) and returns a function that raises :class:`_Traced`, so that nothing of
    f runs and none of its side effects are replayed.
    """
    try:
        import torch._dynamo  # noqa: F401 -- about a second, once per process
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except Exception as err:  # noqa: BLE001 -- a torch without Dynamo: nothing is guarded
        return f"TorchDynamo is not available ({type(err).__name__})"
    sentinel = _sentinel()
    refused: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        for node in gm.graph.nodes:  # every input a tensor f reads where the source names it
            arg = node.meta.get("grapharg") if node.op == "placeholder" else None
            if arg is None:
                continue
            name = getattr(arg.source, "name", "")
            name = name() if callable(name) else name
            if not isinstance(arg.example, Tensor) or getattr(arg, "pass_arg_as_tensor", False) or "(" in str(name):
                refused.append(f"f reads a value TorchDynamo passes as a graph input ({name})")

        def run(*_: Any) -> Any:
            raise _Traced()

        return run

    compiled = torch.compile(sentinel, backend=backend, fullgraph=True, dynamic=False)
    try:
        compiled(f, args, kwargs)
    except _Traced:
        pass
    except Exception as err:  # noqa: BLE001 -- a graph break, an unsupported call: unguarded
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"TorchDynamo cannot trace it whole ({type(err).__name__}: {first[:200]})"
    if refused:
        return refused[0]
    entries = _debug_get_cache_entry_list(sentinel.__code__)
    manager = getattr(entries[0], "guard_manager", None) if len(entries) == 1 else None
    if manager is None or not callable(getattr(manager, "check", None)):  # another torch: nothing guarded
        return "TorchDynamo kept no guard manager for it"
    root = getattr(manager, "root", None)  # what the wrapper's check calls (one Python frame fewer per call)
    return root if callable(getattr(root, "check", None)) else manager


def _inputs(f: Any, args: tuple[Any, ...], options: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """f's arguments in an entry point ``op(f, *args, kwargs=..., **options)``: torch.func's convention."""
    return args, options.get("kwargs") or {}


def first_input(f: Any, args: tuple[Any, ...], options: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """f's arguments in an entry point ``op(f, x, ...)`` that calls ``f(x, **kwargs)`` (the products), or
    ``f(*x, **kwargs)`` where x is a tuple of the model's positional arguments."""
    x = args[0] if args else None
    if isinstance(x, tuple) and any(isinstance(t, Tensor) for t in torch.utils._pytree.tree_leaves(x)):
        return x, options.get("kwargs") or {}
    return args[:1], options.get("kwargs") or {}


def primals(f: Any, args: tuple[Any, ...], options: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """f's arguments in ``op(f, primals, tangents)`` (``jvp``, ``hvp``): the primals, a tuple or one tensor."""
    p = args[0] if args else options["primals"]
    return (tuple(p) if isinstance(p, (tuple, list)) else (p,)), options.get("kwargs") or {}


Inputs = Callable[[Any, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


def entry(inputs: Inputs = _inputs) -> Callable[[F], F]:
    """Make an entry point ``op(f, *args, **options)`` enter a scope for f (see the note).

    Args:
        inputs: ``(f, args, options) -> (f's positional arguments, f's keyword arguments)``; by
            default the entry point's positional arguments after f, and its ``kwargs`` option.
    """

    def wrap(op: F) -> F:
        @functools.wraps(op)
        def scoped(f: Any, *args: Any, **options: Any) -> Any:
            stack = _stack()
            if stack and (stack[-1].f is f or _owner(f) is stack[-1].f):  # (f's wrapper: f's scope)
                return op(f, *args, **options)
            try:
                fargs, fkwargs = inputs(f, args, options)
            except Exception:  # noqa: BLE001 -- arguments the entry point will refuse: no scope needed
                return op(f, *args, **options)
            return scoped_call(f, fargs, fkwargs, lambda: op(f, *args, **options))

        return scoped  # type: ignore[return-value]

    return wrap


def scoped_call(f: Any, fargs: tuple[Any, ...], fkwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
    """``run()`` in a scope for ``f`` called as ``f(*fargs, **fkwargs)`` (an entry point's or a
    transform's call); again, holding ``_threads.BINDING``, where another thread bound a dict of
    tensors into a model f reads meanwhile (the note [Binds and the calls they disturb])."""
    stack = _stack()
    if stack and stack[-1].f is f:
        return run()
    stamp = bind_stamp()  # (before the generation: a bind during its trace disturbs the scope too)
    scope = _Scope(f, _found(f, fargs, fkwargs), stamp)
    stack.append(scope)
    try:
        result = run()
    except Exception:
        if not scope.disturbed():
            raise
    else:
        if (_BEGUN[0] == stamp[0] and not stamp[1]) or not scope.disturbed():  # (no bind since it began)
            return result
    finally:
        stack.pop()
    if any(isinstance(a, Iterator) for a in fargs):  # batches drawn from an iterator cannot be drawn again
        raise RuntimeError(
            f"{type(f).__name__}: another thread bound a dict of tensors into a model this call reads (wrt=dict, "
            "or functional_call in a function of shared tensors) while it ran over an iterator of batches, which "
            "cannot be run again. Pass a data set that can be iterated twice (a DataLoader, a list), or make the "
            "calls on this model from one thread.")
    with BINDING:  # no bind can start: the call as it would run alone
        stack.append(_Scope(f, _found(f, fargs, fkwargs), bind_stamp()))
        try:
            return run()
        finally:
            stack.pop()
