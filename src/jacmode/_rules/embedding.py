"""Rules for ``nn.Embedding`` and ``nn.EmbeddingBag``: the cotangents of the looked-up rows land on
the rows they came from.

NOTE: [Embedding blocks]
out[b, t] = W[idx[b, t]], so J_W[b, k] is zero except rows idx[b, t], which receive G[k, b, t]
(summed when a sample repeats an index): one ``scatter_add_`` into a zeroed block. ``padding_idx``
rows get nothing, as in torch. ``max_norm`` (rewrites the weight during the forward pass) and
``scale_grad_by_freq`` (scales by counts over the whole batch) are not covered.

NOTE: [padding_idx and forward mode]
torch defines the ``padding_idx`` row as a constant: the backward of ``embedding`` and
``embedding_bag`` gives it no gradient. Their forward-mode formula ignores ``padding_idx`` (the jvp
of ``embedding`` is ``embedding(tangent, ids)``), so jvps see the row as a parameter like any other,
and ``_embedding_bag`` has no forward-mode formula at all. Zeroing the row's columns afterwards
would be wrong when the weight is also used elsewhere (an output head tied to it), so
``forward_gap`` reports such models and every forward-mode path (the jacobian engines, the NTK's
products method) takes reverse mode instead, or an explicit ``mode="forward"`` refuses.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence, cast

import torch
from torch import Tensor, nn

from .base import Blocks, NotCovered, Rule, batch_view, cotangent_view


class EmbeddingRule(Rule):
    attrs = ("weight",)

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if module.max_norm is not None:
            return "Embedding with max_norm rewrites its weight during the forward pass"
        if module.scale_grad_by_freq:
            return "Embedding with scale_grad_by_freq scales by counts over the whole batch"
        return None

    def _scatter(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, block: Tensor) -> None:
        idx = batch_view(inputs[0], G.shape[1], 0)  # (B, T)
        g = cotangent_view(G, 1).transpose(0, 1)  # (B, K, T, E)
        pad: Optional[int] = getattr(module, "padding_idx", None)
        if pad is not None:
            keep = idx.ne(pad)
            g = g * keep[:, None, :, None].to(g.dtype)
        index = idx[:, None, :, None].expand(g.shape)
        block.scatter_add_(2, index, g)

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        K, B = G.shape[:2]
        block = G.new_zeros(B, K, *module.weight.shape)  # type: ignore[misc]
        self._scatter(module, inputs, G, block)
        return {"weight": block}

    def sq_sum(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, signs: Optional[Tensor]) -> Blocks:
        """sum over b, k of s[b, k] J[b, k]^2 without the (B, K, V, E) blocks.

        Row v of J[b, k] is sum_t [ids[b, t] = v] g[k, b, t], so its square is the sum over pairs of
        positions holding the same id: sum_t g_t * (sum_u [ids_t = ids_u] g_u), scattered to row ids_t.
        """
        idx = batch_view(inputs[0], G.shape[1], 0)  # (B, T)
        g = cotangent_view(G, 1)  # (K, B, T, E)
        pad: Optional[int] = getattr(module, "padding_idx", None)
        if pad is not None:
            g = g * idx.ne(pad)[None, :, :, None].to(g.dtype)
        same = (idx[:, :, None] == idx[:, None, :]).to(g.dtype)  # (B, T, T)
        pairs = g * torch.einsum("btu,kbue->kbte", same, g)  # (K, B, T, E)
        if signs is not None:
            pairs = pairs * signs.t()[:, :, None, None]
        out = g.new_zeros(cast(Tensor, module.weight).shape)
        out.index_add_(0, idx.reshape(-1), pairs.sum(0).reshape(-1, g.shape[-1]))
        return {"weight": out}

    def write(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, targets: Blocks, accumulate: bool) -> None:
        if "weight" in targets:
            if not accumulate:
                targets["weight"].zero_()
            self._scatter(module, inputs, G, targets["weight"])


class EmbeddingBagRule(Rule):
    """``nn.EmbeddingBag`` over 2-D ids (B, L), one bag per sample: out[b] = sum_l w_bl W[idx[b, l]].

    w_bl is the per-sample weight (positional), 0 on ``padding_idx`` entries, and for mode "mean"
    divided by the bag's count of other entries (an empty bag gives zeros). 1-D ids with offsets
    and weights passed by keyword are not seen here (``NotCovered``, or the completeness check
    sends the layer to the generic engine); mode "max" always takes the generic engine.
    """

    attrs = ("weight",)

    def unsupported(self, module: nn.Module) -> Optional[str]:
        if module.mode == "max":
            return "EmbeddingBag(mode='max') routes each feature to its arg-max entry"
        if module.max_norm is not None:
            return "EmbeddingBag with max_norm rewrites its weight during the forward pass"
        if module.scale_grad_by_freq:
            return "EmbeddingBag with scale_grad_by_freq scales by counts over the whole batch"
        return None

    def _weights(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> tuple[Tensor, Tensor]:
        """ids (B, L) and their coefficients w (B, L): out[b] = sum_l w[b, l] W[ids[b, l]]."""
        idx = inputs[0]
        if idx.dim() != 2 or (len(inputs) > 1 and inputs[1] is not None) or idx.shape[0] != G.shape[1]:
            raise NotCovered("EmbeddingBag with 1-D ids and offsets: bags are not samples along dim 0")
        w = (inputs[2] if len(inputs) > 2 and inputs[2] is not None
             else torch.ones(idx.shape, dtype=G.dtype, device=G.device)).to(G.dtype)
        pad = cast(Optional[int], module.padding_idx)
        if pad is not None:
            w = w * idx.ne(pad).to(G.dtype)
        if module.mode == "mean":
            count = idx.ne(pad).sum(1) if pad is not None else torch.full((idx.shape[0],), idx.shape[1], device=idx.device)
            w = w / count.clamp(min=1).to(G.dtype)[:, None]
        return idx, w

    def _rows(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Tensor:
        """c (B, V): c[b, v] = sum of sample b's coefficients on row v, so J[b, k, v] = c[b, v] G[k, b]."""
        idx, w = self._weights(module, inputs, G)
        return w.new_zeros(idx.shape[0], cast(int, module.num_embeddings)).scatter_add_(1, idx, w)

    def _scatter(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, block: Tensor) -> None:
        idx, w = self._weights(module, inputs, G)
        g = G.transpose(0, 1)  # (B, K, E)
        contrib = w[:, None, :, None] * g[:, :, None, :]  # (B, K, L, E)
        block.scatter_add_(2, idx[:, None, :, None].expand(contrib.shape), contrib)

    def sq_sum(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, signs: Optional[Tensor]) -> Blocks:
        """sum over b, k of s[b, k] J[b, k]^2 = (c^2)^T (sum_k s G^2): no per-sample block (V, E)."""
        g2 = G.square() if signs is None else G.square() * signs.t()[:, :, None]  # (K, B, E)
        return {"weight": self._rows(module, inputs, G).square().t() @ g2.sum(0)}

    def gram(self, module: nn.Module, inputs1: tuple[Any, ...], G1: Tensor, inputs2: tuple[Any, ...], G2: Tensor,
             attrs: Sequence[str], trace: bool) -> Tensor:
        """J1[b1, k1] . J2[b2, k2] = (c1 c2^T)[b1, b2] (G1[k1, b1] . G2[k2, b2])."""
        scale = self._rows(module, inputs1, G1) @ self._rows(module, inputs2, G2).t()  # (B1, B2)
        gg = torch.einsum("kbe,kce->bc" if trace else "kbe,zce->bckz", G1, G2)
        return gg.mul_(scale if trace else scale[:, :, None, None])

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        K, B = G.shape[:2]
        block = G.new_zeros(B, K, *module.weight.shape)  # type: ignore[misc]
        self._scatter(module, inputs, G, block)
        return {"weight": block}

    def write(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, targets: Blocks, accumulate: bool) -> None:
        if "weight" in targets:
            if not accumulate:
                targets["weight"].zero_()
            self._scatter(module, inputs, G, targets["weight"])


RULES: dict[type, Rule] = {nn.Embedding: EmbeddingRule(), nn.EmbeddingBag: EmbeddingBagRule()}


def forward_gap(model: Any, names: Iterable[str]) -> Optional[str]:
    """Why forward mode is not exact for the parameters ``names`` of ``model`` (see the note), or None."""
    if not isinstance(model, nn.Module):
        return None
    if getattr(model, "_jacmode_wrapper", False):  # a function's wrapper: its slots p0, p1, ... may sit in any layer
        for module in model.modules():
            padded = isinstance(module, nn.Embedding) and module.padding_idx is not None
            if isinstance(module, nn.EmbeddingBag) or padded:
                return forward_gap(module, ["weight"])
    wanted = set(names)
    for prefix, module in model.named_modules():
        name = f"{prefix}.weight" if prefix else "weight"
        if name not in wanted:
            continue
        if isinstance(module, nn.EmbeddingBag):
            return f"nn.EmbeddingBag {prefix or type(model).__name__!r} (torch's _embedding_bag has no forward-AD formula)"
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            return (f"nn.Embedding {prefix or type(model).__name__!r} with padding_idx={module.padding_idx} "
                    "(torch's forward-AD formula for embedding ignores padding_idx, whose row torch holds constant)")
    return None
