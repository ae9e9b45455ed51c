"""What the derivative operators differentiate, with which engine, and in which passes.

A :class:`Target` holds the user's function in flat form (z of shape (B, N) to (B, Y)) and picks
the engine: ``_taylor`` (Taylor mode over the captured graph, ``_capture/capture.py``) when every
operation the input flows through has a rule, ``_nested`` (nested forward mode, or nested reverse
mode for operations without a forward-mode rule) for any other callable. Both engines have the
same functions and shapes. Operations with rules treat every sample on its own and change no
state, so the fast path skips the coupling probe and the state guard (a PINN calls the operators
thousands of times on small batches, where that overhead would show); other functions go through
``_problem.describe``, which runs the probe of ``_coupling``, inside ``_state.preserved_state``.
A rule that finds its assumptions broken at run time (``Unsupported``) sends the call, and later
ones with inputs of that shape, to the generic path (:func:`evaluate`).

NOTE: [Chunks of the derivative operators]
``chunk_size`` bounds the width of one vectorised pass, as in :func:`jacmode.jacobian`. laplacian
and divergence vectorise the D coordinate directions, hessian the D (D + 1) / 2 pairs of them, or
for wide inputs its D rows (forward over reverse, see _derivatives.py), so there it counts
directions (pairs or rows); derivative and partial push a single direction shared by all
samples, so there it counts samples. With ``structure="coupled"`` every sample needs tangents of its
own (vmapped over samples, B times the work), and chunk_size counts samples x directions.
By default a pass carries as many directions as keep its widest tensor under
``DEFAULT_PASS_BYTES``, so that the Hessian of a wide input never holds all D^2 / 2 pairs at once.
Operators that sum over their directions (laplacian, divergence, the weighted Laplacian) use the
smaller ``SUM_PASS_BYTES``: their chunks cost nothing extra (no coefficient is shared between
chunks), and on glibc every allocation above 32 MiB is mapped afresh and unmapped when freed, so
each such tensor pays a page fault per 4 KiB page (a 39 MiB tanh_backward took 31 ms instead of
5); tensors under the limit are recycled by malloc. Measured on the 768-wide tanh MLP (D = 50,
B = 256): 610 ms in one pass of 50 directions, 515 ms in chunks of 21, and half the peak memory.
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Literal, Optional, TypeVar, Union

import torch
from torch import Tensor, nn
from torch.func import vmap

from . import _checks, _profile
from ._args import Flat, inputs, rows_of, take
from ._checks import Options
from ._coupling import OPERATOR_WAYS_OUT
from ._capture import capture as _capture
from ._capture import codegen as _codegen
from ._autodiff import nested as _nested
from ._capture import taylor as _taylor
from ._cache import register
from ._capture.capture import Program
from ._problem import captured, connected, describe, riders_independent
from ._rules import decompositions
from ._rules.base import Unsupported
from ._state import RngReplay, Survey, preserved_state
from ._structure import one_hot

Fn = Callable[[Tensor], Tensor]
DEFAULT_PASS_BYTES = 256 * 2**20
SUM_PASS_BYTES = 16 * 2**20  # see the note on chunks
_NO_FORWARD_AD: "weakref.WeakSet[Any]" = register(weakref.WeakSet(), "functions without forward mode")  # reverse only
_GENERIC_ONLY = frozenset({"rows"})  # engine functions that Taylor mode does not have (forward over reverse)


def missing_derivative(err: BaseException, markers: tuple[str, ...], what: str, fix: str) -> Optional[ValueError]:
    """The clear error for ``err`` of a generic engine when its message (one of ``markers``) says torch
    has no derivative formula for an op of f; None for any other error, which the caller re-raises."""
    text = str(err)
    if not any(m in text.lower() for m in markers):
        return None
    return ValueError(f"f: {what} ({text.splitlines()[0][:160]}), and f's graph could not be captured{fix}")


@dataclass
class Target:
    """The function to differentiate in flat form, and the engine that will do it."""

    key: Any  # the user's f: remembers that it needs reverse mode
    fn: Fn  # z (b, N) -> (b, Y), for any number b of samples
    z: Tensor  # (B, N)
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    program: Optional[Program]  # the Taylor fast path applies when not None
    coupled: bool
    rng: Optional[RngReplay]
    widest: int = 0  # the widest nn.Linear of a captured module (direction_chunks' default width)
    source: Any = None  # the flat function of a call of several arguments (``_args.Flat``), else None

    @contextlib.contextmanager
    def rows(self, start: int, stop: int) -> Iterator[None]:
        """Within: ``fn`` and ``program`` are those of the samples [start, stop), so that batched
        riders (``_args.take``) follow a chunk of samples."""
        if rows_of(self.source) is None or (start == 0 and stop >= self.z.shape[0]):
            yield
            return
        saved = self.fn, self.program
        sub = take(self.source, slice(start, stop))
        self.fn = _flat_fn(sub, self.in_shape, math.prod(self.out_shape)) if self.program is None else sub
        self.program = None if self.program is None else self.program.bind(inputs(sub))
        try:
            yield
        finally:
            self.fn, self.program = saved

    def run(self, name: str, z: Tensor, *args: Any, scale: Optional[Tensor] = None) -> Tensor:
        fn = self.fn
        if self.program is not None:
            if name not in _GENERIC_ONLY:  # generated code where it applies (_capture/codegen.py)
                return _codegen.run(name, self.program, z, self.in_shape, *args)
            # a program's f is pure and keeps samples apart (its rules say so): torch.func over f itself
            fn = _flat_fn(self.fn, self.in_shape, math.prod(self.out_shape))
        engine = getattr(_nested, name)
        # torch's own formulas of some ops are wrong above first order (_rules/decompositions.py)
        with decompositions.exact(decompositions.wanted(_order(name, args))):
            if self.key not in _NO_FORWARD_AD:
                try:
                    return engine(fn, z, *args, scale)
                except NotImplementedError as err:  # an op without a forward-mode rule: see _nested
                    if "forward" not in str(err).lower() and "jvp" not in str(err).lower():
                        raise
                    with contextlib.suppress(TypeError):
                        _NO_FORWARD_AD.add(self.key)
            try:
                return engine(fn, z, *args, scale, reverse=True)
            except (NotImplementedError, RuntimeError) as err:  # no derivative of this order in torch
                clear = missing_derivative(
                    err, ("not implemented", "not supported"),
                    "torch has no derivative of the order asked for an operation in f, in forward or reverse mode",
                    " for Taylor mode. Write that operation in primitive ops, or make f traceable by torch.fx "
                    "(jm.plan says why it is not).")
                if clear is None:
                    raise
                raise clear from err

    def over_samples(self, width: Optional[int], lead: tuple[int, ...],
                     compute: Callable[[Tensor, Optional[Tensor]], Tensor]) -> Tensor:
        """``compute(z, scale) -> (*lead, b, Y)`` for all samples, ``width`` samples at a time."""
        batch, n_out = self.z.shape[0], math.prod(self.out_shape)
        if batch == 0 or n_out == 0:
            return self.z.new_zeros(*lead, batch, n_out)
        width = batch if width is None else width
        if self.rng is not None:
            self.rng.reset()
        if not self.coupled:
            if width >= batch:
                return compute(self.z, None)
            return torch.cat([self.chunk(compute, s, s + width) for s in range(0, batch, width)], -2)
        blocks = []
        for s in range(0, batch, width):
            e = min(batch, s + width)
            masks = one_hot(s, e, batch, self.z)[..., None]  # (e - s, B, 1): one sample each
            out = vmap(lambda m: compute(self.z, m), randomness="same")(masks)
            k = torch.arange(e - s, device=out.device)
            blocks.append(out.movedim(-2, 1)[k, s + k].movedim(0, -2))  # (*lead, e - s, Y)
        return torch.cat(blocks, -2)


    def chunk(self, compute: Callable[..., Tensor], start: int, stop: int, *extra: Any) -> Tensor:
        """``compute(z[start:stop], None, *extra)`` with the riders of those samples."""
        with self.rows(start, stop):
            return compute(self.z[start:stop], None, *extra)


def _flat_fn(f: Any, in_shape: tuple[int, ...], n_out: int) -> Fn:
    return lambda z: f(z.reshape(z.shape[0], *in_shape)).reshape(z.shape[0], n_out)


def _order(name: str, args: tuple[Any, ...]) -> int:
    """The derivative order of a call of the engine function ``name`` with ``args``."""
    if name == "partial":
        return len(args[0])
    if name == "partials":
        return max(len(t) for t in args[0])
    return 1 if name == "first" else 2


def validated(f: Any, x: Any, name: str, structure: Any, chunk_size: Any, create_graph: Any,
              devices: bool = True) -> Options:
    """The checks of a derivative operator's input and options. ``devices=False``: the caller
    checks the devices of f's parameters itself (:func:`evaluate` with ``direct``, from its walk)."""
    _checks.check_input(x, wrt="inputs", batched=True, name=name)
    _checks.check_function(f)  # what _jacobian._options checks, x once
    opts = _checks.check_options(wrt="inputs", mode="forward", batched=True, structure=structure,
                                 chunk_size=chunk_size, create_graph=create_graph, flatten=True)
    if devices:
        _checks.check_devices(f, x)
    if opts.structure == "diagonal":
        raise ValueError(
            "structure: 'diagonal' does not apply to the derivative operators. Use 'auto' (the "
            "default), 'independent' or 'coupled'; for elementwise f pass x of shape (B,) "
            "and use jacmode.derivative."
        )
    return opts


@dataclass(frozen=True)
class TargetEntry:
    """What a derivative operator's call keeps in f's profile for the later calls with its key
    (``_profile.py``): the facts of its :class:`Target`, which every operator of f shares.

    Attributes:
        program: f's captured program, checked at this signature; None: the generic path.
        out_shape: the shape of one sample's output.
        coupled: whether f's samples are coupled (the structure asked for or probed; False with a program).
        random: whether f has random layers in training mode (dropout): its passes replay one draw.
        widest: the widest ``nn.Linear`` output of f (0 for a plain function or the generic path).
    """

    program: Optional[Program]
    out_shape: tuple[int, ...]
    coupled: bool
    random: bool
    widest: int


@contextlib.contextmanager
def target(f: Fn, x: Tensor, opts: Options, modules: Optional[list[nn.Module]] = None,
           key: Optional[tuple] = None, survey: Optional[Survey] = None) -> Iterator[Target]:
    """The :class:`Target` of f at x; from f's profile for ``key`` when it has one (``_profile.py``),
    else found (capture and its check, or ``describe`` with the coupling probe) and profiled.
    ``survey``: the modules as the key's walk read them (``_profile.walked``), for the guard of a
    profile hit, which runs nothing before it (a first call captures first, and walks again)."""
    grad_mode = torch.enable_grad() if opts.create_graph else torch.no_grad()
    in_shape = tuple(x.shape[1:])
    source = f if isinstance(f, Flat) else None
    found = None if key is None else _profile.find(f, key)
    if found is not None and not _profile.fresh(found.facts.program, x):  # a closure's value changed: capture again
        _profile.forget(f, key)  # type: ignore[arg-type]
        found = None
    out_shape: tuple[int, ...]
    if found is None:
        program, _ = captured(f, x) if opts.structure in ("auto", "independent") else (None, "")
        if program is not None:  # independent samples and no state by construction: no probe needed
            checked = _capture.check(program, f, x, _taylor.value)
            assert isinstance(checked, tuple)
            out_shape = checked
            riders_independent(f, x, opts.structure, OPERATOR_WAYS_OUT)  # but riders may mix samples
            widest = _widest(f)
            if key is not None:
                _profile.keep(f, key, _profile.Profile(TargetEntry(program, out_shape, False, False, widest)),
                              modules or [])
    else:
        entry: TargetEntry = found.facts
        program, out_shape, coupled, random, widest = (entry.program, entry.out_shape, entry.coupled, entry.random,
                                                       entry.widest)
        if program is not None and source is not None:
            program = program.bind(inputs(f))  # riders are inputs of the program: this call's
    if program is not None:
        with grad_mode:
            z = (x if opts.create_graph else x.detach()).reshape(x.shape[0], math.prod(in_shape))
            yield Target(key=f, fn=f, z=z, in_shape=in_shape, program=program, coupled=False, rng=None,
                         out_shape=out_shape, widest=widest, source=source)
        return
    with preserved_state(f, modules, survey if found is not None else None), grad_mode:
        if found is None:
            p = describe(f, x, opts, OPERATOR_WAYS_OUT)
            out_shape, coupled, random, z = p.out_shape, p.structure == "coupled", p.random, p.z
            if key is not None:
                _profile.keep(f, key, _profile.Profile(TargetEntry(None, out_shape, coupled, random, 0)), modules or [])
        else:  # as describe's z: a copy (f may modify its input in place)
            z = (x if opts.create_graph else x.detach()).clone().reshape(x.shape[0], math.prod(in_shape))
        yield Target(key=f, fn=_flat_fn(f, in_shape, math.prod(out_shape)), z=z, in_shape=in_shape,
                     out_shape=out_shape, program=None, coupled=coupled,
                     rng=RngReplay(x.device) if random else None, source=source)


@dataclass(frozen=True)
class ReadyRun:
    """The generated code a target's profile holds ready for one operator and its arguments, in
    its ``runs`` (see :func:`evaluate`).

    Attributes:
        code: the code (``_capture/codegen.Ready``): its output at z, or None where what its key holds changed.
        width: the number of columns of z, x flattened per sample.
        assemble: the operator's result from the code's output.
        signature: x's input signature, its key in the captured program's ``checked`` table.
    """

    code: _codegen.Ready
    width: int
    assemble: Callable[[Tensor], Any]
    signature: tuple[Any, ...]


T = TypeVar("T")
# how an operator's body reads as one engine call (see evaluate): (engine function, its arguments,
# how the result is assembled from that call's output), or None where it is not one such call
Direct = Callable[[Target], Optional[tuple[str, tuple[Any, ...], Callable[[Tensor], Any]]]]


def direct_call(f: Any, x: Tensor, structure: Any, create_graph: Any, name: Hashable) -> Any:
    """The result of a derivative operator's call ``(f, x)`` from the code its profile holds ready
    (see :func:`evaluate`), before any other work: what its key holds (x's shapes, dtype and device,
    f's modules and parameters, the options as validated by the call that made the profile) is
    what the call's checks would check; ``name`` is :func:`evaluate`'s ``direct[0]``. Else the
    call's :class:`~jacmode._profile.Lookup` for ``evaluate(..., looked=)`` (one look-up per
    call), or None where the options are not plain values that a profile's token can name (the
    call validates them and raises).
    """
    if type(create_graph) is not bool or type(structure) is not str or isinstance(f, Flat):
        return None
    token = _TARGET_TOKEN.get((structure, create_graph))
    if token is None:
        return None
    looked = _profile.lookup(f, token, (x,), guard=False)
    found = looked.found
    if found is not None:
        was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(create_graph)
        try:
            out = _ready(found, name, f, x, create_graph)
        finally:
            torch._C._set_grad_enabled(was)
        if out is not None:
            _profile.served(f, token, looked, x)
            return connected(out[0], f, x, True) if create_graph else out[0]
    return looked


def _ready(found: _profile.Profile[TargetEntry], name: Hashable, f: Any, x: Tensor,
           create_graph: bool) -> Optional[tuple[Any]]:
    """(the result,) from the profile's code ready for ``name``, under the grad mode set to
    ``create_graph``; None where it has none, or its checks fail (then dropped: the call makes it
    again)."""
    run: Union[ReadyRun, Literal[False], None] = found.runs.get(name)
    if not run or not _profile.fresh(found.facts.program, x, run.signature):
        return None
    # without create_graph the code runs under no_grad: x itself serves unless it requires grad
    # (then detached: the code's key holds z's requires_grad=False)
    z = x if create_graph or not x.requires_grad else x.detach()
    out = run.code(z if z.dim() == 2 else z.reshape(x.shape[0], run.width))  # (B, N) already: z itself
    if out is None:  # what the code's key holds changed
        found.runs.pop(name, None)
        return None
    return (run.assemble(out),)


def evaluate(f: Fn, x: Tensor, opts: Options, body: Callable[[Target], T],
             direct: Optional[tuple[Hashable, Direct]] = None, looked: Optional[_profile.Lookup] = None) -> T:
    """``body`` of the :class:`Target` of f; on ``Unsupported``, again on the generic path.

    The target's facts (engine, shapes, coupling) are profiled per f and signature: they do not
    depend on which operator asks, so all operators of the same f and x share one profile.

    ``direct``: (a key of the operator and its arguments that the profile's key does not hold,
    e.g. ``chunk_size``; how its body reads as one engine call). A profile hit whose body is one
    call of generated code keeps that code, ready, in the profile (``Profile.runs``); the next
    hits run it straight away (``_capture/codegen.Ready``, which re-checks all that the code's
    own key holds), without a :class:`Target` or the code's look-up; its key is walked without the
    guard's survey (the guarded path of a function without a captured program walks again). A
    caller passing ``direct`` validated without the devices (``validated(..., devices=False)``):
    they are checked here where no profile is found (a profile's key holds the devices of x and of
    every parameter, as they were when its first call checked them). ``looked``: the look-up
    :func:`direct_call` made for this call (with ``direct``, and f not a ``Flat``).
    """
    token = _TARGET_TOKEN[opts.structure, opts.create_graph]
    tried = looked is not None and looked.key[0] == token  # direct_call looked up, and found no code ready
    if not tried:  # (inside a torch.func transform create_graph is True whatever the call said: another token)
        looked = _profile.lookup(f, token, (x,), guard=direct is None)
    assert looked is not None
    modules, key, survey, found = looked.modules, looked.key, looked.survey, looked.found
    try:
        was = torch.is_grad_enabled()  # a repeated call of a captured program: no context managers
        torch._C._set_grad_enabled(opts.create_graph)
        try:
            hit: Optional[Target] = None
            out = None
            if direct is not None and found is not None and not tried and not isinstance(f, Flat):
                out = _ready(found, direct[0], f, x, opts.create_graph)
                if out is not None:
                    result = out[0]
            if out is None:
                hit = None if found is None else _hit(f, x, opts, found)
                result = None if hit is None else body(hit)
                if hit is not None and direct is not None and direct[0] not in found.runs:  # type: ignore[union-attr]
                    _keep_direct(found, direct, hit, x)  # type: ignore[arg-type]
        finally:
            torch._C._set_grad_enabled(was)
        if out is not None or hit is not None:
            return connected(result, f, x, True) if opts.create_graph else result  # type: ignore[return-value]
        if direct is not None and found is None:
            _checks.check_devices(f, x)  # validated without them (see above)
        with target(f, x, opts, modules, key, survey) as t:
            return connected(body(t), f, x, opts.create_graph)
    except Unsupported as err:
        _profile.forget(f, key)
        program = _capture.program_for(f)
        if not isinstance(program, Program):
            raise
        _capture.reject(program, x, str(err))
    with target(f, x, opts, modules, key) as t:
        return connected(body(t), f, x, opts.create_graph)


def _keep_direct(found: _profile.Profile[TargetEntry], direct: tuple[Hashable, Direct], t: Target, x: Tensor) -> None:
    """Keep in the profile the generated code that ``t``'s body just ran as its one engine call,
    once that code exists (from the call that generates it, ``codegen.AFTER_CALLS``); False where
    it never will (the body is not one call, or the program cannot be generated)."""
    if t.source is not None or t.program is None:
        return
    plan = direct[1](t)
    # the profile's parameters: a hit's key checked their identity, shape, dtype, device and requires_grad
    vouched = {id(p) for p in found.holds if isinstance(p, Tensor)}
    code = None if plan is None else _codegen.ready(plan[0], t.program, t.z, t.in_shape, *plan[1], vouched=vouched)
    if plan is None or code is False:
        found.runs[direct[0]] = False
    elif code is not None:
        # (x's signature is the profile's: its key in program.checked too)
        found.runs[direct[0]] = ReadyRun(code, t.z.shape[1], plan[2], _profile.checked_key(x))


def _hit(f: Any, x: Tensor, opts: Options, found: _profile.Profile[TargetEntry]) -> Optional[Target]:
    """The :class:`Target` of a profile hit with a fresh captured program (what :func:`target`
    yields for it, without its generator context and grad-mode context), else None."""
    program = found.facts.program
    if program is None or not _profile.fresh(program, x):
        return None  # the guarded path, or capture again (target)
    source = f if isinstance(f, Flat) else None
    if source is not None:
        program = program.bind(inputs(f))  # riders are inputs of the program: this call's
    in_shape = tuple(x.shape[1:])
    z = (x if opts.create_graph else x.detach()).reshape(x.shape[0], math.prod(in_shape))
    return Target(key=f, fn=f, z=z, in_shape=in_shape, program=program, coupled=False, rng=None,
                  out_shape=found.facts.out_shape, widest=found.facts.widest, source=source)


# the derivative operators' targets in profile keys: one token per structure and create_graph
_TARGET_TOKEN = {(s, g): _profile.token("derivative operator target", {"structure": s, "create_graph": g})[0]
                 for s in ("auto", "independent", "coupled", "diagonal") for g in (False, True)}


def _widest(f: Any) -> int:
    """The widest ``nn.Linear`` output of a module (0 for a plain function): a pass's widest tensor."""
    if not isinstance(f, nn.Module):
        return 0
    return max([m.out_features for m in f.modules() if isinstance(m, nn.Linear)], default=0)


def direction_chunks(t: Target, n: int, chunk_size: Optional[int],
                     budget: Optional[int] = None) -> tuple[list[range], Optional[int]]:
    """Chunks of the n directions, and samples per pass (see the note on chunks)."""
    if t.coupled:
        return [range(n)], None if chunk_size is None else max(1, chunk_size // max(n, 1))
    if chunk_size is None:  # as many directions as fit the default budget
        width = max(t.widest, math.prod(t.in_shape), math.prod(t.out_shape))
        per_direction = t.z.shape[0] * width * t.z.element_size()
        chunk_size = max(1, (DEFAULT_PASS_BYTES if budget is None else budget) // max(per_direction, 1))
    step = max(1, min(n, chunk_size))
    return [range(s, min(n, s + step)) for s in range(0, n, step)], None


def check_dims(dims: Any, n: int) -> tuple[int, ...]:
    items = (dims,) if isinstance(dims, int) and not isinstance(dims, bool) else dims
    try:
        if isinstance(items, (str, bytes)) or any(isinstance(d, bool) for d in items):
            raise TypeError
        items = tuple(operator.index(d) for d in items)
    except TypeError:
        raise TypeError(
            f"dims: expected a tuple of input coordinates, e.g. (0,) for u_t or (1, 1) for u_xx, "
            f"got {type(dims).__name__} ({dims!r})."
        ) from None
    if not items:
        raise ValueError("dims: expected at least one coordinate to differentiate along, got ().")
    bad = [d for d in items if not -n <= d < n]
    if bad:
        raise ValueError(
            f"dims: coordinate {bad[0]} is out of range: each sample of x has D = {n} "
            f"coordinate(s), so dims must lie in 0..{n - 1} (or -{n}..-1)."
        )
    return tuple(d % n for d in items)
