"""The fallback rule for a module without one: per-sample vjp of that module alone, vmapped.

NOTE: [Module-local vmap]
For a module M with parameters but no closed-form rule (``nn.MultiheadAttention``, PReLU,
ConvTranspose, a user's custom layer), the probe on M's output still gives the cotangents G
(K, B, *out) for all K directions at once; the per-sample blocks of M's parameters are then
vjps of M alone, ``vmap`` over the samples of ``vmap`` over the directions of ``vjp`` of
``functional_call(M, params, sample b's inputs)`` -- Opacus's functorch fallback per module. The
model is run once, and only M (not the whole model) under vmap. M's tensor inputs whose leading
dim is B are split by sample, other arguments are shared; a tuple output is probed at its first
element. ``inputs`` of such a call is ``(args, kwargs)``. The completeness check catches what
this cannot see (an attention mask over the whole batch, outputs used beyond the first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from .._threads import clone_tree
from .base import Blocks, Rule


class LocalVmapRule(Rule):
    attrs = ()  # any parameter in the module's subtree: assigned by ``coverage``

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        args, kwargs = inputs
        batch = G.shape[1]
        params = {n: p.detach() for n, p in module.named_parameters()}
        split = [isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == batch for a in args]
        kw_split = {k: v for k, v in kwargs.items() if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == batch}
        kw_shared = {k: v for k, v in kwargs.items() if k not in kw_split}
        batched = [a for a, s in zip(args, split) if s]

        def one(batched_b: list[Tensor], kw_b: dict[str, Tensor], g_b: Tensor) -> dict[str, Tensor]:
            it = iter(batched_b)
            args_b = tuple(next(it).unsqueeze(0) if s else a for a, s in zip(args, split))
            kw = {**kw_shared, **{k: v.unsqueeze(0) for k, v in kw_b.items()}}

            def f(p: dict[str, Tensor]) -> Tensor:
                out = functional_call(clone_tree(module), p, args_b, kw)
                return (out[0] if isinstance(out, tuple) else out).squeeze(0)

            pull = vjp(f, params)[1]
            return vmap(lambda g: pull(g)[0])(g_b)

        with torch.enable_grad():
            return vmap(one, in_dims=(0, 0, 1), randomness="different")(batched, kw_split, G)


LOCAL = LocalVmapRule()
