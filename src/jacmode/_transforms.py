"""Calls inside torch.func transforms (``grad``, ``jacrev``, ``jacfwd``, ``jvp``, ``vmap`` around jacmode).

NOTE: [jacmode inside torch.func transforms]
A jacmode call inside a transform sees functorch-wrapped tensors: a grad or jvp level that the
outer transform differentiates through, a vmap level whose batch dimension the call never sees.
Two rules keep such a call exact:
- The result stays differentiable with respect to the transformed tensors, as torch.func's own
  functions are: inside a transform every call runs as with ``create_graph=True``
  (``_checks.check_options``). Detaching the input, or running under ``torch.no_grad()`` (which
  ``torch.func.grad`` honours inside the function it transforms), would hand the outer transform
  a constant and silently give zero derivatives.
- Python control flow never reads a batched value: checks that need a Python bool (the coupling
  probe's comparisons, the finiteness of the probed samples) read :func:`plain` values, all vmap
  slices at once, and random draws of the checks happen outside the transforms
  (:func:`outside`), where vmap's ``randomness="error"`` does not apply.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor


_PEEK = getattr(torch._C._functorch, "peek_interpreter_stack", None)


def in_transform() -> bool:
    """Inside a torch.func transform (grad, jvp, vmap, ...), where tensors may be wrapped."""
    return _PEEK is not None and _PEEK() is not None


def plain(t: Tensor) -> Tensor:
    """``t`` without torch.func's wrappers, the batch dims of vmap levels first: values that a
    Python bool may be taken of, which a batched tensor refuses. A plain tensor comes back as is."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        bdim = functorch.maybe_get_bdim(t) if functorch.is_batchedtensor(t) else -1
        t = functorch.get_unwrapped(t)
        t = t.movedim(bdim, 0) if bdim >= 0 else t
    return t


def samples_first(t: Tensor) -> Tensor:
    """:func:`plain` ``t`` with its own dim 0 (the samples) in front: (B, *vmapped, *rest)."""
    v = plain(t)
    return v.movedim(v.dim() - t.dim(), 0) if t.dim() else v


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """Run torch ops on plain tensors, as outside every transform (random draws of the checks)."""
    with torch._C._DisableFuncTorch():
        yield
