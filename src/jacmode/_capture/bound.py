"""The tensors a captured graph uses besides its input, and where a run reads each of them.

NOTE: [Bound tensors]
A trace sees f's tensors as they are at capture time. The module's own parameters and buffers are
read from the module on every run (``get_attr``), as before. Every other tensor that torch.fx
stores as a constant is classified once, when the graph is captured:

* found in f's closure, its globals or its defaults, directly or inside dicts, lists and tuples,
  or in those of a user function or module forward reached that way (:func:`sources`): a :class:`Bound` tensor, read again from there on every run. So
  ``W = W - lr * g`` between calls, a dict whose entries are replaced, or the parameters that
  ``torch.func.grad`` hands to ``lambda p: jm.laplacian(lambda x: functional_call(net, p, (x,)), x)``
  are the tensors the program differentiates. A bound tensor whose shape, dtype or device changed,
  or that is no longer there, makes the capture stale (:meth:`Bound.fresh`): f is traced again.
* made inside f from Python values alone (``torch.ones(3)``, ``torch.tensor(2.0)``): a constant.
* anything else (a tensor reached through an object, or computed eagerly from a tensor of f's,
  ``W.T`` or a branch on ``W.norm()``, whose value the trace would freeze): the capture is refused
  and the generic engine differentiates f as it runs; the plan gives the reason.

Python values are frozen into the graph as they were when it was traced (``torch.tanh(nu * x)``,
``if self.alt is None``, ``self.act = torch.tanh``): a program is found again only under the
generation of f's state it was captured in (``_guard.py``: TorchDynamo's guards over everything f
read), so a changed value means a fresh capture.

``functional_call`` (torch.func's and torch.nn.utils.stateless's both enter torch's
``_reparametrize_module``) swaps its tensors into the module while the trace runs. :class:`Watch`
sees it: the modules holding swapped tensors are traced through (``F.linear(x, weight, bias)``
rather than one ``nn.Linear`` node whose rule would read the module's own weight at run time), and
each swapped tensor is a constant classified as above, so it is bound to the dict it came from.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import types
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor
from torch.nn.utils import stateless
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

Reader = Callable[[], Any]
_DEPTH = 3  # containers inside containers searched for f's tensors
_MAX_TENSORS = 4096  # a closure holding a data set is not searched further
_MAX_FUNCTIONS = 256  # user functions (helpers, module forwards) searched for f's tensors
_LIBRARIES = {"torch", "numpy", "jacmode", "builtins", "functools", "operator", "math", "typing"}
_META = {"shape", "ndim", "dtype", "device", "layout", "requires_grad", "is_leaf", "is_cuda", "names",
         "dim", "size", "numel", "nelement", "element_size", "stride", "is_floating_point", "is_complex",
         "is_contiguous", "__len__", "__hash__", "__format__", "__repr__", "__get__"}
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
           "bernoulli", "multinomial", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout",
           "dropout1d", "dropout2d", "dropout3d", "uniform_", "normal_", "bernoulli_", "exponential_",
           "geometric_", "cauchy_", "log_normal_", "random_", "rrelu"}


class Bound:
    """A tensor of f's that a run reads from where f reads it (see the note)."""

    __slots__ = ("read", "where", "meta")

    def __init__(self, read: Reader, where: str, value: Tensor) -> None:
        self.read, self.where, self.meta = read, where, _meta(value)

    def fresh(self) -> bool:
        """Whether the tensor is still there, with the shape, dtype and device it was traced with."""
        try:
            value = self.read()
        except Exception:  # noqa: BLE001 -- a key or a cell that is gone: capture again
            return False
        return isinstance(value, Tensor) and _meta(value) == self.meta


class Source:
    """A check generated as straight-line Python for repeated calls (``_profile``'s key and guard
    checks, ``_probes/generated._Hot``, ``codegen.Ready``): ``const(v)`` names the value v in the
    code's namespace, ``emit(line)`` adds a line to the body of ``def <signature>: try: ...``, and
    :meth:`function` closes the ``try`` with ``except <caught>: <fail>`` and compiles it."""

    def __init__(self, signature: str, **names: Any) -> None:
        self.name = signature.split("(")[0]
        self.ns: dict[str, Any] = dict(names)
        self.lines = [f"def {signature}:", " try:"]

    def const(self, v: Any) -> str:
        name = f"c{len(self.ns)}"
        self.ns[name] = v
        return name

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

    def off(self, t: str, device: Any) -> str:
        """The test ``t.device != device``, without making a device object where it is the CPU."""
        return f"not {t}.is_cpu" if device.type == "cpu" else f"{t}.device != {self.const(device)}"

    def function(self, caught: str, fail: str, filename: str) -> Callable[..., Any]:
        lines = [*self.lines, f" except {caught}:", f"  {fail}"]
        exec(compile("\n".join(lines), filename, "exec"), self.ns)
        return self.ns[self.name]  # type: ignore[no-any-return]


def _getter(names: list[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """``d -> tuple(d[k] for k in names)`` (KeyError where one is missing), as one ``itemgetter``."""
    if len(names) >= 2:  # an itemgetter of two names or more gives a tuple
        return operator.itemgetter(*names)
    return lambda d: tuple([d[k] for k in names])


def _meta(t: Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device)


def sources(f: Any) -> dict[int, tuple[Reader, str]]:
    """What f reaches through its closure, globals and defaults: each tensor's id -> (reader, where).

    For a module, the ``forward`` of every user-defined module class in it is searched; a user
    function found on the way (a helper in a dict of ops, a module in a closure) is searched too,
    once each, so a tensor that a helper's globals hold is read again like f's own.
    """
    found: dict[int, tuple[Reader, str]] = {}
    seen: set[int] = set()
    if isinstance(f, torch.nn.Module):
        _module(found, f, type(f).__name__, _DEPTH, seen)
    else:
        _function(found, getattr(f, "__func__", f), "f", _DEPTH, seen)  # a bound method's function
    return found


def _library(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "builtins").split(".")[0] in _LIBRARIES


def _function(found: dict[int, tuple[Reader, str]], fn: Any, where: str, depth: int,
              seen: set[int]) -> None:
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen or len(seen) >= _MAX_FUNCTIONS or _library(fn):
        return
    seen.add(id(fn))
    prefix = "" if where == "f" else f"{where}: "
    cells = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, cells):
        _walk(found, _cell_reader(cell), prefix + name, depth, seen)
    glob = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in glob:
            _walk(found, _key_reader(_value(glob), name), prefix + name, depth, seen)
    for i, _ in enumerate(getattr(fn, "__defaults__", None) or ()):
        _walk(found, _key_reader(_field(fn, "__defaults__"), i), f"{prefix}default {i}", depth, seen)
    for name in getattr(fn, "__kwdefaults__", None) or {}:
        _walk(found, _key_reader(_field(fn, "__kwdefaults__"), name), f"{prefix}default {name}",
              depth, seen)


def _module(found: dict[int, tuple[Reader, str]], module: torch.nn.Module, where: str,
            depth: int, seen: set[int]) -> None:
    """The forward of every user-defined module class in ``module`` (library modules read their own state)."""
    for m in module.modules():
        cls = type(m)
        if not _library(cls):
            _function(found, getattr(cls, "forward", None), f"{cls.__name__}.forward", depth, seen)


def _value(v: Any) -> Reader:
    return lambda: v


def _field(obj: Any, name: str) -> Reader:
    return lambda: getattr(obj, name)


def _cell_reader(cell: Any) -> Reader:
    return lambda: cell.cell_contents


def _key_reader(parent: Reader, key: Any) -> Reader:
    return lambda: parent()[key]


def _walk(found: dict[int, tuple[Reader, str]], read: Reader, where: str, depth: int,
          seen: set[int]) -> None:
    try:
        value = read()
    except Exception:  # noqa: BLE001 -- an empty cell
        return
    if isinstance(value, Tensor):
        found.setdefault(id(value), (read, where))
    elif isinstance(value, types.FunctionType):
        _function(found, value, where, depth, seen)
    elif isinstance(value, torch.nn.Module) and id(value) not in seen:
        seen.add(id(value))
        _module(found, value, where, depth, seen)
    elif depth > 0 and len(found) < _MAX_TENSORS and type(value) in (dict, list, tuple):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, _ in list(items)[:_MAX_TENSORS]:
            _walk(found, _key_reader(read, key), f"{where}[{key!r}]", depth - 1, seen)


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name


class Watch(TorchFunctionMode):
    """While a trace runs in this thread: the tensors it made (``pure``), the tensors functional_call
    swapped in (``swapped``) and the first eager use of any other tensor (``eager``); see the note."""

    def __init__(self) -> None:
        super().__init__()
        self.pure: dict[int, Tensor] = {}
        self.swapped: dict[int, Tensor] = {}
        self.eager = ""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, torch.fx.Proxy) for a in leaves) or _name(func) in _META:
            return out  # an operation of the graph, or a shape query
        outside = [a for a in leaves if isinstance(a, Tensor) and id(a) not in self.pure]
        if outside and not self.eager:
            self.eager = (f"forward computes {_name(func) or func} eagerly from a tensor it does not take as "
                          f"input (shape {tuple(outside[0].shape)}); the trace would freeze its value")
        if not outside and _name(func) not in _RANDOM:
            self.pure.update((id(t), t) for t in tree_leaves(out) if isinstance(t, Tensor))
        return out

    def holds_swapped(self, module: torch.nn.Module) -> bool:
        """Whether functional_call has swapped a tensor into ``module`` itself."""
        return any(id(t) in self.swapped for d in (module._parameters, module._buffers) for t in d.values())

    @contextlib.contextmanager
    def active(self) -> Iterator["Watch"]:
        original, me = stateless._reparametrize_module, threading.get_ident()

        @contextlib.contextmanager
        def reparametrize(module: torch.nn.Module, parameters_and_buffers: dict, *a: Any, **k: Any) -> Iterator[None]:
            if threading.get_ident() == me:
                self.swapped.update((id(t), t) for t in tree_leaves(parameters_and_buffers) if isinstance(t, Tensor))
            with original(module, parameters_and_buffers, *a, **k):
                yield

        stateless._reparametrize_module = reparametrize  # type: ignore[assignment]
        try:
            with self:
                yield self
        finally:
            stateless._reparametrize_module = original  # type: ignore[assignment]
