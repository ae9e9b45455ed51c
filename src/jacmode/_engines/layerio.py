"""Layer inputs and output cotangents of Linear layers, for the per-layer product forms.

NOTE: [Layer I/O for products]
Per-sample gradients, the GGN diagonal and NTK blocks of a Linear layer only need, per sample,
its input a (B, *, I) and the cotangent G = d(scalar) / d(layer output) (K, B, *, O) for K
cotangents of the model output: the per-sample weight gradient is sum over * of G (x) a. One
forward pass with hooks records a and adds a zero probe z to the layer output (an in-place op
after the layer would corrupt the output itself, never the probe); one reverse pass to the probes,
vectorised over the K cotangents, gives every G. Autograd carries everything between layers, so
functional activations and residual code need no rule. A Linear layer called twice, or a selected
parameter outside every Linear layer, means the layer is not covered: the caller falls back to the
generic engine. ``complete`` checks once per model and signature that, for a random cotangent v,
the sum over samples of the per-layer gradients equals one ``autograd.grad`` of f(x) (it catches
parameters used outside their module, e.g. weight tying).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from .._cache import WeakCache

_VERDICTS = WeakCache("layer coverage")


@dataclass
class Layer:
    """One Linear call: its module, input a (B, *, I) and zero probe on its output (B, *, O)."""

    module: nn.Linear
    inputs: Tensor
    probe: Tensor


def owners(model: nn.Module, params: Sequence[Tensor]) -> Optional[list[nn.Linear]]:
    """The Linear modules owning every selected parameter, or None if some parameter has none."""
    wanted = {id(p) for p in params}
    found: list[nn.Linear] = []
    covered: set[int] = set()
    for m in model.modules():
        if type(m) is nn.Linear and any(id(p) in wanted for p in m.parameters(recurse=False)):
            found.append(m)
            covered |= {id(p) for p in m.parameters(recurse=False)}
    return found if wanted <= covered else None


@contextlib.contextmanager
def recorded(modules: Sequence[nn.Linear]) -> Iterator[list[Layer]]:
    """Hooks on ``modules`` for the duration of the block; yields the calls as they happen."""
    calls: list[Layer] = []

    def hook(module: nn.Module, args: tuple, out: Tensor) -> Tensor:
        probe = torch.zeros_like(out, requires_grad=True)
        calls.append(Layer(module, args[0].detach(), probe))  # type: ignore[arg-type]
        return out + probe

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def cotangents(out: Tensor, calls: Sequence[Layer], v: Tensor) -> list[Tensor]:
    """G (K, B, *, O) per call for the K cotangents v (K, B, *out) of ``out``, one reverse pass."""
    probes = [c.probe for c in calls]
    if v.shape[0] == 1:
        return [g.unsqueeze(0) for g in torch.autograd.grad(out, probes, v[0], retain_graph=True)]
    return list(torch.autograd.grad(out, probes, v, retain_graph=True, is_grads_batched=True))


def weight_grads(call: Layer, g: Tensor) -> Tensor:
    """Per-sample, per-cotangent weight gradients (K, B, O, I) from G (K, B, *, O)."""
    a = call.inputs
    if a.dim() == 2:
        return g.unsqueeze(-1) * a[None, :, None, :]
    return torch.einsum("kb...o,b...i->kboi", g, a)


def bias_grads(g: Tensor) -> Tensor:
    """Per-sample, per-cotangent bias gradients (K, B, O)."""
    return g if g.dim() == 3 else g.flatten(2, -2).sum(2)


def complete(model: nn.Module, key: tuple, x: Tensor, modules: Sequence[nn.Linear],
             params: Sequence[Tensor]) -> bool:
    """Whether the Linear layers account for every selected parameter's gradient (cached)."""
    hit = _VERDICTS.get(model, key)
    if hit is not None:
        return bool(hit)
    with torch.enable_grad(), recorded(modules) as calls:
        leaves = [p.detach().requires_grad_(True) for p in params]
        out = _call_with(model, params, leaves, x)
        v = torch.randn_like(out)
        seen = {id(c.module) for c in calls}
        ok = len(seen) == len(calls) and len(seen) == len(modules)
        if ok:
            full = torch.autograd.grad(out, leaves, v, retain_graph=True, allow_unused=True)
            gs = cotangents(out, calls, v.unsqueeze(0))
            mine = {}
            for c, g in zip(calls, gs):
                mine[id(c.module.weight)] = weight_grads(c, g).sum((0, 1))
                if c.module.bias is not None:
                    mine[id(c.module.bias)] = bias_grads(g).sum((0, 1))
            for p, ref in zip(params, full):
                got = mine.get(id(p))
                ref = torch.zeros_like(p) if ref is None else ref
                tol = 1e-4 if p.dtype == torch.float32 else 1e-8
                if got is None or not torch.allclose(got, ref, rtol=tol, atol=tol * (1 + float(ref.abs().max()))):
                    ok = False
                    break
    _VERDICTS.put(model, key, ok)
    return ok


def _call_with(model: nn.Module, params: Sequence[Tensor], leaves: Sequence[Tensor], x: Tensor) -> Tensor:
    """model(x) with ``params`` replaced by ``leaves`` (hooks stay active, unlike under vmap)."""
    named = {n: p for n, p in model.named_parameters()}
    by_id = {id(p): leaf for p, leaf in zip(params, leaves)}
    swap = {n: by_id[id(p)] for n, p in named.items() if id(p) in by_id}
    return torch.func.functional_call(model, swap, (x,))
