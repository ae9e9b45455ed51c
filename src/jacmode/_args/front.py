"""The entry points' front (:func:`front`) and tail (:func:`finish`), the old one-argument forms and named coordinates.

See the note [Several arguments] in ``_args/__init__.py``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

from torch import Tensor
from torch.utils._pytree import tree_flatten

from .call import Call
from .describe import _positional, check_argnums, check_in_dims, describe_call
from .flat import _fmt


# ---- the entry points' front and tail ------------------------------------------------------------
def front(
    f: Any,
    args: tuple[Any, ...],
    kwargs: Any = None,
    *,
    argnums: Any = 0,
    in_dims: Any = 0,
    has_aux: Any = False,
    batched: bool = True,
    floating: bool = True,
    name: str = "x",
) -> Call:
    """Validate and describe the call of an entry point ``ep(f, *args, argnums=, in_dims=,
    kwargs=, has_aux=)``; ``call.fn`` and ``call.x`` are what the existing body takes.

    A call of one tensor (``ep(f, x)``) is ``simple``: ``call.fn is f`` and ``call.x is x``, and
    the body's own input checks speak as before.
    """
    if not callable(f):
        raise TypeError(
            f"f: expected an nn.Module or a callable, got {type(f).__name__} ({_fmt(f)}). Pass the model "
            "itself or a function such as `lambda x, t: model(torch.cat([x, t], 1))`.")
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux: expected True or False, got {type(has_aux).__name__} ({_fmt(has_aux)}).")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise TypeError(
            f"kwargs: expected a dict of f's keyword arguments (name -> value), got {type(kwargs).__name__} "
            f"({_fmt(kwargs)}). e.g. kwargs={{'mask': mask}}.")
    if not args:
        raise TypeError(
            f"{name}: missing: pass the input(s) of f after f, e.g. jm.jacobian(f, x) or jm.jacobian(u, x, t, "
            "argnums=(0, 1)).")
    if len(args) == 1 and not kwargs and not has_aux and isinstance(argnums, int) and not isinstance(argnums, bool):
        x = args[0]
        if isinstance(x, Tensor) or not any(isinstance(v, Tensor) for v in tree_flatten(x)[0]):
            check_argnums(argnums, 1)  # one input: the body checks it and speaks as before
            check_in_dims(in_dims, 1)
            return Call(f=f, batched=batched, argnums=(0,), int_argnums=True, has_aux=False, args_spec=None,  # type: ignore[arg-type]
                        leaves=[x], diff=[], diff_specs={}, riders={}, batch=0, names=(), fn=f, x=x, simple=True)
    return describe_call(f, tuple(args), kwargs, argnums=argnums, in_dims=in_dims, has_aux=has_aux,
                         batched=batched, floating=floating)


def flat_jacobian(call: Call, result: Tensor) -> Tensor:
    """An engine's (B, *out, *in) result for ``call.fn`` at ``call.x`` as (B, Y, D) (unbatched (Y, N))."""
    if call.batched:
        return result.reshape(result.shape[0], -1, math.prod(call.x.shape[1:]))
    return result.reshape(-1, call.x.numel())


def finish(call: Call, result: Any) -> Any:
    """``result``, with the auxiliary output of ``has_aux=True`` as torch.func returns it: a pair."""
    return (result, call.aux()) if call.has_aux else result


def legacy_trailing(f: Any, args: tuple[Any, ...], given: bool, looks: Callable[[Any], bool], option: str,
                    example: str) -> tuple[tuple[Any, ...], Any]:
    """Split the one-argument call ``ep(f, x, <option>)`` of the derivative operators (``order``,
    ``dims``, ``terms`` given positionally, as before several arguments) from ``ep(f, *args)``.

    The last positional argument is read as ``option`` when it is not given by keyword, there are
    exactly two positional arguments, and f takes one positional argument (or its signature is
    unknown and the last one looks like the option, with no tensor but a term's coefficient). When f takes more, the call is
    ambiguous: a clear error asks for the keyword. Returns (args, the option or None).
    """
    if given or len(args) != 2:
        return args, None
    one = _positional(f)[1]  # whether f takes exactly one positional argument (None: unknown)
    if one is True:  # f takes one argument: the last one is the option, whatever it is (checked later)
        return args[:1], args[1]
    if not looks(args[1]) or (option != "terms" and any(isinstance(v, Tensor) for v in tree_flatten(args[1])[0])):
        return args, None
    if one is False:
        raise TypeError(
            f"{option}: ambiguous call: f takes several positional arguments, and the last argument "
            f"{_fmt(args[1])} could be {option} (the one-argument form ep(f, x, {option})) or an argument of f. "
            f"Pass it by keyword: {example}; an argument of f that is a number goes after it, "
            "with argnums saying which arguments are differentiated.")
    return args[:1], args[1]


def trailing_inputs(option: str, looks: Callable[[Any], bool]) -> Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments f is called with, for an entry point whose one-argument form takes ``option``
    positionally after x (:func:`legacy_trailing`): for its scope (``_guard.entry``)."""

    def inputs(f: Any, args: tuple[Any, ...], options: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # an ambiguous call raises here as in the entry point itself, which then runs without a scope
        return legacy_trailing(f, args, options.get(option) is not None, looks, option, "")[0], \
            options.get("kwargs") or {}

    return inputs


def coordinate_args(coords: Sequence[Any], names: tuple[str, ...], name: str) -> Optional[tuple[int, ...]]:
    """The positional arguments named by coordinates (``"t"``, ``("x", 1)``, ``(0, 1)`` pairs), sorted;
    None when no coordinate names an argument. Plain int coordinates next to names are an error
    (they count in the flat input, which depends on argnums)."""
    named, plain = set(), False
    for c in coords:
        if isinstance(c, str):
            if c not in names:
                raise ValueError(
                    f"{name}: {c!r} is not the name of a positional argument of f (its arguments are "
                    f"{list(names)}). Name coordinates by f's parameter names, or by position as (argnum, i).")
            named.add(names.index(c))
        elif isinstance(c, tuple) and len(c) == 2 and isinstance(c[1], int) and isinstance(c[0], (str, int)) \
                and not isinstance(c[0], bool):
            if isinstance(c[0], str):
                if c[0] not in names:
                    raise ValueError(
                        f"{name}: {c[0]!r} is not the name of a positional argument of f (its arguments are "
                        f"{list(names)}). Name coordinates by f's parameter names, or by position as (argnum, i).")
                named.add(names.index(c[0]))
            else:
                named.add(c[0])
        else:
            plain = True
    if not named:
        return None
    if plain:
        raise ValueError(
            f"{name}: mixes argument names with plain int coordinates; plain ints count in the concatenated "
            "differentiated arguments, which depend on argnums. Name every coordinate (e.g. ('x', 0)), or pass "
            "argnums explicitly.")
    return tuple(sorted(named))


def resolve(call: Call, coords: Sequence[Any], name: str) -> tuple[Any, ...]:
    """Coordinates (ints, names, pairs) as columns of the flat input (ints pass through unchecked)."""
    if call.simple:
        return tuple(coords)
    return tuple(call.coordinate(c, name) for c in coords)
