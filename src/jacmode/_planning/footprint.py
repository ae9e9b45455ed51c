"""Measure what one forward pass of ``f`` costs: aten calls, flops and activation bytes.

NOTE: [Footprint]
The cost model and the memory planner need numbers per sample that the shapes alone do not
give: the floating-point work of one forward pass (counted with the formulas of
``torch.utils.flop_counter``'s registry, in the dispatch mode below rather than through
``FlopCounterMode``, whose module tracker hangs hooks on every module of the process: another
thread's forward pass would run them): ``flops`` of matmuls, ``conv_flops`` of convolutions, which run at another rate, and ``conv_out``, the positions they write: images x spatial entries), the entries of transcendental
elementwise maps (``special``: a tanh or a GELU costs several times a ReLU per entry), the bytes of every tensor the pass
produces (``act``: an upper bound of the tape that reverse mode keeps) and of the largest one
(``peak``: what forward mode keeps alive at a time), and the number of aten calls (``ops``: the
fixed per-pass overhead that dominates small problems). They are counted with a dispatch mode on
one forward pass over one sample, without differentiating, and cached per function
(weakly), per-sample shape, dtype, device and parameter selection.

For the probe engine (per-sample parameter Jacobians, ``_probes/``) the same pass also counts its
``tail``: the work after the first call of a module whose parameters are selected, which is all
that the engine's reverse pass crosses (it stops at the probes, never reaching the input), and the
number of such calls, each of which its rule turns into blocks. Its hooks count this thread's
calls only (``_threads.transient_hooks``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .._cache import Kind
from .._threads import transient_hooks


@dataclass(frozen=True)
class Tail:
    """Per-sample work of a forward pass after the first call of a hooked module (see the note)."""

    ops: int
    flops: float
    conv_flops: float
    act: float
    calls: int  # calls of the hooked modules
    conv_out: float = 0.0
    special: float = 0.0


@dataclass(frozen=True)
class Footprint:
    """Per-sample cost of one forward pass: aten calls, flops, bytes produced, largest tensor."""

    ops: int
    flops: float
    act: float
    peak: float
    conv_flops: float = 0.0
    conv_out: float = 0.0  # positions the convolutions write: narrow convolutions cost per position, not per flop
    special: float = 0.0  # entries of transcendental maps (tanh, gelu, exp, ...): several times a relu's each
    tail: Optional[Tail] = None  # measured with hooked modules (the probe engine's), else None


# elementwise maps that evaluate a transcendental function per entry (their backward does too)
SPECIAL = frozenset({"tanh", "sigmoid", "gelu", "silu", "mish", "elu", "selu", "celu", "softplus", "exp", "expm1",
                     "log", "log1p", "erf", "erfc", "sin", "cos", "tan", "sqrt", "rsqrt", "atan", "asinh",
                     "_softmax", "_log_softmax", "logsigmoid", "log_sigmoid_forward", "hardswish"})


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops, self.bytes, self.peak, self.flops, self.conv, self.conv_out, self.special = 0, 0, 0, 0.0, 0.0, 0.0, 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            n = count(*args, **(kwargs or {}), out_val=out)
            if "conv" in str(func):
                self.conv += n
                self.conv_out += sum(_positions(t) for t in tree_flatten(out)[0] if isinstance(t, Tensor))
            else:
                self.flops += n
        if func._overloadpacket.__name__ in SPECIAL:
            self.special += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, Tensor))
        if not getattr(func, "is_view", False):
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    n = t.numel() * t.element_size()
                    self.bytes += n
                    self.peak = max(self.peak, n)
        return out


def _positions(t: Tensor) -> int:
    """The positions (images x spatial entries) of a convolution's output ``(N, C, *spatial)``: a
    narrow convolution's time is per position, whatever its few channels."""
    return t.numel() // max(t.shape[1], 1) if t.dim() >= 3 else t.numel()


_CACHE = Kind("footprints")


def measure(fn: Callable[[Tensor], Any], x: Tensor, samples: int, hooked: Sequence[nn.Module] = ()) -> Footprint:
    """Run ``fn(x)`` once under the counters; ``x`` holds ``samples`` samples (>= 1).

    ``hooked``: modules whose calls start the tail (see the note); the footprint's ``tail`` is then
    the work after the first of their calls ended.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        >>> fp = measure(net, torch.randn(1, 8), 1, hooked=[net[2]])
        >>> fp.flops, fp.tail.flops, fp.tail.calls   # 2*(8*32 + 32*4); the last layer's output is the probe
        (768.0, 0.0, 1)
    """
    counter = _Counter()
    first: list[tuple[int, float, float, int, float, float]] = []  # counters when the first hooked call ended
    calls = [0]
    me = threading.get_ident()

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if threading.get_ident() != me:  # another thread's forward pass: not this count's
            return
        calls[0] += 1
        if not first:
            first.append((counter.ops, counter.flops, counter.conv, counter.bytes, counter.conv_out, counter.special))

    with transient_hooks():
        handles = [m.register_forward_hook(hook) for m in hooked]
        try:
            with torch.no_grad(), counter:
                fn(x.detach())
        finally:
            for h in handles:
                h.remove()
    k = max(1, samples)
    mm, conv = counter.flops, counter.conv
    tail = None
    if first:
        ops0, mm0, conv0, bytes0, out0, special0 = first[0]
        tail = Tail(ops=counter.ops - ops0, flops=(mm - mm0) / k, conv_flops=(conv - conv0) / k,
                    act=(counter.bytes - bytes0) / k, calls=calls[0], conv_out=(counter.conv_out - out0) / k,
                    special=(counter.special - special0) / k)
    return Footprint(ops=counter.ops, flops=mm / k, act=counter.bytes / k, peak=counter.peak / k, conv_flops=conv / k,
                     conv_out=counter.conv_out / k, special=counter.special / k, tail=tail)


def footprint(ident: Any, key: tuple, fn: Callable[[Tensor], Any], x: Tensor, samples: int,
              hooked: Sequence[nn.Module] = ()) -> Footprint:
    """:func:`measure`, cached under ``ident`` (weakly) and ``key``."""
    hit = _CACHE.get(ident, key)
    if hit is None:
        hit = measure(fn, x, samples, hooked)
        _CACHE.put(ident, key, hit)
    return hit
