"""A captured computation (:class:`Program`), how it runs, and the check of it against ``f``.

``_engines/capture.py`` builds a Program from the torch.fx graph of a model; the Taylor engine
(``_engines/taylor.py``) runs it with coefficients. Before a Program serves inputs of a new shape,
:func:`check` runs it on three samples and compares its value with ``f`` itself (see the note in
``capture.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch
from torch import Tensor

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
    guards: list[Any] = field(default_factory=list)  # Python values frozen into the steps (``bound.Guard``)
    checked: dict[tuple, Union[tuple[int, ...], str]] = field(default_factory=dict)  # shape -> out shape | reason

    def run(self, alg: Algebra, x: Traced) -> Any:
        env: list[Any] = [x]
        for step in self.steps:
            args = _resolve(step.args, env)
            kwargs = _resolve(step.kwargs, env) if step.kwargs else {}
            env.append(step.fn(alg, *args, **kwargs) if step.traced else step.fn(*args, **kwargs))
        return _resolve(self.output, env)


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
