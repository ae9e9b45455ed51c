"""Graph capture: trace a model once with ``torch.fx`` and keep its computation as a :class:`Program`.

The Taylor engine (``_capture/taylor.py``) runs a Program with coefficients instead of plain
tensors; every operation the input flows through must have a rule (``_rules/table.py``).

NOTE: [Capture]
``torch.fx.symbolic_trace`` records ``forward`` at the level of modules and torch functions:
built-in modules (nn.Linear, nn.Tanh, nn.Conv2d, ...) stay single nodes, custom modules are traced
through, and ``torch.tanh(x)``, ``F.tanh(x)``, ``x.tanh()`` and ``nn.Tanh()`` all reach the same
rule through the table. A plain function is traced inside a small root module that owns the
modules its closure and globals refer to, so ``lambda x: net(x)[:, :1]`` is captured too.
Nodes that do not depend on the input (parameters, constants, shapes) are evaluated plainly.
One trace serves every input shape; it is cached weakly per function and re-made when the
modules, their hooks or their training flags change, or when a tensor or Python value it took from
f's closure, globals or modules changed (see [Bound tensors] in ``bound.py``: a run reads f's
tensors where f reads them, also those ``functional_call`` swaps in). The first call for each input shape runs
the program on two samples and compares its value with ``f`` itself: a program that disagrees, or
a rule that finds its assumptions broken (the batch moved away from dimension 0, samples mixed),
rejects that shape, and those calls take the generic engine, whose plan says why.
Tracing fails on value-dependent Python branches, ``.item()`` and the like (``TraceError``):
the generic engine again, with the reason.
"""

from __future__ import annotations

import builtins
import contextlib
import operator
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.fx as fx
from torch import Tensor, nn

from .._args import Flat, traced_body
from .._cache import Kind
from .._threads import SERIAL, clone_tree
from .._rules.base import Traced
from .._state import _filled
from .._rules.table import META, lookup
from .bound import Bound, Watch, sources
from .program import Program, Ref, Step, check, reject  # noqa: F401 -- the engines' view of capture

_PROGRAMS = Kind("captured programs")


class _FnRoot(nn.Module):
    """The root module a plain function is traced in: it owns the modules the function uses."""

    def __init__(self, fn: Callable[..., Any], modules: list[nn.Module]) -> None:
        super().__init__()
        self.fn = fn
        self.used = nn.ModuleList(modules)

    def forward(self, x: Tensor) -> Any:
        return self.fn(x)


class _FlatRoot(_FnRoot):
    """The root a call of several arguments (``_args.Flat``) is traced in: its forward takes the flat
    input and the riders, so that a run reads the riders it is bound to (``Program.bind``), never the
    values seen at capture time."""

    def forward(self, z: Tensor, riders: Any) -> Any:  # type: ignore[override]
        return self.fn(z, riders)


def _used_modules(fn: Any) -> list[nn.Module]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    found = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
    glob = getattr(fn, "__globals__", {})
    found += [glob[n] for n in code.co_names if n in glob]
    return [m for m in found if isinstance(m, nn.Module)]


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _global_hooks() -> bool:
    mod = nn.modules.module
    return bool(getattr(mod, "_global_forward_hooks", None) or getattr(mod, "_global_forward_pre_hooks", None))


def program_for(f: Any) -> Union[Program, str]:
    """The captured program of ``f``, or why there is none (cached; see the note)."""
    if _global_hooks():
        return "global module hooks are registered"
    user = f.f if isinstance(f, Flat) else f
    if isinstance(user, nn.Module):
        modules = list(user.modules())
    elif callable(user) and hasattr(user, "__code__"):
        modules = [m for u in _used_modules(user) for m in u.modules()]
    else:
        return f"{type(user).__name__} is not a module or a Python function"
    hooked = next((type(m).__name__ for m in modules if _hooked(m)), None)
    if hooked is not None:
        return f"{hooked} has hooks"
    key = tuple((id(m), m.training) for m in modules)
    cached = _PROGRAMS.get(f, ("program",))
    if cached is not None and cached[0] == key and (
            isinstance(cached[1], str) or all(b.fresh() for b in cached[1].bound)):
        return cached[1]
    try:
        found: Union[Program, str] = _capture(f)
    except Exception as err:  # noqa: BLE001 -- tracing runs user code: any failure means "not traceable"
        found = f"torch.fx could not trace it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    _PROGRAMS.put(f, ("program",), (key, found))
    return found


class _Refused(Exception):
    pass


class _Tracer(fx.Tracer):
    """Traces through modules that are not submodules of the root (``nn.Flatten()(h)`` in forward),
    and through modules holding tensors that functional_call swapped in, which it keeps as
    constants (see the note in ``bound.py``).

    While it traces, torch.fx routes every ``nn.Module.__call__`` and ``__getattr__`` of the process
    through it: those of other threads (a training step on the same model) get the plain call and
    the plain attribute (see [Threads] in ``_threads.py``).
    """

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch
        self.constants: dict[int, str] = {}  # swapped tensors, by id, kept on the root under these names
        self.thread = threading.get_ident()  # the thread that traces

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self.thread:  # another thread's call: the module's own __call__
            return forward(*args, **kwargs)
        try:
            self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) and not self.watch.holds_swapped(m)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self.thread:  # another thread's attribute: the value itself
            return attr_val
        if isinstance(attr_val, Tensor) and id(attr_val) in self.watch.swapped:
            return attr_val  # not the module's own parameter: create_arg makes it a constant
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, Tensor) and id(a) in self.watch.swapped:
            name = f"_jacmode_swapped{len(self.constants)}"
            self.constants.setdefault(id(a), name)
            setattr(self.root, self.constants[id(a)], a)
            return self.create_node("get_attr", self.constants[id(a)], (), {})
        return super().create_arg(a)


_FUNCTIONS = torch.autograd.function  # Function.apply asks it _is_setup_context_defined first


@contextlib.contextmanager
def _functions_refused() -> Iterator[None]:
    """While tracing in this thread, a call of any autograd.Function's apply raises _Refused."""
    original, me = getattr(_FUNCTIONS, "_is_setup_context_defined", None), threading.get_ident()
    if original is None:  # another torch: the graph's check against f still runs
        yield
        return

    def refuse(fn: Any) -> bool:
        if threading.get_ident() == me:
            raise _Refused("forward calls an autograd.Function, whose derivatives are its own")
        return original(fn)

    _FUNCTIONS._is_setup_context_defined = refuse
    try:
        yield
    finally:
        _FUNCTIONS._is_setup_context_defined = original


def _trace(root: nn.Module, watch: Watch) -> tuple[fx.Graph, dict[str, Any]]:
    """The graph of root.forward, with the modules put back as found: tracing runs forward with
    proxies, and ``self.calls += 1`` would store one. A forward that changes a buffer, or calls an
    autograd.Function (whose derivatives are its own, not those of the ops in its forward), is refused.

    ``root`` is a clone (:func:`~jacmode._threads.clone_tree`) where f is a module; a plain function's
    root holds the user's modules, which its code calls: those are put back entry by entry, never
    emptied, since another thread may be running them (see [Threads] in ``_threads.py``). One trace
    at a time (``_threads.SERIAL``): torch.fx patches process-wide state while it runs.
    """
    with SERIAL:
        saved = [(m, dict(m.__dict__)) for m in root.modules()]
        saved_dicts: list[tuple[Any, dict]] = [(d, dict(d)) for m, _ in saved
                                               for d in (m._buffers, m._parameters, m._modules)]
        buffers = [(b, b.clone()) for b in root.buffers()]
        tracer = _Tracer(watch)
        constants: dict[str, Any] = {}
        try:
            with _functions_refused(), watch.active():
                graph = tracer.trace(root)
        finally:
            known = saved[0][1].keys() | saved_dicts[0][1].keys() | saved_dicts[1][1].keys()
            constants = {k: v for k, v in {**root.__dict__, **root._buffers, **root._parameters}.items()
                         if k not in known}
            for d, items in [*((m.__dict__, attrs) for m, attrs in saved), *saved_dicts]:
                _put_back(d, items)
            changed = [(b, old) for b, old in buffers if not torch.equal(b, old)]
            with torch.no_grad():
                for b, old in changed:
                    b.copy_(old)
    if changed:
        raise _Refused("forward updates a buffer")
    if watch.eager:
        raise _Refused(watch.eager)
    return graph, constants  # tensors the tracer stored on root (closure constants)


def _put_back(d: dict[str, Any], items: dict[str, Any]) -> None:
    """``d`` as ``items`` again, changing only the entries that differ (a reader in another thread
    never finds it empty)."""
    for k in [k for k in d if k not in items]:
        del d[k]
    for k, v in items.items():
        if d.get(k, _MISSING) is not v:
            d[k] = v


_MISSING = object()


_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow, operator.setitem}


def _in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("__")
    return node.op == "call_function" and (node.target in _IN_PLACE or "out" in node.kwargs)


def _capture(f: Any) -> Union[Program, str]:
    flat = isinstance(f, Flat)
    if flat:
        user = f.f
        root: nn.Module = _FlatRoot(traced_body(f.call), [user] if isinstance(user, nn.Module) else _used_modules(user))
    else:
        user = f
        root = f if isinstance(f, nn.Module) else _FnRoot(f, _used_modules(f))
    watch, found = Watch(), sources(user)
    own = {id(t): name for name, t in [*root.named_parameters(), *root.named_buffers()]}
    try:  # a module is traced on its clone, a function on the modules its code calls (see _trace)
        graph, constants = _trace(clone_tree(root) if root is f else root, watch)
    except _Refused as err:
        return str(err)
    if flat:
        _rejoin(graph, f.call)
    bound: list[Bound] = []
    slots: dict[fx.Node, int] = {}
    traced: set[fx.Node] = set()
    steps: list[Step] = []
    ops: list[str] = []
    output: Any = None
    riders_step = None

    def ref(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: Ref(slots[n]))  # type: ignore[arg-type, return-value]

    for node in graph.nodes:
        if node.op == "placeholder":
            if not slots:
                slots[node] = 0
                traced.add(node)
                continue
            if flat and riders_step is None:  # the riders: an input of every run (Program.bind)
                steps.append(Step(_unbound, (), {}, False, node.name))
                riders_step = len(steps) - 1
            elif not node.args:  # a second required argument
                return f"forward takes more than one tensor argument ({node.target!r})"
            else:
                steps.append(Step(lambda v=node.args[0]: v, (), {}, False, node.name))
        elif node.op == "output":
            output = ref(node.args[0])
            break
        elif node.op == "get_attr":
            value = constants.get(str(node.target))
            if isinstance(value, Tensor):  # a tensor the trace bound: where does a run read it?
                how = _binding(value, found, own, watch, root)
                if isinstance(how, str):
                    return how
                getter = how.read if isinstance(how, Bound) else how
                bound += [how] if isinstance(how, Bound) else []
            else:
                getter = _constant(value) if value is not None else _attr(root, str(node.target))
            steps.append(Step(getter, (), {}, False, node.name))
        else:
            depends = any(a in traced for a in node.all_input_nodes)
            target, what = _target(root, node)
            if _in_place(node):
                return f"{what} works in place"

            rule = lookup(target, node) if depends else None
            if depends and rule is None:
                return f"no rule for {what}"
            if rule is not None and rule is not META:
                traced.add(node)
                ops.append(what)
            if node.kwargs.get("inplace") and any(len(a.users) > 1 for a in node.all_input_nodes):
                return f"{what} works in place on a tensor used elsewhere"
            fn = _plain(root, node) if rule is None else rule
            if rule is META:
                fn = _meta(node)
            module_first = node.op == "call_module" and rule is not None and rule is not META
            args = ((root.get_submodule(str(node.target)),) if module_first else ()) + tuple(ref(node.args))
            steps.append(Step(fn, args, dict(ref(node.kwargs)), rule is not None and rule is not META, node.name))
        slots[node] = len(steps)
    if isinstance(root, _FnRoot):  # traced: the program never calls it, and it must not keep f alive
        del root.fn
    return Program(steps=steps, output=output, ops=sorted(set(ops)), bound=bound,
                   riders_step=riders_step)


def _rejoin(graph: fx.Graph, call: Any) -> None:
    """``torch.cat([x, t], 1)`` of the differentiated arguments of a call, in argnums order and whole, is
    the flat input itself: the program skips slicing it apart and joining it again (the PINN's
    ``u(x, t) = net(torch.cat([x, t], 1))`` runs the program of ``net``)."""
    nodes = list(graph.nodes)
    if not nodes or nodes[0].op != "placeholder" or len(call.diff) < 2:
        return
    z, width = nodes[0], call.diff[-1].lo + call.diff[-1].size
    for node in nodes:
        if node.op != "call_function" or node.target not in (torch.cat, torch.concat) or node.kwargs.get("out") is not None:
            continue
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim not in (1, -1) or not isinstance(parts, (list, tuple)) or not parts:
            continue
        spans = [_column_slice(p, z) for p in parts]
        if any(sp is None for sp in spans) or spans[0][0] != 0 or spans[-1][1] != width:  # type: ignore[index]
            continue
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):  # type: ignore[index]
            node.replace_all_uses_with(z)
            for dead in [node, *parts]:  # the join, then the slices nothing else reads
                if not dead.users:
                    graph.erase_node(dead)


def _column_slice(node: Any, z: fx.Node) -> Optional[tuple[int, int]]:
    """(lo, hi) when ``node`` is ``z[:, lo:hi]``, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not operator.getitem:
        return None
    if node.args[0] is not z or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2:
        return None
    rows, cols = node.args[1]
    if rows != slice(None) or not isinstance(cols, slice) or cols.step not in (None, 1):
        return None
    if not isinstance(cols.start, int) or not isinstance(cols.stop, int):
        return None
    return cols.start, cols.stop


def _unbound() -> Any:
    raise RuntimeError("jacmode internal error: the captured program of a call with riders ran without "
                       "them (Program.bind was not called; report this)")


def _binding(value: Tensor, found: dict[int, Any], own: dict[int, str], watch: Watch,
             root: nn.Module) -> Union[Bound, Callable[[], Any], str]:
    """How a run reads a constant tensor of the trace (see the note in ``bound.py``), or why it cannot."""
    if id(value) in found:
        read, where = found[id(value)]
        return Bound(read, where, value)
    if id(value) in own:  # functional_call given the module's own tensor
        return _attr(root, own[id(value)])
    if id(value) in watch.pure:
        return _constant(value)
    what = "a tensor functional_call swapped in" if id(value) in watch.swapped else "a tensor"
    return (f"forward uses {what} (shape {tuple(value.shape)}) that jacmode cannot read again on each call: "
            "not the module's own, not made inside forward, not found in f's closure, globals or defaults")


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def _attr(root: nn.Module, path: str) -> Callable[[], Any]:
    getter = operator.attrgetter(path)
    if isinstance(root, _FnRoot):  # only the program holds it
        return lambda: getter(root)
    anchor = weakref.ref(root)  # f itself: the cache is weak in f
    return lambda: getter(anchor())


def _target(root: nn.Module, node: fx.Node) -> tuple[Any, str]:
    if node.op == "call_module":
        m = root.get_submodule(str(node.target))
        return type(m), f"nn.{type(m).__name__}" if type(m).__module__.startswith("torch.nn") else type(m).__name__
    if node.op == "call_method":
        return ("method", node.target), f"Tensor.{node.target}"
    t = node.target
    mod = getattr(t, "__module__", None) or ""
    name = getattr(t, "__name__", repr(t))
    prefix = {"torch.nn.functional": "F.", "torch._C._nn": "F.", "_operator": "operator.", "builtins": ""}.get(mod, "torch." if "torch" in mod else "")
    return t, f"{prefix}{name}"


def _plain(root: nn.Module, node: fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        return root.get_submodule(str(node.target))
    if node.op == "call_method":
        name = str(node.target)
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    return node.target  # type: ignore[return-value]


def _meta(node: fx.Node) -> Callable[..., Any]:
    """Shapes, ranks, dtypes of a traced tensor: read from its value."""

    def value(a: Any) -> Any:
        return a.value if isinstance(a, Traced) else a

    if node.op == "call_method":
        name = str(node.target)
        return lambda x, *a, **k: getattr(value(x), name)(*a, **k)
    fn = node.target
    if fn is builtins.getattr:
        return lambda x, attr: getattr(value(x), attr)
    return lambda *a, **k: fn(*(value(v) for v in a), **k)  # type: ignore[operator]
