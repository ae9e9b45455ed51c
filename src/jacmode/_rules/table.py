"""The one table of rules: every spelling of every supported operation, mapped to its rule.

Keys are module types (``nn.Tanh``), functions (``torch.tanh``, ``F.tanh``, ``operator.mul``) and
Tensor methods (``("method", "tanh")``). The families live in their own modules (``linear``,
``shape``, ``arithmetic``, ``norm``, ``pooling``, ``softmax``, ``batchnorm``, ``losses``); the elementwise
functions are listed here, each spelling
once, with the parameters it takes. Adding an operation is adding one entry. ``META`` marks
operations that only read shapes (``x.shape``, ``x.size(1)``): they carry no derivatives.
"""

from __future__ import annotations

import builtins
import math
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from . import arithmetic, batchnorm, conv, linear, losses, norm, pooling, shape, softmax
from .base import Algebra, Traced, Unsupported
from .elementwise import FUNCTIONS, SELU

Rule = Callable[..., Any]
META: Rule = lambda *a, **k: None  # noqa: E731 -- a marker, never called


def _act(name: str, params: Callable[..., Any] = lambda *a, **k: None) -> Rule:
    """The rule of an elementwise function; ``params(*args, **kwargs)`` reads its parameters."""
    jet = FUNCTIONS[name]

    def rule(alg: Algebra, x: Any, *args: Any, **kwargs: Any) -> Traced:
        p = params(*args, **kwargs)
        return alg.elementwise(x, lambda h, n: jet(p, h, n))

    setattr(rule, "single_elementwise", True)  # one alg.elementwise of its argument (Program.run)
    return rule


def _module(name: str) -> Rule:
    jet = FUNCTIONS[name]

    def rule(alg: Algebra, m: nn.Module, x: Any) -> Traced:
        return alg.elementwise(x, lambda h, n: jet(m, h, n))

    setattr(rule, "single_elementwise", True)
    return rule


def _ns(**defaults: Any) -> Callable[..., Any]:
    names = list(defaults)

    def read(*args: Any, **kwargs: Any) -> Any:
        values = dict(defaults, **dict(zip(names, args)), **kwargs)
        values.pop("inplace", None)  # in place or not, the rule computes a new tensor (see capture)
        return SimpleNamespace(**values)

    return read


def _gelu(alg: Algebra, x: Any, approximate: str = "none") -> Traced:
    if approximate == "none":
        return _act("gelu")(alg, x)
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), written with the other rules
    inner = arithmetic.mul(alg, arithmetic.add(alg, x, arithmetic.mul(alg, arithmetic.power(alg, x, 3.0), 0.044715)),
                           math.sqrt(2 / math.pi))
    t = _act("tanh")(alg, inner)
    return arithmetic.mul(alg, arithmetic.mul(alg, x, 0.5), arithmetic.add(alg, t, 1.0))


def _mish(alg: Algebra, x: Any, inplace: bool = False) -> Traced:
    return arithmetic.mul(alg, x, _act("tanh")(alg, _act("softplus", _ns(beta=1.0, threshold=20.0))(alg, x)))


def _dropout(alg: Algebra, x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    if training and p > 0:
        raise Unsupported("dropout in training mode draws random masks")
    return x


def _dropout_module(alg: Algebra, m: nn.Module, x: Any) -> Any:
    return _dropout(alg, x, float(getattr(m, "p")), m.training)


_SLOPE = _ns(negative_slope=0.01, inplace=False)
_SOFTPLUS = _ns(beta=1.0, threshold=20.0)
_ELU = _ns(alpha=1.0, inplace=False)
_HARDTANH = _ns(min_val=-1.0, max_val=1.0, inplace=False)
_INPLACE = _ns(inplace=False)

TABLE: dict[Any, Rule] = {**linear.TABLE, **conv.TABLE, **shape.TABLE, **arithmetic.TABLE, **norm.TABLE,
                         **pooling.TABLE, **softmax.TABLE, **batchnorm.TABLE, **losses.TABLE}
for name, spellings, params in [
    ("tanh", (torch.tanh, F.tanh, ("method", "tanh")), None),
    ("sigmoid", (torch.sigmoid, F.sigmoid, ("method", "sigmoid")), None),
    ("relu", (torch.relu, F.relu, ("method", "relu")), _INPLACE),
    ("leaky_relu", (F.leaky_relu,), _SLOPE),
    ("softplus", (F.softplus,), _SOFTPLUS),
    ("silu", (F.silu,), _INPLACE),
    ("elu", (F.elu,), _ELU),
    ("hardtanh", (F.hardtanh,), _HARDTANH),
    ("exp", (torch.exp, ("method", "exp")), None),
    ("log", (torch.log, ("method", "log")), None),
    ("sin", (torch.sin, ("method", "sin")), None),
    ("cos", (torch.cos, ("method", "cos")), None),
    ("abs", (torch.abs, ("method", "abs")), None),
]:
    for spelling in spellings:
        TABLE[spelling] = _act(name, params) if params else _act(name)
TABLE.update({
    F.selu: _act("elu", lambda *a, **k: SimpleNamespace(**SELU)), torch.selu: _act("elu", lambda *a, **k: SimpleNamespace(**SELU)),
    F.relu6: _act("hardtanh", lambda *a, **k: SimpleNamespace(min_val=0.0, max_val=6.0)),
    F.gelu: _gelu, F.mish: _mish, F.dropout: _dropout,
})
for module, name in [(nn.Tanh, "tanh"), (nn.Sigmoid, "sigmoid"), (nn.ReLU, "relu"), (nn.LeakyReLU, "leaky_relu"),
                     (nn.Softplus, "softplus"), (nn.SiLU, "silu"), (nn.ELU, "elu"), (nn.Hardtanh, "hardtanh"),
                     (nn.ReLU6, "hardtanh")]:
    TABLE[module] = _module(name)
TABLE.update({
    nn.SELU: lambda alg, m, x: _act("elu", lambda: SimpleNamespace(**SELU))(alg, x),
    nn.GELU: lambda alg, m, x: _gelu(alg, x, m.approximate),
    nn.Mish: lambda alg, m, x: _mish(alg, x),
    nn.Dropout: _dropout_module, nn.AlphaDropout: _dropout_module,
})
_META = {("method", n) for n in ("size", "dim")} | {builtins.getattr}


def lookup(target: Any, node: Optional[fx.Node] = None) -> Optional[Rule]:
    """The rule for an operation, ``META`` for shape queries, None when there is none."""
    if target in _META:
        if target is builtins.getattr and node is not None and node.args[1] not in ("shape", "ndim", "dtype", "device"):
            return None
        return META
    try:
        return TABLE.get(target)
    except TypeError:  # unhashable
        return None
