"""``jm.clear_cache()`` empties every cache of the package (see the note [The registry of caches] in ``_cache.py``).

* every module-level dict, set, list, weak table, ``Kind`` and ``lru_cache`` of every module is
  either registered (``_cache.register``) or named in ``_cache.NOT_CACHES``, so a new cache cannot be
  missed;
* after calls of every kind of entry point fill them, ``clear_cache`` leaves every registered cache
  empty, and the objects they held (profiles, captured programs, with the code kept on them) go;
* a function whose output changed from a tensor to a tuple is served after ``clear_cache`` as the
  first call of a fresh process serves it;
* ``clear_cache`` in one thread does not break calls running in others.
"""

from __future__ import annotations

import collections
import copy
import gc
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
import threading
import weakref
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import jacmode as jm
from jacmode import _cache, _capture, _profile

DT = torch.float64
_TABLES = (dict, set, list, collections.deque, weakref.WeakKeyDictionary, weakref.WeakValueDictionary,
           weakref.WeakSet, _cache.Kind, _cache.Field)


def _modules() -> list[Any]:
    return [jm] + [importlib.import_module(m.name) for m in pkgutil.walk_packages(jm.__path__, "jacmode.")]


def _is_lru(obj: Any) -> bool:
    return (callable(getattr(obj, "cache_clear", None)) and hasattr(obj, "cache_info")
            and str(getattr(obj, "__module__", "")).startswith("jacmode"))


def _tables() -> dict[int, list[str]]:
    """id -> every ``module.name`` of a module-level table or lru_cache of the package (an object
    imported into several modules has several names)."""
    found: dict[int, list[str]] = {}
    for mod in _modules():
        for name, obj in vars(mod).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            if isinstance(obj, _TABLES) or _is_lru(obj):
                found.setdefault(id(obj), []).append(f"{mod.__name__}.{name}")
    return found


def _resolve(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _size(obj: Any) -> int:
    if isinstance(obj, (_cache.Kind, _cache.Field)):
        return sum(1 for _ in obj.items())
    if hasattr(obj, "cache_info"):
        return int(obj.cache_info().currsize)
    return len(obj)


# ---- every table is registered or allowed -------------------------------------------------------

def test_every_module_level_table_is_registered_or_allow_listed() -> None:
    registered = {id(obj) for _, obj in _cache.registered()}
    allowed = {id(_resolve(q)) for q in _cache.NOT_CACHES}
    missed = sorted(names[0] for i, names in _tables().items() if i not in registered and i not in allowed)
    assert not missed, (
        f"module-level tables that clear_cache does not know: {missed}. A cache: define it as "
        "register(<table>, 'what it holds') (jacmode._cache.register). Not a cache: add it to "
        "jacmode._cache.NOT_CACHES with the reason.")


def test_the_allow_list_names_tables_that_exist_and_are_not_registered() -> None:
    registered = {id(obj) for _, obj in _cache.registered()}
    for qualified, why in _cache.NOT_CACHES.items():
        obj = _resolve(qualified)  # a stale name raises here
        assert isinstance(obj, _TABLES) or _is_lru(obj), qualified
        assert id(obj) not in registered, f"{qualified} is registered and allow-listed"
        assert why.strip(), qualified


def test_the_known_caches_are_registered() -> None:
    """The tables outside testing found surviving clear_cache, by name."""
    registered = {id(obj) for _, obj in _cache.registered()}
    for qualified in ("jacmode._transform._EAGER", "jacmode._args.call._OUTPUTS", "jacmode._args.describe._SIGNATURES",
                      "jacmode._operands._NO_FORWARD_AD", "jacmode._sparse.api._COLORINGS",
                      "jacmode._sparse.api._VERIFIED", "jacmode._sparse.evaluate._SEEDS",
                      "jacmode._functional._SPELLINGS", "jacmode._args.params._HANDLES",
                      "jacmode._args.params._SUBCLASSES", "jacmode._profile._LAST", "jacmode._profile._PROFILES",
                      "jacmode._capture.capture._PROGRAMS", "jacmode._coupling._masks"):
        assert id(_resolve(qualified)) in registered, qualified


def test_register_refuses_what_it_cannot_empty() -> None:
    with pytest.raises(TypeError, match="cannot empty"):
        _cache.register(3, "a number")


# ---- clear_cache empties them -------------------------------------------------------------------

class _Two(nn.Module):
    """A model of two arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2).to(DT)

    def forward(self, x: Tensor, m: Tensor) -> Tensor:
        return torch.tanh(self.lin(x * m))


def _fill() -> list[Any]:
    """Calls of every kind of entry point (twice: the repeated calls' caches too); returns what they
    were called with, which the caller keeps alive (the caches are weak in it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).to(DT)
    x = torch.randn(4, 3, dtype=DT)
    y = torch.randn(4, 2, dtype=DT)
    two = _Two()

    def f(v: Tensor, w: Tensor) -> Tensor:
        return v.sin() * w

    def fp(p: dict[str, Tensor], v: Tensor, w: Tensor) -> Tensor:
        return torch.func.functional_call(net, p, (v * w,))

    def g(v: Tensor) -> Tensor:
        return v.sin() * v.roll(1) + v.pow(3)

    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    t = jm.transform(jm.laplacian, net)
    for _ in range(2):
        jm.jacobian(net, x)
        jm.jacobian(net, x, wrt="params")
        jm.jacobian(net, x, mode="autotune")
        jm.laplacian(net, x)
        jm.partials(net, x, [(0,), (1, 1)])
        jm.hessian(torch.tanh, x)
        jm.per_sample_grads(net, x, lambda out, yy: ((out - yy) ** 2).sum(1), y=y)
        t(x)
        jm.jacobian(f, x, y[:, :1].expand(4, 3).contiguous())
        jm.jacobian(two, x, torch.ones(4, 3, dtype=DT), wrt="params")
        jm.jacobian(fp, params, x, x.cos(), argnums=0, in_dims=(None, 0, 0))
        jm.sparse_jacobian(g, torch.randn(12, dtype=DT))
        jm.jacobian(g, torch.randn(12, dtype=DT), batched=False, structure="sparse")
    return [net, x, y, two, f, fp, g, params, t]


def test_clear_cache_empties_every_registered_cache() -> None:
    jm.clear_cache()
    held = _fill()
    full = {name for name, obj in _cache.registered() if _size(obj)}
    # the caches these calls fill, for certain (others depend on the engines chosen)
    for name in ("profiles", "profiles of the last repeated calls", "eager calls' transforms", "captured programs",
                 "output structures of calls with several arguments", "positional parameters of functions",
                 "modules of sample rows", "module classes of sample rows",
                 "sparsity patterns", "sparse colourings", "autotune", "checked options"):
        assert name in full, f"{name!r} is empty after the calls: {sorted(full)}"
    kept = [weakref.ref(p) for _, _, p in _profile._PROFILES.items()]
    kept += [weakref.ref(p) for _, _, p in _capture.capture._PROGRAMS.items() if not isinstance(p, (str, tuple))]
    assert kept
    jm.clear_cache()
    left = {name: _size(obj) for name, obj in _cache.registered() if _size(obj)}
    assert not left, f"caches left after clear_cache: {left}"
    gc.collect()
    alive = [r() for r in kept if r() is not None]
    assert not alive, f"objects kept after clear_cache (who holds them? {gc.get_referrers(alive[0])[:3]})"
    del held


# ---- after clear_cache, a call is a fresh call ------------------------------------------------------

_SEQUENCE = '''
import json, sys
import torch, jacmode as jm

FLAG = {"tuple": False}

def f(x, y):
    z = x.sin() * y
    return (z, z.cos()) if FLAG["tuple"] else z

x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
y = torch.linspace(0.5, 2, 12, dtype=torch.float64).reshape(4, 3)

def outcome():
    try:
        r = jm.jacobian(f, x, y)
    except Exception as err:
        return ["error", type(err).__name__]
    leaves = list(r) if isinstance(r, tuple) else [r]
    return ["ok", [[list(t.shape), t.flatten().tolist()] for t in leaves]]

steps = []
if sys.argv[1] == "changed":
    steps.append(outcome())          # a tensor
    FLAG["tuple"] = True
    steps.append(outcome())          # the tuple: nothing of the first call's structure is reused
    jm.clear_cache()
FLAG["tuple"] = True
steps.append(outcome())              # the tuple: after clear_cache, or a fresh process's first call
steps.append(outcome())              # and repeated
print(json.dumps(steps))
'''


def _sequences(*kinds: str) -> list[list[Any]]:
    """The steps of :data:`_SEQUENCE` of each kind, each in a process of its own (run side by side)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SEQUENCE), kind], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for kind in kinds]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    return found


def test_an_output_changed_to_a_tuple_is_served_after_clear_cache_as_in_a_fresh_process() -> None:
    changed, fresh = _sequences("changed", "fresh")
    assert fresh[0][0] == "ok" and len(fresh[0][1]) == 2 and fresh[1] == fresh[0]
    assert changed[0][0] == "ok" and len(changed[0][1]) == 1 and changed[1] == fresh[0]
    # after clear_cache: the tuple output served as the first call of a fresh process serves it
    assert changed[2:] == fresh


def _outcome(call: Callable[[], Any]) -> Any:
    try:
        r = call()
    except Exception as err:  # noqa: BLE001 -- the outcome compared is the error's type
        return ("error", type(err).__name__)
    return ("ok", [t.clone() for t in (r if isinstance(r, tuple) else (r,))])


def _same(a: Any, b: Any) -> bool:
    if a[0] != b[0] or a[0] == "error":
        return bool(a == b)
    return len(a[1]) == len(b[1]) and all(torch.equal(u, v) for u, v in zip(a[1], b[1]))


class _Flagged(_Two):
    """A model of two arguments whose output becomes a tuple when ``pair`` is set."""

    pair = False

    def forward(self, x: Tensor, m: Tensor) -> Any:  # type: ignore[override]
        out = super().forward(x, m)
        return (out, out * out) if self.pair else out


@pytest.mark.parametrize("wrt", ["inputs", "params"])
def test_a_model_whose_output_became_a_tuple_behaves_after_clear_cache_as_a_fresh_one(wrt: str) -> None:
    torch.manual_seed(1)
    model = _Flagged()
    fresh = copy.deepcopy(model)  # never called before: what a new process sees
    x, m = torch.randn(4, 3, dtype=DT), torch.rand(4, 3, dtype=DT)
    jm.clear_cache()
    jm.jacobian(model, x, m, wrt=wrt)
    model.pair = fresh.pair = True
    first = _outcome(lambda: jm.jacobian(fresh, x, m, wrt=wrt))
    changed = _outcome(lambda: jm.jacobian(model, x, m, wrt=wrt))  # nothing of the first call's structure reused
    jm.clear_cache()
    after = _outcome(lambda: jm.jacobian(model, x, m, wrt=wrt))
    assert first[0] == "ok" and _same(changed, first) and _same(after, first)


# ---- threads -------------------------------------------------------------------------------------

def test_clear_cache_does_not_break_a_call_running_in_another_thread() -> None:
    """Calls in flight keep what they looked up; a lock against them is not needed (see the note).

    One thread calls: two threads that both run first calls (which clear_cache makes every call)
    can collide in torch's process-wide forward-AD level without any clear_cache (the jvp of
    ``_autodiff/nested.py`` takes no lock), which is not what this tests.
    """
    errors: list[BaseException] = []
    stop = threading.Event()
    ready = threading.Event()
    calls_made = [0]

    def work() -> None:
        torch.manual_seed(2)
        net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(DT)
        x = torch.randn(4, 3, dtype=DT)
        y = torch.randn(4, 2, dtype=DT)
        t = jm.transform(jm.jacobian, net, wrt="params")
        two, m = _Two(), torch.rand(4, 3, dtype=DT)
        values = {k: v.detach() + 0.5 for k, v in net.named_parameters()}  # wrt a dict: bound for the call
        calls = [lambda: jm.jacobian(net, x), lambda: jm.jacobian(net, x, wrt="params"), lambda: jm.laplacian(net, x),
                 lambda: jm.jacobian(two, x, m, wrt="params"), lambda: jm.jacobian(net, x, wrt=values),
                 lambda: jm.partials(net, x, [(0,), (1, 1)]), lambda: t(x),
                 lambda: jm.per_sample_grads(net, x, lambda out, yy: ((out - yy) ** 2).sum(1), y=y),
                 lambda: jm.jacobian(lambda v: v.sin() * v.roll(1), x[0], batched=False, structure="sparse")]
        try:
            want = [c() for c in calls]
            ready.set()
            while not stop.is_set():
                for c, w in zip(calls, want):
                    got = c()
                    calls_made[0] += 1
                    for u, v in zip(got if isinstance(got, tuple) else (got,), w if isinstance(w, tuple) else (w,)):
                        torch.testing.assert_close(u.to_dense() if u.is_sparse else u,
                                                   v.to_dense() if v.is_sparse else v, rtol=1e-12, atol=1e-12)
        except BaseException as err:  # noqa: BLE001 -- reported by the main thread
            errors.append(err)
        finally:
            ready.set()

    worker = threading.Thread(target=work)
    worker.start()
    ready.wait(120)
    for _ in range(300):
        jm.clear_cache()
        stop.wait(0.002)
    stop.set()
    worker.join(120)
    assert not errors, repr(errors[0])
    assert calls_made[0] > 0
