"""Linear differential operators, their randomised estimators, and the memory of a Taylor pass.

References are float64 nested ``torch.autograd.grad`` loops (conftest / test_derivatives) or
closed forms; estimators are checked for unbiasedness with a fixed seed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jacmode._engines import capture
from jacmode._engines.program import _refs
from test_capture import Residual

DT = torch.float64


def test_each_slot_is_dropped_once_after_its_last_reader() -> None:
    program = capture.program_for(Residual())
    assert isinstance(program, capture.Program)
    dead = program.last_uses()
    dropped = [slot for slots in dead for slot in slots]
    kept = set(_refs(program.output))
    assert sorted(dropped) == sorted(set(range(len(program.steps) + 1)) - kept)
    when = {slot: i for i, slots in enumerate(dead) for slot in slots}
    for i, step in enumerate(program.steps):
        for slot in _refs((step.args, step.kwargs)):
            assert slot in kept or when[slot] >= i  # never dropped before a step that reads it
