"""The one table of per-module parameter rules: module type -> rule (see ``base.py`` for the vocabulary).

Adding a module type is adding one entry in its family's module (linear, conv, norm, embedding).
Subclasses of a listed type are not matched: their ``forward`` may do something else.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from . import conv, embedding, linear, norm
from .base import Rule

RULES: dict[type, Rule] = {**linear.RULES, **conv.RULES, **norm.RULES, **embedding.RULES}


def rule_for(module: nn.Module) -> Optional[Rule]:
    """The rule for exactly this module type, or None."""
    return RULES.get(type(module))
