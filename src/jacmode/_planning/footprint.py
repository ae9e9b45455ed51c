"""Measure what one forward pass of ``f`` costs: aten calls, flops and activation bytes.

NOTE: [Footprint]
The cost model and the memory planner need numbers per sample that the shapes alone do not
give: the floating-point work of one forward pass (counted with the formulas of
``torch.utils.flop_counter``'s registry, in the dispatch mode below rather than through
``FlopCounterMode``, whose module tracker hangs hooks on every module of the process: another
thread's forward pass would run them): ``flops`` of matmuls, ``conv_flops`` of convolutions, which run at another rate), the bytes of every tensor the pass
produces (``act``: an upper bound of the tape that reverse mode keeps) and of the largest one
(``peak``: what forward mode keeps alive at a time), and the number of aten calls (``ops``: the
fixed per-pass overhead that dominates small problems). They are counted with a dispatch mode on
one forward pass over one sample, without differentiating, and cached per function
(weakly), per-sample shape, dtype, device and parameter selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .._cache import WeakCache


@dataclass(frozen=True)
class Footprint:
    """Per-sample cost of one forward pass: aten calls, flops, bytes produced, largest tensor."""

    ops: int
    flops: float
    act: float
    peak: float
    conv_flops: float = 0.0


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops, self.bytes, self.peak, self.flops, self.conv = 0, 0, 0, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            n = count(*args, **(kwargs or {}), out_val=out)
            if "conv" in str(func):
                self.conv += n
            else:
                self.flops += n
        if not getattr(func, "is_view", False):
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    n = t.numel() * t.element_size()
                    self.bytes += n
                    self.peak = max(self.peak, n)
        return out


_CACHE = WeakCache("footprints")


def measure(fn: Callable[[Tensor], Any], x: Tensor, samples: int) -> Footprint:
    """Run ``fn(x)`` once under the counters; ``x`` holds ``samples`` samples (>= 1)."""
    counter = _Counter()
    with torch.no_grad(), counter:
        fn(x.detach())
    k = max(1, samples)
    return Footprint(ops=counter.ops, flops=counter.flops / k, act=counter.bytes / k, peak=counter.peak / k,
                     conv_flops=counter.conv / k)


def footprint(ident: Any, key: tuple, fn: Callable[[Tensor], Any], x: Tensor, samples: int) -> Footprint:
    """:func:`measure`, cached under ``ident`` (weakly) and ``key``."""
    hit = _CACHE.get(ident, key)
    if hit is None:
        hit = measure(fn, x, samples)
        _CACHE.put(ident, key, hit)
    return hit
