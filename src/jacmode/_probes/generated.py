"""Generated code for the probe engine: a parameter Jacobian's record, pull-back and write as one graph.

NOTE: [Generated probe code]
For a model, a selection of parameters and one signature (input shape, dtype and device, the
result's layout, the parameters' and buffers' shapes), the probe engine does the same work on
every call: hooks record each covered module's inputs, one reverse pass pulls the Y output
directions back to the probes, and the rules write the blocks into views of the (B, Y, P)
result (``layerwise.fill``). At B = 2 on problem 1's class that Python (module calls, hooks,
autograd's graph, views and narrows) costs three times the kernels. :func:`fill` therefore traces
the whole step once with ``make_fx`` (fake tensors: no value is computed or baked in; a forward
that branches on values fails the trace) into a ``torch.fx.GraphModule`` of aten operations that
later calls run directly, without grad.

Inputs of the graph, read afresh on every call: x, ``out=`` when the call has one (the graph then
writes into it; otherwise it allocates the result), and every parameter and buffer of the model,
put into a structural clone of the model for the trace (``_threads.clone_tree``: the user's modules
never hold a fake tensor, see [Threads] in ``_threads.py``). The graph applies only while it
describes the model exactly:

* the model is a captured program (``capture.program_for``): its ``forward`` is straight-line code,
  and the Python values it read from its closure, globals and modules are guarded; a recapture (a
  value changed) is a new program and generates anew. The leaf modules' scalar attributes
  (``negative_slope``, ``eps``, ``stride``), which fx does not see, are part of the key;
* the trace holds no tensor it did not receive as an input (a tensor from a closure or a global
  would be frozen): such a graph is refused;
* on the call that generates it, the graph's result is compared with the interpreted engine's;
  a mismatch refuses the signature.

NOTE: [Generated code on the profile]
A repeated call whose profile matched (``_jacobian._again``: the key walked the module tree, its
flags and hooks, every parameter's identity, flag, dtype, shape and device, the buffers' dtypes,
shapes and devices, the input's signature and the grad, inference and transform modes) passes
the profile's ``runs`` (``_profile.Profile``). Its last generated code is then checked only on what that key does not
hold: the strides and storage offsets of x, ``out`` and every parameter and buffer (re-read from
their modules: a buffer may be a new tensor), the leaf modules' scalar attributes, the backend,
and the tensors the program binds (Python values are the generation's, ``_guard.py``); the look-up of the program and the full
key (about 30 microseconds at B = 2) is skipped. Anything else falls to the full look-up.

Passes: the probes (``out + zeros_like(out)``) are dropped, subgraphs that read no input (the
identity seeds, ``eye``) are computed once, and dead nodes are removed. Code is generated on the
third call of a signature (``codegen.AFTER_CALLS``) where the result is at most
``MAX_RESULT_BYTES`` (the Python it saves matters only beside short kernels), or on the first inside
``codegen.generated(backend)``, which also compiles it: with Inductor straight from the graph
(``torch._inductor.compile``; at B = 2 Dynamo's guards on every call would cost more than the
kernels, and the key above is the guard). Not under a torch.func transform, inference
mode, Dynamo, a caller's torch function or dispatch mode (a default-device context excepted:
``codegen.modes``, in the key), or with grad enabled
(``create_graph``): the interpreted engine serves those calls, as it serves any refused one.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import Tensor, nn

from .._autodiff.reverse import per_sample_rows
from .._capture import bindings, codegen, rewrites
from .._threads import SERIAL, clone_tree
from .._capture.bound import Source
from .._transforms import in_transform
from . import layerwise
from .probes import Coverage
from .._capture.capture import program_for

if TYPE_CHECKING:
    from .._planning.plan import Plan
    from .._problem import Problem

ENABLED = True  # internal switch: False always interprets (tests compare the two)
MAX_SIGNATURES = 16
# Uncompiled code is generated only for results of at most this size: it saves the Python around
# the kernels (about 0.1 ms a call), which matters where the kernels are short; generating costs
# three runs of the step and a comparison (seconds for the 325 MB result of problem 1's class at
# B = 512, whose step takes 0.25 s; at B = 2 the step is 0.2 ms and its Python most of it).
MAX_RESULT_BYTES = 16 << 20

Entry = Union[int, str, Callable[..., Tensor]]  # calls so far, why not, or the generated code


def jacobian(model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage, out: Optional[Tensor],
             dtype: torch.dtype, device: torch.device, shape: tuple[int, int, int], repeat: bool,
             runs: Optional[dict[Any, Any]] = None) -> Optional[Tensor]:
    """The (B, Y, P) Jacobian of ``dtype`` on ``device`` (in ``out`` when given) from generated
    code, or None when it does not apply (see the note). Every selected parameter must be covered
    (the caller fills nothing else).

    ``runs``: the ``runs`` of the call's profile (``_profile.Profile``, given by ``_jacobian._again``
    only where the profile's key was checked for this call); see [Generated code on the profile].
    """
    if torch.is_grad_enabled() or cov.uncovered or not _applies(x, out):
        return None
    mode = codegen._MODE.get()
    if mode is None and shape[0] * shape[1] * shape[2] * dtype.itemsize > MAX_RESULT_BYTES:
        return None
    hot = None if runs is None else runs.get("probe_code")
    if hot is not None:
        found = hot.run(x, out)
        if found is not None:
            return found

    program = program_for(model)
    if isinstance(program, str):
        return None
    owners = program.__dict__.get("_probe_owners")
    if owners is None:  # the module tree is the program's (a new tree is a new program); not the
        # model itself, which the program's cache holds weakly
        owners = program.__dict__["_probe_owners"] = [
            (f"{prefix}.", m) for prefix, m in model.named_modules(remove_duplicate=False) if prefix]
    slots = [(prefix + n, t) for prefix, m in (("", model), *owners) for d in (m._parameters, m._buffers)
             for n, t in d.items() if t is not None]
    backend = None if mode is None else mode["backend"]
    active = codegen.modes()  # a default-device context's devices, or None (_applies refused the others)
    key = (tuple(n for n, _ in named), _meta(x), None if out is None else _meta(out), shape, dtype, device,
           repeat, backend, tuple((n, _meta(t)) for n, t in slots), codegen._layout(program).settings(), active)
    table: dict[tuple, Entry] = program.__dict__.setdefault("_probe_codegen", {})
    entry = table.get(key)
    if entry is None and len(table) >= MAX_SIGNATURES:
        return None
    tensors = [t for _, t in slots]
    if entry is None or isinstance(entry, int):
        calls = (entry or 0) + 1
        if calls < (1 if mode is not None else codegen.AFTER_CALLS):
            table[key] = calls
            return None
        result = out if out is not None else torch.empty(shape, dtype=dtype, device=device)
        layerwise.fill(model, x, named, cov, result, repeat=repeat)  # the interpreted engine: this call's answer
        table[key] = _generate(model, x, named, cov, out, dtype, device, shape, slots, mode, result)
        return result
    if isinstance(entry, str):
        return None
    if runs is not None:  # what the profile's key does not hold (see the note)
        refs = [(d, n) for _, m in (("", model), *owners) for d in (m._parameters, m._buffers)
                for n, t in d.items() if t is not None]  # slots' order
        runs["probe_code"] = _Hot(program, refs, codegen._layout(program), x, out, backend, tensors, entry, active)
    return entry(x, *tensors) if out is None else entry(x, out, *tensors)


def _placed(t: Tensor) -> tuple:
    return (t.stride(), t.storage_offset())


class _Hot:
    """A profile's last generated code, with what the profile's key does not hold of its call
    (see [Generated code on the profile]): the strides and storage offsets of x, ``out`` and the
    model's tensors (read from their modules), the buffers' requires_grad, the backend, the leaf
    modules' scalar attributes and the tensors the program binds. :meth:`run` is generated once per code:
    those checks and the call as straight-line Python (:func:`_hot_run`)."""

    __slots__ = ("guards", "refs", "layout", "x", "out", "backend", "tensors", "settings", "modes", "code", "run")

    def __init__(self, program: Any, refs: list[tuple[dict[str, Any], str]], layout: Any, x: Tensor,
                 out: Optional[Tensor], backend: Any, tensors: list[Tensor], code: Callable[..., Tensor],
                 modes: Any = None) -> None:
        self.guards = tuple(program.bound)  # the program's own, fixed (a recapture is a new program)
        self.refs, self.layout, self.backend, self.code = refs, layout, backend, code
        self.x, self.out = _placed(x), None if out is None else _placed(out)
        self.tensors = [(t.stride(), t.storage_offset(), t.requires_grad) for t in tensors]
        self.settings, self.modes = layout.settings(), modes  # the code's key's (codegen.modes)
        self.run: Callable[[Tensor, Optional[Tensor]], Optional[Tensor]] = _hot_run(self)


def _hot_run(hot: _Hot) -> Callable[[Tensor, Optional[Tensor]], Optional[Tensor]]:
    """``run(x, out)``: the code on ``x`` (into ``out``), or None where anything it froze changed:
    the backend; the strides and storage offsets of x, ``out`` and each tensor, read where the code
    reads it, and its requires_grad; each leaf module's number of attributes and scalar settings
    (as ``codegen._Layout.settings``: equal); the tensors the program binds, by their ``fresh``
    (Python values it froze are the generation's: ``_guard.py``)."""
    src = Source("run(x, out)", _MODE=codegen._MODE, _code=hot.code, _modes=codegen.modes)
    emit, const = src.emit, src.const
    emit("if _modes() is not None: return None" if hot.modes is None else f"if _modes() != {const(hot.modes)}: return None")
    emit("mode = _MODE.get()")
    emit(f"if (None if mode is None else mode['backend']) != {const(hot.backend)}: return None")
    emit(f"if x.stride() != {const(hot.x[0])} or x.storage_offset() != {hot.x[1]}: return None")
    if hot.out is None:
        emit("if out is not None: return None")
    else:
        emit(f"if out is None or out.stride() != {const(hot.out[0])} or out.storage_offset() != {hot.out[1]}: "
             "return None")
    names = []
    for i, ((d, n), (stride, offset, grad)) in enumerate(zip(hot.refs, hot.tensors)):
        emit(f"t{i} = {const(d)}[{const(n)}]")
        emit(f"if t{i}.stride() != {const(stride)} or t{i}.storage_offset() != {offset} or t{i}.requires_grad "
             f"is not {grad}: return None")
        names.append(f"t{i}")
    hot.layout.emit_settings(hot.settings, emit, const, "return None")
    for g in hot.guards:  # the tensors it binds still there, as traced (Python values: the generation)
        emit(f"if not {const(g)}.fresh(): return None")
    emit(f"return _code({', '.join(['x', *([] if hot.out is None else ['out']), *names])})")
    return src.function("KeyError", "return None  # an attribute or a slot that is gone", "<jacmode probe code check>")


def _applies(x: Tensor, out: Optional[Tensor]) -> bool:
    return (ENABLED and codegen.ENABLED and not torch.compiler.is_dynamo_compiling() and not in_transform()
            and not torch.is_inference_mode_enabled() and codegen.modes() is not True and x.layout == torch.strided
            and (out is None or out.layout == torch.strided))


def rerun(hot: "_Hot", x: Tensor, out: Optional[Tensor]) -> Optional[Tensor]:
    """The profile's last generated code on ``x`` (into ``out``), for a call whose profile matched
    and that runs nothing else: no guard of the model is needed (the code reads x and the model's
    tensors, and changes neither), grad is off within. None where the code does not apply.

    Of :func:`jacobian`'s conditions the profile's key holds the torch.func transforms, inference
    mode and the layouts of x and ``out`` (the code was made where they allowed it); the rest are
    checked here."""
    if not (ENABLED and codegen.ENABLED) or torch.compiler.is_dynamo_compiling():
        return None
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return hot.run(x, out)
    finally:
        torch._C._set_grad_enabled(grad)


def _meta(t: Tensor) -> tuple:
    return (*codegen._meta(t), t.storage_offset())


def _generate(model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage, out: Optional[Tensor],
              dtype: torch.dtype, device: torch.device, shape: tuple[int, int, int], slots: list[tuple[str, Tensor]],
              mode: Optional[dict[str, Any]], want: Tensor) -> Entry:
    """The graph of one signature, checked against ``want`` (the interpreted engine's result), or why there is none.

    Without ``out`` the graph allocates its result (``code(x, *tensors)``); with it, it writes into
    it (``code(x, out, *tensors)``).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    names = [n for n, _ in slots]
    selected = {n for n, _ in named}

    def write(xx: Tensor, res: Tensor, tensors: tuple[Tensor, ...]) -> Tensor:
        # the trace's fake tensors go into a clone of the model, whose modules the coverage is
        # mapped to: the user's modules never hold them (see [Threads] in _threads.py)
        clones: dict[int, nn.Module] = {}
        mine = clone_tree(model, clones)
        swap = dict(zip(names, tensors))
        for name, t in swap.items():
            owner, _, attr = name.rpartition(".")
            m = mine.get_submodule(owner)
            (m._parameters if attr in m._parameters else m._buffers)[attr] = t  # type: ignore[assignment]
        held = Coverage({n: (clones[id(m)], a) for n, (m, a) in cov.covered.items()}, cov.uncovered,
                        {clones[id(m)]: r for m, r in cov.rules.items()},
                        {n: swap[n] for n in cov.tensors if n in swap and n in selected})
        with torch.enable_grad():
            layerwise.fill(mine, xx, named, held, res, repeat=False)  # no fixed cost to save in a graph
        return res

    def into(xx: Tensor, res: Tensor, *tensors: Tensor) -> Tensor:
        return write(xx, res, tensors)

    def fresh(xx: Tensor, *tensors: Tensor) -> Tensor:
        return write(xx, torch.empty(shape, dtype=dtype, device=device), tensors)

    tensors = [t.detach() for _, t in slots]
    inputs = [x.detach(), *([] if out is None else [out]), *tensors]
    try:
        with SERIAL:  # one trace at a time in the process (see [Threads] in _threads.py)
            gm = make_fx(fresh if out is None else into, tracing_mode="fake")(*inputs)
    except Exception as err:  # noqa: BLE001 -- a forward that branches on values, an op fake tensors lack
        return f"make_fx could not trace the probe engine ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''})"
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return "the trace holds a tensor that is not an input (a closure or global tensor would be frozen)"
    _drop_probes(gm.graph)
    _fold_constants(gm)
    _shared_bmm(gm.graph)
    _collapse_views(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    check_inputs = inputs if out is None else [inputs[0], torch.empty_like(out), *tensors]
    if mode is not None and mode["backend"] is not None:
        code = _compiled(gm, inputs, mode["backend"], mode["kwargs"], out is None)
    else:  # not through nn.Module.__call__ (a few microseconds a call), with torch's bindings
        code = bindings.fast(gm, check_inputs).forward
    try:
        check = code(*check_inputs)
    except Exception as err:  # noqa: BLE001 -- the generated code is only an optimisation
        return f"the generated probe code failed ({type(err).__name__})"
    tol = 1e-5 if want.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-12
    if check.shape != want.shape or not _close(check, want, tol):
        return "the generated probe code disagrees with the interpreted engine"
    return code


def _close(got: Tensor, want: Tensor, tol: float) -> bool:
    """``torch.allclose(got, want, tol, tol * max(1, max|want|))`` a few samples at a time: the
    comparison's temporaries of a large result stay in cache instead of being fresh memory."""
    atol = tol * max(1.0, float(want.abs().max())) if want.numel() else tol
    if want.dim() == 0 or got.shape != want.shape:
        return got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=atol)
    step = max(1, (1 << 18) // max(1, want[0].numel()))
    return all(torch.allclose(g, w, rtol=tol, atol=atol) for g, w in zip(got.split(step), want.split(step)))


def _compiled(gm: fx.GraphModule, inputs: list[Tensor], backend: Any, kwargs: dict[str, Any],
              functional: bool) -> Callable[..., Tensor]:
    """Inductor straight on the graph (no Dynamo, whose guards would cost more than the kernels at
    B = 2: the key above is the guard), other backends through ``torch.compile``; a failed
    compilation falls back to the graph with a warning (``_capture/compiled.py``)."""
    from .._capture.compiled import _warn, compiled

    if backend != "inductor" or kwargs or not functional:
        return compiled(gm, backend, **kwargs)
    try:
        import torch._inductor

        run = torch._inductor.compile(gm, list[Any](inputs))
    except Exception as err:  # noqa: BLE001 -- no C++ compiler, an inductor error: the graph serves
        _warn(backend, err)
        return gm

    def call(*args: Tensor) -> Tensor:
        got = run(*args)
        return got[0] if isinstance(got, (list, tuple)) else got

    return call


_aten = torch.ops.aten


def _drop_probes(graph: fx.Graph) -> None:
    """``a + zeros_like(a)`` (a probe on a module output) is ``a`` outside autograd."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.add.Tensor or len(node.args) != 2 or node.kwargs:
            continue
        a, z = node.args
        if isinstance(z, fx.Node) and z.target is _aten.zeros_like.default and z.args[:1] == (a,):
            node.replace_all_uses_with(a)
            graph.erase_node(node)


def _fold_constants(gm: fx.GraphModule) -> None:
    """Compute once the pure nodes that read no input (``eye`` and its views), kept as attributes.

    Not a node that a mutating operation reads, nor anything it is computed from.
    """
    graph = gm.graph
    pure: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        target = node.target
        ok = (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
              and not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags
              and all(pure.get(a, False) for a in node.all_input_nodes))
        pure[node] = ok
    for node in graph.nodes:  # what a mutating op writes stays computed per call, with its ancestors
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            stack = _written(node)
            while stack:
                n = stack.pop()
                if pure.get(n):
                    pure[n] = False
                    stack.extend(n.all_input_nodes)
    for node in graph.nodes:  # and what is computed from those (in graph order: inputs come first)
        if pure.get(node) and not all(pure.get(a, False) for a in node.all_input_nodes):
            pure[node] = False
    values: dict[fx.Node, Any] = {}
    for k, node in enumerate(list(graph.nodes)):
        if not pure.get(node):
            continue
        args = fx.node.map_arg(node.args, lambda n: values[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n])
        values[node] = node.target(*args, **kwargs)
        if all(pure.get(u) for u in node.users) or not isinstance(values[node], Tensor):
            continue
        name = f"_jacmode_constant{k}"
        gm.register_buffer(name, values[node], persistent=False)
        with graph.inserting_before(node):
            const = graph.get_attr(name)
        const.meta = dict(node.meta)
        for u in [u for u in node.users if not pure.get(u)]:
            u.replace_input_with(node, const)


def _written(node: fx.Node) -> list[fx.Node]:
    """The nodes a mutating op writes into (``self`` of ``copy_``, ``out=``), by its schema."""
    out: list[fx.Node] = []
    schema = node.target._schema  # type: ignore[union-attr]
    for k, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or k >= len(node.args) else node.args[k]
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node))
    return out


def _shared_bmm(graph: fx.Graph) -> None:
    """``bmm(a, b)`` whose ``b`` repeats one matrix along the batch (stride 0: a weight pulled back
    under a batch of seeds) is one ``mm`` of the flattened ``a``: out[i] = a[i] @ b[0]. The result has
    bmm's shape and (contiguous) strides, which the views after it were traced with. CPU's bmm of
    small matrices loops over the batch (at B = 2 on problem 1's class: 95 of 225 microseconds)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _aten.bmm.default or node.kwargs:
            continue
        a, b = node.args
        va, vb, val = map(rewrites._val, (a, b, node))
        if va is None or vb is None or val is None:
            continue
        if vb.stride(0) != 0 or not val.is_contiguous() or va.shape[0] < 2:
            continue
        nb, k, m = va.shape
        with graph.inserting_before(node):
            flat = graph.call_function(_aten.reshape.default, (a, [nb * k, m]))
            one = graph.call_function(_aten.select.int, (b, 0, 0))
            prod = graph.call_function(_aten.mm.default, (flat, one))
            new = graph.call_function(_aten.view.default, (prod, list(val.shape)))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


_VIEW_OPS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "select", "slice", "narrow", "unsqueeze",
             "squeeze", "expand", "detach", "alias", "diagonal", "as_strided"}


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.overloadpacket.__name__ in _VIEW_OPS and isinstance(node.meta.get("val"), Tensor)
            and not target._schema.is_mutable)


def _collapse_views(graph: fx.Graph) -> None:
    """A chain of two or more views is one ``as_strided`` of its base (sizes, strides and offsets are
    fixed by the signature, storage offsets of the inputs included)."""
    for node in list(graph.nodes):
        if not _is_view(node) or all(_is_view(u) for u in node.users):
            continue
        base, length = node, 0
        while _is_view(base) and isinstance(base.args[0], fx.Node):
            base, length = base.args[0], length + 1
        val = node.meta["val"]
        if length < 2 or base.op == "get_attr":
            continue
        with graph.inserting_before(node):
            new = graph.call_function(_aten.as_strided.default,
                                      (base, list(val.shape), list(val.stride()), val.storage_offset()))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)


def disabled() -> contextlib.AbstractContextManager[None]:
    """Inside the block the probe engine always interprets (tests compare the two paths)."""
    return codegen.switched_off(sys.modules[__name__])


def engine(p: "Problem", plan: "Plan", out: Optional[Tensor]) -> Tensor:
    """The probe engine's per-sample parameter Jacobian (B, Y, P) of a problem: the generated code
    (:func:`jacobian`) where it serves, else the rules over one probed pass per chunk of samples
    (``layerwise.fill``); the generic engine for the parameters no rule covers."""
    assert p.probes is not None and p.model is not None and p.subset_fn is not None
    B, Y, N = p.batch, p.n_out, p.n_in
    named = [(n, t) for (n, _), t in zip(p.params, p.tensors)]
    if torch.is_grad_enabled():  # create_graph: differentiable blocks, every parameter covered
        flat = layerwise.blocks(p.model, p.x, named, p.probes)
        return out.copy_(flat) if out is not None else flat
    step_b = plan.sample_chunk or B
    repeat = not p.random and B > 1 and plan.costs.get("reverse", 1.0) < layerwise.REPEAT_COST
    if step_b >= B and not p.random:
        found = jacobian(p.model, p.x, named, p.probes, out, p.dtype, p.device, (B, Y, N), repeat,
                                   p.__dict__.get("runs"))
        if found is not None:  # see [Generated probe code]
            return found
    result = out if out is not None else torch.empty(B, Y, N, dtype=p.dtype, device=p.device)  # not p.z: made lazily
    for b0 in range(0, B, step_b):  # chunks of samples: max_memory
        layerwise.fill(p.model, p.x[b0 : b0 + step_b], named, p.probes, result[b0 : b0 + step_b], repeat=repeat)
    rest = [n for n, _ in named if n in p.probes.uncovered]
    if rest:
        starts, cols = 0, []
        for n, t in named:
            if n in p.probes.uncovered:
                cols.append(torch.arange(starts, starts + t.numel(), device=result.device))
            starts += t.numel()
        idx = torch.cat(cols)
        zk, one = p.subset_fn(rest)

        def place(b0: int, b1: int, y0: int, y1: int, blk: Tensor) -> None:
            result[b0:b1, y0:y1, idx] = blk

        try:
            per_sample_rows(one, zk, p.x, Y, place, step_b, Y)
        except RuntimeError:  # vmap cannot run these parameters' layers: autograd, sample by sample
            with torch.enable_grad():
                zg = zk.detach().requires_grad_(True)
                for b in range(B):
                    row = one(zg, p.x[b])
                    place(b, b + 1, 0, Y, torch.stack([torch.autograd.grad(o, zg, retain_graph=True)[0] for o in row])[None])
    return result
