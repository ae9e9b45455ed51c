"""Known bugs: the cases the harness expects to fail until their fixes are merged.

Each entry is a predicate over the drawn case, the letter of the branch that fixes it (A
functional_call and torch.func params, B integer inputs / losses / RNN per-sample grads,
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
]


def known(case: G.Case) -> Optional[Known]:
    """The first entry that describes ``case``, if any."""
    return next((k for k in KNOWN if k.matches(case)), None)
