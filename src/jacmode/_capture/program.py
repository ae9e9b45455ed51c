"""A captured computation (:class:`Program`), how it runs, and the check of it against ``f``.

``_capture/capture.py`` builds a Program from the torch.fx graph of a model; the Taylor engine
(``_capture/taylor.py``) runs it with coefficients. Before a Program serves inputs of a new shape,
:func:`check` runs it on three samples and compares its value with ``f`` itself (see the note in
``capture.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor

from .._args import inputs, take
from .._cache import rng_kept
from .._rules.base import Algebra, Traced, Unsupported
from .._state import preserved_state
from .._transforms import plain as _plain


class Ref:
    """A reference to the result of an earlier step."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass
class Step:
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    traced: bool  # a rule (called with the algebra first) rather than a plain call
    name: str


@dataclass
class Program:
    """A captured computation: steps over slots, slot 0 the input."""

    steps: list[Step]
    output: Any
    ops: list[str]  # the traced operations, for plans
    bound: list[Any] = field(default_factory=list)  # tensors of f read on each run (``bound.Bound``)
    checked: dict[tuple, Union[tuple[int, ...], str]] = field(default_factory=dict)  # shape -> out shape | reason
    _dead: Optional[list[tuple[int, ...]]] = field(default=None, repr=False)  # see the note on memory
    _reads: list[dict[int, int]] = field(default_factory=list, repr=False)  # step -> slot -> times read
    riders_step: Optional[int] = None  # the step that yields the call's riders (a call of several arguments)

    def bind(self, values: tuple[Tensor, ...]) -> "Program":
        """The program of a call of several arguments with its riders (``_args.inputs``) read from
        ``values``: riders are inputs of the program, never constants of the capture. Shares the
        check results and the memory plan with ``self``; ``self`` itself when there are no riders."""
        if self.riders_step is None:
            return self
        self.last_uses()
        steps = list(self.steps)
        steps[self.riders_step] = Step(lambda: values, (), {}, False, "riders")
        return replace(self, steps=steps)

    def run(self, alg: Algebra, x: Traced) -> Any:
        """The program's output on x, each slot dropped after its last use (see the note)."""
        dead = self.last_uses()
        reuse = hasattr(alg, "spare") and not torch.is_grad_enabled()
        env: list[Any] = [x]
        for i, step in enumerate(self.steps):
            args = _resolve(step.args, env)
            kwargs = _resolve(step.kwargs, env) if step.kwargs else {}
            if reuse and step.traced:  # only a rule that is one elementwise map of its argument
                single = getattr(step.fn, "single_elementwise", False)
                setattr(alg, "spare", _spare(dead[i], self._reads[i], env) if single else set())
            env.append(step.fn(alg, *args, **kwargs) if step.traced else step.fn(*args, **kwargs))
            del args, kwargs
            for slot in dead[i]:
                env[slot] = None
        return _resolve(self.output, env)

    def last_uses(self) -> list[tuple[int, ...]]:
        """For each step, the slots that no later step (nor the output) reads: computed once.

        NOTE: [Memory of a forward pass]
        A Taylor pass carries coefficients of shape (L, B, *shape) for every intermediate tensor;
        kept until the pass ends, they make the peak grow with depth (one (D, B, H) tensor per
        layer for a Laplacian). A slot is needed only until the step that reads it last, so
        :meth:`run` drops it there and the peak is that of the widest step or two, not of the
        whole program. The slot of a step that nobody reads is dropped as soon as it is made.
        Without autograd (no ``create_graph``), an algebra with a ``spare`` attribute is told
        which coefficient tensors die at a step and are held by nothing else (:func:`_spare`), so
        that the step may overwrite them instead of allocating a new tensor; only for rules marked
        ``single_elementwise`` (one elementwise map of their argument, which they read once):
        a composite rule (softmax, mish, layer_norm) reads its argument's coefficients again.
        """
        if self._dead is None:
            last: dict[int, int] = {}  # slot -> index of the last step that reads it
            self._reads = []
            for i, step in enumerate(self.steps):
                reads = list(_refs((step.args, step.kwargs)))
                self._reads.append({slot: reads.count(slot) for slot in reads})
                for slot in reads:
                    last[slot] = i
            kept = set(_refs(self.output))
            dead: list[list[int]] = [[] for _ in self.steps]
            for slot in range(len(self.steps) + 1):
                if slot in kept:
                    continue
                i = last.get(slot, slot - 1)  # never read: drop it right after the step that made it
                if i >= 0:
                    dead[i].append(slot)
            self._dead = [tuple(d) for d in dead]
        return self._dead


def _tensors(v: Any) -> Iterator[Tensor]:
    """The coefficient tensors held by a slot's value (a Traced, or a tuple / list of them)."""
    if isinstance(v, Traced):
        yield from (v._coef or {}).values()  # an unbuilt seed holds no tensor yet (_rules/base.py)
    elif isinstance(v, (tuple, list)):
        for u in v:
            yield from _tensors(u)


def _spare(dying: tuple[int, ...], reads: dict[int, int], env: list[Any]) -> set[int]:
    """ids of the coefficient tensors that the step may overwrite: held by one Traced argument
    that this step reads once and no later step reads, contiguous, and shared with no other slot,
    by object or by storage (a view, an expand)."""
    slots = [s for s in dying if reads.get(s) == 1 and isinstance(env[s], Traced)]
    if not slots:
        return set()
    others = {id(t) for s, v in enumerate(env) if v is not None and s not in slots for t in _tensors(v)}
    counts: dict[int, int] = {}
    for s in slots:
        for t in env[s].coef.values():
            counts[id(t)] = counts.get(id(t), 0) + 1
    out = set()
    for s in slots:
        if sum(env[s] is v for v in env) != 1:  # the same Traced in another slot (an identity rule)
            continue
        for t in env[s].coef.values():
            if id(t) not in others and counts[id(t)] == 1 and t.is_contiguous() and _sole_storage(t):
                out.add(id(t))
    return out


def _sole_storage(t: Tensor) -> bool:
    try:
        return bool(torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2)  # itself + the storage object
    except (AttributeError, RuntimeError):  # another torch: never overwrite
        return False


def _refs(a: Any) -> Iterator[int]:
    """The slots that an argument structure refers to."""
    if type(a) is Ref:
        yield a.index
    elif isinstance(a, (tuple, list)):
        for v in a:
            yield from _refs(v)
    elif isinstance(a, dict):
        for v in a.values():
            yield from _refs(v)
    elif type(a) is slice:
        yield from _refs((a.start, a.stop, a.step))


def _resolve(a: Any, env: list[Any]) -> Any:
    if type(a) is Ref:
        return env[a.index]
    if isinstance(a, tuple):
        return tuple(_resolve(v, env) for v in a)
    if isinstance(a, list):  # fx's immutable_list too
        return [_resolve(v, env) for v in a]
    if isinstance(a, dict):
        return {k: _resolve(v, env) for k, v in a.items()}
    if type(a) is slice:
        return slice(_resolve(a.start, env), _resolve(a.stop, env), _resolve(a.step, env))
    return a


def check(program: Program, f: Any, x: Tensor, run: Callable[[Program, Tensor], Tensor]) -> Union[tuple[int, ...], str]:
    """Out shape per sample if ``program`` reproduces ``f`` on three samples of x, else the reason (cached)."""
    key = (tuple(x.shape[1:]), x.dtype, x.device.type)
    found = program.checked.get(key)
    if found is not None:
        return found
    xs = x[:3].detach().clone()  # three samples (not the sizes the coupling probe uses), f may modify them
    f = take(f, slice(0, 3))  # a call of several arguments: its batched riders follow the samples
    program = program.bind(inputs(f))
    try:
        with torch.no_grad(), rng_kept(x.device), preserved_state(f):  # f runs once more: leave no trace
            expected = f(xs)
            got = run(program, xs)
        if not isinstance(expected, Tensor) or expected.shape != got.shape or expected.dim() == 0:
            found = "the captured graph does not give the shape of f(x)"
        elif not torch.allclose(_plain(expected), _plain(got), rtol=1e-4, atol=1e-5, equal_nan=True):
            found = "the captured graph does not reproduce f(x)"
        else:
            found = tuple(expected.shape[1:])
    except Unsupported as err:
        found = str(err)
    except Exception as err:  # noqa: BLE001 -- f itself raised: let the generic path report it
        found = f"{type(err).__name__} while checking the captured graph"
    program.checked[key] = found
    return found


def reject(program: Program, x: Tensor, reason: str) -> None:
    """Send every later call with inputs shaped like x to the generic engine."""
    program.checked[(tuple(x.shape[1:]), x.dtype, x.device.type)] = reason
