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


@dataclasses.dataclass(frozen=True)
class Known:
    letter: str
    description: str
    matches: Callable[[G.Case], bool]


KNOWN: list[Known] = [
    Known("NEW", "jacobian(fn, params, x, in_dims=(None, 0)) calls fn on the whole batch (jacmode's convention for f), "
          "not per sample as the vmap(jacrev(fn), in_dims=(None, 0)) that docs/functional.md equates it with: torch.func's "
          "per-sample spelling fn(p, v) = functional_call(net, p, (v[None],))[0] raises torch's shape errors or gives "
          "another layout (docs or front to settle)",
          lambda c: c.entry == "jacobian_functional" and c.options.get("spelling") == "sample"),
    Known("NEW", "EmbeddingBag parameters: torch has no forward formula for _embedding_bag and no derivative of "
          "_embedding_bag_backward, so J v over them (jvp wrt=params, ggn(v=), linearize(wrt=params)) and hvp wrt=params "
          "end in torch's raw NotImplementedError (torch.func cannot either; jm.jacobian / jm.ggn without v work)",
          lambda c: c.head == "embeddingbag" and c.entry in ("jvp_params", "ggn_v", "linearize_params", "hvp_params")
          and c.convention != "inference_mode" and c.options.get("mode") != "forward" and not c.coupled),
]


def known(case: G.Case) -> Optional[Known]:
    """The first entry that describes ``case``, if any."""
    return next((k for k in KNOWN if k.matches(case)), None)
