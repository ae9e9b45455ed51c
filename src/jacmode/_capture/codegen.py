"""Generated code for the Taylor engine: a captured program and its algebra as one straight-line graph.

NOTE: [Generated code]
The Taylor engine (``taylor.py``) interprets a captured :class:`~jacmode._capture.capture.Program`
step by step: per step it resolves arguments, dispatches to a rule, and the rule loops over the
coefficients of its algebra in Python. For one operator (``partials`` with its multisets,
``laplacian`` with its directions, ...) and one signature (input shape, dtype, device, grad mode,
the shapes of the tensors the program reads) that work is the same on every call, so
:func:`run` traces it once with ``make_fx`` (fake tensors: no numbers are computed and none can be
baked in; a rule that would branch on a value fails the trace, and the interpreter serves) into a
``torch.fx.GraphModule`` of aten operations, which later calls run directly.

Inputs of the generated code, read afresh on every call, exactly where the interpreter reads them:

* z, the flat input;
* the tensors of the program's reading steps (``get_attr``: parameters of traced-through modules,
  tensors bound to f's closure, globals or defaults, see [Bound tensors] in ``bound.py``);
* the parameters and buffers of the leaf modules whose rules read them (``nn.Linear.weight``), and
  of modules the program calls plainly (on values that do not depend on the input), put into
  structural clones of those modules for the trace (``_threads.clone_tree``: the user's modules
  never hold a fake tensor, see [Threads] in ``_threads.py``).

A reading step that yields anything but a tensor or a Python scalar (a container of tensors) keeps
the call on the interpreter.

So an optimizer step, ``W = W - lr * g`` on a closure tensor, or ``functional_call`` are followed,
and ``create_graph=True`` records autograd through the generated aten ops as through the rules'
torch ops. Anything else that would change the program (a bound tensor of another shape, a changed
Python value or module) re-captures the program (``capture.program_for``) and with it the code.

The graph is traced with grad mode on (the interpreter's in-place reuse of dead coefficients,
``Program.run``, decides from storage reference counts, which a trace cannot see), then
``rewrites.py`` folds its constants (the seeds), folds directions shared by all samples into the
next weight and sums a Laplacian's last-layer squares block by block (its notes), and
:func:`fuse` rewrites it: dead code goes, ``a + b * c`` as ``addcmul``, ``a * b + c * d`` keeps one temporary less,
and, for code that runs without grad, elementwise results overwrite an operand that no later
operation reads (in place where safe: same shape and dtype, not an input, not a view).

Code is generated on the third call of a signature (``AFTER_CALLS``: the first calls keep today's
cost; a training loop makes thousands), or on the first one inside :func:`generated`, which also
compiles it (:func:`jacmode._capture.compiled.compiled`). Generating costs about one interpreted
call plus 0.1-0.3 s of tracing for the networks of the benchmarks, and once per process the
import of torch's fake-tensor machinery (3-6 s on the loaded 2-core machine).
Not while a torch function or dispatch mode of the caller's is active (a default-device context,
``with torch.device(...)`` or ``torch.set_default_device``, excepted: its devices are in the code's
key, :func:`modes`), under torch.func transforms, in inference mode, or while Dynamo traces
(``traceable.py`` serves those calls).
``ENABLED`` is the internal switch the tests flip to compare both paths.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
import sys
from typing import Any, Callable, Collection, Iterator, Literal, Optional, Union

import torch
import torch.fx as fx
from torch import Tensor, nn

from .._threads import SERIAL, clone_tree
from .._transforms import in_transform
from . import bindings, rewrites
from .bound import Source, _getter
from . import taylor as _taylor
from .._rules import linear as _linear
from .program import Program, Step

try:  # the mode behind ``with torch.device(...)`` and ``torch.set_default_device``
    from torch.utils._device import DeviceContext as _DeviceContext
except ImportError:  # pragma: no cover - another torch: such contexts interpret
    _DeviceContext = None  # type: ignore[assignment,misc]

ENABLED = True  # internal switch: False runs the interpreter always (tests compare the two)
AFTER_CALLS = 3  # generate on this call of a signature (1: the first); see the note on first calls
MAX_SIGNATURES = 16  # generated versions kept per program; further signatures are interpreted

@contextlib.contextmanager
def switched_off(module: Any) -> Iterator[None]:
    """Inside the block ``module.ENABLED`` (an internal switch: this one, ``generated.py``'s) is False."""
    old, module.ENABLED = module.ENABLED, False
    try:
        yield
    finally:
        module.ENABLED = old


def disabled() -> contextlib.AbstractContextManager[None]:
    """Inside the block Taylor-path calls always interpret (tests compare the two paths)."""
    return switched_off(sys.modules[__name__])


_MODE: contextvars.ContextVar[Optional[dict[str, Any]]] = contextvars.ContextVar("jacmode_codegen", default=None)


@contextlib.contextmanager
def generated(backend: Optional[str] = None, **compile_kwargs: Any) -> Iterator[None]:
    """Inside the block, Taylor-path calls run generated code from their first call, compiled with
    ``torch.compile(backend=backend, dynamic=False, **compile_kwargs)`` when a backend is given.

    The entry point of the function transforms (``compile=True``): ``with generated("inductor"):
    jm.partials(net, x, ...)``. Calls that take the generic torch.func engines are unaffected.
    """
    token = _MODE.set({"backend": backend, "kwargs": compile_kwargs})
    try:
        yield
    finally:
        _MODE.reset(token)


@dataclasses.dataclass
class _Layout:
    """Where the program reads its tensors: reading steps, and (module, kind, name) of leaf modules."""

    steps: list[int]
    modules: list[tuple[nn.Module, list[tuple[nn.Module, str, str]]]]  # leaf, [(owner, "p"/"b", name)]

    scalars: list[tuple[nn.Module, list[str]]] = dataclasses.field(default_factory=list)

    def settings(self) -> tuple:
        """The scalar attributes of the leaf modules, which their rules read at run time and the
        generated code has frozen (``negative_slope``, ``eps``, ``stride``), and how many
        attributes each module has (one added or removed is a change too)."""
        getters = self.__dict__.get("_getters")
        if getters is None:
            getters = self.__dict__["_getters"] = [(m, _getter(names)) for m, names in self.scalars]
        try:  # every call of generated code reads them: one C call per module
            return tuple([(len(m.__dict__), *get(m.__dict__)) for m, get in getters])
        except KeyError:  # an attribute that is no longer there
            out = []
            for m, names in self.scalars:
                d = m.__dict__
                out.append((len(d), *(d.get(k, _GONE) for k in names)))
            return tuple(out)

    def emit_settings(self, expected: tuple, emit: Callable[[str], None], const: Callable[[Any], str],
                      fail: str) -> None:
        """Emit straight-line Python that runs ``fail`` unless :meth:`settings` equals ``expected``
        (each value identical or ``==``, as a tuple compares; an attribute that is gone raises
        KeyError, which the generated code's ``except`` turns into ``fail``): see ``bound.Source``."""
        for (m, keys), want in zip(self.scalars, expected):
            conds = [f"len(d) != {want[0]}"] + [
                f"(d[{const(k)}] is not {const(v)} and d[{const(k)}] != {const(v)})" for k, v in zip(keys, want[1:])]
            emit(f"d = {const(m)}.__dict__")
            emit(f"if {' or '.join(conds)}: {fail}")

    def read(self, program: Program) -> tuple[list[Any], list[Tensor]]:
        values = [program.steps[i].fn() for i in self.steps]
        tensors = [v for v in values if isinstance(v, Tensor)]
        for _, slots in self.modules:
            for owner, kind, name in slots:
                t = (owner._parameters if kind == "p" else owner._buffers)[name]
                if t is not None:
                    tensors.append(t)
        return values, tensors


def _layout(program: Program) -> _Layout:
    found = program.__dict__.get("_codegen_layout")
    if found is None:
        steps = [i for i, s in enumerate(program.steps) if not s.traced and not s.args and not s.kwargs]
        leaves: dict[int, nn.Module] = {}
        for s in program.steps:  # a rule's module (its first argument), or a module called plainly
            for m in (s.args[0] if s.traced and s.args else None, s.fn):
                if isinstance(m, nn.Module):
                    leaves.setdefault(id(m), m)
        modules = [(m, [(owner, kind, name) for owner in m.modules()
                        for kind, d in (("p", owner._parameters), ("b", owner._buffers)) for name in d])
                   for m in leaves.values()]
        scalars = [(m, [k for k, v in m.__dict__.items() if _scalar(v)]) for m, _ in modules]
        found = program.__dict__["_codegen_layout"] = _Layout(steps, modules, scalars)
    return found


_SCALARS = (bool, int, float, complex, str, type(None))
_GONE = object()  # an attribute that is no longer there


def _scalar(v: Any) -> bool:
    return type(v) in _SCALARS or (type(v) is tuple and all(type(e) in _SCALARS for e in v))


def _frozen(a: Any) -> Any:
    """A hashable key of an engine argument (a range is one already: equal and hashed by value)."""
    if type(a) is range or type(a) is int:
        return a
    if isinstance(a, (list, tuple)):
        return tuple(_frozen(v) for v in a)
    return a


def modes() -> Any:
    """The caller's torch function and dispatch modes, as generated code sees them: None, none is
    active; a tuple of devices, default-device contexts alone (``with torch.device(...)``,
    ``torch.set_default_device``), under which code runs as it was traced for the same devices (so
    they are part of its key); True, another mode (a flop counter, a tracer), under which the
    interpreter runs as the user expects and a trace could not."""
    try:
        if torch._C._len_torch_dispatch_stack():
            return True
        if not torch._C._is_torch_function_mode_enabled():
            return None
        stack = torch.overrides._get_current_function_mode_stack()
    except AttributeError:  # another torch
        return True
    if _DeviceContext is None or not stack or any(type(m) is not _DeviceContext for m in stack):
        return True
    return tuple(getattr(m, "device", None) for m in stack)


def _meta(t: Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)  # torch.Size: a tuple


def run(name: str, program: Program, z: Tensor, in_shape: tuple[int, ...], *args: Any) -> Tensor:
    """``taylor.<name>(program, z, in_shape, *args)``, from generated code where it applies."""
    interpret: Callable[..., Tensor] = getattr(_taylor, name)
    active = modes()
    if (not ENABLED or torch.compiler.is_dynamo_compiling() or in_transform() or torch.is_inference_mode_enabled()
            or z.layout != torch.strided or active is True):
        return interpret(program, z, in_shape, *args)
    mode = _MODE.get()
    layout = _layout(program)
    values, tensors = layout.read(program)
    if not all(isinstance(v, Tensor) or _scalar(v) for v in values):  # tensors in a container: not followed
        return interpret(program, z, in_shape, *args)
    grad = torch.is_grad_enabled()
    backend = None if mode is None else mode["backend"]
    key = (name, _frozen(args), in_shape, _meta(z), grad, backend, tuple(_meta(t) for t in tensors),
           tuple(v if _scalar(v) else type(v) for v in values), layout.settings(), active)
    table: dict[tuple, Any] = program.__dict__.setdefault("_codegen", {})
    entry = table.get(key)
    if entry is None and len(table) >= MAX_SIGNATURES:
        return interpret(program, z, in_shape, *args)
    if entry is None or isinstance(entry, int):
        calls = (entry or 0) + 1
        if calls < (1 if mode is not None else AFTER_CALLS):
            table[key] = calls
            return interpret(program, z, in_shape, *args)
        entry = table[key] = _generate(name, program, layout, values, tensors, z, in_shape, args, grad, mode)
    if isinstance(entry, str):  # could not be generated: why, and the interpreter serves
        return interpret(program, z, in_shape, *args)
    return entry(z, *tensors)


class Ready:
    """The generated code of one call of :func:`run`, with everything its key read, so that a later
    call of the same engine function and arguments (a profile hit of the derivative operators,
    ``_operands.evaluate``) runs it without building and hashing that key again.

    ``ready(z)`` checks what :func:`run`'s key holds, by comparison with the values it was made
    with: the conditions of generated code (switch, compiling, modes; torch.func transforms,
    inference mode and z's layout are in the caller's profile key),
    the backend, grad mode, z's shape, strides, dtype, device and ``requires_grad``, the program's
    tensors read afresh (each one's metadata) and Python values, and the leaf modules' scalar
    settings; it returns the code's result, or None where anything differs (the caller then takes
    :func:`run`, which finds or generates the code of the new key).
    """

    __slots__ = ("program", "layout", "code", "z_meta", "grad", "backend", "metas", "values", "same", "strides",
                 "slots", "modes", "fast")

    def __init__(self, program: Program, layout: _Layout, code: Callable[..., Tensor], z_meta: tuple, grad: bool,
                 backend: Optional[str], metas: tuple, values: tuple, settings: tuple,
                 same: Optional[tuple[Tensor, ...]] = None, active: Any = None) -> None:
        self.program, self.layout, self.code, self.modes = program, layout, code, active
        self.z_meta, self.grad, self.backend, self.metas = z_meta, grad, backend, metas
        self.values = (values, settings)
        # the tensors, where the caller vouches for all but their strides while they are these objects
        self.same, self.strides = same, tuple(m[1] for m in metas)
        # where they are all the leaf modules' (no reading steps) and no slot is empty: the dicts and
        # names they are read from (a slot emptied or filled is another object there)
        slots = [(owner._parameters if kind == "p" else owner._buffers, name)
                 for _, slots in layout.modules for owner, kind, name in slots]
        self.slots = None if same is None or layout.steps or len(slots) != len(same) else slots
        self.fast = None if self.slots is None else self._fast()

    def __call__(self, z: Tensor) -> Optional[Tensor]:
        """The code's result for z, or None where a check fails. The caller holds in its own key
        what this call does not check again: torch.func transforms, inference mode, z's layout."""
        fast = self.fast
        return self.checked(z) if fast is None else fast(z)

    def _fast(self) -> Callable[[Tensor], Optional[Tensor]]:
        """:meth:`checked` for code that reads only the vouched tensors of the leaf modules, as
        straight-line code with the values it compares with inlined (a repeated call of
        ``partials`` or ``laplacian`` makes this test every time); where a slot holds another
        tensor than the vouched one, :meth:`checked` decides."""
        src = Source("run(z)", _cg=sys.modules[__name__], _compiling=torch.compiler.is_dynamo_compiling,
                     _grad=torch.is_grad_enabled, _MODE=_MODE, _code=self.code, _checked=self.checked)
        emit, const = src.emit, src.const
        shape, stride, dtype, device, requires_grad = self.z_meta
        same_modes = "_cg.modes() is not None" if self.modes is None else f"_cg.modes() != {const(self.modes)}"
        emit(f"if not _cg.ENABLED or _compiling() or {same_modes} or _grad() is not {self.grad}: return None")
        emit("mode = _MODE.get()")
        emit(f"if (None if mode is None else mode['backend']) != {const(self.backend)}: return None")
        emit(f"if z.shape != {const(shape)} or z.stride() != {const(stride)} or z.dtype is not {const(dtype)} or "
             f"z.requires_grad is not {requires_grad} or {src.off('z', device)}: return None")
        names = [f"t{i}" for i in range(len(self.slots or ()))]
        for t, (d, k) in zip(names, self.slots or ()):
            emit(f"{t} = {const(d)}[{const(k)}]")
        if names:
            emit(f"if {' or '.join(f'{t} is not {const(v)}' for t, v in zip(names, self.same or ()))}: "
                 "return _checked(z)")
            emit(f"if {' or '.join(f'{t}.stride() != {const(st)}' for t, st in zip(names, self.strides))}: return None")
        self.layout.emit_settings(self.values[1], emit, const, "return None")
        emit(f"return _code(z{''.join(', ' + t for t in names)})")
        return src.function("KeyError", "return None  # a slot or an attribute that is gone",
                            "<jacmode generated code check>")

    def checked(self, z: Tensor) -> Optional[Tensor]:
        """:meth:`__call__`, checked by the general code (any reading steps and tensors)."""
        if not ENABLED or torch.compiler.is_dynamo_compiling() or modes() != self.modes or torch.is_grad_enabled() is not self.grad:
            return None
        mode = _MODE.get()
        if (None if mode is None else mode["backend"]) != self.backend or _meta(z) != self.z_meta:
            return None
        layout = self.layout
        slots, same = self.slots, self.same
        if slots is not None:  # the vouched tensors of the leaf modules, read where layout.read reads them
            try:
                found: list[Any] = [d[k] for d, k in slots]
            except KeyError:
                return None
            if not all(map(operator.is_, found, same)):  # type: ignore[arg-type]
                found = layout.read(self.program)[1]  # another tensor (or None): all their metadata
                if tuple(map(_meta, found)) != self.metas:
                    return None
            elif tuple([t.stride() for t in found]) != self.strides:
                return None
            if layout.settings() != self.values[1]:  # no reading steps: no values
                return None
            return self.code(z, *found)
        values, tensors = layout.read(self.program)
        if same is not None and len(tensors) == len(same) and all(map(operator.is_, tensors, same)):
            if tuple([t.stride() for t in tensors]) != self.strides:
                return None
        elif tuple(map(_meta, tensors)) != self.metas:
            return None
        if (tuple(v if _scalar(v) else type(v) for v in values), layout.settings()) != self.values:
            return None
        return self.code(z, *tensors)


def ready(name: str, program: Program, z: Tensor, in_shape: tuple[int, ...], *args: Any,
          vouched: Collection[int] = ()) -> Union[Ready, None, Literal[False]]:
    """The :class:`Ready` code of ``run(name, program, z, in_shape, *args)`` as called now, where
    that call would run generated code already made (eager, not compiled: a compiled call keeps
    :func:`run`); None where it would not (yet); False where the program is interpreted for good
    at this key (the code could not be generated, too many signatures, values in containers).

    ``vouched``: ids of tensors whose shape, dtype, device and ``requires_grad`` the caller checks
    before every call of the result for as long as they are the same objects (a profile's
    parameters, whose key holds them): where the program reads only such tensors, the result
    compares their identity and strides instead of all their metadata."""
    active = modes()
    if (not ENABLED or torch.compiler.is_dynamo_compiling() or in_transform() or torch.is_inference_mode_enabled()
            or z.layout != torch.strided or active is True or _MODE.get() is not None):
        return None
    layout = _layout(program)
    values, tensors = layout.read(program)
    if not all(isinstance(v, Tensor) or _scalar(v) for v in values):
        return False
    grad = torch.is_grad_enabled()
    metas = tuple(_meta(t) for t in tensors)
    scalars = tuple(v if _scalar(v) else type(v) for v in values)
    settings = layout.settings()
    key = (name, _frozen(args), in_shape, _meta(z), grad, None, metas, scalars, settings, active)
    table = program.__dict__.get("_codegen", {})
    entry = table.get(key)
    if isinstance(entry, str) or (entry is None and len(table) >= MAX_SIGNATURES):
        return False
    if not callable(entry):
        return None
    same = tuple(tensors) if tensors and all(id(t) in vouched for t in tensors) else None
    return Ready(program, layout, entry, _meta(z), grad, None, metas, scalars, settings, same, active)


def _generate(name: str, program: Program, layout: _Layout, values: list[Any], tensors: list[Tensor], z: Tensor,
              in_shape: tuple[int, ...], args: tuple, grad: bool, mode: Optional[dict[str, Any]]) -> Any:
    """The generated code of one signature, or the reason it could not be made."""
    from torch.fx.experimental.proxy_tensor import make_fx

    interpret: Callable[..., Tensor] = getattr(_taylor, name)
    tensor_steps = [i for i, v in zip(layout.steps, values) if isinstance(v, Tensor)]
    n_steps = len(tensor_steps)

    def traced(zz: Tensor, *tensors: Tensor) -> Tensor:
        steps = list(program.steps)
        for i, t in zip(tensor_steps, tensors[:n_steps]):
            steps[i] = Step(_constant(t), (), {}, False, steps[i].name)
        # the leaf modules' tensors (fake here) go into clones of those modules, which the copy of
        # the program calls: the user's modules never hold them (see [Threads] in _threads.py)
        clones: dict[int, nn.Module] = {}
        rest = iter(tensors[n_steps:])
        for m, slots in layout.modules:
            clone_tree(m, clones)
            for owner, kind, attr in slots:
                if (owner._parameters if kind == "p" else owner._buffers)[attr] is not None:
                    mine = clones[id(owner)]
                    (mine._parameters if kind == "p" else mine._buffers)[attr] = next(rest)  # type: ignore[assignment]
        for i, s in enumerate(steps):
            if s.traced and s.args and isinstance(s.args[0], nn.Module) and id(s.args[0]) in clones:
                steps[i] = dataclasses.replace(s, args=(clones[id(s.args[0])], *s.args[1:]))
            elif isinstance(s.fn, nn.Module) and id(s.fn) in clones:
                steps[i] = dataclasses.replace(s, fn=clones[id(s.fn)])
        return interpret(dataclasses.replace(program, steps=steps, checked={}), zz, in_shape, *args)

    try:  # one trace at a time in the process (see [Threads] in _threads.py)
        with SERIAL, torch.enable_grad():  # see the note: no in-place reuse decided from reference counts
            token = _linear.TRACED_GRAD.set(grad)  # the rules choose their products for the run's grad mode
            try:
                gm = make_fx(traced, tracing_mode="fake")(z.detach(), *(t.detach() for t in tensors))
            finally:
                _linear.TRACED_GRAD.reset(token)
    except Exception as err:  # noqa: BLE001 -- a rule that branches on values, an op fake tensors lack
        return f"make_fx could not trace the program ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"
    rewrites.constants(gm)
    gm = rewrites.constant_directions(gm, compiled=mode is not None and mode["backend"] is not None,
                                      in_place=not grad) or gm
    if mode is not None and mode["backend"] == "inductor" and not grad:
        rewrites.fast_tanh(gm)  # see [Tanh in compiled code] in rewrites.py
    fuse(gm, in_place=not grad)
    if mode is not None and mode["backend"] is not None:
        from .compiled import compiled, options

        return compiled(gm, mode["backend"], **options(mode["backend"], z.device, mode["kwargs"]))
    return bindings.fast(gm, [z, *tensors]).forward  # not through nn.Module.__call__


def _constant(t: Tensor) -> Callable[[], Tensor]:
    return lambda: t


_aten = torch.ops.aten
_ELEMENTWISE = {_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor, _aten.neg.default,
                _aten.tanh.default, _aten.sigmoid.default, _aten.tanh_backward.default,
                _aten.sigmoid_backward.default, _aten.addcmul.default, _aten.exp.default, _aten.sin.default,
                _aten.cos.default, _aten.reciprocal.default, _aten.square.default if hasattr(_aten, "square") else None,
                _aten.pow.Tensor_Scalar, _aten.relu.default, _aten.silu.default}
_IN_PLACE = {_aten.add.Tensor: _aten.add_.Tensor, _aten.sub.Tensor: _aten.sub_.Tensor,
             _aten.mul.Tensor: _aten.mul_.Tensor, _aten.div.Tensor: _aten.div_.Tensor,
             _aten.addcmul.default: _aten.addcmul_.default, _aten.tanh.default: _aten.tanh_.default,
             _aten.neg.default: _aten.neg_.default}
_IN_PLACE_OPS = frozenset(_IN_PLACE.values())


_val = rewrites._val  # the example value traced for a node, when a tensor


def _dtype(n: Any) -> Optional[torch.dtype]:
    v = _val(n)
    return None if v is None else v.dtype


def fuse(gm: fx.GraphModule, in_place: bool) -> None:
    """Fewer passes over memory (see the note): ``addcmul`` for ``a + b * c`` and, without grad,
    elementwise results written into a dead operand of the same shape and dtype."""
    graph = gm.graph
    rewrites.dead_code(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.add.Tensor or node.kwargs:
            continue
        a, b = node.args[:2]
        for acc, prod in ((a, b), (b, a)):
            if (isinstance(prod, fx.Node) and prod.target is _aten.mul.Tensor and len(prod.users) == 1
                    and not prod.kwargs and all(isinstance(v, fx.Node) for v in prod.args)
                    and isinstance(acc, fx.Node) and _same(_val(acc), _val(node))
                    and all(_dtype(v) == _dtype(node) for v in prod.args)):
                with graph.inserting_before(node):
                    new = graph.call_function(_aten.addcmul.default, (acc, *prod.args))
                new.meta = dict(node.meta)
                node.replace_all_uses_with(new)
                graph.erase_node(node)
                graph.erase_node(prod)
                break
    if in_place:
        _overwrite_dead(graph)
    graph.lint()
    gm.recompile()


def _same(a: Optional[Tensor], b: Optional[Tensor]) -> bool:
    return (a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous())


def _overwrite_dead(graph: fx.Graph) -> None:
    """Elementwise ops whose first operand dies there, is a fresh (non-view, non-input) tensor of the
    result's shape and dtype: run in place on it."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    fresh = {n for n in graph.nodes if n.op == "call_function" and _fresh_op(n)}
    for node in list(graph.nodes):
        target = _IN_PLACE.get(node.target) if node.op == "call_function" else None
        if target is None or node.kwargs or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        first = node.args[0]
        if first not in fresh or len(first.users) != 1 or not _same(_val(first), _val(node)):
            continue
        if any(isinstance(a, fx.Node) and a is first for a in node.args[1:]):
            continue
        if any(order[u] > order[node] for u in first.users if u is not node):
            continue
        node.target = target
        fresh.add(node)
        # the result aliases its operand: nothing reads the operand afterwards (single user)


_VIEWS = {"view", "reshape", "expand", "permute", "transpose", "t", "slice", "select", "unsqueeze", "squeeze",
          "as_strided", "alias", "_unsafe_view", "unfold", "diagonal", "detach", "split", "unbind", "chunk"}


def _fresh_op(n: fx.Node) -> bool:
    """The op makes a new tensor of its own (not a view of another, not an input)."""
    target = n.target
    name = getattr(getattr(target, "overloadpacket", None), "__name__", "")
    if name in _VIEWS or target is operator.getitem:
        return False
    return target in _ELEMENTWISE or target in _IN_PLACE_OPS or name in ("mm", "addmm", "bmm", "clone")
