"""Every validation of user input, and the wording of its errors.

All checks run before any differentiation. Errors name the argument, what was expected, what was
received, and the fix: ``TypeError`` for wrong types, ``ValueError`` for wrong values.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn

from ._cache import register
from ._losses import SUPPORTED, is_torch_loss
from ._state import bound_values
from ._transforms import in_transform

MODES = ("auto", "forward", "reverse", "autotune")
STRUCTURES = ("auto", "independent", "coupled", "diagonal", "sparse")
WRT_KINDS = ("inputs", "params")

Wrt = Union[str, Sequence[str], Mapping[str, Tensor]]  # a dict: functional parameters (_functional.py)


@dataclass(frozen=True)
class Options:
    """Normalised keyword arguments of a jacobian or plan call."""

    wrt: str  # "inputs" or "params"
    param_names: Optional[tuple[str, ...]]  # selected parameter names when wrt is "params"
    mode: str
    batched: bool
    structure: str
    chunk_size: Optional[int]
    create_graph: bool
    flatten: bool
    max_memory: Optional[int] = None  # workspace budget in bytes, None for the default


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_function(f: Any) -> None:
    """``f`` must be an ``nn.Module`` or a callable."""
    if not callable(f):
        raise TypeError(
            f"f: expected an nn.Module or a callable taking one tensor, got {type(f).__name__} "
            f"({_fmt(f)}). Pass the model itself or a function such as `lambda x: model(x)`."
        )


def check_input(x: Any, *, wrt: str, batched: bool, name: str = "x") -> None:
    """``x`` must be a tensor; a floating tensor when it is differentiated; batched if asked."""
    if not isinstance(x, Tensor):
        if isinstance(x, (tuple, list, dict)) and any(isinstance(v, Tensor) for v in
                                                      (x.values() if isinstance(x, dict) else x)):
            raise TypeError(_several_tensors(x, wrt=wrt, name=name))
        raise TypeError(
            f"{name}: expected a torch.Tensor, got {type(x).__name__} ({_fmt(x)}). "
            f"Convert it first, e.g. `torch.as_tensor({name}, dtype=torch.float32)`."
        )
    if wrt == "inputs" and not (x.is_floating_point()):
        kind = "complex" if x.is_complex() else "integer/bool"
        raise TypeError(
            f"{name}: differentiating with respect to the inputs needs a real floating dtype "
            f"(float16, bfloat16, float32, float64), got {kind} dtype {x.dtype}. "
            f"Convert with `{name}.float()`, or use wrt='params' for integer inputs such as "
            "token ids."
        )
    if x.is_complex():
        raise TypeError(
            f"{name}: complex inputs are not supported, got dtype {x.dtype}. "
            "Split real and imaginary parts into a real tensor."
        )
    if batched and x.dim() == 0:
        raise ValueError(
            f"{name}: batched=True needs a batch dimension, got a 0-d tensor. "
            f"Pass {name}.reshape(1) for one sample, or batched=False for a single point."
        )


def _several_tensors(x: Any, *, wrt: str, name: str) -> str:
    """The message for a tuple, list or dict of tensors where one tensor is expected."""
    what = f"a {type(x).__name__} of {len(x)} items"
    if wrt == "inputs":
        rest = ("Pass the tensors that are not differentiated through a closure, e.g. "
                "`jm.jacobian(lambda x: f(x, mask), x)`; to differentiate several, concatenate them "
                "per sample (`torch.cat([a.flatten(1), b.flatten(1)], 1)`) and split them inside f.")
    else:
        rest = ("Pass the other arguments of the model through a wrapper module whose forward takes x "
                "alone (e.g. `forward(self, x): return self.model(x, self.mask)`).")
    return (
        f"{name}: expected one torch.Tensor, got {what}. jacmode differentiates one tensor, x of "
        f"shape (B, *in), and holds everything else fixed. {rest} A tuple or list of tensors is not "
        "read as a data set: pass data sets as an iterable of batches such as a DataLoader "
        "(see docs/datasets.md)."
    )


# check_options' results for plain values (Options is frozen)
_VALID: dict[tuple[Any, ...], Options] = register({}, "checked options")


def check_options(
    *,
    wrt: Any,
    mode: Any,
    batched: Any,
    structure: Any,
    chunk_size: Any,
    create_graph: Any,
    flatten: Any,
    max_memory: Any = None,
) -> Options:
    """Validate and normalise the keyword arguments shared by ``jacobian`` and ``plan``.

    The Options of plain values (a str ``wrt``, the others hashable) are remembered, by value and
    type (1 is not True) and whether a torch.func transform is active: a repeated call of the
    operators validates its options once.
    """
    key: Optional[tuple[Any, ...]] = None
    if type(wrt) is str:
        key = (wrt, mode, batched, structure, chunk_size, create_graph, flatten, max_memory, type(mode),
               type(batched), type(structure), type(chunk_size), type(create_graph), type(flatten),
               type(max_memory), in_transform())
        try:
            hit = _VALID.get(key)
        except TypeError:  # an unhashable value: validated (and refused) below
            key, hit = None, None
        if hit is not None:
            return hit
    opts = _check_options(wrt=wrt, mode=mode, batched=batched, structure=structure, chunk_size=chunk_size,
                          create_graph=create_graph, flatten=flatten, max_memory=max_memory)
    if key is not None and len(_VALID) < 4096:
        _VALID[key] = opts
    return opts


def _check_options(*, wrt: Any, mode: Any, batched: Any, structure: Any, chunk_size: Any, create_graph: Any,
                   flatten: Any, max_memory: Any) -> Options:
    """The body of :func:`check_options`."""
    param_names: Optional[tuple[str, ...]] = None
    if isinstance(wrt, str):
        if wrt not in WRT_KINDS:
            raise ValueError(
                f"wrt: expected one of {WRT_KINDS} or a list of parameter names, got {wrt!r}. "
                "Use wrt='inputs' for d out / d x, wrt='params' for d out / d parameters, or "
                "wrt=['layer.bias'] for a subset of parameters."
            )
        kind = wrt
    elif isinstance(wrt, (list, tuple)) and all(isinstance(n, str) for n in wrt):
        if len(wrt) == 0:
            raise ValueError(
                "wrt: got an empty list of parameter names. Name at least one parameter, "
                "or pass wrt='params' for all trainable parameters."
            )
        if len(set(wrt)) != len(wrt):
            raise ValueError(f"wrt: parameter names must be unique, got {list(wrt)!r}.")
        kind, param_names = "params", tuple(wrt)
    elif isinstance(wrt, dict):
        raise TypeError(
            "wrt: a dict of parameter tensors is not taken by this function (jacobian, plan, per_sample_grads, "
            "ggn, ntk and ntk_plan take one). Pass the names, wrt=list(params), and evaluate the module at the "
            "dict with torch.func.functional_call.")
    else:
        raise TypeError(
            f"wrt: expected 'inputs', 'params' or a list of parameter names (for a module also a dict name -> tensor), got "
            f"{type(wrt).__name__} ({_fmt(wrt)})."
        )
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(
            f"mode: expected one of {MODES}, got {mode!r}. 'auto' picks the faster of "
            "forward and reverse from the sizes involved; 'autotune' times both once and caches "
            "the winner."
        )
    if not isinstance(structure, str) or structure not in STRUCTURES:
        raise ValueError(
            f"structure: expected one of {STRUCTURES}, got {structure!r}. 'auto' assumes "
            "independent samples and checks it; 'independent' skips the check; 'coupled' "
            "computes the exact diagonal blocks of the whole-batch Jacobian; 'diagonal' is for "
            "elementwise functions; 'sparse' (with batched=False) detects and colours the pattern."
        )
    for name, value in (("batched", batched), ("create_graph", create_graph), ("flatten", flatten)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected True or False, got {type(value).__name__} ({_fmt(value)}).")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(
                f"chunk_size: expected a positive int or None, got {type(chunk_size).__name__} "
                f"({_fmt(chunk_size)})."
            )
        if chunk_size <= 0:
            raise ValueError(
                f"chunk_size: expected a positive number of directions per vectorised pass, got "
                f"{chunk_size}. Use None to let jacmode choose, or e.g. chunk_size=64."
            )
    if structure == "diagonal" and kind != "inputs":
        raise ValueError(
            "structure: 'diagonal' (elementwise functions) applies to wrt='inputs' only, got "
            f"wrt={wrt!r}. Use structure='auto' for parameter Jacobians."
        )
    if structure == "sparse" and (batched or kind != "inputs"):
        raise ValueError(
            "structure: 'sparse' is for the Jacobian of one point with respect to x (jm.jacobian "
            "with batched=False) or the Hessian of a scalar function (jm.hessian), got "
            f"batched={batched!r}, wrt={wrt!r}. Pass batched=False (and wrt='inputs'); for "
            "independent samples the default structure='auto' already skips the zero blocks."
        )
    if not batched and structure == "coupled":
        raise ValueError(
            "structure: 'coupled' describes a batch, but batched=False treats x as one point "
            "(its full Jacobian is already exact). Drop structure= or set batched=True."
        )
    return Options(
        wrt=kind,
        param_names=param_names,
        mode=mode,
        batched=batched,
        structure=structure,
        chunk_size=chunk_size,
        create_graph=create_graph or in_transform(),  # see the note in _transforms.py
        flatten=flatten,
        max_memory=check_max_memory(max_memory),
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def check_max_memory(value: Any) -> Optional[int]:
    """``max_memory``: None, a positive number of bytes, or a string such as "2GB" or "512MiB".

    KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB powers of 1024 (case-insensitive).

    Example:
        >>> check_max_memory("200MB"), check_max_memory("512 MiB"), check_max_memory(1e9)
        (200000000, 536870912, 1000000000)
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"max_memory: expected a number of bytes or a string such as '2GB' or '512MiB', got "
            f"{type(value).__name__} ({_fmt(value)})."
        )
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"max_memory: could not read {value!r} as an amount of memory. Write a number with "
                "an optional unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                "(powers of 1024), e.g. '2GB' or '512MiB', or pass the bytes as an int."
            )
        value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ValueError(
            f"max_memory: expected a positive amount of memory, got {_fmt(value)}. Pass e.g. "
            "max_memory='2GB', or None for the default (half of the free memory)."
        )
    return int(value)


class PytreeOutput(TypeError):
    """f returned a tuple, list or dict where a body of one tensor output was running.

    ``jm.jacobian(f, x)`` catches it and describes the call as torch.func's (``_args``), whose
    result is the matching pytree; every other entry point raises it as the TypeError it is.
    """


def check_output(out: Any, *, batched: bool, n_in: int, where: str = "f(x)") -> Tensor:
    """The function must return one tensor that keeps the batch dimension of its input.

    Raises:
        PytreeOutput: f returned a tuple, list or dict (a TypeError).
        TypeError: f returned anything else that is not a floating tensor.
        ValueError: with ``batched``, the output lost the batch dimension.
    """
    if not isinstance(out, Tensor):
        if isinstance(out, (tuple, list, dict)):
            raise PytreeOutput(
                f"f: expected {where} to return one torch.Tensor, got {type(out).__name__}. It returned a "
                "tuple/list/dict: select one output, e.g. `lambda x: model(x)[0]` or `lambda x: model(x)['logits']`.")
        raise TypeError(f"f: expected {where} to return one torch.Tensor, got {type(out).__name__}.")
    if not (out.is_floating_point()):
        raise TypeError(
            f"f: expected {where} to return a floating tensor (something to differentiate), got "
            f"dtype {out.dtype}. Return logits or probabilities, not class indices."
        )
    if batched and (out.dim() == 0 or out.shape[0] != n_in):
        got = tuple(out.shape)
        raise ValueError(
            f"f: with batched=True, {where} must keep the batch dimension: an input batch of "
            f"{n_in} samples gave output shape {got}. Do not reduce over dim 0 (e.g. use the "
            "per-sample loss, not its mean), or pass batched=False to treat x as one point."
        )
    return out


def check_param_selection(
    model: Any, names: Optional[Sequence[str]]
) -> list[tuple[str, nn.Parameter]]:
    """Return the (name, parameter) pairs to differentiate, in ``named_parameters()`` order."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"f: wrt='params' needs an nn.Module (its parameters are what is differentiated), got "
            f"{type(model).__name__}. Wrap the parameters in a module, or use wrt='inputs'."
        )
    bound = _bound_selection(model, names)
    if bound is not None:
        return bound
    all_named = dict(model.named_parameters())
    if names is None:
        chosen = [(n, p) for n, p in all_named.items() if p.requires_grad]
        if not chosen:
            raise ValueError(
                f"f: {type(model).__name__} has no trainable parameters (none with "
                "requires_grad=True), so wrt='params' has nothing to differentiate. Unfreeze some "
                "(p.requires_grad_(True)) or name them explicitly in wrt=[...]."
            )
        return chosen
    unknown = [n for n in names if n not in all_named]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(all_named), n=3)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"wrt: {name!r} is not a parameter of {type(model).__name__}.{hint} "
            f"Valid names are those of model.named_parameters(), e.g. {list(all_named)[:4]!r}."
        )
    wanted = set(names)
    return [(n, p) for n, p in all_named.items() if n in wanted]


def _bound_selection(model: Any, names: Optional[Sequence[str]]) -> Optional[list[tuple[str, nn.Parameter]]]:
    """Inside a call with ``wrt`` a dict (``_state.bind``): the dict's tensors, in its order."""
    values = bound_values(model)
    if values is None or names is None or not set(names) <= set(values):
        return None
    return [(n, values[n]) for n in names]  # type: ignore[misc]  # tensors in the parameters' slots


def check_param_values(model: Any, values: Any) -> dict[str, Tensor]:
    """``wrt`` as a dict name -> tensor, as for ``torch.func.functional_call(model, values, x)``.

    The names must be the module's parameters (or floating buffers), each value a floating tensor of
    that parameter's shape, all of one dtype and device; two names tied in the module must get the
    same tensor. Returns the dict (the caller binds it, see ``_functional.py``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"wrt: a dict of parameter tensors needs f to be an nn.Module (the dict replaces its parameters, as "
            f"in torch.func.functional_call(f, params, x)), got {type(model).__name__}. For a function of "
            "(params, x), pass the dict as an argument: jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0)).")
    if not values:
        raise ValueError("wrt: got an empty dict of parameters. Give at least one name -> tensor, or wrt='params'.")
    own = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    names = [*own, *(n for n, b in buffers.items() if b is not None and b.is_floating_point())]
    dtypes, devices = set(), set()
    for name, t in values.items():
        if not isinstance(name, str):
            raise TypeError(f"wrt: dict keys must be parameter names (str), got {type(name).__name__} ({_fmt(name)}).")
        if name not in own and name not in buffers:
            close = difflib.get_close_matches(name, names, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"wrt: {name!r} is not a parameter of {type(model).__name__}.{hint} The dict's names must be those "
                f"of model.named_parameters() (or of floating buffers), e.g. {names[:4]!r}.")
        mine = own[name] if name in own else buffers[name]
        if not isinstance(t, Tensor):
            raise TypeError(
                f"wrt: the value of {name!r} must be a tensor (the parameter's value), got {type(t).__name__} "
                f"({_fmt(t)}). Pass e.g. {{name: p.detach() for name, p in model.named_parameters()}}.")
        if not t.is_floating_point():
            raise TypeError(
                f"wrt: the value of {name!r} has dtype {t.dtype}; differentiating needs a floating dtype. "
                "Convert it with `.float()`.")
        if mine is not None and tuple(t.shape) != tuple(mine.shape):
            raise ValueError(
                f"wrt: the value of {name!r} has shape {tuple(t.shape)}, but the module's {name!r} has shape "
                f"{tuple(mine.shape)}. Give each name a tensor of its parameter's shape (for an ensemble from "
                "torch.func.stack_module_state, vmap over the stacked dim 0 instead of passing the stack).")
        dtypes.add(t.dtype)
        devices.add(t.device)
    if len(dtypes) > 1 or len(devices) > 1:
        raise TypeError(
            f"wrt: the dict's tensors must share one dtype and device, got {sorted(map(str, dtypes))} on "
            f"{sorted(map(str, devices))}. Convert them, e.g. {{n: t.double() for n, t in params.items()}}.")
    by_id: dict[int, list[str]] = {}
    for name, t in (*own.items(), *buffers.items()):
        if t is not None:
            by_id.setdefault(id(t), []).append(name)
    empty = [n for names_ in by_id.values() if not any(n in values for n in names_)
             for n in names_[:1] if (own[n] if n in own else buffers[n]).is_meta]
    if empty and not all(t.is_meta for t in values.values()) and not getattr(model, "_jacmode_wrapper", False):
        raise ValueError(
            f"wrt: the module's {empty[0]!r} is on the meta device (no values; torch.func.stack_module_state's "
            f"base model) and the dict does not give it. Give every parameter in the dict, and move the buffers "
            f"to the data's device, e.g. base.{empty[0].rpartition('.')[0] or empty[0]}.to_empty(device=...) "
            f"then load them, or keep a base model on the data's device.")
    for tied in by_id.values():
        given = [n for n in tied if n in values]
        if len(given) > 1 and len({id(values[n]) for n in given}) > 1:
            raise ValueError(
                f"wrt: {given!r} are tied in the module (one tensor), but the dict gives them different tensors. "
                "Give one of the names (the others follow it, as functional_call's tie_weights=True does), or the "
                "same tensor for all.")
    return dict(values)


def check_out_buffer(out: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A caller-provided ``out=`` tensor must match the result exactly."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}.")
    if tuple(out.shape) != shape:
        raise ValueError(
            f"out: expected shape {shape} (B, Y, P), got {tuple(out.shape)}. Allocate it with "
            f"torch.empty({shape}, dtype={dtype}, device='{device}')."
        )
    if out.dtype != dtype:
        raise ValueError(f"out: expected dtype {dtype} (the parameters' dtype), got {out.dtype}.")
    if out.device != device:
        raise ValueError(f"out: expected device {device} (the parameters' device), got {out.device}.")
    if out.requires_grad:
        raise ValueError("out: must not require grad; create_graph=True results cannot be written into out=.")
    return out


def check_devices(f: Callable[..., Any], x: Tensor) -> None:
    """A model and its input must live on the same device."""
    if isinstance(f, nn.Module):
        first = _first_parameter(f)  # named_parameters' first, without its generators (every call)
        if first is None or first.device == x.device:
            return
        for name, p in f.named_parameters():
            if p.device != x.device:
                raise ValueError(
                    f"x: is on {x.device} but parameter {name!r} of the model is on {p.device}. "
                    f"Move one of them, e.g. `x.to('{p.device}')` or `model.to('{x.device}')`."
                )
            break


def _first_parameter(m: nn.Module) -> Optional[Tensor]:
    """The first of ``m.named_parameters()`` (pre-order over the modules), or None."""
    stack = [m]
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for p in m._parameters.values():
            if p is not None:
                return p
        if m._modules:
            stack.extend([c for c in reversed(m._modules.values()) if c is not None])
    return None


def check_not_arguments(value: Any, name: str) -> None:
    """A tuple or list holding tensors is never read as a data set (nor as several arguments)."""
    if isinstance(value, (tuple, list)) and any(isinstance(v, Tensor) for v in value):
        raise TypeError(
            f"{name}: got a {type(value).__name__} of {len(value)} entries holding tensors, which jacmode "
            "reads neither as one input nor as a data set. For a model with extra inputs (a mask), pass them "
            "as separate arguments where the entry point takes them (`jm.jacobian(model, x, mask)`), or give f "
            "one input: `lambda x: model(x, mask)`, or for parameters an nn.Module whose forward(x) calls "
            "model(x, mask). For a data set, wrap the batches: `iter([x1, x2])`, a DataLoader, or a list of "
            "(x,) / (x, y) tuples (batches of several arguments: jm.jacobians(f, loader, n_args=2))."
        )


def check_one_argument(more: tuple[Any, ...], name: str) -> None:
    """Entry points of one tensor argument (the sparse ones): a clear error for f(x, t, ...)."""
    if more:
        raise TypeError(
            f"x: {name} takes f and one tensor x, got {len(more) + 1} positional arguments. Pass a function of "
            f"one tensor (e.g. `lambda z: f(z, t)`, or concatenate the arguments and split them inside f); "
            "several arguments are taken by jm.jacobian, jm.hessian and the derivative operators.")


def check_batches(batches: Any, name: str) -> None:
    """A data set must be an iterable of batches, not a tensor, string, mapping or tuple of tensors."""
    if isinstance(batches, Tensor) or isinstance(batches, (str, bytes, dict)) or not hasattr(
            batches, "__iter__"):
        raise TypeError(
            f"{name}: expected an iterable of batches (a DataLoader, a generator, a list of (x,) or "
            f"(x, y) tuples), got {type(batches).__name__} ({_fmt(batches)}). For one tensor x, "
            "call jm.jacobian(f, x, wrt='params'), or pass iter([x])."
        )
    check_not_arguments(batches, name)


def check_progress(progress: Any) -> None:
    """``progress`` is None (a bar on a terminal), True or False."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress: expected None, True or False, got {_fmt(progress)}.")


def check_rows_out(out: Any) -> Tensor:
    """``out=`` of a data set: a writable tensor or NumPy array (a memmap) with one row per sample."""
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise ValueError("out: the NumPy array is read-only; open the memmap with mode='w+' "
                             "or 'r+' (np.lib.format.open_memmap(path, mode='w+', ...)).")
        out = torch.from_numpy(out)
    if not isinstance(out, Tensor):
        raise TypeError(f"out: expected a torch.Tensor or a NumPy array (N, Y, P), got "
                        f"{type(out).__name__} ({_fmt(out)}).")
    if out.dim() == 0 or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor with one row per sample (N, Y, P), "
                         f"got shape {tuple(out.shape)}{'' if out.dim() == 0 else ', not contiguous'}. "
                         "Allocate it with torch.empty((N, Y, P)).")
    return out


# --- per_sample_grads, ntk, ggn (jacmode._products) ---


def check_outside_transforms(name: str, why: str, instead: str) -> None:
    """``name`` cannot run inside torch.func transforms: say so rather than return a constant.

    Not checked while Dynamo traces (``torch.compile``): there the interpreter stack always reads
    as a transform, and the compiled path (``_autodiff/traceable.py``) is plain torch.func."""
    if in_transform() and not torch.compiler.is_dynamo_compiling():
        raise ValueError(
            f"f: jm.{name} cannot run inside a torch.func transform (grad, jacrev, jacfwd, jvp, vmap "
            f"around the call): {why}, so the transform could not differentiate or batch through it "
            f"(its derivative would read as zero). Call jm.{name} outside the transform; {instead}"
        )


NTK_METHODS = ("auto", "contraction", "products", "structured")
GGN_LOSSES = ("mse", "cross_entropy")


def check_product_options(*, wrt: Any, chunk_size: Any, max_memory: Any, flatten: Any = True) -> Options:
    """``wrt``, ``chunk_size``, ``max_memory`` (and ``flatten``) of per_sample_grads, ntk, ggn."""
    opts = check_options(wrt=wrt, mode="auto", batched=True, structure="auto", chunk_size=chunk_size,
                         create_graph=False, flatten=flatten, max_memory=max_memory)
    if opts.wrt != "params":
        raise ValueError(
            "wrt: per_sample_grads, ntk and ggn differentiate with respect to parameters, got "
            "wrt='inputs'. Pass wrt='params' (all trainable parameters) or a list of parameter "
            "names; for input derivatives use jm.jacobian(f, x)."
        )
    return opts


def check_loss(loss: Any, *, name: str = "loss") -> None:
    """A per-sample loss must be callable."""
    if not callable(loss):
        raise TypeError(
            f"{name}: expected a callable mapping f(x) (B, *out) to per-sample losses (B,), got "
            f"{type(loss).__name__} ({_fmt(loss)}). E.g. "
            "`lambda out, y: F.cross_entropy(out, y, reduction='none')` with y=labels."
        )


def check_torch_loss(loss: Any, y: Any, where: str) -> None:
    """One of torch's loss modules: a supported type, with targets ``y`` (see ``_losses.py``)."""
    if not is_torch_loss(loss):
        return
    if not isinstance(loss, SUPPORTED):
        names = ", ".join(f"nn.{t.__name__}" for t in SUPPORTED)
        raise TypeError(
            f"loss: {where} takes torch's {names}; got {type(loss).__name__}, whose reduction jacmode "
            "cannot read. Pass a callable `lambda out, y: ...` returning per-sample losses (B,)."
        )
    if loss.reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss: reduction must be 'mean', 'sum' or 'none', got {loss.reduction!r}.")
    if y is None:
        raise ValueError(
            f"y: {where} with nn.{type(loss).__name__} needs the targets it compares f(x) with; pass "
            "y= (one row per sample: class indices (B, *T) for cross entropy, values shaped like f(x) "
            "otherwise), or yield (x, y) batches from a data set."
        )


def check_losses(value: Any, batch: int) -> Tensor:
    """The loss must return one floating tensor of shape (B,): one loss per sample."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(
            f"loss: expected a floating tensor of per-sample losses, shape ({batch},), got "
            f"{type(value).__name__}{'' if not isinstance(value, Tensor) else ' of dtype ' + str(value.dtype)}."
        )
    if tuple(value.shape) != (batch,):
        raise ValueError(
            f"loss: expected per-sample losses of shape ({batch},), got {tuple(value.shape)}. "
            "Do not reduce over the batch: pass reduction='none' (e.g. F.mse_loss(out, y, "
            "reduction='none').sum(1)) and sum any per-sample output dimensions, or pass torch's loss "
            "module itself (e.g. nn.MSELoss(), any reduction)."
        )
    return value


def check_target(y: Any, batch: int, name: str = "y") -> None:
    """Targets must be a tensor with one row per sample."""
    if y is None:
        return
    if not isinstance(y, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of targets or None, got {type(y).__name__} ({_fmt(y)}).")
    if y.dim() == 0 or y.shape[0] != batch:
        raise ValueError(
            f"{name}: expected one target per sample, shape ({batch}, ...), got {tuple(y.shape)}. "
            "Pass the targets of the same batch as x."
        )


def check_second_input(x1: Tensor, x2: Any) -> None:
    """``x2`` of ntk must be a batch like ``x1`` (same per-sample shape, dtype, device)."""
    if x2 is None:
        return
    check_input(x2, wrt="params", batched=True, name="x2")
    if x2.shape[1:] != x1.shape[1:] or x2.dtype != x1.dtype or x2.device != x1.device:
        raise ValueError(
            f"x2: expected a batch of samples like x1 (per-sample shape {tuple(x1.shape[1:])}, "
            f"{x1.dtype}, {x1.device}), got shape {tuple(x2.shape)}, {x2.dtype}, {x2.device}. "
            "Convert it, or pass x2=None for the kernel of x1 with itself."
        )


def check_ntk_method(method: Any, trace: Any) -> None:
    """``method`` of ntk, and ``trace`` a bool."""
    if not isinstance(method, str) or method not in NTK_METHODS:
        raise ValueError(
            f"method: expected one of {NTK_METHODS}, got {method!r}. 'auto' picks the fastest "
            "from the sizes (see jm.ntk_plan)."
        )
    if not isinstance(trace, bool):
        raise TypeError(f"trace: expected True or False, got {type(trace).__name__} ({_fmt(trace)}).")


def check_ggn_loss(loss: Any, diagonal: Any) -> None:
    """``loss`` of ggn: 'mse', 'cross_entropy', a torch loss module or a callable returning (B, Y, Y)."""
    if isinstance(loss, str):
        if loss not in GGN_LOSSES:
            raise ValueError(
                f"loss: expected one of {GGN_LOSSES} or a callable returning the per-sample "
                f"Hessians (B, Y, Y) of the loss with respect to f(x), got {loss!r}."
            )
    elif not callable(loss):
        raise TypeError(
            f"loss: expected 'mse', 'cross_entropy' or a callable out -> (B, Y, Y), got "
            f"{type(loss).__name__} ({_fmt(loss)})."
        )
    if not isinstance(diagonal, bool):
        raise TypeError(f"diagonal: expected True or False, got {type(diagonal).__name__} ({_fmt(diagonal)}).")


def check_ggn_target(loss: Any, y: Any, batch: int) -> None:
    """``y`` of ggn: targets of a torch loss module; a Hessian callable never receives them."""
    if y is None:
        return
    if callable(loss) and not is_torch_loss(loss) and not isinstance(loss, str):
        raise ValueError(
            "y: a Hessian callable gets f(x) only, never targets. Close over them "
            "(`lambda out: hessians(out, y)`), or pass torch's loss module (e.g. nn.CrossEntropyLoss()) with y=."
        )
    check_target(y, batch)


def check_hessians(value: Any, batch: int, n_out: int) -> Tensor:
    """A Hessian callable of ggn must return (B, Y, Y)."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(f"loss: the Hessian callable must return a floating tensor (B, Y, Y), got {type(value).__name__}.")
    if tuple(value.shape) != (batch, n_out, n_out):
        raise ValueError(
            f"loss: the Hessian callable must return per-sample Hessians of shape ({batch}, {n_out}, "
            f"{n_out}) (B, Y, Y with Y = outputs per sample), got {tuple(value.shape)}."
        )
    return value


# --- sparse Jacobians and Hessians (jacmode._sparse) ---

SPARSE_LAYOUTS = ("csr", "coo", "dense")
SPARSE_MODES = ("auto", "forward", "reverse")
PARTITIONS = ("auto", "column", "row", "star", "bidirectional")
COLOR_ORDERS = ("best", "natural", "largest_first", "smallest_last", "incidence", "fields")


def check_sparse_args(*, layout: Any = "csr", mode: Any = "auto", hessian: Any = False,
                      pattern: Any = None, partition: Any = "auto", order: Any = "best") -> None:
    """Options of jm.sparsity, jm.coloring, jm.sparse_jacobian and jm.sparse_hessian."""
    from ._sparse.pattern import SparsityPattern

    for name, value, allowed in (("layout", layout, SPARSE_LAYOUTS), ("mode", mode, SPARSE_MODES),
                                 ("partition", partition, PARTITIONS), ("order", order, COLOR_ORDERS)):
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {_fmt(value)}.")
    if not isinstance(hessian, bool):
        raise TypeError(f"hessian: expected True or False, got {type(hessian).__name__} ({_fmt(hessian)}).")
    if pattern is not None and not isinstance(pattern, SparsityPattern):
        raise TypeError(f"pattern: expected a SparsityPattern from jm.sparsity(f, x), got "
                        f"{type(pattern).__name__} ({_fmt(pattern)}).")
    if pattern is not None and partition == "star" and not pattern.symmetric:
        raise ValueError("partition: 'star' colours symmetric (Hessian) patterns, got a Jacobian "
                         "pattern. Use 'column' or 'row', or jm.sparsity(f, x, hessian=True).")
    if pattern is not None and partition in ("column", "row", "bidirectional") and pattern.symmetric:
        raise ValueError(f"partition: a Hessian pattern is coloured with 'star' (or 'auto'), got "
                         f"{partition!r}.")


# Linear differential operators and their estimators (``_operators.py``)

DISTRIBUTIONS = ("rademacher", "gaussian")


def check_directions(directions: Any, x: Tensor) -> Optional[Tensor]:
    """None, or the vectors (M, 1 | B, N) of ``directions`` given as (M, N) or per sample (B, M, N)."""
    if directions is None:
        return None
    n = math.prod(x.shape[1:])
    if not isinstance(directions, Tensor) or not directions.is_floating_point():
        raise TypeError(
            f"directions: expected a floating tensor of shape (M, D) or (B, M, D), got "
            f"{type(directions).__name__} ({_fmt(directions)}). Pass one vector per row, e.g. torch.eye(D)."
        )
    if directions.dim() == 2 and directions.shape[1] == n:
        return directions.to(x.dtype)[:, None, :]
    if directions.dim() == 3 and directions.shape[0] == x.shape[0] and directions.shape[2] == n:
        return directions.to(x.dtype).transpose(0, 1)
    raise ValueError(
        f"directions: expected shape (M, {n}) or ({x.shape[0]}, M, {n}) for x of shape {tuple(x.shape)}, "
        f"got {tuple(directions.shape)}. Each row is one direction in the D = {n} input coordinates."
    )


def check_terms(terms: Any, x: Tensor, labels: int, directions: bool) -> list[tuple[Any, tuple[int, ...]]]:
    """Terms ``(c, dims)`` of a linear operator, with dims sorted and c a number or a tensor."""
    what = "rows of directions" if directions else "input coordinates"
    if isinstance(terms, (str, bytes, Tensor)) or not isinstance(terms, Sequence) or not terms:
        raise TypeError(
            f"terms: expected a non-empty list of (coefficient, dims) pairs, e.g. [(1.0, (0, 0)), "
            f"(1.0, (1, 1))] for u_00 + u_11, got {_fmt(terms)}."
        )
    out = []
    for term in terms:
        if not isinstance(term, (tuple, list)) or len(term) != 2:
            raise TypeError(f"terms: each term must be a pair (coefficient, dims), e.g. (2.0, (0, 1)), got {_fmt(term)}.")
        coef, dims = term
        if isinstance(coef, bool) or not isinstance(coef, (int, float, Tensor)):
            raise TypeError(
                f"terms: a coefficient must be a number or a tensor ((B,) per sample, (1 | B, *out) per output), "
                f"got {type(coef).__name__} ({_fmt(coef)})."
            )
        if isinstance(coef, Tensor):
            if not coef.is_floating_point():
                raise TypeError(f"terms: a tensor coefficient must be floating point, got dtype {coef.dtype}.")
            if coef.dim() == 0:
                coef = coef.reshape(1).expand(x.shape[0])
            if coef.dim() == 1 and coef.shape[0] != x.shape[0]:
                raise ValueError(
                    f"terms: a coefficient of shape (B,) must have one entry per sample, B = {x.shape[0]}, got "
                    f"{tuple(coef.shape)}. For weights per output component pass shape (1, *out)."
                )
            if coef.dim() >= 2 and coef.shape[0] not in (1, x.shape[0]):
                raise ValueError(
                    f"terms: a coefficient of shape (1 | B, *out) must lead with 1 or B = {x.shape[0]}, got {tuple(coef.shape)}."
                )
            coef = coef.to(x.dtype)
        items = (dims,) if isinstance(dims, int) and not isinstance(dims, bool) else dims
        if isinstance(items, (str, bytes)) or not isinstance(items, (tuple, list)) or any(
                isinstance(d, bool) or not isinstance(d, int) for d in items):
            raise TypeError(f"terms: dims must be a tuple of {what}, e.g. (0, 0), got {_fmt(dims)}.")
        bad = [d for d in items if not -labels <= d < labels]
        if bad:
            raise ValueError(f"terms: dims entry {bad[0]} is out of range: there are {labels} {what}, so dims "
                             f"must lie in 0..{labels - 1} (or -{labels}..-1, counting from the end, as jm.partial does).")
        out.append((coef, tuple(sorted(d % labels for d in items))))
    return out


def check_term_outputs(read: Sequence[tuple[Tensor, tuple[int, ...]]], batch: int, out_shape: tuple[int, ...]) -> None:
    """Per-output coefficients (1 | B, Y) must match f's output per sample."""
    n_out = math.prod(out_shape)
    for coef, _ in read:
        if coef.shape[1] != n_out:
            raise ValueError(
                f"terms: a coefficient per output component must have shape (1 | B, *out) with out = "
                f"{out_shape} ({n_out} entries per sample), got {coef.shape[1]} entries per sample."
            )


def check_weight(weight: Any, x: Tensor) -> Optional[Tensor]:
    """None, or S as (R, 1 | B, N) (one direction per column of S), for C = S S^T."""
    if weight is None:
        return None
    n = math.prod(x.shape[1:])
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise TypeError(
            f"weight: expected a floating tensor S of shape (D, R) or (B, D, R), with C = S S^T, got "
            f"{type(weight).__name__} ({_fmt(weight)})."
        )
    if weight.dim() == 2 and weight.shape[0] == n:
        return weight.to(x.dtype).t()[:, None, :]
    if weight.dim() == 3 and weight.shape[0] == x.shape[0] and weight.shape[1] == n:
        return weight.to(x.dtype).permute(2, 0, 1)
    raise ValueError(
        f"weight: expected S of shape ({n}, R) or ({x.shape[0]}, {n}, R) so that C = S S^T is D x D for "
        f"x of shape {tuple(x.shape)}, got {tuple(weight.shape)}. For a symmetric positive semi-definite C "
        "pass S = torch.linalg.cholesky(C) (or an eigendecomposition's Q sqrt(L))."
    )


def check_estimator(samples: Any, distribution: Any, generator: Any, return_std: Any,
                    allowed: Sequence[str] = DISTRIBUTIONS) -> Optional[int]:
    """``samples`` None (exact) or a positive int, and the estimator's options."""
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int)):
        raise TypeError(f"samples: expected None (exact) or a positive int of random directions, got {_fmt(samples)}.")
    if samples is not None and samples < 1:
        raise ValueError(f"samples: expected a positive number of random directions, got {samples}. Use None for the exact value.")
    if distribution not in allowed:
        others = [d for d in DISTRIBUTIONS if d not in allowed]
        hint = f" ({others[0]} directions give a biased estimate here)" if others and distribution in others else ""
        raise ValueError(f"distribution: expected one of {', '.join(map(repr, allowed))}, got {distribution!r}{hint}.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}.")
    if not isinstance(return_std, bool):
        raise TypeError(f"return_std: expected a bool, got {type(return_std).__name__}.")
    if return_std and samples is None:
        raise ValueError("return_std: the exact value has no spread; pass samples=K to estimate it from K directions.")
    if return_std and samples is not None and samples < 2:
        raise ValueError(f"return_std: the spread needs at least 2 directions, got samples={samples}.")
    return samples
