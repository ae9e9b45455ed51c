"""What keeps threads apart: structural clones of a module tree, and one lock for what torch keeps per process.

NOTE: [Threads]
A user's model is shared: another thread may run it (a training step, another jacmode call)
while a jacmode call runs. So jacmode never puts anything of its own into the live modules:

* code generation traces with fake tensors (``make_fx``) on a structural clone of the modules
  it reads (:func:`clone_tree`): new module objects whose parameter, buffer, submodule and hook
  dicts are their own, holding the user's tensors, into which the trace puts its fake tensors;
  the generic engines' ``functional_call`` over the parameters swaps into a clone too;
* ``torch.fx``'s symbolic tracing patches ``nn.Module.__call__`` and ``__getattr__`` for the
  whole process while it runs; the tracer (``_capture/capture.py``) lets every other thread's
  calls through to the original behaviour, and a module is traced on a clone;
* probe hooks (``_probes/probes.py``) act only within the forward pass of the call that placed
  them, in its thread;
* the state guard (``_state.py``) writes back only what a call leaves behind in the model.

Some of torch's machinery is per process, not per thread: tracing (``torch.fx`` and ``make_fx``
patch process-wide state and restore it on exit, which two traces at once would interleave) and
forward-mode AD (the forward-AD levels of ``torch.autograd.forward_ad`` and the jvp nesting of
``torch.func.jvp`` are process-wide, so two threads running jvps at once fail with "invalid forward
AD level" or worse). :data:`SERIAL` is held by each of them: jacmode's traces and forward-mode
passes (:func:`jvp`, :func:`jacfwd`, :func:`hessian`, :func:`dual_level`, used instead of torch's
own) take turns across threads; reverse mode, the Taylor engine and generated code run in parallel.
One lock for both, re-entrant, so that no two locks can be taken in opposite orders.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict, deque
from typing import Any, Callable, Iterator, Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

# one trace or forward-mode pass at a time in the process (see the note); re-entrant: a jvp in a jvp
SERIAL = threading.RLock()
_PLACED = [0]  # calls, in any thread, with hooks of their own on the user's modules right now


@contextlib.contextmanager
def transient_hooks() -> Iterator[None]:
    """Within: this call may hang hooks of its own on the user's modules (the probes, a module
    tracker). The guard of ``_guard.py`` makes no trace meanwhile: TorchDynamo would read those
    hooks as part of the model, and a dict of hooks changed under its trace is not safe."""
    with SERIAL:
        _PLACED[0] += 1
    try:
        yield
    finally:
        with SERIAL:
            _PLACED[0] -= 1


def hooks_in_flight() -> bool:
    """Whether some call has hooks of its own on the user's modules (see :func:`transient_hooks`)."""
    return _PLACED[0] > 0


# ---- dicts of tensors bound into a user's model, and the calls they disturb ----
#
# NOTE: [Binds and the calls they disturb]
# A call in the functional style runs an fn that may swap tensors into the user's modules it refers
# to (``functional_call``; counted as binds of them, :func:`touching`). (A call with ``wrt`` a dict
# of tensors binds nothing into the user's model: it runs on a copy, ``_functional.bound_copy``.)
# Binds take turns (:data:`BINDING`), but another thread's jacmode call that reads the same model
# meanwhile would compute with the bound tensors. So binds are
# numbered and listed with the ids of the modules they touch (:func:`bind_started`,
# :func:`bind_ended`, under BINDING, before the swap and after the swap back). Every scope an entry
# point opens takes a stamp (:func:`bind_stamp`) and asks, whenever it reads a cache and when its
# call ends, whether another thread bound a module it reads since (:func:`disturbed`: two reads
# where no bind happened). A disturbed scope keeps and reads nothing from then on; its call runs
# again holding BINDING, when no bind can start (``_guard.scoped_call``), and its state guard writes
# no slot back (the slots are the bind's). Its result is then the one it would give alone. BINDING
# is SERIAL itself: a bind may happen inside a forward-mode pass (a dict call inside f), and one
# lock cannot be taken in opposite orders.

BINDING = SERIAL
_BEGUN = [0]  # binds begun in the process, ever
# (number, ids of the bound model's modules, thread ident) of the last binds
_RECENT: "deque[tuple[int, frozenset[int], int]]" = deque(maxlen=256)
_BINDS: dict[int, tuple[frozenset[int], int]] = {}  # number -> (ids, thread ident) of the binds in flight


class _Mine(threading.local):
    begun = 0  # binds begun by this thread


_MINE = _Mine()


def bind_started(model: nn.Module) -> int:
    """A bind of ``model`` (all its modules) begins: its number, for :func:`bind_ended` (the caller
    holds BINDING; before the swap)."""
    me = threading.get_ident()
    ids = frozenset(id(m) for m in model.modules())
    _BEGUN[0] += 1
    _MINE.begun += 1
    _RECENT.append((_BEGUN[0], ids, me))
    _BINDS[_BEGUN[0]] = (ids, me)
    return _BEGUN[0]


def bind_ended(number: int) -> None:
    """The bind ``number`` ended (the caller holds BINDING; after the swap back)."""
    del _BINDS[number]


@contextlib.contextmanager
def touching(modules: list[nn.Module]) -> Iterator[None]:
    """Within: the calling thread may swap tensors into ``modules`` (a function of shared tensors that
    calls ``functional_call`` on them): counted as binds of them, holding BINDING."""
    with BINDING:
        numbers = [bind_started(m) for m in modules]
        try:
            yield
        finally:
            for n in numbers:
                bind_ended(n)


Stamp = tuple[int, tuple[tuple[frozenset[int], int], ...], int]


def bind_stamp() -> Stamp:
    """When a call starts: the binds begun so far, those in flight (of any thread), and the calling
    thread's own binds begun so far."""
    return _BEGUN[0], tuple(_BINDS.values()) if _BINDS else (), _MINE.begun


def disturbed(stamp: Stamp, used: Callable[[], set[int]]) -> bool:
    """Whether another thread bound a model the call reads (``used()``: the ids of its modules)
    since ``stamp`` (or was binding one when it was taken)."""
    number, binding, mine = stamp[0], stamp[1], stamp[2]
    if _BEGUN[0] == number and not binding:
        return False
    me = threading.get_ident()
    others = _BEGUN[0] - number - (_MINE.begun - mine)  # binds begun since by other threads
    if others == 0 and all(thread == me for _, thread in binding):
        return False
    since = [(found, t) for n, found, t in list(_RECENT) if n > number and t != me]
    if len(since) < others:  # some fell out of the list of recent binds: any may have touched f
        return True
    ids: set[int] = set()
    for found, thread in (*binding, *since):
        if thread != me:
            ids |= found
    return bool(ids) and not ids.isdisjoint(used())


def clone_tree(root: nn.Module, memo: Optional[dict[int, nn.Module]] = None) -> nn.Module:
    """A structural clone of ``root``'s module tree: a new object of the same class per module,
    sharing the user's tensors and other attributes, with its own ``_parameters``, ``_buffers``,
    ``_modules`` and hook dicts (and sets), so that putting a tensor into a slot of the clone or
    a hook on it leaves the user's module untouched. ``memo`` (original id -> clone) keeps a
    module that appears twice one clone, and maps the user's modules to theirs for the caller.
    """
    memo = {} if memo is None else memo
    found = memo.get(id(root))
    if found is not None:
        return found
    clone = object.__new__(type(root))  # copy.copy without __reduce_ex__: the dict is set below
    memo[id(root)] = clone
    state = dict(root.__dict__)
    for key, value in state.items():
        if type(value) in (dict, OrderedDict, set) and key != "_modules":
            state[key] = type(value)(value)  # parameters, buffers, hooks, non-persistent names
    state[_ORIGINAL] = original(root)
    state["_modules"] = type(root._modules)(
        (k, None if m is None else clone_tree(m, memo)) for k, m in root._modules.items())
    clone.__dict__.update(state)
    return clone


_ORIGINAL = "_jacmode_clone_of"  # a clone's attribute: the user's module it copies
_CONTAINERS = (dict, OrderedDict, set)


def refresh(clone: nn.Module, root: nn.Module) -> bool:
    """Bring ``clone``, a structural clone of ``root`` (:func:`clone_tree`), up to root's present
    state, in place: pair by pair down both trees, each module's attributes, and the contents of
    its parameter, buffer and hook dicts (kept as the clone's own objects, which code generated for
    the clone reads). False, having changed nothing that matters, where the trees differ in shape
    (another child name or class, a module shared in one tree and not in the other): then the
    caller makes a new clone."""
    pairs: list[tuple[nn.Module, nn.Module]] = []
    seen: dict[int, nn.Module] = {id(root): clone}
    mine: dict[int, nn.Module] = {id(clone): root}
    stack = [(root, clone)]
    while stack:  # the shapes first: nothing is written unless they match
        o, c = stack.pop()
        if type(c) is not type(o) or list(o._modules) != list(c._modules):
            return False
        pairs.append((o, c))
        for name, child in o._modules.items():
            other = c._modules[name]
            if child is None or other is None:
                if child is not other:
                    return False
                continue
            if seen.get(id(child), other) is not other or mine.get(id(other), child) is not child:
                return False
            if id(child) not in seen:
                seen[id(child)], mine[id(other)] = other, child
                stack.append((child, other))
    for o, c in pairs:
        od, cd = o.__dict__, c.__dict__
        for key, value in od.items():
            if key == "_modules" or key == _ORIGINAL:
                continue
            if type(value) in _CONTAINERS:
                held = cd.get(key)
                if held is not None and type(held) is type(value):
                    if value or held:  # (most hook dicts: empty in both)
                        held.clear()
                        held.update(value)
                else:
                    cd[key] = type(value)(value)
            elif cd.get(key, refresh) is not value:
                cd[key] = value
        for key in [k for k in cd if k not in od and k != _ORIGINAL]:
            del cd[key]
    return True


def original(module: nn.Module) -> nn.Module:
    """The user's module that ``module`` is a structural clone of (itself if it is none), for what
    jacmode keys by the module object (``_args/params.py``'s call in progress)."""
    return module.__dict__.get(_ORIGINAL, module)


def jvp(*args: Any, **kwargs: Any) -> Any:
    """``torch.func.jvp``, one thread at a time (see the note)."""
    with SERIAL:
        return torch.func.jvp(*args, **kwargs)


def _serialised(make: Callable[..., Callable[..., Any]]) -> Callable[..., Callable[..., Any]]:
    """A transform whose result runs forward-mode AD, its result run under :data:`SERIAL`."""

    @functools.wraps(make)
    def transform(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        inner = make(*args, **kwargs)

        @functools.wraps(inner)
        def run(*a: Any, **k: Any) -> Any:
            with SERIAL:
                return inner(*a, **k)

        return run

    return transform


jacfwd = _serialised(torch.func.jacfwd)
hessian = _serialised(torch.func.hessian)  # jacfwd over jacrev


@contextlib.contextmanager
def dual_level() -> Iterator[None]:
    """``torch.autograd.forward_ad.dual_level()``, one thread at a time (see the note)."""
    with SERIAL, fwAD.dual_level():
        yield
