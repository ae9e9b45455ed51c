"""Known bugs: the cases the harness expects to fail until their fixes are merged.

Each entry is a predicate over the drawn case, the letter of the branch that fixes it (issue 17:
A functional_call and torch.func params, B integer inputs / losses / RNN per-sample grads,
C torch's wrong higher derivatives of norms, D coupling and inference_mode, NEW found by this
harness) and one line saying what goes wrong. A failing case that matches an entry is counted as
known instead of failing the run; a matching case that passes is counted too ("known but
passed"), so the run shows when an entry can be removed. Keep every predicate narrow: it must
describe the bug, not the symptom.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import grammar as G
import runner as R

RNNS = ("rnn", "gru", "lstm")


@dataclasses.dataclass(frozen=True)
class Known:
    letter: str
    description: str
    matches: Callable[[G.Case], bool]


def _kinds(case: G.Case) -> set[str]:
    return {b[1] for b in case.blocks}


def _differentiates_result(case: G.Case) -> bool:
    """The convention differentiates jacmode's result once more (one order higher)."""
    return case.convention in ("grad_create_graph", "fcall_autograd", "func_grad", "jacrev")


KNOWN: list[Known] = [
    Known("A", "gradients (torch.func.grad, or autograd.grad wrt leaf tensors) of a create_graph=True result of "
               "f = functional_call(net, p, .): the fast engines read net's own parameters, so d/dp is zero",
          lambda c: c.convention in ("func_grad", "fcall_autograd") and not c.coupled and c.options.get("batched", True)
          and not c.pointwise and c.head not in RNNS  # no parameters; RNNs take the exact generic path
          and c.options.get("structure") != "coupled"
          and not (c.entry == "jacobian" and c.options["mode"] == "reverse")),
    Known("B", "integer inputs (Embedding, EmbeddingBag ids): per_sample_grads / ntk return the ids' int dtype, "
               "ggn raises torch's raw cast error, ntk of EmbeddingBag lacks a forward-mode formula",
          lambda c: c.integer and c.entry in G.PRODUCTS and R.expected_error(c) is None),
    Known("B", "Embedding / EmbeddingBag with padding_idx: jacobian(wrt='params') gives the padding row a "
               "nonzero gradient where torch's is 0",
          lambda c: c.integer and c.head_spec.get("padding_idx") is not None and c.entry == "jacobian_params"),
    Known("B", "ggn(loss='cross_entropy') on outputs (B, C, *rest) takes one softmax over all outputs of a "
               "sample, where torch takes it over dim 1 (classes) per position",
          lambda c: c.entry == "ggn" and c.options["loss"] == "cross_entropy" and len(c.out_shape) > 1),
    Known("B", "per_sample_grads of nn.RNN / nn.GRU / nn.LSTM raises torch's raw broadcast error",
          lambda c: c.entry == "per_sample_grads" and c.head in RNNS),
    Known("C", "LayerNorm above first order: paths that lean on torch's layer_norm derivative formulas (nested "
               "jvp, the coupled structure) return torch's wrong numbers",
          lambda c: "layernorm" in _kinds(c) and R.order(c) + _differentiates_result(c) >= 2),
    Known("D", "causal coupling along dim 0 (torch.cumsum(x, 0)) goes undetected: per-sample results are "
               "returned where CoupledBatchError is due",
          lambda c: "cumsum" in _kinds(c) and R.expected_error(c) is not None),
    Known("NEW", "torch.func.vmap around a jacmode call with structure='auto': the coupling probe compares "
                 "batched tensors in Python (data-dependent control flow) and raises vmap's raw error",
          lambda c: c.convention == "vmap" and c.batch > 1 and c.options.get("structure", "auto") == "auto"),
]


def known(case: G.Case) -> Optional[Known]:
    """The first entry that describes ``case``, if any."""
    return next((k for k in KNOWN if k.matches(case)), None)
