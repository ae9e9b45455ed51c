"""Pattern detection: run ``f`` once under a torch function mode that propagates index sets.

NOTE: [Detection: an eager trace with values]
``f`` runs once on the real input under a ``TorchFunctionMode``: every torch function, method and
operator it calls (``nn.Module``s call ``nn.functional``, so modules need nothing of their own) is
executed as usual and, where a differentiated tensor takes part, the rule of that operation
(``rules.py``) gives the index sets of its outputs. This sees the same operations a ``torch.fx``
graph holds, with three things fx lacks: concrete shapes (no shape propagation), any Python around
the calls (loops over ``x.shape[0]``, helper functions), and the moment a value reaches Python.
That is what decides the scope of the pattern:

* **global**: no value computed from x was read by Python (``bool``, ``item``, data-dependent
  shapes) and no index was computed from x. The operations run, and so the pattern, are then the
  same for every input of this shape and dtype; it is cached per function and signature.
* **local**: some were (value-dependent branches, ``x[x > 0]``, an ``argsort`` used as an index),
  or an operation has no rule and its own Jacobian at this input gave its pattern. Valid at this
  input; recomputed per call.
* **dense**: an operation could not be handled at all (no rule and no Jacobian of its own, a
  differentiated value read as a Python number, an in-place operation on a view): the exact
  fallback takes the nonzeros of the dense Jacobian at this input, with a ``JacmodeWarning`` (once per
  function and reason: ``_cache.warn_once``).

The second-order pass (Hessians of scalar functions) additionally carries, per tensor, the input
pairs its Hessian can touch (see ``rules.py``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from .._cache import Kind, warn_once
from .. import _threads
from .._state import preserved_state
from . import rules, sets
from .pattern import SparsityPattern
from .rules import Info, Unsupported
from .sets import Index, Rows

PAIR_CAP = 20_000_000  # Hessian pairs held at once before a pattern counts as dense
OP_JACOBIAN_CAP = 4_000_000  # entries of an unknown op's own Jacobian read for its pattern

_PATTERNS = Kind("sparsity patterns")

_R_OPS = {"radd": "add", "rsub": "sub", "rmul": "mul", "rtruediv": "rdiv", "rdiv": "rdiv",
          "rpow": "rpow", "rmatmul": "rmatmul"}
_DUNDER = {"truediv": "div", "pos": "positive", "mod": "remainder", "floordiv": "floor_divide",
           "bool": "py_bool", "int": "py_int", "float": "py_float", "index": "py_index",
           "complex": "py_complex", "array": "py_array"}
_INPLACE_CONSTANT = {"zero", "fill", "normal", "uniform", "random", "bernoulli", "exponential"}


def op_name(func: Callable) -> tuple[str, bool]:
    """The rule name of a torch function, method or operator, and whether it works in place."""
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # properties: x.T, x.mT, x.data
        name = getattr(getattr(func, "__self__", None), "__name__", "") or ""
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core in _R_OPS:
            return _R_OPS[core], False
        if core.startswith("i") and core[1:] in ("add", "sub", "mul", "truediv", "pow", "div", "matmul"):
            return _DUNDER.get(core[1:], core[1:]), True
        if core == "setitem":
            return "setitem", True
        return _DUNDER.get(core, core), False
    if name.endswith("_") and not name.startswith("_") and len(name) > 1:
        return name[:-1], True
    return name, False


class Tracer(TorchFunctionMode):
    """Carries an :class:`~jacmode._sparse.rules.Info` for every tensor that depends on x."""

    def __init__(self, n: int, second: bool, max_average: Optional[int] = None) -> None:
        super().__init__()
        self.n, self.second, self.cap = n, second, PAIR_CAP
        self.max_average = max_average  # abandon once a tensor's sets average more (structure="auto")
        self._infos: dict[int, tuple[Tensor, Info]] = {}
        self.local_reasons: list[str] = []
        self.bytes_seen = 0
        self.random = False  # a random operation ran (dropout in training mode, rand_like, ...)

    # --- bookkeeping used by the rules ---
    def get(self, t: Any) -> Optional[Info]:
        if not isinstance(t, Tensor):
            return None
        hit = self._infos.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    def check_size(self, nnz: int, numel: int) -> None:
        """Give up (an ``Unsupported``) before building sets that average over ``max_average``."""
        if self.max_average is not None and nnz > self.max_average * max(numel, 1):
            raise Unsupported(f"dense: index sets of {nnz / max(numel, 1):.0f} inputs per element")

    def put(self, t: Tensor, info: Info) -> None:
        if info.rows is not None:
            self.check_size(info.rows.nnz, t.numel())
        self._infos[id(t)] = (t, info)
        self.bytes_seen += t.numel() * t.element_size()

    def rows(self, t: Tensor) -> Rows:
        info = self.get(t)
        return info.rows if info is not None and info.rows is not None else sets.empty(t.numel())

    def pairs_of(self, t: Any) -> Optional[Index]:
        info = self.get(t)
        return rules.NO_PAIRS if info is None else info.pairs

    def local(self, reason: str) -> None:
        if reason not in self.local_reasons:
            self.local_reasons.append(reason)

    # --- the mode ---
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name, inplace = op_name(func)
        leaves = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        known = [i for i in (self.get(a) for a in leaves) if i is not None]
        if name in rules.RANDOM and (name != "dropout" or _dropout_active(args, kwargs)):
            self.random = True
        if name in rules.VALUE_READS and any(i.rows is not None for i in known):
            raise Unsupported(f"{name}() of a value computed from x (its derivative leaves the graph)")
        if name in rules.BRANCHES or name in rules.VALUE_READS:
            if any(i.tainted for i in known):
                self.local(f"{name.replace('py_', '')}() of a value computed from the input")
            if name not in rules.BRANCHES or name.startswith("py_") or name in ("equal", "allclose"):
                return func(*args, **kwargs)
        target = args[0] if inplace and args and isinstance(args[0], Tensor) else None
        if known and target is not None and target._base is not None:
            raise Unsupported(f"in-place {name} on a view (its base would not see the change)")
        out = func(*args, **kwargs)
        if not known or (name in rules.CONSTANT and not inplace):
            return out
        if inplace and name in _INPLACE_CONSTANT and target is not None:
            self.put(target, Info(None, False))
            return out
        if name == "setitem":
            rules.setitem(self, name, args, kwargs, out, func)
            return out
        floats = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_floating_point()]
        if not floats or name in rules.ZERO_DERIVATIVE or all(i.rows is None for i in known):
            tainted = any(i.tainted for i in known)
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.put(t, Info(None, tainted))
            return out
        rule = rules.RULES.get(name)
        if rule is None:
            self._own_jacobian(func, name, args, kwargs, out)
            return out
        try:
            rule(self, name, args, kwargs, out, func)
        except Unsupported:
            raise
        except Exception as err:  # noqa: BLE001 -- a call the rule does not cover: fall back, exactly
            raise Unsupported(f"{name} (its sparsity rule failed: {type(err).__name__}: {err})") from err
        return out

    def _own_jacobian(self, func: Callable, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        """No rule: read the op's pattern off its own Jacobian at this input (a local pattern)."""
        deps = rules._deps(self, args, kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.is_floating_point()]
        n_in, n_out = sum(d.numel() for d in deps), sum(o.numel() for o in outs)
        if n_in * n_out > OP_JACOBIAN_CAP:
            raise Unsupported(f"{name} (no sparsity rule, and its own Jacobian, {n_out} x {n_in}, is too large to read)")

        def g(*ts: Tensor) -> tuple[Tensor, ...]:
            swap = {id(d): t for d, t in zip(deps, ts)}
            a2, k2 = torch.utils._pytree.tree_map(lambda a: swap.get(id(a), a) if isinstance(a, Tensor) else a,
                                                  (args, kwargs))
            res = tree_flatten(func(*a2, **k2))[0]
            return tuple(r for r in res if isinstance(r, Tensor) and r.is_floating_point())

        try:
            with torch.enable_grad():
                jac = torch.autograd.functional.jacobian(g, tuple(d.detach() for d in deps))
        except Exception as err:  # noqa: BLE001 -- any failure means this op cannot be handled
            raise Unsupported(f"{name} (no sparsity rule, and its Jacobian failed: {type(err).__name__})") from err
        combined = rules._concat([self.rows(d) for d in deps])
        for k, o in enumerate(outs):
            blocks = [jac[k][j].reshape(o.numel(), d.numel()) for j, d in enumerate(deps)]
            nz = torch.cat(blocks, dim=1).ne(0).nonzero().cpu().numpy()
            rows = sets.pull(combined, nz[:, 0], nz[:, 1], o.numel(), self.n)
            pairs = sets.merge_keys([sets.pairs_within(rows, self.n, self.cap)] +
                                    [self.pairs_of(d) for d in deps]) if self.second else rules.NO_PAIRS
            self.put(o, Info(rows, True, pairs))
        self.local(f"no sparsity rule for {name}: its pattern was read off its Jacobian at this input")


def _dropout_active(args: tuple, kwargs: dict) -> bool:
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return bool(training)


def _key(f: Any, x: Tensor, second: bool) -> tuple:
    flags = tuple(m.training for m in f.modules()) if isinstance(f, torch.nn.Module) else ()
    return (tuple(x.shape), x.dtype, str(x.device), second, flags)


def detect(f: Callable[[Tensor], Tensor], x: Tensor, *, hessian: bool = False) -> SparsityPattern:
    """The Jacobian pattern of ``f`` at ``x`` (or, with ``hessian=True``, the Hessian pattern of a
    scalar ``f``); global patterns come from the cache after the first call."""
    key = _key(f, x, hessian)
    hit = _PATTERNS.get(f, key)
    if hit is not None:
        return hit
    pattern = _trace(f, x, hessian)
    if isinstance(pattern, str):
        pattern = _dense_fallback(f, x, hessian, pattern)
    elif pattern.scope == "global":
        _PATTERNS.put(f, key, pattern)
    return pattern


def _trace(f: Callable[[Tensor], Tensor], x: Tensor, hessian: bool,
           max_average: Optional[int] = None) -> Union[SparsityPattern, str]:
    """The pattern, or why there is none (a string)."""
    n = x.numel()
    xx = x.detach().clone()
    tracer = Tracer(n, hessian, max_average)
    tracer.put(xx, Info(sets.identity(n), True))
    try:
        with preserved_state(f), torch.no_grad(), tracer:
            y = f(xx)
    except Unsupported as err:
        return str(err)
    if not isinstance(y, Tensor):
        raise TypeError(f"f: expected f(x) to return one torch.Tensor, got {type(y).__name__}.")
    info = tracer.get(y)
    y_rows = info.rows if info is not None and info.rows is not None else sets.empty(y.numel())
    scope = "local" if tracer.local_reasons else "global"
    reason = "; ".join(tracer.local_reasons)
    if not hessian:
        return SparsityPattern((y.numel(), n), y_rows.ptr, y_rows.idx, tuple(x.shape), tuple(y.shape),
                               scope, False, reason, tracer.bytes_seen, tracer.random)
    pairs = info.pairs if info is not None else rules.NO_PAIRS
    if pairs is None:
        return "the Hessian pattern is dense (more pairs than the detection holds)"
    return _hessian_pattern(pairs, y_rows, n, tuple(x.shape), scope, reason, tracer.bytes_seen,
                            tracer.random)


def _hessian_pattern(pairs: Index, first: Rows, n: int, in_shape: tuple[int, ...], scope: str,
                     reason: str, pass_bytes: int, random: bool) -> SparsityPattern:
    """Symmetric pattern from pair keys, with the whole diagonal of the inputs f depends on
    (a stored zero costs nothing and keeps star colouring's diagonal recovery simple)."""
    diag = sets.unique(first.idx) if first.nnz else np.arange(0, dtype=np.int64)
    keys = sets.unique(np.concatenate([pairs, diag * n + diag, (pairs % n) * n + pairs // n]))
    r = keys // n
    crow = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=n), out=crow[1:])
    return SparsityPattern((n, n), crow, keys - r * n, in_shape, (), scope, True, reason, pass_bytes, random)


def _dense_fallback(f: Callable[[Tensor], Tensor], x: Tensor, hessian: bool, why: str) -> SparsityPattern:
    """The exact fallback: the nonzeros of the dense Jacobian (or Hessian) at this input."""
    warn_once(f,  # once per f and reason (_cache.py), though the fallback runs on every call
              f"jacmode: no sparsity pattern could be detected for f ({why}); using the nonzeros of the "
              "dense " + ("Hessian" if hessian else "Jacobian") + " at this input instead (exact here, "
              "N times the work). Write f with supported operations (see docs/sparse.md) to avoid this.")
    xx = x.detach()
    with preserved_state(f):
        if hessian:
            dense = _threads.hessian(f)(xx).reshape(x.numel(), x.numel())
            out_shape: tuple[int, ...] = ()
        else:
            jac = torch.func.jacfwd(f)(xx)
            out_shape = tuple(jac.shape[: jac.dim() - x.dim()])
            dense = jac.reshape(math.prod(out_shape), x.numel())
    nz = dense.ne(0).cpu()  # the pattern lives on the CPU
    if hessian:
        nz = nz | nz.t() | torch.eye(x.numel(), dtype=torch.bool, device="cpu")
    crow = np.zeros(nz.shape[0] + 1, dtype=np.int64)
    np.cumsum(nz.sum(1).numpy(), out=crow[1:])
    col = nz.nonzero()[:, 1].numpy().astype(np.int64)
    shape = (int(nz.shape[0]), int(nz.shape[1]))
    return SparsityPattern(shape, crow, col, tuple(x.shape), out_shape, "dense", hessian, why,
                           4 * x.numel() * x.element_size())
