"""Per-sample parameter Jacobians of Linear/activation stacks by explicit backpropagation.

NOTE: [Layer-wise reverse mode for parameters]
For an ``nn.Sequential`` of ``nn.Linear`` layers and known activations (the stacks of
``layers_of``), the per-sample Jacobian of the Y outputs with respect to every parameter
has a closed form, the one BackPACK computes: carry the sensitivity G = d out / d (layer output),
one row per output direction, shape (Y, B, H), from the top (the identity, one row shared by all
samples) down through the layers. Through an activation G becomes s'(h) * G; through a Linear
layer with input a (B, I), the weight block is G (x) a, the bias block is G, and G becomes G W.
Each block is written straight into its slice of the (B, Y, P) result (or the caller's ``out=``),
so nothing is concatenated and no vmap runs: one forward pass, Y-wide matrix products on the way
down, and the writes of the result itself. Plain torch operations on the parameters keep the result
differentiable (``create_graph=True``); then the blocks are concatenated instead of written in place.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .._rules.elementwise import jet, rule


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _leaves(f: nn.Sequential) -> Optional[list[nn.Module]]:
    layers: list[nn.Module] = []
    for m in f:  # not children(): a module used twice appears twice
        if _hooked(m):
            return None
        if type(m) is nn.Sequential:
            inner = _leaves(m)
            if inner is None:
                return None
            layers.extend(inner)
        elif type(m) is nn.Linear or rule(m) is not None:
            layers.append(m)
        else:
            return None
    return layers


def layers_of(f: object, in_shape: tuple[int, ...]) -> Optional[list[nn.Module]]:
    """The layers of ``f`` if explicit backpropagation applies to it for per-sample inputs of ``in_shape``.

    It applies to an ``nn.Sequential`` (nested ones included) of exactly ``nn.Linear`` and known
    activations, without hooks, whose input is (B, D) with D the first Linear's in_features.
    """
    if type(f) is not nn.Sequential or len(in_shape) != 1 or _hooked(f):
        return None
    if getattr(nn.modules.module, "_global_forward_hooks", None) or getattr(
        nn.modules.module, "_global_forward_pre_hooks", None
    ):
        return None
    layers = _leaves(f)
    if layers and type(layers[0]) is nn.Linear and layers[0].in_features != in_shape[0]:
        return None
    return layers


def applies(layers: Optional[Sequence[nn.Module]], params: Sequence[Tensor]) -> bool:
    """Whether the fast path can compute the Jacobian for these selected parameters."""
    if not layers:
        return False
    owned = [p for m in layers if type(m) is nn.Linear for p in m.parameters()]
    # a layer used twice, or a selected parameter outside the stack: the generic path handles it
    return len({id(p) for p in owned}) == len(owned) and {id(p) for p in params} <= {id(p) for p in owned}


def param_jacobian(
    layers: Sequence[nn.Module], x: Tensor, params: Sequence[Tensor], out: Optional[Tensor], differentiable: bool
) -> Tensor:
    """(B, Y, P) Jacobian of the stack at x (B, D) with respect to ``params`` (flattened, in order).

    Args:
        layers: the stack, from ``layers_of``.
        x: the inputs, shape (B, D).
        params: the selected parameters, in ``named_parameters()`` order.
        out: a (B, Y, P) tensor to write into, or None.
        differentiable: keep the graph (no in-place writes).
    """
    offsets, start = {}, 0
    for p in params:
        offsets[id(p)] = (start, p.numel())
        start += p.numel()
    inputs: list[Tensor] = []
    jets = []
    h = x
    for m in layers:  # forward pass, keeping what the way down needs
        if type(m) is nn.Linear:
            inputs.append(h)
            h = torch.nn.functional.linear(h, m.weight, m.bias)
        else:
            j = jet(m, h, 1)
            jets.append(j)
            h = j.value
    batch, n_out = x.shape[0], h.shape[-1]
    g = torch.eye(n_out, dtype=x.dtype, device=x.device).unsqueeze(1)  # (Y, 1, Y)
    result = out
    if result is None and not differentiable:
        result = x.new_empty(batch, n_out, start)
    blocks: dict[int, Tensor] = {}
    for m in reversed(layers):
        if type(m) is nn.Linear:
            a = inputs.pop()
            for p in (m.weight, m.bias):
                if p is None or id(p) not in offsets:
                    continue
                lo, n = offsets[id(p)]
                factors: tuple[Tensor, ...]
                if p is m.weight:  # (B, Y, O, I) = G[y, b, o] a[b, i]
                    shape = (batch, n_out, *p.shape)
                    factors = (g.transpose(0, 1).unsqueeze(-1), a[:, None, None, :])
                else:
                    shape = (batch, n_out, p.shape[0])
                    factors = (g.transpose(0, 1),)
                if differentiable:
                    value = factors[0] * factors[1] if len(factors) == 2 else factors[0]
                    blocks[lo] = value.expand(shape).reshape(batch, n_out, n)
                else:
                    target = result[..., lo : lo + n].view(shape)  # type: ignore[index]
                    if len(factors) == 2:
                        torch.mul(factors[0], factors[1], out=target)
                    else:
                        target.copy_(factors[0].expand(shape))
            g = g @ m.weight
        else:
            g = jets.pop().first(g)
    if differentiable:
        flat = torch.cat([blocks[lo] for lo in sorted(blocks)], dim=-1)
        if out is not None:
            out.copy_(flat)
            return out
        return flat
    assert result is not None
    return result
