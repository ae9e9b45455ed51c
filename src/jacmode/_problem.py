"""Describe the problem: turn ``(f, x, wrt)`` into a pure function of the differentiated tensor.

A :class:`Problem` is what the planner and the engines see. Whatever the user asked for, it holds
a function ``fn`` of one flat tensor ``z`` (the inputs reshaped to (B, D), or all selected
parameters concatenated into (P,)), the axes B, N (D or P) and Y, and the output shapes used to
assemble the result. For parameters, ``sample_fn(z, x_b)`` evaluates one sample, which the
per-sample reverse strategy vectorises over the batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._threads import clone_tree
from . import _checks
from ._args import Flat, inputs, rows_of
from ._cache import Kind, problem_key
from ._checks import Options
from ._coupling import WAYS_OUT, probe
from ._capture import capture as _capture
from ._probes import layerwise as _layerwise
from ._capture import taylor as _taylor
from ._probes.probes import Coverage, coverage
from ._functional import refreshed, selection_key
from ._state import bound_values
from ._rules.local import LOCAL
from ._transforms import in_transform


@dataclass
class Problem:
    """A Jacobian problem in flat form: J[b, y, n] = d fn(z)[b, y] / d z[b, n] (or z[n])."""

    kind: str  # "inputs" or "params"
    batched: bool
    structure: str  # "independent", "coupled" or "diagonal"
    fn: Callable[[Tensor], Tensor]  # z -> (B, Y) when batched, (Y,) otherwise
    z: Tensor  # (B, D) for batched inputs, (N,) unbatched inputs, (P,) for parameters
    x: Tensor  # the user's input
    batch: int  # B (1 when unbatched)
    n_in: int  # D, N or P
    n_out: int  # Y
    in_shape: tuple[int, ...]  # per-sample input shape, x.shape unbatched, (P,) for parameters
    out_shape: tuple[int, ...]  # per-sample output shape (full output shape when unbatched)
    sample_fn: Optional[Callable[[Tensor, Tensor], Tensor]] = None  # params: (z, x_b) -> (Y,)
    params: list[tuple[str, torch.Size]] = field(default_factory=list)
    random: bool = False  # random layers in training mode (dropout)
    program: Optional[_capture.Program] = None  # inputs: the captured graph, for Taylor mode
    generic: str = ""  # inputs: why the captured graph does not serve (for plans)
    tensors: list[Tensor] = field(default_factory=list)  # params: the selected parameters
    model: Optional[nn.Module] = None  # params: the module
    probes: Optional[Coverage] = None  # params: what the layer-wise probe engine covers (verified)
    subset_fn: Optional[Callable[[list[str]], tuple[Tensor, Callable[[Tensor, Tensor], Tensor]]]] = None
    row_fn: Optional[Callable[[Tensor], Tensor]] = None  # inputs, captured graph: one sample z_b (D,) -> (Y,)

    @property
    def dtype(self) -> torch.dtype:
        return self.z.dtype

    @property
    def device(self) -> torch.device:
        return self.z.device


def _has_random_layers(f: Any) -> bool:
    return isinstance(f, nn.Module) and any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in f.modules()
    )


def captured(f: Any, x: Tensor) -> tuple[Optional[_capture.Program], str]:
    """The captured graph of f if it reproduces f on inputs shaped like x, else None and why."""
    if not x.is_floating_point() or x.shape[0] == 0:
        return None, "x is not floating point" if x.shape[0] else "empty batch"
    program = _capture.program_for(f)
    if isinstance(program, str):
        return None, program
    checked = _capture.check(program, f, x, _taylor.value)
    return (program.bind(inputs(f)), "") if isinstance(checked, tuple) else (None, checked)


def describe(f: Callable[[Tensor], Tensor], x: Tensor, opts: Options, ways_out: str = WAYS_OUT) -> Problem:
    """Build the :class:`Problem` for a call; runs ``f`` on a few samples (see ``_coupling``).

    ``ways_out`` is what a ``CoupledBatchError`` tells the caller to do instead.
    """
    structure = opts.structure
    batched = opts.batched and structure != "diagonal"
    if structure == "auto":
        structure = "independent"
    selected = _checks.check_param_selection(f, opts.param_names) if opts.wrt == "params" else []

    def validate(out: Any, n: int) -> Tensor:
        return _checks.check_output(out, batched=batched, n_in=n)

    # a captured graph treats every sample on its own by construction (each rule raises where
    # samples would mix, see _capture/capture.py), so it needs no probe; it is made here anyway
    program, why = captured(f, x) if opts.wrt == "inputs" and batched and structure == "independent" else (None, "")
    if program is not None:
        out_shape = _capture.check(program, f, x, _taylor.value)
        assert isinstance(out_shape, tuple)  # captured() returned the program: its check passed
        riders_independent(f, x, opts.structure, ways_out)
    elif batched:
        out_shape = probe(f, x, check=opts.structure == "auto" and x.shape[0] > 1, validate=validate,
                          ways_out=ways_out)
    else:
        with torch.no_grad():
            out_shape = tuple(validate(f(x.clone()), 1).shape)
    if opts.structure == "diagonal" and out_shape != tuple(x.shape):
        raise ValueError(
            f"structure: 'diagonal' needs an elementwise f whose output has the shape of x, but "
            f"x has shape {tuple(x.shape)} and f(x) has shape {out_shape}. Use structure='auto'."
        )
    batch = x.shape[0] if batched else 1
    n_out = math.prod(out_shape)
    random = _has_random_layers(f)

    if opts.wrt == "inputs":
        in_shape = tuple(x.shape) if structure == "diagonal" else tuple(x.shape[1:]) if batched else tuple(x.shape)
        return _inputs_problem(f, x, opts, Problem(
            kind="inputs", fn=f, z=x, batch=1 if structure == "diagonal" else batch,
            n_in=n_out if structure == "diagonal" else math.prod(in_shape), n_out=n_out, in_shape=in_shape,
            out_shape=out_shape, batched=batched, structure=structure, x=x, random=random, program=program,
            generic=why))

    model = f
    assert isinstance(model, nn.Module)  # checked by check_param_selection
    probes = None
    if batched and structure == "independent" and selected and not in_transform():
        probes = _probe_coverage(model, x, selected, opts, random)
    return _params_problem(model, x, selected, opts, Problem(
        kind="params", fn=f, z=x, batch=batch, n_in=0, n_out=n_out, in_shape=(), out_shape=out_shape,
        batched=batched, structure=structure, x=x, random=random, probes=probes))


def riders_independent(f: Any, x: Tensor, structure: str, ways_out: str = WAYS_OUT) -> None:
    """A captured program keeps samples apart where its input flows, but not in plain operations on
    batched riders (``mask.mean(0)``): for a call with batched riders the coupling probe runs
    (cached per function and call structure) before the program serves, changing the riders of
    some samples too (``_coupling._changed_riders``)."""
    if structure == "auto" and x.shape[0] > 1 and rows_of(f) is not None:
        probe(f, x, check=True, validate=lambda out, n: _checks.check_output(out, batched=True, n_in=n),
              ways_out=ways_out)


def connected(result: Any, f: Any, x: Tensor, create_graph: bool) -> Any:
    """``result`` (a tensor, tuple or dict of them) differentiable wherever ``create_graph`` asks.

    A derivative that is constant (the Laplacian of a linear model) has no autograd graph; under
    ``create_graph=True`` with x or a parameter of f requiring grad it is tied to them by an empty
    slice, which adds exact zeros (NaN-free) and lets ``.backward()`` give zero gradients, as
    torch.func does, instead of raising "does not require grad".
    """
    if not create_graph or not torch.is_grad_enabled():
        return result
    items = result.values() if isinstance(result, dict) else result if isinstance(result, tuple) else (result,)
    if all(r.requires_grad or not r.is_floating_point() for r in items):  # the usual case: nothing to tie
        return result
    params = [p for p in f.parameters() if p.requires_grad and p.device == x.device] if isinstance(f, nn.Module) else []
    # (a model on the meta device whose tensors a dict replaces, torch.func.stack_module_state's idiom, has no values)
    sources = [s for s in (x, *params) if s.requires_grad]
    if not sources:
        return result
    zero = sum((s.reshape(-1)[:0].sum() for s in sources[1:]), sources[0].reshape(-1)[:0].sum())

    def tie(r: Tensor) -> Tensor:
        return r if r.requires_grad or not r.is_floating_point() else r + zero.to(r.dtype)

    if isinstance(result, tuple):
        return tuple(tie(r) for r in result)
    if isinstance(result, dict):
        return {k: tie(r) for k, r in result.items()}
    return tie(result)


def facts(p: Problem) -> Problem:
    """``p`` without its model, input and functions: what a profile may keep (``_profile.py``)."""
    bound = p.model is not None and bound_values(p.model) is not None  # a dict's tensors are not kept
    return dataclasses.replace(p, fn=_gone, z=p.z.new_empty(0), x=p.x.new_empty(0), sample_fn=None, row_fn=None,
                               subset_fn=None, model=None, tensors=[] if bound else p.tensors,
                               probes=_without_tensors(p.probes) if bound else p.probes)


def _without_tensors(cov: Optional[Coverage]) -> Optional[Coverage]:
    return None if cov is None else dataclasses.replace(cov, tensors={})


def _gone(z: Tensor) -> Tensor:
    raise RuntimeError("jacmode: the facts of a problem have no function; call again()")  # pragma: no cover


def again(p: Problem, f: Any, x: Tensor, opts: Options, shared: bool = False) -> Problem:
    """The problem of a call identical to the one ``p`` was made for, at a new ``x``.

    ``x`` has the shape, dtype and device of that call's input, and ``f``'s flags and parameters
    are those ``p`` was made for (its profile's key, see ``_profile.py``): what ``describe``
    found still holds; only the values change. ``shared``: see :func:`_inputs_problem`.
    """
    if p.kind == "inputs":
        return _inputs_problem(f, x, opts, p, shared)
    if bound_values(f) is not None:  # a dict's tensors: this call's (see _functional.py)
        selected = _checks.check_param_selection(f, [n for n, _ in p.params])
        return _params_problem(f, x, selected, opts, dataclasses.replace(p, probes=refreshed(p.probes, selected)))
    # names, shapes, sizes and the other fields: the same for every call of the profile (its key
    # names the parameters, their shapes, dtypes and devices), kept on the profile's facts
    layout = p.__dict__.get("_layout")
    if layout is None:
        layout = p.__dict__["_layout"] = ([n for n, _ in p.params], [t.shape for t in p.tensors],
                                          [t.numel() for t in p.tensors])
    template = p.__dict__.get("_template")
    made = _params_problem(f, x, list(zip(layout[0], p.tensors)), opts, p, layout, template)
    if template is None and isinstance(made, _LazyParams):
        made.dtype, made.device  # noqa: B018 -- computed once, kept in the template
        p.__dict__["_template"] = {k: v for k, v in made.__dict__.items()
                                   if k not in ("fn", "x", "sample_fn", "subset_fn", "model", "_z")} | {"_z": None}
    return made


def _inputs_problem(f: Any, x: Tensor, opts: Options, facts: Problem, shared: bool = False) -> Problem:
    """The input problem at ``x``: flat values and the function of them; the rest from ``facts``.

    ``shared``: z is x's own memory, not a copy (see :func:`own_input`): only for an engine that
    never runs f (Taylor mode over the captured program, whose rules write no value in place).
    """
    if shared and facts.batched and facts.structure != "diagonal" and not isinstance(f, Flat):
        return _shared_inputs_problem(f, x, facts)
    xin = (x if opts.create_graph else x.detach()).clone()  # f may modify its input in place: never x
    p = type(facts).__new__(type(facts))  # copy.copy, without its reduce protocol (every repeated call)
    p.__dict__.update(facts.__dict__)
    p.x = x
    if facts.program is not None and isinstance(f, Flat):
        p.program = facts.program.bind(inputs(f))  # riders are inputs of the program: this call's
    if facts.structure == "diagonal":
        p.fn, p.z = f, xin
        return p
    batch, n_in, n_out, in_shape = facts.batch, facts.n_in, facts.n_out, facts.in_shape
    if facts.batched:
        z = xin.reshape(batch, n_in)
        fn = lambda z: f(z.reshape(batch, *in_shape)).reshape(batch, n_out)  # noqa: E731
        if facts.program is not None and not isinstance(f, Flat):  # samples independent, ops with rules
            p.row_fn = lambda zb: f(zb.reshape(1, *in_shape)).reshape(n_out)  # see _structure.run
    else:
        z = xin.reshape(n_in)
        fn = lambda z: f(z.reshape(in_shape)).reshape(n_out)  # noqa: E731
    p.fn, p.z = fn, z
    return p


def _shared_inputs_problem(f: Any, x: Tensor, facts: Problem) -> Problem:
    """:func:`_inputs_problem` of a batched call whose z is x's own memory (``shared``): a repeated
    call's, with the fewest new objects (x itself where it is (B, D) already and needs no detach)."""
    p = type(facts).__new__(type(facts))
    d = p.__dict__
    d.update(facts.__dict__)
    batch, n_in, n_out, in_shape = facts.batch, facts.n_in, facts.n_out, facts.in_shape
    d["x"] = x
    d["z"] = x if len(in_shape) == 1 and x.dim() == 2 and not x.requires_grad else x.detach().reshape(batch, n_in)
    d["fn"] = lambda z: f(z.reshape(batch, *in_shape)).reshape(batch, n_out)
    if facts.program is not None:
        d["row_fn"] = lambda zb: f(zb.reshape(1, *in_shape)).reshape(n_out)
    d["_shares_x"] = True
    return p


def own_input(p: Problem) -> None:
    """Give ``p`` its own copy of x before an engine that runs f (which may modify its input in
    place) uses a problem made with ``shared`` z: the fallbacks of Taylor mode (``_structure.run``,
    ``decide.execute``)."""
    if p.__dict__.pop("_shares_x", False):
        p.z = p.z.clone()


def _params_problem(model: nn.Module, x: Tensor, selected: Sequence[tuple[str, Tensor]], opts: Options,
                    facts: Problem, layout: Optional[tuple[list[str], list[Any], list[int]]] = None,
                    template: Optional[dict[str, Any]] = None) -> Problem:
    """The parameter problem at ``x``: flat values and functions of them; the rest from ``facts``
    (``layout``: the names, shapes and sizes of ``selected`` when the caller knows them;
    ``template``: the fields of an earlier problem of the same profile, see :func:`again`)."""
    batch, n_out, batched = facts.batch, facts.n_out, facts.batched
    keep = (lambda t: t) if opts.create_graph else (lambda t: t.detach())
    if layout is None:
        layout = ([n for n, _ in selected], [p.shape for _, p in selected], [p.numel() for _, p in selected])
    names, shapes, sizes = layout
    n_in = sum(sizes)
    # z, a copy of every selected parameter, is made when an engine first reads it (the probe
    # engine reads the parameters themselves, never z); with create_graph at once, in the graph
    lazy = bool(selected) and not opts.create_graph
    z: Optional[Tensor] = None if lazy else (
        torch.cat([keep(p).reshape(-1) for _, p in selected]) if selected else torch.zeros(0))

    def unflatten(z: Tensor) -> dict[str, Tensor]:
        return {n: t.view(s) for n, t, s in zip(names, z.split(sizes), shapes)}

    if batched:
        fn = lambda z: functional_call(clone_tree(model), unflatten(z), (x,)).reshape(batch, n_out)  # noqa: E731
    else:
        fn = lambda z: functional_call(clone_tree(model), unflatten(z), (x,)).reshape(n_out)  # noqa: E731
    sample_fn = lambda z, xb: functional_call(clone_tree(model), unflatten(z), (xb.unsqueeze(0),)).reshape(n_out)  # noqa: E731

    def subset_fn(wanted: list[str]) -> tuple[Tensor, Callable[[Tensor, Tensor], Tensor]]:
        """(flat values of the parameters ``wanted``, (z_w, x_b) -> (Y,)) for the generic engine."""
        chosen = [(n, p) for n, p in selected if n in wanted]
        ks, kz = [p.shape for _, p in chosen], [p.numel() for _, p in chosen]
        zk = torch.cat([keep(p).reshape(-1) for _, p in chosen])

        def one(zk: Tensor, xb: Tensor) -> Tensor:
            values = {n: t.view(s) for (n, _), t, s in zip(chosen, zk.split(kz), ks)}
            return functional_call(clone_tree(model), values, (xb.unsqueeze(0),)).reshape(n_out)

        return zk, one

    if lazy and template is not None:  # a repeated call: the profile's fields, this call's values
        lazy_p = _LazyParams.__new__(_LazyParams)
        d = lazy_p.__dict__
        d.update(template)
        d["fn"], d["x"], d["sample_fn"], d["subset_fn"], d["model"] = fn, x, sample_fn, subset_fn, model
        return lazy_p
    p = (_LazyParams if lazy else Problem)(
        kind="params", fn=fn, z=z, batch=batch, n_in=n_in, n_out=n_out,  # type: ignore[arg-type]
        in_shape=(n_in,), out_shape=facts.out_shape, sample_fn=sample_fn,
        params=list(zip(names, shapes)), batched=batched, structure=facts.structure, x=x,
        random=facts.random, tensors=[t for _, t in selected], probes=facts.probes,
        subset_fn=subset_fn, model=model)
    return p


class _LazyParams(Problem):
    """A parameter problem whose flat z (the detached parameters concatenated, (P,)) is made when
    it is first read: the probe engine of a repeated call never reads it, and the copy of every
    parameter was most of that call's cost outside the engine. ``dtype`` and ``device`` are those
    ``torch.cat`` gives z (the promoted dtype of the parameters, their device) without making it."""

    @property  # type: ignore[override]
    def z(self) -> Tensor:
        z = self.__dict__.get("_z")
        if z is None:
            z = self.__dict__["_z"] = torch.cat([t.detach().reshape(-1) for t in self.tensors])
        return z

    @z.setter
    def z(self, value: Optional[Tensor]) -> None:
        self.__dict__["_z"] = value

    @property
    def dtype(self) -> torch.dtype:
        d = self.__dict__
        dtype = d.get("_dtype")
        if dtype is None:
            dtype = self.tensors[0].dtype
            for t in self.tensors[1:]:
                if t.dtype is not dtype:
                    dtype = torch.promote_types(dtype, t.dtype)
            d["_dtype"] = dtype
        return dtype

    @property
    def device(self) -> torch.device:
        d = self.__dict__
        device = d.get("_device")
        if device is None:
            device = d["_device"] = self.tensors[0].device
        return device


def _probe_coverage(model: nn.Module, x: Tensor, selected: Sequence[tuple[str, Tensor]], opts: Options,
                    random: bool) -> Optional[Coverage]:
    """The verified coverage of the probe engine, or None when the generic engine runs everything.

    Cached per model and signature (shapes, flags, the selected parameter objects), so that a call
    walks the model's modules once, in the first call only.
    """
    key = (*problem_key(model, x, True, "params", "independent", True), opts.create_graph,
           selection_key(model, selected))
    hit = _COVERAGE.get(model, key)
    if hit is not None:
        return refreshed(hit[0], selected)  # a bound dict's tensors are new in each call
    found: Optional[Coverage] = None
    # the module-local vmap rule re-runs a module: not with random layers (new masks) nor with
    # create_graph (its blocks are not differentiable); without it too if it fails the check
    for local in (False,) if random or opts.create_graph else (True, False):
        cov = coverage(model, selected, local=local)
        if cov.covered and not (cov.uncovered and (random or opts.create_graph)):
            if _layerwise.complete(model, x, selected, cov):
                found = cov
                break
        if not any(r is LOCAL for r in cov.rules.values()):
            break
    _COVERAGE.put(model, key, (found,))
    return found


_COVERAGE = Kind("probe coverage")
