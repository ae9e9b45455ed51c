"""The entry points ``jacobian`` and ``plan``: validate, describe, plan, run, assemble."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor

from . import _guard
from . import _args, _checks, _profile, _transform
from ._args import Argnums, InDims
from ._capture import codegen as _codegen
from ._checks import Options, Wrt
from ._functional import accepts_params_dict
from ._planning import memory as _memory
from ._planning.decide import Decision, decide, execute
from ._planning.plan import Plan
from ._probes import generated
from ._problem import Problem, again, connected, describe, facts
from ._rules import decompositions
from ._sparse import api as _sparse
from ._state import modules_of, preserved_state
from ._structure import run
from ._transforms import in_transform

Result = Union[Tensor, dict[str, Tensor]]


def _options(f: Any, x: Any, **kw: Any) -> Options:
    _checks.check_function(f)
    opts = _checks.check_options(**kw)
    _checks.check_input(x, wrt=opts.wrt, batched=opts.batched)
    _checks.check_devices(f, x)
    return opts


@accepts_params_dict
@_guard.entry()
def plan(
    f: Callable[..., Any],
    *args: Any,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    wrt: Wrt = "inputs",
    mode: str = "auto",
    batched: bool = True,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    max_memory: Optional[Union[int, float, str]] = None,
    create_graph: bool = False,
    flatten: bool = True,
) -> Plan:
    """Say what :func:`jacobian` would do for these arguments, and why, without doing it.

    Takes the same arguments as :func:`jacmode.jacobian` (also several arguments, ``argnums``,
    ``in_dims``, ``kwargs``, ``has_aux``), which runs exactly this plan. Runs
    ``f`` on a few samples to learn the output shape, to check that samples are independent, to
    measure its footprint (flops, bytes, aten calls) and to find operations an engine cannot run
    (see docs/modes.md); the first call per function and shape also tries one jvp and one vjp on
    one sample. Differentiates nothing else; with ``mode="autotune"`` it reports the cached
    winner, or the cost model's choice if nothing was timed yet.

    Returns:
        A :class:`Plan` with the mode, strategy, directions, chunk sizes, estimated time of each
        candidate, estimated memory (result, workspace, budget) and a one-line reason (its
        ``repr``).

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(784, 20), torch.nn.ReLU(), torch.nn.Linear(20, 10))
        >>> p = jm.plan(net, torch.randn(64, 784), wrt="params")
        >>> p.mode, p.strategy, p.directions
        ('reverse', 'per-sample', 10)
        >>> p.costs["forward"] > 10 * p.costs["reverse"]   # 15,910 tangents vs 10 cotangents
        True
        >>> p = jm.plan(net, torch.randn(64, 784), wrt="params", max_memory="50KB")
        >>> p.sample_chunk < 64 and p.workspace_bytes <= 50_000   # samples chunked to fit the budget
        True
    """
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux, batched=batched,
                       floating=wrt == "inputs")
    if call.simple:
        try:
            return _plan(f, call.x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph, flatten,
                         True)
        except _checks.PytreeOutput:  # f(x) is a tuple, list or dict: planned as jacobian runs it
            call = _args.describe_call(f, tuple(args), kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux,
                                       batched=batched, floating=wrt == "inputs", flat=True)
    if not call.simple and wrt != "inputs":
        call = _args.params_call(f, args, kwargs, in_dims=in_dims, has_aux=has_aux, batched=batched)
        with _args.rows_bound(call):
            return _plan(call.fn, call.x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph,
                         flatten, False)
    if not call.simple:
        _several_supported(call, wrt, structure)
    return _plan(call.fn, call.x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph, flatten,
                 call.simple)


def _plan(f: Any, x: Any, wrt: Any, mode: Any, batched: Any, structure: Any, chunk_size: Any, max_memory: Any,
          create_graph: Any, flatten: Any, simple: bool) -> Plan:
    """The body of :func:`plan` for a function of one tensor."""
    # ---- body ----
    opts = _options(f, x, wrt=wrt, mode=mode, batched=batched, structure=structure,
                    chunk_size=chunk_size, max_memory=max_memory, create_graph=create_graph,
                    flatten=flatten)
    if opts.structure == "sparse" or (simple and _sparse.auto(f, x, opts) is not None):
        return _sparse.plan(f, x, opts.mode, opts.chunk_size, opts.max_memory)
    with preserved_state(f), torch.no_grad():
        problem = describe(f, x, opts)
        return decide(f, problem, opts, out_given=False, timing=False).plan


@accepts_params_dict
@_guard.entry()
def jacobian(
    f: Callable[..., Any],
    *args: Any,
    argnums: Argnums = 0,
    in_dims: InDims = 0,
    kwargs: Optional[dict[str, Any]] = None,
    has_aux: bool = False,
    wrt: Wrt = "inputs",
    mode: str = "auto",
    batched: bool = True,
    structure: str = "auto",
    chunk_size: Optional[int] = None,
    max_memory: Optional[Union[int, float, str]] = None,
    create_graph: bool = False,
    flatten: bool = True,
    out: Optional[Tensor] = None,
) -> Result:
    """Per-sample Jacobian of ``f`` at ``x``, in forward or reverse mode, chosen from the sizes.

    With ``batched=True`` (the default) ``x`` holds B independent samples along dim 0 and the
    result holds one Jacobian per sample: the diagonal blocks of the whole-batch Jacobian,
    computed without the off-diagonal zeros (D tangents or Y cotangents in all, not B*D or B*Y).

    Args:
        f: an ``nn.Module`` or a callable mapping x of shape (B, *in) to (B, *out), or to a tuple,
            list or dict of such tensors; or any ``f(*args)`` returning a tensor or a pytree of
            tensors (docs/torchfunc.md).
        *args: x, the input, shape (B, *in) (one point of any shape when ``batched=False``); or
            all of f's positional arguments, tensors or pytrees of tensors.
        argnums: which positional arguments are differentiated (an int or a tuple, torch.func's
            convention; default 0). A tuple gives a tuple of Jacobians per output leaf.
        in_dims: how the other tensors are passed: 0 (batched along dim 0 with the samples,
            vmap's default) or None (broadcast); for all, per positional argument (a tuple), or
            by name or position (a dict).
        kwargs: keyword arguments for f, passed through (tensors treated as ``in_dims`` says).
        has_aux: f returns ``(output, aux)``; the result is then ``(jacobian, aux)``.
        wrt: "inputs" (d out / d x), "params" (d out / d every trainable parameter of the module
            ``f``), or a list of parameter names (a subset; the others are held constant), or a
            dict name -> tensor: the module evaluated at those values, as ``functional_call``
            (docs/functional.md; ``fn(params, x)`` with ``argnums``/``in_dims=(None, 0)`` too).
        mode: "auto" (measured cost model, see :func:`plan`), "forward" (vmap over jvp),
            "reverse" (vmap over vjp), or "autotune" (time both once on these inputs, cache the
            winner; see :func:`autotune_cache`). "auto" falls back to a slower exact path, with
            a ``JacmodeWarning``, when ``f`` defeats an engine (no forward-AD formula, ``.item()``
            or value-dependent control flow under vmap); explicit modes raise instead.
        batched: False treats x as one point and returns the full Jacobian.
        structure: "auto" assumes independent samples and checks it with a cheap probe (cached);
            "independent" skips the check; "coupled" computes the exact diagonal blocks of the
            whole-batch Jacobian (about B times the work); "diagonal" is for elementwise f (output
            i depends on input i only) and returns the diagonal, shape of x, from one jvp.
            "sparse" (batched=False) detects the pattern, colours it and returns a (Y, N)
            ``torch.sparse_csr_tensor`` (see :func:`sparse_jacobian`); with batched=False and
            N >= 4096, "auto" does the same when it needs 8 times fewer passes than the dense
            Jacobian, and returns the dense result.
        chunk_size: directions (and, for per-sample parameter Jacobians, samples x directions)
            per vectorised pass; smaller uses less memory, same result.
        max_memory: workspace budget on top of the result, in bytes or as a string such as
            "2GB" or "512MiB"; chunk sizes are chosen to stay inside it. Default: half of the
            free memory of the device (RAM, or free CUDA memory) less the result.
        create_graph: keep the result differentiable with respect to the parameters and x;
            always so inside torch.func transforms (docs/pinn.md).
        flatten: for parameters, False returns a dict name -> (B, *out, *param.shape).
        out: for wrt="params" with flatten=True, a (B, Y, P) tensor to write the result into.

    Random layers in training mode (dropout): each sample draws one mask, as one batched forward
    pass would, shared by all of its output directions and chunks (see docs/structure.md).

    Returns:
        wrt="inputs": (B, *out, *in); unbatched (*out, *x.shape); diagonal: x.shape.
        structure="sparse": (Y, N) sparse CSR with Y = numel(f(x)), N = numel(x).
        wrt="params": (B, Y, P) with Y = prod(out) and P the selected parameters flattened and
        concatenated in ``named_parameters()`` order; unbatched (Y, P).
        An f that returns a tuple, list or dict of tensors gets the matching pytree, as
        ``vmap(jacrev(f))`` (each leaf (B, *out_leaf, *in); unbatched (*out_leaf, *x.shape)); for
        parameters Y counts every output leaf, in pytree order (``flatten=False``: one dict per leaf).

    Raises:
        CoupledBatchError: samples are coupled (e.g. BatchNorm in training mode) and
            ``structure="auto"``.
        MemoryError: the result alone is larger than the free memory (before allocating).
        ValueError: an explicit mode cannot run ``f`` (the message names the operation), or
            not even one direction per pass fits ``max_memory``.

    Example:
        >>> import torch, jacmode as jm
        >>> net = torch.nn.Sequential(torch.nn.Linear(1, 20), torch.nn.Tanh(), torch.nn.Linear(20, 4))
        >>> t = torch.linspace(0, 1, 1000).unsqueeze(1)
        >>> jm.jacobian(net, t).shape            # (B, Y, D): dy_i/dt at every time step
        torch.Size([1000, 4, 1])
        >>> jm.jacobian(net, t, wrt="params").shape   # (B, Y, P)
        torch.Size([1000, 4, 124])
    """
    compiling = torch.compiler.is_dynamo_compiling()
    if (not compiling and len(args) == 1 and kwargs is None and has_aux is False and type(argnums) is int
            and argnums == 0 and type(in_dims) is int and in_dims == 0 and isinstance(args[0], Tensor)
            and callable(f)):  # jacobian(f, x): what the front would find (a simple call), without it
        values = (wrt, mode, batched, structure, chunk_size, max_memory, create_graph, flatten)  # _eager, inlined
        t = _transform.eager_hit(jacobian, f, values, (type(wrt), type(mode), type(batched), type(structure),
                                                       type(chunk_size), type(max_memory), type(create_graph),
                                                       type(flatten)))
        if t is None:
            t = _transform.eager(jacobian, f, dict(zip(_OPTION_NAMES, values)))
        return _run(t, f, args[0], _NO_DATA if out is None else {"out": out})
    if compiling:  # inside the user's torch.compile: no front (its caches do not trace)
        from ._autodiff import traceable as _traceable

        if not _traceable.simple(args, kwargs, argnums, has_aux):
            return _traceable.eager("several arguments", lambda: jacobian(
                f, *args, argnums=argnums, in_dims=in_dims, kwargs=kwargs, has_aux=has_aux, wrt=wrt, mode=mode,
                batched=batched, structure=structure, chunk_size=chunk_size, max_memory=max_memory,
                create_graph=create_graph, flatten=flatten, out=out))
        return _jacobian(f, args[0], wrt, mode, batched, structure, chunk_size, max_memory, create_graph,
                         flatten, out)
    # ---- front: the call of several arguments as one flat function (see _args/) ----
    call = _args.front(f, args, kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux, batched=batched,
                       floating=wrt == "inputs")
    if call.simple:
        return _jacobian(f, call.x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph,
                         flatten, out)
    return _several(call, f, args, kwargs, in_dims, has_aux, wrt, mode, batched, structure, chunk_size,
                    max_memory, create_graph, flatten, out)


def _pytree_output(f: Any, x: Tensor, options: dict[str, Any], out: Optional[Tensor]) -> Any:
    """``jacobian(f, x)`` where f returns a tuple, list or dict of tensors: the call described as
    torch.func's (``_args.describe_call``, as for ``argnums=0`` with several arguments), so the result
    is the matching pytree, one (B, *out_leaf, *in) block per output leaf (unbatched
    (*out_leaf, *x.shape)), as ``vmap(jacrev(f))`` gives; parameters as for several arguments."""
    o = {**_DEFAULTS, **options}
    call = _args.describe_call(f, (x,), None, batched=o["batched"], floating=o["wrt"] == "inputs", flat=True)
    return _several(call, f, (x,), None, 0, False, o["wrt"], o["mode"], o["batched"], o["structure"],
                    o["chunk_size"], o["max_memory"], o["create_graph"], o["flatten"], out)


def _several(call: _args.Call, f: Any, args: tuple[Any, ...], kwargs: Any, in_dims: Any, has_aux: bool,
             wrt: Any, mode: Any, batched: Any, structure: Any, chunk_size: Any, max_memory: Any,
             create_graph: Any, flatten: Any, out: Any) -> Any:
    """The tail of :func:`jacobian` for a described call (several arguments, pytrees, kwargs, has_aux):
    the engines on its flat function, the result in torch.func's layout."""
    if wrt != "inputs":  # every argument passed through, the engines see the model of sample indices
        call = _args.params_call(f, args, kwargs, in_dims=in_dims, has_aux=has_aux, batched=batched)
        with _args.rows_bound(call):
            result = _jacobian(call.fn, call.x, wrt, mode, batched, structure, chunk_size, max_memory,
                               create_graph, flatten, out)
        return _args.finish(call, _args.params_layout(call, result, flatten or out is not None))
    _several_supported(call, wrt, structure)
    if out is not None:
        raise ValueError("out: not supported for a call of several arguments or an f that returns a tuple, list or "
                         "dict (the result is a pytree); drop out=.")
    flat = _jacobian(call.fn, call.x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph,
                     flatten, None)
    # ---- tail: torch.func's layout ----
    assert isinstance(flat, Tensor)
    if structure == "diagonal":
        return _args.finish(call, flat)
    return _args.finish(call, call.jacobian(_args.flat_jacobian(call, flat)))


def _several_supported(call: _args.Call, wrt: Any, structure: Any) -> None:
    """What a call of several arguments (or pytrees, kwargs, has_aux) cannot do yet: a clear error."""
    if structure == "sparse":
        raise ValueError(
            "structure: 'sparse' takes one tensor argument; for several arguments pass a function of one "
            "tensor (concatenate the arguments and split them inside f).")
    if structure == "diagonal" and (len(call.diff) != 1 or not call.single_output()):
        outputs = call.out_spec.num_leaves if call.out_spec is not None else "?"
        raise ValueError(
            "structure: 'diagonal' needs one differentiated tensor and one output tensor of its shape; got "
            f"{len(call.diff)} differentiated tensor(s) and {outputs} output tensor(s). Use structure='auto'.")


def _jacobian(f: Any, x: Any, wrt: Any, mode: Any, batched: Any, structure: Any, chunk_size: Any,
              max_memory: Any, create_graph: Any, flatten: Any, out: Any) -> Result:
    """The body of :func:`jacobian` for a function of one tensor (the user's f, or ``_args.Flat``):
    the cached transform of f with these options (``_transform.py``), which runs :func:`_run`."""
    if torch.compiler.is_dynamo_compiling():  # inside the user's torch.compile: a traceable path
        opts = _options(f, x, wrt=wrt, mode=mode, batched=batched, structure=structure,
                        chunk_size=chunk_size, max_memory=max_memory, create_graph=create_graph,
                        flatten=flatten)
        from ._autodiff import traceable as _traceable

        def again() -> Result:
            return _jacobian(f, x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph, flatten, out)

        if opts.structure == "sparse" or out is not None or opts.mode == "autotune":
            return _traceable.eager("jacobian option", again)
        return _traceable.jacobian(again, f, x, wrt=opts.wrt if opts.param_names is None else list(opts.param_names),
                                   mode=opts.mode, batched=opts.batched, structure=opts.structure,
                                   create_graph=opts.create_graph, flatten=opts.flatten)
    return _eager(f, x, wrt, mode, batched, structure, chunk_size, max_memory, create_graph, flatten, out)


def _eager(f: Any, x: Any, wrt: Any, mode: Any, batched: Any, structure: Any, chunk_size: Any,
           max_memory: Any, create_graph: Any, flatten: Any, out: Any) -> Result:
    """An eager call of one tensor outside torch.compile: the cached transform of f with these
    options (``_transform.eager``), looked up by the options' values in their fixed order."""
    values = (wrt, mode, batched, structure, chunk_size, max_memory, create_graph, flatten)
    t = _transform.eager_hit(jacobian, f, values)
    if t is None:
        t = _transform.eager(jacobian, f, dict(zip(_OPTION_NAMES, values)))
    return _run(t, f, x, _NO_DATA if out is None else {"out": out})


_NO_DATA: dict[str, Any] = {}


# ---- profile: the body of a jacobian call, looked up in f's profile (_profile.py) ----


@dataclass(frozen=True)
class _State:
    """Validated options of a jacobian transform: as given, and as inside a torch.func transform."""

    opts: Options
    inner: Options  # create_graph=True: see the note in _transforms.py


@dataclass(frozen=True)
class JacobianEntry:
    """What a jacobian call keeps in f's profile for the later calls with its key (``_profile.py``).

    Attributes:
        problem: the problem's facts, without its model, input and functions (``_problem.facts``).
        decision: its plan and what the plan was made from: footprint, capabilities, budget (``_planning.decide``).
    """

    problem: Problem
    decision: Decision


def _prepare(options: dict[str, Any]) -> _State:
    unknown = set(options) - set(_OPTION_NAMES)
    if unknown:
        raise TypeError(f"transform(jacobian, f, ...): unknown option {sorted(unknown)[0]!r}; jacobian takes "
                        f"{', '.join(_OPTION_NAMES)} (and out= per call).")
    opts = _checks.check_options(**{**_DEFAULTS, **options})
    opts = dataclasses.replace(opts, create_graph=bool(options.get("create_graph", False)))
    return _State(opts, dataclasses.replace(opts, create_graph=True))


def _run(t: Any, f: Any, x: Any, data: dict[str, Any]) -> Result:
    """The jacobian of one tensor input (the eager call's and the transform's body): :func:`_run_one`,
    or, for an f that returns a tuple, list or dict of tensors, the matching pytree of Jacobians."""
    try:
        return _run_one(t, f, x, data)
    except _checks.PytreeOutput:
        if isinstance(f, _args.Flat):  # a described call's flat function returns one tensor: not its output
            raise
    return _pytree_output(f, x, t.options, data.get("out") if data else None)


def _run_one(t: Any, f: Any, x: Any, data: dict[str, Any]) -> Result:
    """The jacobian of f at one tensor x, f returning one tensor (see the note in ``_transform.py``)."""
    state: _State = t.state
    inside = in_transform()
    opts = state.inner if inside else state.opts
    out = data.get("out") if data else None
    _checks.check_input(x, wrt=opts.wrt, batched=opts.batched)
    if opts.structure == "sparse" and out is not None:
        raise ValueError("out: not supported with structure='sparse' (the result is a new sparse tensor); "
                         "drop out=.")
    if opts.structure == "sparse" or (not opts.batched and out is None and not isinstance(f, _args.Flat)
                                      and _sparse.auto(f, x, opts) is not None):  # auto: unbatched only
        layout = "csr" if opts.structure == "sparse" else "dense"
        return _sparse.sparse_jacobian(f, x, mode=opts.mode, layout=layout, chunk_size=opts.chunk_size,
                                       max_memory=opts.max_memory, create_graph=opts.create_graph)
    # a repeated call that ran without the guard last time (_direct) likely does so again: its
    # look-up makes no survey for it (the guard, where it is needed after all, walks itself)
    columns = opts.wrt == "inputs" and out is None and not opts.create_graph and not inside
    if opts.mode == "autotune":  # autotune keeps its own table of timings: no profile
        modules, key, survey, profile = modules_of(f), None, None, None
    else:
        looked = _profile.lookup(f, t.token, (x,), data, guard=not t.__dict__.get("_direct", False))
        modules, key, survey, profile = looked.modules, looked.key, looked.survey, looked.found
    if profile is not None:
        flat = _direct(profile, f, x, opts, out, columns)
        t.__dict__["_direct"] = flat is not None
        if flat is not None:  # the profile's engine alone, without the guard of the model's state
            if not data:
                _profile.served(f, t.token, looked, x)
            return _assemble(profile.facts.problem, flat, opts, out)
    if profile is None:
        _checks.check_devices(f, x)
    # no_grad unless create_graph; a hit of Taylor mode over a program without attention leaves
    # the attention kernels' flags alone (_state._kernels_in)
    with preserved_state(f, modules, survey, grad=opts.create_graph,
                         kernels=profile is None or _attention(profile.facts)):
        hit = None if profile is None else _again(profile, f, x, opts, out is not None)
        problem = describe(f, x, opts) if hit is None else hit[0]
        if out is not None:
            if opts.wrt != "params" or not opts.flatten:
                raise ValueError(
                    "out: only supported for wrt='params' with flatten=True (a (B, Y, P) tensor); "
                    "drop out= for other calls."
                )
            _checks.check_out_buffer(out, _flat_shape(problem), problem.dtype, problem.device)
        if problem.batch == 0 or problem.n_in == 0 or problem.n_out == 0:
            flat = out if out is not None else problem.z.new_zeros(_flat_shape(problem))
        else:
            if hit is not None:
                decision = hit[1]
            else:
                decision = decide(f, problem, opts, out_given=out is not None)
                if key is not None:
                    _profile.keep(f, key, _profile.Profile(JacobianEntry(facts(problem), decision)), modules)
            if opts.create_graph or inside:  # decompositions.wanted(): a graph differentiated again
                with decompositions.exact():
                    flat = execute(f, problem, decision, opts, out)
            else:
                flat = execute(f, problem, decision, opts, out)
    result = _assemble(problem, flat, opts, out)
    return result if out is not None or not opts.create_graph else connected(result, f, x, True)


def _attention(entry: JacobianEntry) -> bool:
    """Whether the engine of a profile's plan may run attention kernels (``_state._kernels_in``):
    all but Taylor mode over a captured program without attention operations or modules."""
    problem, plan = entry.problem, entry.decision.plan
    known = problem.__dict__.get("_attention")
    if known is None or known[0] is not plan:  # per plan: execute may re-plan (decision.plan)
        program = problem.program
        known = problem.__dict__["_attention"] = (plan, not (
            program is not None and plan.loop is None and plan.mode == "forward" and plan.strategy == "broadcast"
            and not any("attention" in op.lower() or "transformer" in op.lower() for op in program.ops)))
    return known[1]


def _pure(entry: JacobianEntry) -> bool:
    """Whether a profile's plan is Taylor mode over a pure captured program: every step a rule (or a
    read of a tensor or constant, or of a shape): no module's own forward, no riders, no random
    layers, no attention (see :func:`_columns_rerun`). Kept on the facts, per plan."""
    problem, plan = entry.problem, entry.decision.plan
    known = problem.__dict__.get("_pure")
    if known is None or known[0] is not plan:  # per plan: execute may re-plan (decision.plan)
        program = problem.program  # not _attention: Taylor mode (loop-free, forward, broadcast) over it
        pure = (program is not None and problem.kind == "inputs" and problem.batched
                and problem.structure != "diagonal" and not problem.random and program.riders_step is None
                and not _attention(entry) and all(_pure_step(s) for s in program.steps))
        known = problem.__dict__["_pure"] = (plan, pure)
    return known[1]


def _pure_step(step: Any) -> bool:
    """A rule, a read (a tensor, a constant, an argument: no arguments of its own and not a module),
    or a shape query (``_capture.capture._meta``)."""
    if step.traced:
        return True
    if isinstance(step.fn, torch.nn.Module):
        return False
    return (not step.args and not step.kwargs) or getattr(step.fn, "__qualname__", "").startswith("_meta.")


def _columns_rerun(profile: _profile.Profile[JacobianEntry], f: Any, x: Tensor, opts: Options) -> Optional[Tensor]:
    """The flat result of a repeated input Jacobian by Taylor mode over a pure captured program
    (:func:`_pure`), or None (then the call takes the guarded path).

    Such a program runs rules that read x and the model's tensors and write neither, and never
    runs f: the call needs no guard of the model's state (as the generated probe code, :func:`_direct`),
    only grad mode off. Where a rule's assumption breaks (``Unsupported``) or anything raises, the
    program is rejected or the error left to the guarded path, which runs the call again with its
    fallbacks and its errors.
    """
    if not _pure(profile.facts):
        return None
    ready = profile.runs.get("columns_code")
    if ready:
        flat = _columns_ready(profile, ready, x, opts)
        if flat is not None:
            return flat
    hit = _again(profile, f, x, opts, False)  # a pure program: x itself, never copied
    if hit is None:
        return None
    p, decision = hit
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        flat = run(p, decision.plan, None, fallback=False)
        if ready is None:
            _keep_columns(profile, p, decision)
        return flat
    except Exception:  # noqa: BLE001 -- the guarded path runs it again, with its fallbacks and errors
        return None
    finally:
        torch._C._set_grad_enabled(grad)


def _keep_columns(profile: _profile.Profile[JacobianEntry], p: Problem, decision: Decision) -> None:
    """Keep in the profile's ``runs`` the generated code that ``p``'s plan just ran, where that plan
    is one call of it (all D directions in one chunk: ``forward.layerwise_columns``), once the code
    exists (``_capture/codegen.AFTER_CALLS``); False where it never will."""
    plan = decision.plan
    if (p.program is None or plan.engine != "forward-layerwise" or plan.strategy != "broadcast"
            or plan.chunk_size < p.n_in):
        profile.runs["columns_code"] = False
        return
    vouched = {id(t) for t in profile.holds if isinstance(t, Tensor)}  # the key checked them
    code = _codegen.ready("first", p.program, p.z, p.in_shape, range(0, p.n_in), vouched=vouched)
    if code is not None:
        profile.runs["columns_code"] = code


def _columns_ready(profile: _profile.Profile[JacobianEntry], ready: Any, x: Tensor, opts: Options) -> Optional[Tensor]:
    """The flat (B, Y, D) result of a repeated input Jacobian from the code :func:`_keep_columns`
    kept: the checks of :func:`_again` (the program's bound tensors, the memory budget) and those
    of the code (``codegen.Ready``), without a problem or a plan. None where any fails."""
    problem, decision = profile.facts.problem, profile.facts.decision
    if not _profile.fresh(problem.program, x, problem.__dict__.get("_check_key")):
        return None
    if _fits(*_sized(profile, problem), decision, opts, False) is None:
        return None
    z = x.detach() if x.requires_grad else x  # the code's key holds z's requires_grad (False)
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        blk = ready(z.reshape(problem.batch, problem.n_in))
    except Exception:  # noqa: BLE001 -- the guarded path runs it again, with its fallbacks and errors
        blk = None
    finally:
        torch._C._set_grad_enabled(grad)
    if blk is None:  # what the code's key holds changed: the engine's path finds or makes new code
        profile.runs.pop("columns_code", None)
        return None
    return blk.permute(1, 2, 0)  # (D, B, Y) products: columns d of every block (_structure._broadcast_forward)


def _again(profile: _profile.Profile[JacobianEntry], f: Any, x: Tensor, opts: Options,
           out_given: bool) -> Optional[tuple[Problem, Decision]]:
    """The problem at ``x`` and the decision of the profile, or None when memory no longer fits.

    The free memory is re-read (at most every ``memory.RECENT_S``): the result must fit as in
    ``decide``, and the plan is reused only while its workspace fits the new budget. The problem
    carries the profile's ``runs``, where an engine may leave what a repeated call runs straight
    away (the generated probe code, [Generated code on the profile] in ``_probes/generated.py``).
    """
    problem, decision = profile.facts.problem, profile.facts.decision
    check = problem.__dict__.get("_check_key")  # x's (shape, dtype, device): fixed by the profile's key
    if not _profile.fresh(problem.program, x, check):  # a value f's captured program took changed: describe again
        return None
    plan = decision.plan
    # Taylor mode over the captured program never runs f nor writes its input: z may be x itself
    # (_problem.own_input copies it where a fallback runs f)
    p = again(problem, f, x, opts, problem.program is not None and not opts.create_graph and plan.loop is None
              and plan.mode == "forward" and plan.strategy == "broadcast" and problem.kind == "inputs")
    if check is None:
        problem.__dict__["_check_key"] = _profile.checked_key(x)
    budget = _fits(*_sized(profile, p), decision, opts, out_given)
    if budget is None:
        return None
    decision.budget = budget
    if p.kind == "params":
        p.__dict__["runs"] = profile.runs
    return p, decision


def _sized(profile: _profile.Profile[JacobianEntry], p: Problem) -> tuple[int, torch.device]:
    """The bytes and the device of a profile's result, computed once from ``p`` (its facts, or its
    problem at a new x): the profile's key fixes the shapes, dtypes and devices they depend on."""
    sized = profile.__dict__.get("_sized")
    if sized is None:
        sized = profile.__dict__["_sized"] = (
            p.dtype.itemsize * (p.n_in if p.structure == "diagonal" else p.batch * p.n_out * p.n_in), p.device)
    return sized  # type: ignore[no-any-return]


def _fits(result_bytes: int, device: torch.device, decision: Decision, opts: Options, out_given: bool) -> Optional[int]:
    """The memory budget of a repeated call with a result of ``result_bytes`` on ``device``, or None
    where the result or the plan's workspace no longer fits (``describe`` and ``decide`` then
    raise the MemoryError or plan anew). The free memory is re-read (at most every ``memory.RECENT_S``)."""
    budget = _memory.budget(opts.max_memory, device, result_bytes, out_given)
    return None if budget is None or decision.plan.workspace_bytes > budget else budget


def _direct(profile: _profile.Profile[JacobianEntry], f: Any, x: Tensor, opts: Options,
            out: Optional[Tensor], columns: bool) -> Optional[Tensor]:
    """The flat result of a profile hit from its engine alone, or None (the guarded path then runs).

    Two engines read only x and the model's tensors and write neither, so a repeated call needs
    neither the guard of the model's state nor, for the first, a problem of its own:

    * the generated probe code of a parameter Jacobian, which the profile's ``runs`` holds;
      ``generated.rerun`` checks what the profile's key does not hold ([Generated code on the
      profile] in ``_probes/generated.py``);
    * Taylor mode over a pure captured program for an input Jacobian (:func:`_columns_rerun`).

    The transform remembers whether it served, so that the next walk takes the key alone.
    """
    if opts.wrt == "params" and not opts.create_graph:
        hot = profile.runs.get("probe_code")
        if hot is None:
            return None
        if _fits(*_sized(profile, profile.facts.problem), profile.facts.decision, opts, out is not None) is None:
            return None
        return generated.rerun(hot, x, out)
    return _columns_rerun(profile, f, x, opts) if columns else None


_OPTION_NAMES = ("wrt", "mode", "batched", "structure", "chunk_size", "max_memory", "create_graph", "flatten")
_DEFAULTS: dict[str, Any] = dict(wrt="inputs", mode="auto", batched=True, structure="auto", chunk_size=None,
                                 max_memory=None, create_graph=False, flatten=True)
_transform.register(jacobian, _transform.Spec("jacobian", _prepare, _run, data=("out",), positional=False,
                                              defaults=_DEFAULTS))


def _flat_shape(p: Problem) -> tuple[int, ...]:
    if p.structure == "diagonal":
        return tuple(p.z.shape)
    return (p.batch, p.n_out, p.n_in) if p.batched else (p.n_out, p.n_in)


def _assemble(p: Problem, flat: Tensor, opts: Options, out: Optional[Tensor]) -> Result:
    """Give the flat result its user-facing shape (see the ``Returns`` of :func:`jacobian`)."""
    if out is not None:
        return out
    if p.structure == "diagonal":
        return flat.reshape(p.x.shape)
    lead = (p.batch, *p.out_shape) if p.batched else tuple(p.out_shape)
    if p.kind == "inputs":
        shape = (*lead, *p.in_shape)  # a tuple: both may be empty (0-d x)
        if flat.shape == shape and flat.is_contiguous():  # the engine's layout already (a repeated call)
            return flat
        return flat.reshape(shape).contiguous()
    if opts.flatten:
        return flat.contiguous()
    sizes = [s.numel() for _, s in p.params]
    return {
        name: block.reshape((*lead, *shape))
        for (name, shape), block in zip(p.params, flat.split(sizes, dim=-1))
    }


def jacfn(f: Any, *, compile: Union[bool, str] = False, **options: Any) -> _transform.Transformed:
    """``transform(jacobian, f, **options)``: the per-sample Jacobian of f as a function of x.

    Example:
        >>> import torch, jacmode as jm
        >>> jac = jm.jacfn(torch.sin)
        >>> x = torch.zeros(2, 3)
        >>> jac(x).shape                                  # (B, *out, *in)
        torch.Size([2, 3, 3])
    """
    return _transform.transform(jacobian, f, compile=compile, **options)
