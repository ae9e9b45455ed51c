"""Taylor-mode fast path: push derivative coefficients through Linear + activation stacks.

For an ``nn.Sequential`` of ``nn.Linear`` layers and activations with known derivatives (see
``_rules/elementwise.py``), higher derivatives are propagated layer by layer with plain torch operations
instead of nesting forward mode. Plain operations on the parameters keep the results
differentiable with respect to the parameters and the input (``create_graph=True``), and such a
stack treats every sample on its own, so the samples are independent by construction.

NOTE: [Taylor mode over multisets]
The mixed partial d^k f / dx_(d1) ... dx_(dk) is the derivative of f(x + t_1 e_(d1) + ... +
t_k e_(dk)) with respect to t_1 ... t_k at 0. Nested forward mode carries one coefficient per
subset of {1..k}, 2^k in all. But a coefficient only depends on which coordinates its subset
differentiates along, the sub-multiset of (d1..dk), so one per sub-multiset is enough: k + 1 for
d^k / dt^k, 6 instead of 8 for u_xxy. Through ``y = W h + b`` every coefficient is multiplied by W
(the bias goes to the value only); through an activation ``y = s(h)`` Faa di Bruno's formula over
set partitions gives y_K = sum over partitions pi of K of s^(|pi|)(h) prod_(block in pi) h_block,
with the partitions that give the same blocks grouped and counted once (``_terms``). The input
coefficients are x itself, e_d (one row, broadcast over all samples, so the cost does not grow
with B beyond the batched pass) and zero above first order.

Second-order operators vectorise the directions instead: the Hessian carries the D first-order
coefficients as one (D, B, H) tensor and the wanted pairs (i, j) as one (P, B, H) tensor, with
y_ij = s'(h) h_ij + s''(h) h_i h_j; the Laplacian needs only the sum over i of h_ii, so it carries
that sum (the forward Laplacian, or collapsed Taylor mode): L' = s'(h) L + s''(h) sum_i h_i^2.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from typing import Callable, Iterator, Optional, Sequence, cast

import torch.nn.functional as F
from torch import Tensor, nn

from .._rules.elementwise import combine, jet, rule
from .nested import seeds

Key = tuple[int, ...]  # a multiset of coordinates, sorted
Term = tuple[int, int, tuple[Key, ...]]  # (how many partitions, order of s, blocks)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _leaves(f: nn.Sequential) -> Optional[list[nn.Module]]:
    layers: list[nn.Module] = []
    for m in f:  # not children(): a module used twice appears twice
        if _hooked(m):
            return None
        if type(m) is nn.Sequential:
            inner = _leaves(m)
            if inner is None:
                return None
            layers.extend(inner)
        elif type(m) is nn.Linear or rule(m) is not None:
            layers.append(m)
        else:
            return None
    return layers


def layers_of(f: object, in_shape: tuple[int, ...]) -> Optional[list[nn.Module]]:
    """The layers of ``f`` if the fast path applies to it for per-sample inputs of ``in_shape``.

    It applies to an ``nn.Sequential`` (nested ones included) of exactly ``nn.Linear`` and known
    activations, without hooks, whose input is (B, D) with D the first Linear's in_features.
    """
    if type(f) is not nn.Sequential or len(in_shape) != 1 or _hooked(f):
        return None
    if getattr(nn.modules.module, "_global_forward_hooks", None) or getattr(
        nn.modules.module, "_global_forward_pre_hooks", None
    ):
        return None
    layers = _leaves(f)
    if layers and type(layers[0]) is nn.Linear and layers[0].in_features != in_shape[0]:
        return None
    return layers


def _set_partitions(items: list[int]) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    head, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[head], *part]
        for i in range(len(part)):
            yield [*part[:i], [head, *part[i]], *part[i + 1 :]]


@functools.lru_cache(maxsize=None)
def _terms(key: Key) -> tuple[Term, ...]:
    """Faa di Bruno's formula for the coefficient ``key``, partitions with equal blocks grouped."""
    counts: Counter = Counter()
    for part in _set_partitions(list(range(len(key)))):
        counts[tuple(sorted(tuple(key[i] for i in block) for block in part))] += 1
    return tuple((n, len(blocks), blocks) for blocks, n in sorted(counts.items()))


@functools.lru_cache(maxsize=None)
def _sub_keys(target: Key) -> tuple[Key, ...]:
    """All sub-multisets of ``target``, by increasing size (the empty one first)."""
    counts = Counter(target)
    labels = sorted(counts)
    keys = [
        tuple(label for label, n in zip(labels, ns) for _ in range(n))
        for ns in itertools.product(*(range(counts[label] + 1) for label in labels))
    ]
    return tuple(sorted(keys, key=len))


def _product(count: int, factors: Sequence[Tensor]) -> Tensor:
    out = factors[0] if count == 1 else count * factors[0]
    for f in factors[1:]:
        out = out * f
    return out


def partial(layers: Sequence[nn.Module], z: Tensor, dims: Key) -> Tensor:
    """Per-sample mixed partial along ``dims``: z (B, D) -> (B, Y). See the module note."""
    target = tuple(sorted(dims))
    keys = _sub_keys(target)
    labels = sorted(set(target))
    coef: dict[Key, Tensor] = {(): z}
    coef.update({(d,): e for d, e in zip(labels, seeds(z, labels))})
    for index, layer in enumerate(layers):
        wanted = (target,) if index == len(layers) - 1 else keys
        if type(layer) is nn.Linear:
            coef = {k: _affine(layer, v, bias=k == ()) for k, v in coef.items() if k in wanted}
            continue
        act = jet(layer, coef[()], max(len(k) for k in wanted))
        new: dict[Key, Tensor] = {(): act.value} if () in wanted else {}
        for key in wanted:
            if not key:
                continue
            grouped: dict[int, Tensor] = {}  # order m of s -> sum of the products it multiplies
            for count, m, blocks in _terms(key):
                if m > 1 and act.higher[m] is not None and all(b in coef for b in blocks):
                    product = _product(count, [coef[b] for b in blocks])
                    grouped[m] = grouped[m] + product if m in grouped else product
            out = combine(act, coef.get(key), list(grouped.items()))
            if out is not None:
                new[key] = out
        coef = new
    out = coef.get(target)
    if out is None:  # f is polynomial of lower degree along dims (e.g. ReLU, linear)
        return _zeros(layers, z)
    return out.expand(z.shape[0], out.shape[-1]) if out.shape[0] != z.shape[0] else out


def out_features(layers: Sequence[nn.Module], d: int) -> int:
    """Y, the output width of the stack for inputs of width d."""
    return next((m.out_features for m in reversed(layers) if type(m) is nn.Linear), d)


def _zeros(layers: Sequence[nn.Module], z: Tensor) -> Tensor:
    return z.new_zeros(z.shape[0], out_features(layers, z.shape[1]))


def _affine(layer: nn.Module, t: Tensor, bias: bool = False) -> Tensor:
    """W t (+ b) for an nn.Linear layer."""
    lin = cast(nn.Linear, layer)
    return F.linear(t, lin.weight, lin.bias if bias else None)


def _linear(t: Optional[Tensor], layer: nn.Module) -> Optional[Tensor]:
    return None if t is None else _affine(layer, t)


def first(layers: Sequence[nn.Module], z: Tensor, dims: Sequence[int]) -> Tensor:
    """First derivatives along each d in ``dims``: z (B, D) -> (k, B, Y)."""
    value, grad = z, seeds(z, dims)  # grad (k, 1|B, H)
    for index, layer in enumerate(layers):
        if type(layer) is nn.Linear:
            grad = _affine(layer, grad)
            if index < len(layers) - 1:
                value = _affine(layer, value, bias=True)
            continue
        act = jet(layer, value, 1)
        value, grad = act.value, act.first(grad)
    return grad.expand(len(dims), z.shape[0], grad.shape[-1])


def _second(layers: Sequence[nn.Module], z: Tensor, dims: Sequence[int],
            cross: Callable[[Tensor], Tensor]) -> Optional[Tensor]:
    """Second-order coefficients whose rule through an activation is s' h_2 + s'' cross(grads).

    ``grad`` carries the first derivatives along ``dims``, (k, 1|B, H); ``cross(grad)`` says which
    products of them the second-order coefficients need. None when they are zero.
    """
    value, grad = z, seeds(z, dims)
    second: Optional[Tensor] = None
    for index, layer in enumerate(layers):
        if type(layer) is nn.Linear:
            second = _linear(second, layer)
            if index < len(layers) - 1:
                value, grad = _affine(layer, value, bias=True), _affine(layer, grad)
            continue
        act = jet(layer, value, 2)
        second = combine(act, second, [(2, cross(grad))])
        value, grad = act.value, act.first(grad)
    return second


def pairs(layers: Sequence[nn.Module], z: Tensor, ii: Sequence[int], jj: Sequence[int]) -> Tensor:
    """Second derivatives d^2 f / dx_i dx_j for the pairs (ii[p], jj[p]): z (B, D) -> (P, B, Y)."""
    second = _second(layers, z, range(z.shape[1]), lambda g: g[list(ii)] * g[list(jj)])
    if second is None:
        return _zeros(layers, z).expand(len(ii), -1, -1)
    return second.expand(len(ii), z.shape[0], second.shape[-1])


def laplacian(layers: Sequence[nn.Module], z: Tensor, dims: Sequence[int]) -> Tensor:
    """Sum over d in dims of d^2 f / dx_d^2 (the forward Laplacian): z (B, D) -> (B, Y)."""
    lap = _second(layers, z, dims, lambda g: (g * g).sum(0))
    if lap is None:
        return _zeros(layers, z)
    return lap.expand(z.shape[0], lap.shape[-1])
