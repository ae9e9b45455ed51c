"""Fallbacks for functions that defeat an engine, and torch's vmap warnings translated.

NOTE: [Fallbacks]
Three things stop the vectorised engines, and each has a slower path that still gives the right
answer:

* an operation without a forward-AD formula (``torch.cdist``, a custom ``autograd.Function``
  without ``jvp``): forward mode cannot run; reverse mode can.
* ``.item()``, Python branching on tensor values, or a custom ``autograd.Function`` without a
  vmap rule: ``vmap`` over samples cannot run (vmap over directions usually can, since the primal
  is not batched); a Python loop over samples with vmap over directions can.
* an ``autograd.Function`` written the old way (``forward(ctx, ...)`` without ``setup_context``),
  or a kernel that reads its inputs' memory directly (cuDNN's LSTM and GRU on a GPU): no
  ``torch.func`` transform runs it; plain ``torch.autograd.grad`` loops can.

``capabilities`` finds these before computing, by one jvp, one vjp and (for per-sample parameter
Jacobians) one vmap over two samples, on one sample, cached per function. Errors the probe could
not foresee are classified when the engines raise them (``classify``). ``mode="auto"`` then takes
the slower path with a ``JacmodeWarning``, given once per function and gap (``_cache.warn_once``,
from the first call on and whether or not f can be guarded); an explicit mode raises a
``ValueError`` that names the operation (and where in ``f`` it is called) and says which mode to
use instead.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor
from torch.func import functional_call, vjp, vmap

from .._threads import clone_tree, jvp  # jvp one thread at a time: see [Threads] in _threads.py
from .._args import take
from .._cache import Kind, register, rng_kept
from .._errors import JacmodeWarning, user_stacklevel
from .._problem import Problem
from .._rules.embedding import forward_gap
from .reverse import recording

_CAPS = Kind("capabilities")
_WARNED_OPS: set[str] = register(set(), "operations warned about (no vmap batching rule)")
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(__file__)


@dataclass
class Caps:
    """Why each engine cannot run ``f`` (None: it can). The warnings already given are kept apart
    from it (``_cache.warn_once``): a warning given is not a fact about f's state."""

    forward: Optional[str] = None
    vmap_samples: Optional[str] = None
    vmap_directions: Optional[str] = None
    functorch: Optional[str] = None


def _where(exc: BaseException) -> str:
    """'file.py:12 (`code`)': the last frame of the user's code in the traceback."""
    frames = [fr for fr in traceback.extract_tb(exc.__traceback__)
              if not fr.filename.startswith((_TORCH_DIR, _HERE)) and "<frozen" not in fr.filename]
    if not frames:
        return ""
    fr = frames[-1]
    return f" (called at {os.path.basename(fr.filename)}:{fr.lineno}: `{(fr.line or '').strip()}`)"


def _function_name(exc: BaseException) -> Optional[str]:
    """The custom autograd.Function being applied when ``exc`` was raised, if any."""
    tb = exc.__traceback__
    name = None
    while tb is not None:
        cls = tb.tb_frame.f_locals.get("cls")
        if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
            name = cls.__name__
        tb = tb.tb_next
    return name


def classify(exc: BaseException) -> Optional[tuple[str, str]]:
    """(kind, what) for errors a fallback can avoid: kind is "forward", "vmap" or "functorch"."""
    msg = str(exc)
    fn = _function_name(exc)
    if "setup_context staticmethod" in msg:
        return "functorch", f"custom autograd.Function {fn or '?'} without setup_context{_where(exc)}"
    if "doesn't have storage" in msg or "storage of TensorWrapper" in msg:  # (cuDNN's RNN kernels on a GPU)
        return "functorch", f"an operation that reads its inputs' memory directly{_where(exc)}"
    if "forward AD" in msg or "jvp function for custom autograd.Function" in msg:
        m = re.search(r"forward AD with (\S+) that", msg)
        what = f"aten::{m.group(1)}" if m else f"custom autograd.Function {fn or '?'} without jvp"
        return "forward", f"{what}{_where(exc)}"
    if "vmap" in msg or "Batching rule not implemented" in msg:
        m = re.search(r"vmap over (\w+), but", msg) or re.search(r"(aten::[\w.]+)", msg)
        if ".item()" in msg:
            what = ".item() or Python control flow on tensor values"
        elif m:
            name = m.group(1).rstrip(".")
            what = name if name.startswith("aten::") else f"custom autograd.Function {name} without a vmap rule"
        else:
            what = "an operation vmap cannot batch"
        return "vmap", f"{what}{_where(exc)}"
    return None


def params_fn(f: Any, p: Problem, x: Tensor) -> Callable[[Tensor], Tensor]:
    """z -> f(x), flat like ``p.fn``, with the selected parameters taken from z (x: a copy)."""
    sizes = [math.prod(shape) for _, shape in p.params]

    def fn(z: Tensor) -> Tensor:
        named = {n: t.view(shape) for (n, shape), t in zip(p.params, z.split(sizes))}
        out = functional_call(clone_tree(f), named, (x,))
        return out.reshape(x.shape[0], -1) if p.batched else out.reshape(-1)  # as p.fn

    return fn


def _one_sample(f: Any, p: Problem) -> tuple[Any, Tensor]:
    """A function of one sample and its point, for the probes; never on the user's x itself."""
    x = (p.x[:1] if p.batched else p.x).detach().clone()  # f may modify its input in place
    if p.kind == "params":
        return params_fn(f, p, x), p.z
    if p.batched:
        return take(f, slice(0, 1)), x  # a call of several arguments: the riders of that sample
    return p.fn, p.z


def _try(call: Any, any_error: bool = False) -> Optional[tuple[str, str]]:
    """Why ``call`` fails (see ``classify``); None if it runs. ``any_error``: every error counts
    (kind "error", with the error's type and message)."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - anything unforeseen surfaces in the real run
        return classify(exc) or (("error", f"{type(exc).__name__}: {exc}") if any_error else None)
    return None


def _pull_ones(out: Tensor, pull: Any) -> Any:
    return pull(torch.ones_like(out))


def capabilities(f: Any, key: tuple, p: Problem) -> Caps:
    """Probe once (per function ``f`` and key) which engines can run ``f``; see the note."""
    caps = _CAPS.get(f, key)
    if caps is not None:
        return caps
    caps = Caps()
    if p.kind == "params":  # exactness, not only ability: see [padding_idx and forward mode]
        caps.forward = forward_gap(f, [n for n, _ in p.params])
    if p.batch > 0 and p.n_in > 0:
        g, pt = _one_sample(f, p)
        with rng_kept(p.device), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with recording():  # each probe under the grad mode of the engine it stands for
                gap = _try(lambda: _pull_ones(*vjp(g, pt)), any_error=True)
            if gap is not None and gap[0] == "functorch":
                caps.functorch = gap[1]
            else:
                # where reverse mode runs, any error of forward mode is a gap of forward mode (torch's
                # jvp of CUDA layer norm in half precision mixes float32 into the tangent, for one)
                reverse_runs = gap is None
                gap = None if caps.forward else _try(lambda: jvp(g, (pt,), (torch.ones_like(pt),)),
                                                     any_error=reverse_runs)
                if gap is not None:
                    caps.forward = gap[1] if gap[0] != "error" else \
                        f"an operation whose forward mode fails here ({gap[1].strip().splitlines()[0][:200]})"
                one = p.sample_fn
                if p.kind == "params" and p.batched and p.structure == "independent" and one is not None:
                    xs = p.x[:2].detach().clone()
                    gap = _try(lambda: vmap(one, in_dims=(None, 0), randomness="different")(p.z, xs))
                    if gap is not None and gap[0] == "vmap":
                        with recording():  # what per_sample_rows runs: under vjp f may take other kernels
                            runs = _try(lambda: vmap(lambda xb: _pull_ones(*vjp(lambda z: one(z, xb), p.z)),
                                                     randomness="different")(xs), any_error=True) is None
                        caps.vmap_samples = None if runs else gap[1]
    _CAPS.put(f, key, caps)
    return caps


def learn(ident: Any, key: tuple, caps: Caps, plan: Any, kind: str, what: str) -> None:
    """Record a gap found while running ``plan`` (see ``classify``), so later calls avoid it."""
    if kind == "functorch" or (kind == "vmap" and plan.chunk_size == 1 and plan.loop):
        caps.functorch = what
    elif kind == "forward":
        caps.forward = what
    elif plan.strategy == "per-sample" and plan.loop is None:
        caps.vmap_samples = what
    elif caps.vmap_directions is None:
        caps.vmap_directions = what
    else:
        caps.functorch = what
    _CAPS.put(ident, key, caps)


def explicit_error(mode: str, kind: str, what: str) -> ValueError:
    """The error for an explicit mode that cannot run ``f``."""
    if kind == "forward" and what.startswith("nn.Embedding"):  # see [padding_idx and forward mode]
        return ValueError(
            f"mode: 'forward' would not be exact for {what}. Use mode='reverse' (or mode='auto', which "
            "takes reverse), or leave that layer's weight out of wrt=[...]."
        )
    if kind == "forward":
        return ValueError(
            f"mode: 'forward' needs a forward-AD (jvp) formula for every operation of f, but {what} "
            "has none. Use mode='reverse' (or mode='auto', which falls back to reverse), or give "
            "the autograd.Function a jvp staticmethod."
        )
    if kind == "functorch":
        return ValueError(
            f"mode: {mode!r} runs f under torch.func transforms, which cannot run {what}. Use "
            "mode='auto' (it falls back to plain torch.autograd.grad loops, slower), or add a "
            "setup_context staticmethod to the Function (see torch's 'Extending torch.func')."
        )
    rewrite = (", or rewrite the value-dependent code with torch.where / masks so that vmap can batch it"
               if ".item()" in what else "")
    return ValueError(
        f"mode: {mode!r} vectorises over samples with vmap, which cannot run {what}. Use mode='auto' "
        f"(it falls back to a loop over samples, slower) or mode='forward'{rewrite}."
    )


_PERF = re.compile(r"performance drop because we have not yet implemented the batching rule for (\S+?)\.?\s")


@contextlib.contextmanager
def translated_warnings() -> Iterator[None]:
    """Turn torch's vmap-fallback performance warnings into one ``JacmodeWarning`` per operation."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        m = _PERF.search(str(w.message))
        if m is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        elif m.group(1) not in _WARNED_OPS:
            _WARNED_OPS.add(m.group(1))
            warnings.warn(
                f"torch has no vmap batching rule for {m.group(1)}, so vmap runs it one direction "
                "at a time inside the vectorised pass: the result is right, only slower. "
                "mode='autotune' measures whether the other mode is faster for this f.",
                JacmodeWarning,
                stacklevel=user_stacklevel(),
            )
