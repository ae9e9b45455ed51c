"""Function transforms: an entry point and its options bound to f once, then called many times.

NOTE: [Transforms and eager calls]
``jm.transform(jm.jacobian, f, wrt="params")`` validates the options once and returns a
:class:`Transformed`; calling it with f's input runs the entry point. Its first call per input
signature profiles f (``_profile.py``); later ones look the profile up and run the engine. The
eager calls (``jm.jacobian(f, x, ...)``) are thin wrappers over the same object: :func:`eager`
keeps one :class:`Transformed` per function (weakly) and set of options, so both forms share one
path and one profile. This is torch.func's convention (``jacrev(f)(x)``), with jacmode's options.

Each entry point registers a :class:`Spec` (how to validate its options without x, and how to run
it on a call); the entry points without a profiled path get a generic one that binds their
options against their signature and calls them.

``compile=True`` (or a backend name) plugs in at one place, :meth:`Transformed._runner`: the
Taylor-mode operators then run inside ``_capture.codegen.generated(backend)``, which turns each
captured program into straight-line code and compiles it (see that module's note); the other
entry points run eagerly and say so with one ``JacmodeWarning`` per transform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Hashable, Optional, Union

from torch import Tensor

from . import _checks, _guard
from ._cache import Field
from ._guard import held, memo, peek
from ._errors import JacmodeWarning, user_stacklevel
from ._operands import check_dims
from ._profile import freeze as _freeze, token as _token

Run = Callable[["Transformed", Any, Tensor, dict[str, Any]], Any]  # (transform, f, x, data) -> result


@dataclass(frozen=True)
class Spec:
    """How an entry point runs as a transform.

    Attributes:
        name: the entry point's name.
        prepare: options (a dict of the entry point's keyword options) -> the validated state that
            ``run`` reads; raises the entry point's usual errors for bad options.
        run: ``(transform, f, x, data)`` -> the entry point's result, where ``data`` holds the
            per-call arguments named in ``data``; it reads the validated options as
            ``transform.state`` and names its profiles with ``transform.token``.
        data: per-call arguments of the entry point other than x (``out``, ``y``, ``x2``): given
            by keyword to the transform's call, or (with ``positional``) positionally after x.
        module: f must be an ``nn.Module`` (keyword arguments for f are then not supported yet).
    """

    name: str
    prepare: Callable[[dict[str, Any]], Any]
    run: Run
    data: tuple[str, ...] = ()
    module: bool = False
    positional: bool = True
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # the options' defaults (for the token)


_SPECS: dict[Any, Optional[Spec]] = {}  # the transformable entry points (register)
_FRONT = ("argnums", "in_dims", "has_aux")
# the entry points whose engine is Taylor mode over a captured program: compile=True runs their
# generated code (_capture/codegen.py) through torch.compile
_GENERATED = ("jacobian", "derivative", "partial", "partials", "hessian", "laplacian", "divergence", "operator",
              "biharmonic")


def register(op: Callable[..., Any], spec: Optional[Spec] = None) -> None:
    """Make ``op`` (a public entry point) transformable with ``spec`` (None: the generic spec, made
    from its signature on first use, unless it has one already)."""
    _SPECS[op] = spec if spec is not None else _SPECS.get(op)


_DATA = {"per_sample_grads": ("y",), "ggn": ("y",), "ntk": ("x2",), "operator": ("directions",)}
_PRODUCTS = ("per_sample_grads", "ggn", "ntk")


def _generic_spec(op: Callable[..., Any]) -> Spec:
    """A spec for an entry point without a profiled transform of its own: validate the options
    (those that need no input), then call the entry point (which uses the profiles inside)."""
    sig = inspect.signature(op)
    name = op.__name__
    data = _DATA.get(name, ())

    def prepare(options: dict[str, Any]) -> dict[str, Any]:
        clash = [k for k in options if k in data]
        if clash:
            raise TypeError(f"transform({name}, f, ...): {clash[0]!r} is given per call, not as an option: "
                            f"call the transform as t(x, {clash[0]}=...).")
        try:
            sig.bind(None, None, **options)
        except TypeError as err:
            raise _option_error(name, sig, options, err) from None
        _validate(name, sig, options)
        return options

    def run(t: Transformed, f: Any, x: Tensor, data: dict[str, Any]) -> Any:
        return op(f, x, **t.state, **data)

    return Spec(name, prepare, run, data=data, module=name in _PRODUCTS)


def _validate(name: str, sig: inspect.Signature, options: dict[str, Any]) -> None:
    """The checks of ``name``'s options that need no input, with the entry point's own errors."""

    given = {**{k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty},
             **options}
    if name in _PRODUCTS:
        _checks.check_product_options(wrt=given.get("wrt", "params"), chunk_size=given.get("chunk_size"),
                                      max_memory=given.get("max_memory"), flatten=given.get("flatten", True))
        if name == "per_sample_grads":
            _checks.check_loss(given["loss"])
        return
    if given.get("structure") != "sparse":
        _checks.check_options(wrt="inputs", mode="forward", batched=True, structure=given.get("structure", "auto"),
                              chunk_size=given.get("chunk_size"), create_graph=given.get("create_graph", False),
                              flatten=True)
    for required in {"partial": ("dims",), "partials": ("dims",), "operator": ("terms",)}.get(name, ()):
        if given.get(required) is None:  # None by default: the one-argument calls may give it positionally
            raise TypeError(f"transform({name}, f, ...): missing option {required!r}, which {name} requires; give "
                            f"it by keyword, e.g. transform({name}, f, {required}=...).")
    if name == "derivative":
        order = given["order"]
        if isinstance(order, bool) or not isinstance(order, int):
            raise TypeError(f"order: expected a positive int, got {type(order).__name__} ({order!r}).")
        if order < 1:
            raise ValueError(f"order: expected a positive int, got {order}. Use 1 for dy/dt, 2 for d2y/dt2, ...")
    if name == "partial":
        check_dims(given["dims"], 1 << 62)
    if name == "partials":
        dims = given["dims"]
        if not isinstance(dims, (list, tuple)) or not dims or any(isinstance(d, int) for d in dims):
            raise TypeError(f"dims: expected a list of coordinate tuples, one per partial, e.g. [(0,), (1, 1)] "
                            f"for u_t and u_xx, got {dims!r}.")
        for d in dims:
            check_dims(d, 1 << 62)


def _option_error(name: str, sig: inspect.Signature, options: dict[str, Any], err: TypeError) -> TypeError:
    params = list(sig.parameters.values())[2:]
    known = [p.name for p in params]
    unknown = [k for k in options if k not in known]
    if unknown:
        return TypeError(f"transform({name}, f, ...): unknown option {unknown[0]!r}; {name} takes "
                         f"{', '.join(known)}. Check the spelling (options are {name}'s keyword arguments).")
    missing = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in options]
    if missing:
        return TypeError(f"transform({name}, f, ...): missing option {missing[0]!r}, which {name} requires; "
                         f"give it by keyword, e.g. transform({name}, f, {missing[0]}=...).")
    return TypeError(f"transform({name}, f, ...): {err}")


def _spec(op: Any) -> Spec:
    spec = _SPECS.get(op)
    if spec is not None:
        return spec
    if op not in _SPECS:
        names = ", ".join(sorted(o.__name__ for o in _SPECS))
        raise TypeError(f"op: expected one of jacmode's entry points ({names}), got "
                        f"{getattr(op, '__name__', type(op).__name__)!r}. Pass the function itself, "
                        "e.g. jm.transform(jm.jacobian, f, wrt='params').")
    spec = _SPECS[op] = _generic_spec(op)
    return spec


class Transformed:
    """An entry point bound to a function and its options; call it with f's input.

    Built by :func:`transform` (or :func:`jacfn`). Calling it with ``x`` (and the entry point's
    per-call data, e.g. ``out=`` for jacobian, ``y`` for per_sample_grads) runs the entry point,
    exactly as the eager call with the same options would; other keyword arguments are passed to
    f. The first call per input signature profiles f; later calls only run the engine.

    Attributes:
        op: the entry point's name. f: the function. options: the options given.
        compile: whether ``compile=True`` was asked (see the note in ``_transform.py``).
    """

    def __init__(self, spec: Spec, f: Any, options: dict[str, Any], compile: Union[bool, str], strong: bool = True,
                 op: Optional[Callable[..., Any]] = None) -> None:
        self._spec = spec
        self._op = op
        # the options of the several-arguments front (_args/): a call with them goes through the
        # entry point's front, which describes the call as a flat function and comes back here
        self._front = {k: options[k] for k in _FRONT if k in options}
        options = {k: v for k, v in options.items() if k not in _FRONT}
        self.state = spec.prepare(dict(options))
        # the options with the entry point's defaults filled in: the eager call (which passes every
        # option) and jm.transform with the same options share one token, so one profile
        self.token, self._frozen = _token(spec.name, {**spec.defaults, **options})
        self.options = dict(options)
        self.compile = compile
        self.op = spec.name
        self._f: Any = f if strong else None
        self._run = self._runner()

    @property
    def f(self) -> Any:
        return self._f

    def _runner(self) -> Run:
        run = self._spec.run
        if not self.compile:
            return run
        # ---- compile: the Taylor-mode operators run generated code, compiled (_capture/codegen.py) ----
        if self.op not in _GENERATED:
            warnings.warn(f"jacmode: transform({self.op}, ..., compile={self.compile!r}): {self.op} has no generated "
                          "code in this build (only the Taylor-mode operators: "
                          f"{', '.join(_GENERATED)}); it runs eagerly, with the same results.", JacmodeWarning,
                          stacklevel=user_stacklevel())
            return run
        from ._capture import codegen

        backend = "inductor" if self.compile is True else str(self.compile)

        def compiled_run(t: "Transformed", f: Any, x: Tensor, data: dict[str, Any]) -> Any:
            with codegen.generated(backend):
                return run(t, f, x, data)

        self._backend = backend
        return compiled_run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        f, spec = self._f, self._spec
        fkwargs = {k: v for k, v in kwargs.items() if k not in spec.data} if kwargs else kwargs
        return _guard.scoped_call(f, args[:1] if spec.positional else args, fkwargs,
                                  lambda: self.call(f, args, kwargs))

    def _generated(self) -> ContextManager[None]:
        backend = getattr(self, "_backend", None)
        if backend is None:
            return contextlib.nullcontext()
        from ._capture import codegen

        return codegen.generated(backend)

    def call(self, f: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the entry point on ``f`` (the eager wrappers pass f, which they hold weakly)."""
        spec = self._spec
        if not args:
            raise TypeError(f"{self.op}: the transformed function takes f's input x as its first argument, got none.")
        data: dict[str, Any] = {}
        if len(args) > 1:
            if spec.positional and len(args) - 1 > len(spec.data):
                raise TypeError(
                    f"{self.op}: the transformed function takes one input x"
                    f"{' and ' + ', '.join(spec.data) if spec.data and spec.positional else ''}, got {len(args)} positional "
                    "arguments. Pass the other arguments of f by keyword, or through a closure.")
            if spec.positional:
                data.update(zip(spec.data, args[1:]))
        if kwargs:
            for name in spec.data:
                if name in kwargs:
                    data[name] = kwargs.pop(name)
        if self._front or kwargs or (len(args) > 1 and not spec.positional):
            if self._op is None:  # pragma: no cover -- every transform is made with its entry point
                raise TypeError(f"{self.op}: several arguments need the entry point; use jm.transform(op, f, ...).")
            pos = args if not spec.positional else args[:1]
            with self._generated():
                return self._op(f, *pos, **({"kwargs": kwargs} if kwargs else {}), **self._front, **self.options,
                                **data)
        return self._run(self, f, args[0], data)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        name = getattr(self._f, "__name__", type(self._f).__name__)
        return f"transform({self.op}, {name}{', ' if opts else ''}{opts}{', compile=True' if self.compile else ''})"


def transform(op: Callable[..., Any], f: Any, *, compile: Union[bool, str] = False, **options: Any) -> Transformed:
    """Bind a jacmode entry point and its options to ``f``; the result is called with f's input.

    The options are the entry point's keyword options, validated here once (positional
    parameters such as partial's ``dims`` or derivative's ``order`` are given by keyword too).
    The first call per input signature (shapes, dtypes, devices, the model's flags, parameters
    and hooks) profiles f; later calls look the profile up and run only the engine, so a training
    loop pays the planning once. Keyword arguments of the call named like the entry point's
    per-call data (``out`` for jacobian, ``y`` for per_sample_grads and ggn, ``x2`` for ntk) go
    to it, the others to f.

    Args:
        op: one of jacmode's entry points (``jm.jacobian``, ``jm.partials``, ``jm.laplacian``,
            ``jm.per_sample_grads``, ...).
        f: the function or ``nn.Module`` to differentiate.
        compile: True (Inductor) or a ``torch.compile`` backend name: the Taylor-mode operators
            (derivative, partial(s), hessian, laplacian, divergence, operator, biharmonic) run
            their generated code compiled (the first call per input signature compiles: seconds
            with Inductor); shapes or dtypes that change compile again, and a compilation that fails
            falls back to the uncompiled code with a ``JacmodeWarning``. Other entry points run
            eagerly, with a ``JacmodeWarning`` when the transform is made.
        options: the entry point's keyword options, e.g. ``wrt="params"``, ``argnums=(0, 1)`` or
            ``dims=[(0,), (1, 1)]``.

    Returns:
        A :class:`Transformed`: ``t(x)`` returns what ``op(f, x, **options)`` returns.

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> jac = jm.transform(jm.jacobian, net, wrt="params")
        >>> x = torch.randn(4, 3)
        >>> jac(x).shape                                  # (B, Y, P)
        torch.Size([4, 2, 50])
        >>> torch.equal(jac(x), jm.jacobian(net, x, wrt="params"))
        True
        >>> u_t, u_xx = jm.transform(jm.partials, net, dims=[(0,), (1, 1)])(x)
        >>> u_t.shape
        torch.Size([4, 2])
    """
    spec = _spec(op)
    if not isinstance(compile, (bool, str)) or compile in ("", "yes", "no", "true", "false"):
        raise TypeError(f"compile: expected True, False or a torch.compile backend name such as 'inductor' or "
                        f"'aot_eager', got {type(compile).__name__} ({compile!r}).")
    _checks.check_function(f)
    return Transformed(spec, f, options, compile, op=op)


# f -> {frozen options: the Transformed of its eager calls} (Memo.eager)
_EAGER = Field("eager", "eager calls' transforms")
_EAGER_PER_FUNCTION = 32


def eager(op: Callable[..., Any], f: Any, options: dict[str, Any]) -> Transformed:
    """The :class:`Transformed` an eager call runs (one per function, weakly, and set of options).

    It holds f weakly (the eager call passes f to :meth:`Transformed.call`); the options are
    validated when it is made, so a repeated call validates only its input.
    """
    spec = _spec(op)
    values = tuple(options.values())  # the front passes every option, always in the same order
    frozen: Optional[Hashable] = (spec.name, values, tuple(map(type, values)))  # types: 1 is not True
    try:
        hash(frozen)
    except TypeError:  # a list of parameter names, say
        try:
            frozen = (spec.name, _freeze(options))
        except TypeError:
            frozen = None
    if frozen is not None:
        hit = _EAGER.get(f)
        if hit is not None:
            t = hit.get(frozen)
            if t is not None:
                return t
    _checks.check_function(f)
    t = Transformed(spec, None, options, False, strong=False, op=op)
    if frozen is not None:
        kept = memo(f)
        if kept is None:  # f cannot be weakly referenced
            return t
        entries = kept.eager
        if len(entries) >= _EAGER_PER_FUNCTION:
            entries.pop(next(iter(entries)))
        entries[frozen] = t
    return t


def eager_hit(op: Callable[..., Any], f: Any, values: tuple[Any, ...],
              types: Optional[tuple[type, ...]] = None) -> Optional[Transformed]:
    """The :class:`Transformed` of an earlier eager call of ``op`` on ``f`` with these option
    values (all of them, in the entry point's order, as :func:`eager` is given them), or None:
    the repeated call's look-up, without building the options' dict (``types``: the values'
    types, when the caller has them)."""
    scope = held(f)  # f's Memo as the call's guard read it (no second look-up), else the table's
    m = scope.memo if scope is not None else peek(f)
    if m is None:  # no eager call yet
        return None
    try:
        return m.eager.get((_spec(op).name, values, tuple(map(type, values)) if types is None else types))
    except TypeError:  # f cannot be weakly referenced, or an unhashable option (a list of names)
        return None
