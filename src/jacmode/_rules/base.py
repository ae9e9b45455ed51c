"""The vocabulary of the rules, for both engine families.

Input derivatives (Taylor mode over a captured graph, ``_capture/taylor.py``): a :class:`Traced` is
one tensor of the captured graph that depends on the input: its ``value`` (B, *shape) and its Taylor
coefficients ``coef[key]`` of shape (L, 1 or B, *shape), one leading dimension of directions (L = 1
for a single multiset coefficient, K directions, P pairs) and the batch dimension, 1 where the
coefficient is the same for every sample (a seed e_d before it meets anything sample-dependent). A
missing key is a coefficient that is zero everywhere. A Taylor rule maps its arguments (Traced for
what depends on the input, plain values otherwise) to a Traced, with the help of an
:class:`Algebra` that knows which coefficients are carried and how products and elementwise
functions combine them. Rules linear in their traced input need no algebra: :func:`linear` applies
the map to every coefficient. A Taylor rule raises :class:`Unsupported` when its arguments break
what the engines assume (the batch stays dimension 0 and samples stay independent); the whole call
then takes the generic engine. They are listed in ``table.py``, by spelling.

Parameter Jacobians (the probe engine, ``_probes/probes.py``): a :class:`Rule` knows, for one
module type, how the module's parameters enter its output. Given what the probe engine recorded for
one call of the module, its inputs and the cotangents G (K, B, *out) of its output for K
directions, it returns the per-sample blocks

    per_sample(module, inputs, G) -> {attribute: Tensor (B, K, *param.shape)}

(``J[b, k] = sum over the module's output of G[k, b] * d out[b] / d param``), or writes them straight
into given views of a result with ``write(module, inputs, G, targets, accumulate)``, which the
default implementation does by copying ``per_sample``; rules override it where an ``out=`` kernel
avoids the temporary. ``unsupported(module)`` says why a module instance cannot be handled (None when
it can). Optional cheaper reductions of the same blocks: ``sq_sum`` (sum over B and K of the squared
blocks, BackPACK's DiagGGN form) and ``gram`` (NTK blocks); see :func:`has`. They are listed in
``modules.py``, by module type.

Each family module (``linear``, ``conv``, ``norm``, ``embedding``, ``elementwise``, ``shape``,
``arithmetic``) holds both kinds of rule for its operations, so what is supported is read in one place.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from torch import Tensor, nn

from .elementwise import Jet


class Unsupported(Exception):
    """An operation the fast path cannot treat exactly: the caller falls back to the generic engine."""


class Traced:
    """A tensor that depends on the input, with its Taylor coefficients (see the module note).

    ``value`` (B, *shape) may be given as ``make``, computed on first use: the value of the last
    linear layer is never needed when only derivatives are asked for.

    NOTE: [Seeds as columns]
    The input of a first-order pass (``taylor.Stacked``) carries the one-hot rows e_d, d in ``dims``,
    shared by all samples. A linear map applied to them is a selection of its columns (for
    ``nn.Linear``, rows of W^T), so the input may be built with ``seed=Seed(dims, wrap)`` and
    ``coef_make``: the one-hot tensor (k, 1, D) is only made if a rule reads ``coef``, and the
    linear rules (``linear(..., columns=)``) read ``seed`` instead, without a (k, D) x (D, H)
    product by the identity.
    """

    __slots__ = ("_value", "_make", "_coef", "_coef_make", "seed")

    def __init__(self, value: Optional[Tensor], coef: Optional[dict[Any, Tensor]],
                 make: Optional[Callable[[], Tensor]] = None, *,
                 coef_make: Optional[Callable[[], dict[Any, Tensor]]] = None,
                 seed: Optional["Seed"] = None) -> None:
        self._value, self._make = value, make
        self._coef, self._coef_make = coef, coef_make  # key -> (L, 1 | B, *shape); missing = zero
        self.seed = seed

    @property
    def value(self) -> Tensor:
        if self._value is None:
            assert self._make is not None
            self._value, self._make = self._make(), None
        return self._value

    @property
    def coef(self) -> dict[Any, Tensor]:
        if self._coef is None:
            assert self._coef_make is not None
            self._coef, self._coef_make = self._coef_make(), None
        return self._coef

    @coef.setter
    def coef(self, coef: dict[Any, Tensor]) -> None:
        self._coef, self._coef_make, self.seed = coef, None, None


class Seed:
    """The one-hot input directions e_d, d in ``dims``, not yet built (see [Seeds as columns]).

    ``wrap(columns)`` turns the columns of a linear map, (k, *out features), into the
    coefficients of its output, as the algebra carries them.
    """

    __slots__ = ("dims", "wrap")

    def __init__(self, dims: Sequence[int], wrap: Callable[[Tensor], dict[Any, Tensor]]) -> None:
        self.dims, self.wrap = list(dims), wrap

    def index(self, t: Tensor, dim: int) -> Tensor:
        """``t`` at positions ``dims`` along ``dim``: a slice when they are consecutive."""
        d = self.dims
        if d and d == list(range(d[0], d[0] + len(d))):
            return t.narrow(dim, d[0], len(d))
        return t.index_select(dim, torch.as_tensor(d, dtype=torch.long, device=t.device))


class Algebra(Protocol):
    """Which coefficients are carried, and how the nonlinear rules combine them."""

    order: int  # the highest derivative order an elementwise function must provide

    def elementwise(self, x: Traced, jet: Callable[[Tensor, int], Jet]) -> Traced: ...

    def mul(self, a: Traced, b: Traced) -> Traced: ...


Map = Callable[[Tensor], Tensor]


def linear(x: Traced, value: Map, coef: Optional[Map] = None,
           columns: Optional[Callable[["Seed"], Tensor]] = None) -> Traced:
    """A map linear in x (plus a constant): ``value`` on x.value, ``coef`` (default ``value``) on coefficients.

    ``columns(seed)``: the map's columns at ``seed.dims``, (k, *out features), for an x that is still
    an unbuilt seed (see [Seeds as columns]); x's one-hot coefficients are then never made.
    """
    if columns is not None and x.seed is not None and x._coef is None:
        seed = x.seed
        return Traced(None, seed.wrap(columns(seed)), lambda: value(x.value))
    c = value if coef is None else coef
    return Traced(None, {k: c(t) for k, t in x.coef.items()}, lambda: value(x.value))


def merged(fn: Map) -> Map:
    """``fn`` of a (N, *shape) batch applied to a coefficient (L, Bc, *shape) (e.g. convolutions)."""

    def apply(t: Tensor) -> Tensor:
        out = fn(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]))
        return out.reshape(t.shape[0], t.shape[1], *out.shape[1:])

    return apply


def batch_kept(x: Traced, out: Traced, what: str) -> Traced:
    """Check that an operation kept the batch as dimension 0 of its result."""
    if out.value.dim() == 0 or out.value.shape[0] != x.value.shape[0]:
        raise Unsupported(f"{what} changes the batch dimension ({tuple(x.value.shape)} -> {tuple(out.value.shape)})")
    return out


def feature_dim(dim: int, rank: int, what: str) -> int:
    """A dimension of a value of rank ``rank`` as a dimension of its coefficients (one more in front)."""
    d = dim + rank if dim < 0 else dim
    if not 0 < d < rank:
        raise Unsupported(f"{what} over dimension {dim} mixes the samples of the batch")
    return d + 1


def expand_batch(tensors: list[Tensor]) -> list[Tensor]:
    """Coefficients expanded to a common direction and batch size (before cat/stack)."""
    lead = max(t.shape[0] for t in tensors), max(t.shape[1] for t in tensors)
    return [t.expand(*lead, *t.shape[2:]) for t in tensors]


# Parameter rules (the probe engine)


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

    def write_rows(self, module: nn.Module, inputs: tuple[Any, ...], g: Tensor, targets: Blocks) -> None:
        """:meth:`write` for one output direction (a per-sample gradient), not accumulating: ``g``
        (B, *out) is the cotangent without the K dim, ``targets`` {attr: (B, *param.shape)} views.

        A rule may write these with fewer views than :meth:`write` needs for K directions (see
        ``_probes/layerwise.write_rows``); by default it is :meth:`write` with K = 1.
        """
        self.write(module, inputs, g.unsqueeze(0), {a: t.unsqueeze(1) for a, t in targets.items()}, False)


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
