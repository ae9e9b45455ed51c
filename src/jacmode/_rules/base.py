"""The vocabulary of per-module parameter rules: per-sample blocks from a layer's input and cotangents.

A rule knows, for one module type, how the module's parameters enter its output. Given what the
probe engine (``_engines/probes.py``) recorded for one call of the module, its inputs and the
cotangents G (K, B, *out) of its output for K directions, a rule returns the per-sample blocks

    per_sample(module, inputs, G) -> {attribute: Tensor (B, K, *param.shape)}

(``J[b, k] = sum over the module's output of G[k, b] * d out[b] / d param``), or writes them straight
into given views of a result with ``write(module, inputs, G, targets, accumulate)``, which the
default implementation does by copying ``per_sample``; rules override it where an ``out=`` kernel
avoids the temporary. ``unsupported(module)`` says why a module instance cannot be handled (None when
it can). Room is left for cheaper reductions of the same blocks, e.g. ``sq_sum`` (sum over B and K
of the squared blocks, BackPACK's DiagGGN form) and ``gram`` (NTK blocks): a rule that lacks them
simply does not define them (see :func:`has`).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

Blocks = dict[str, Tensor]


class NotCovered(Exception):
    """A recorded call that a rule cannot turn into per-sample blocks (the caller falls back)."""


class Rule:
    """Per-sample parameter blocks of one module type (see the module docstring)."""

    #: the parameter attributes the rule handles
    attrs: tuple[str, ...] = ("weight", "bias")

    def unsupported(self, module: nn.Module) -> Optional[str]:
        """Why this module instance is not covered, or None."""
        return None

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        """{attr: (B, K, *param.shape)} from inputs and output cotangents G (K, B, *out)."""
        raise NotImplementedError

    def write(
        self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, targets: Blocks, accumulate: bool
    ) -> None:
        """Write (or add, when ``accumulate``) the blocks of ``targets``' attributes into its views.

        Not differentiable: call it under ``torch.no_grad()`` (``per_sample`` keeps the graph).
        """
        for attr, block in self.per_sample(module, inputs, G).items():
            if attr in targets:
                target = targets[attr]
                target.add_(block) if accumulate else target.copy_(block)


def has(rule: Rule, method: str) -> bool:
    """Whether ``rule`` defines the optional reduction ``method`` (``sq_sum``, ``gram``, ...)."""
    return callable(getattr(rule, method, None))


def batch_view(t: Tensor, batch: int, keep: int) -> Tensor:
    """(B, M, *last ``keep`` dims): fold the dims between the batch and the kept ones into M.

    Raises NotCovered when the leading dim of ``t`` is not the batch (the model reshaped samples).
    """
    if t.dim() < keep + 1 or t.shape[0] != batch:
        raise NotCovered(f"leading dim {tuple(t.shape)} is not the batch of {batch} samples")
    return t.reshape(batch, -1, *t.shape[t.dim() - keep :]) if keep else t.reshape(batch, -1)


def cotangent_view(G: Tensor, keep: int) -> Tensor:
    """(K, B, M, *last ``keep`` dims) of cotangents G (K, B, ...)."""
    return G.reshape(G.shape[0], G.shape[1], -1, *G.shape[G.dim() - keep :]) if keep else G.reshape(*G.shape[:2], -1)
