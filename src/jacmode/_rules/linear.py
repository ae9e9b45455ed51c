"""Rules for ``nn.Linear`` / ``F.linear`` / matmul with a constant, and sums and means over features.

Taylor rules (input derivatives): each maps every Taylor coefficient with the map itself, without the
bias (``base.linear``). Sums and means must leave the batch dimension alone, or they would mix samples.

Parameter rules (the probe engine): ``LinearRule`` for ``nn.Linear`` with any number of leading dims.

NOTE: [Linear blocks]
out[..., o] = sum_i W[o, i] a[..., i] + bias[o]. With the leading dims of one sample folded into T,
J_W[b, k] = sum_t G[k, b, t, :] (x) a[b, t, :] and J_bias[b, k] = sum_t G[k, b, t, :]. Without leading
dims (T = 1) the weight block is a plain outer product, written into the result by one broadcast
``torch.mul(..., out=)``; with T > 1 it is a batched matrix product.

Products without the blocks (T = 1; with T > 1 they reduce ``per_sample``): the GGN diagonal
sum_(b,k) s_bk J_W[b, k]^2 = (sum_k s_bk G[k, b]^2)^T (a[b]^2), O(B*K*(I+O)) work; the NTK block
J_W1[b1, k1] . J_W2[b2, k2] = (G1[k1, b1] . G2[k2, b2]) * (a1[b1] . a2[b2]), and the bias block
G1 . G2 (BackPACK's DiagGGN and neural-tangents' structured NTK for dense layers).

NOTE: [Order of the writes]
A (B, P) or (B, Y, P) result is written block by block, each a strided column range of every row.
A small block (a bias, the last layer's weight) written after a large one touches a few cache
lines in each of B rows that the large block's stream has already pushed out to memory; written
before it, the same lines are cheap and the large block streams around them. The write of
``_probes/layerwise.py`` (``write``, and ``write_rows`` for per-sample gradients) therefore takes the
modules with the fewest columns first and this rule writes the bias before the weight (measured by ``bench/psg_floor.py``: per_sample_grads of problem 1's class at
B = 512 spends 0.1-0.4 ms less in the writes, 3-10% of the fill of its result).
"""

from __future__ import annotations

import operator
from contextvars import ContextVar
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (
    Algebra,
    Blocks,
    Rule,
    Seed,
    Traced,
    Unsupported,
    batch_view,
    cotangent_view,
    feature_dim,
    linear,
)


def _traced(x: Any, what: str) -> Traced:
    if not isinstance(x, Traced):
        raise Unsupported(f"{what} with a traced weight")
    return x


def _plain(*weights: Any) -> None:
    if any(isinstance(w, Traced) for w in weights):
        raise Unsupported("a weight that depends on the input")


def _affine(v: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """F.linear(v, weight, bias), cheaper for a batch of rows: torch's addmm first copies the bias
    into every row (a full pass over the output), ``mm`` then ``add_`` does not; with one input
    feature (a scalar per sample, problem 2) one fused ``addcmul`` replaces the product.

    NOTE: [The weight gradient of a narrow input]
    Given ``W^T`` as a transposed view, autograd computes the weight's gradient in W's own layout,
    ``(G^T X)`` (O, B) x (B, I): for few inputs (the PINN class's first layer, I = 2, O = 64, B =
    10^4) MKL runs that product 7x slower than ``(X^T G)^T`` (1.1 ms against 0.15 ms, 1 thread),
    3% of a training step. Where grad mode is on and I < O the product therefore
    reads a row-major copy of W^T (2 x 64 numbers), whose gradient is X^T G; the same numbers.
    """
    if v.dim() != 2 or bias is None or weight.dim() != 2:
        return F.linear(v, weight, bias)
    if weight.shape[1] == 1:
        return torch.addcmul(bias, v, weight.t())
    wt = weight.t()
    if weight.shape[1] < weight.shape[0] and _grad_mode():
        wt = wt.contiguous()
    return torch.mm(v, wt).add_(bias)


# the grad mode that code traced from these rules will run under (``_capture/codegen.py`` traces
# under grad mode whatever the run's), so that traced code takes the same products as the rules
# run eagerly: a transposed view and its copy give results that can differ in the last bit
TRACED_GRAD: ContextVar[Optional[bool]] = ContextVar("TRACED_GRAD", default=None)


def _grad_mode() -> bool:
    traced = TRACED_GRAD.get()
    return torch.is_grad_enabled() if traced is None else traced


def _weight_columns(x: Traced, weight: Tensor, last: bool = False) -> Optional[Callable[[Seed], Tensor]]:
    """For x (B, D) still an unbuilt seed: F.linear(e_d, W) for d in the seed, i.e. rows d of W^T,
    (k, H), without the product by the identity (see [Seeds as columns] in ``base.py``). A copy, so
    that no later in-place step can write into the weight; with ``last`` (see [Directions last]) a
    plain copy of W's columns, seen transposed, instead of a transposing copy."""
    if x.value.dim() != 2 or weight.dim() != 2:
        return None
    if last:
        return lambda seed: seed.index(weight, 1).clone(memory_format=torch.contiguous_format).t()
    return lambda seed: seed.index(weight, 1).t().clone(memory_format=torch.contiguous_format)


LAST_MIN_DIRECTIONS = 32  # see [Directions last]


def _coefficients(alg: Algebra, weight: Tensor) -> Callable[[Tensor], Tensor]:
    """The map of the coefficients (L, Bc, *features) of x to those of F.linear(x, W).

    NOTE: [Directions last]
    First derivatives along k directions are carried as one (k, Bc, H) coefficient. F.linear of
    it is one (k*Bc, H) x (H, Y) product whose result, read as the per-sample Jacobians (Bc, Y, k),
    must then be copied into that layout: a transposing copy of the whole result, slow at every
    size (a (1024, 256, 64) result: 75 ms of copy after 37 ms of product), and the product itself
    is slow in BLAS for a narrow output (Y = 10: problem 1's last layer, 65 us for k = 784, B = 2,
    against 19 us below). For an algebra that asks for it (``directions_last``: the first-order one
    of ``jacobian``) and at least ``LAST_MIN_DIRECTIONS`` directions, the product is
    W @ c.permute(1, 2, 0) (one bmm): Bc products (Y, H) x (H, k) whose result (Bc, Y, k) is the
    Jacobians' own layout (a (k, Bc, Y) view of it, so the final permute is free); the first
    layer's columns are copied as W lies (``_weight_columns``), so that the whole pass keeps the
    directions last in memory. The same numbers up to the order of a sum of H products. Measured
    (1 thread, forward mode, repeated calls) against the plain product: 0.19-0.6x on MLPs of 32 to
    784 inputs, widths 8 to 256, outputs 1 to 512, B from 1 to 4096; 0.97x with 20,000 samples;
    below 32 directions the plain product was as fast or faster (k = 24, B = 8: 1.2x).
    """
    if getattr(alg, "directions_last", False) and weight.dim() == 2 and not isinstance(weight, Traced):
        def apply(c: Tensor) -> Tensor:
            if c.dim() == 3 and c.shape[0] >= LAST_MIN_DIRECTIONS:
                # bmm, not matmul: matmul folds a weight that requires grad into the slow product
                return torch.bmm(weight.expand(c.shape[1], *weight.shape), c.permute(1, 2, 0)).permute(2, 0, 1)
            return _folded(c, weight)

        return apply
    return lambda c: _folded(c, weight)


def _folded(c: Tensor, weight: Tensor) -> Tensor:
    """F.linear(c, W) as one product of the rows of a contiguous c. Eager ``matmul`` copies a
    non-contiguous c (the directions-last layout) that needs no gradient into rows itself, but its
    traced decomposition (``_capture/codegen.py``) takes a batched product instead, whose sums can
    differ in the last bit: copied here, generated code computes what the rules compute eagerly,
    bit for bit."""
    return F.linear(c if c.dim() < 3 else c.contiguous(), weight)


def _matrix_rows(x: Traced, w: Tensor) -> Optional[Callable[[Seed], Tensor]]:
    """For x (B, D) still an unbuilt seed: e_d @ w for d in the seed, rows d of w: (k,) or (k, H)."""
    if x.value.dim() != 2:
        return None
    return lambda seed: seed.index(w, 0).clone(memory_format=torch.contiguous_format)


def _dense(alg: Algebra, x: Traced, weight: Tensor, bias: Callable[[], Optional[Tensor]]) -> Traced:
    """F.linear(x, weight, bias()), the bias read when the value is made."""
    return linear(x, lambda v: _affine(v, weight, bias()), _coefficients(alg, weight),
                  _weight_columns(x, weight, getattr(alg, "directions_last", False)) if x.seed is not None else None)


def linear_module(alg: Algebra, m: nn.Linear, x: Traced) -> Traced:
    return _dense(alg, x, m.weight, lambda: m.bias)


def linear_fn(alg: Algebra, x: Any, weight: Any, bias: Any = None) -> Traced:
    x = _traced(x, "F.linear")
    _plain(weight, bias)
    return _dense(alg, x, weight, lambda: bias)


def matmul(alg: Algebra, x: Any, w: Any) -> Traced:
    if not isinstance(x, Traced) or isinstance(w, Traced) or x.value.dim() < 2 or w.dim() > 2:
        raise Unsupported("matmul other than (B, ..., D) @ a constant (D,) or (D, H)")
    return linear(x, lambda t: t @ w, None, _matrix_rows(x, w) if x.seed is not None else None)


def _dims(dim: Any, rank: int, what: str) -> Optional[tuple[int, ...]]:
    if dim is None:
        raise Unsupported(f"{what} over all dimensions mixes the samples of the batch")
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(feature_dim(d, rank, what) for d in dims)


def _reduction(fn: Callable[..., Tensor], what: str) -> Callable[..., Traced]:
    def rule(alg: Algebra, x: Traced, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Traced:
        if dtype is not None:
            raise Unsupported(f"{what} with a dtype")
        dims = _dims(dim, x.value.dim(), what)
        columns = None
        if x.seed is not None and x.value.dim() == 2 and dims == (2,):  # the features of e_d sum to 1
            def columns(seed: Seed) -> Tensor:
                c = x.value.new_full((len(seed.dims),), 1.0 if fn is torch.sum else 1.0 / x.value.shape[1])
                return c.unsqueeze(1) if keepdim else c
        return linear(x, lambda v: fn(v, dim, keepdim), lambda c: fn(c, dims, keepdim), columns)

    return rule


TABLE: dict[Any, Callable[..., Traced]] = {nn.Linear: linear_module, F.linear: linear_fn}
for spelling in (torch.matmul, operator.matmul, ("method", "matmul"), torch.mm, ("method", "mm")):
    TABLE[spelling] = matmul
for name, reduce in (("sum", torch.sum), ("mean", torch.mean)):
    TABLE[reduce] = TABLE[("method", name)] = _reduction(reduce, f"torch.{name}")


# Parameter rules (the probe engine)


class LinearRule(Rule):
    def _factors(self, inputs: tuple[Any, ...], G: Tensor) -> tuple[Tensor, Tensor]:
        a = batch_view(inputs[0], G.shape[1], 1)  # (B, T, I)
        return a, cotangent_view(G, 1)  # (K, B, T, O)

    def per_sample(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor) -> Blocks:
        a, g = self._factors(inputs, G)
        blocks: Blocks = {}
        if module.weight is not None:
            if a.shape[1] == 1:
                blocks["weight"] = g[:, :, 0].transpose(0, 1).unsqueeze(-1) * a[:, None, 0, None, :]
            else:
                blocks["weight"] = g.permute(1, 0, 3, 2) @ a.unsqueeze(1)
        if module.bias is not None:
            blocks["bias"] = g.sum(2).transpose(0, 1)
        return blocks

    def write(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, targets: Blocks, accumulate: bool) -> None:
        a, g = self._factors(inputs, G)
        b = targets.get("bias")  # the bias first: see the note [Order of the writes]
        if b is not None:
            block = g[:, :, 0] if g.shape[2] == 1 else g.sum(2)
            b.add_(block.transpose(0, 1)) if accumulate else b.copy_(block.transpose(0, 1))
        w = targets.get("weight")
        if w is not None and not accumulate and a.shape[1] == 1:
            torch.mul(g[:, :, 0].transpose(0, 1).unsqueeze(-1), a[:, None, 0, None, :], out=w)
        elif w is not None:
            block = g.permute(1, 0, 3, 2) @ a.unsqueeze(1)
            w.add_(block) if accumulate else w.copy_(block)

    def write_rows(self, module: nn.Module, inputs: tuple[Any, ...], g: Tensor, targets: Blocks) -> None:
        a = inputs[0]
        if a.dim() != 2 or g.dim() != 2 or a.shape[0] != g.shape[0]:  # leading dims: the K = 1 write
            return super().write_rows(module, inputs, g, targets)
        b = targets.get("bias")  # the bias first: see the note [Order of the writes]
        if b is not None:
            b.copy_(g)
        w = targets.get("weight")
        if w is not None:  # (B, O, 1) * (B, 1, I): one broadcast product into the (B, O, I) view
            torch.mul(g.unsqueeze(2), a.unsqueeze(1), out=w)

    def sq_sum(self, module: nn.Module, inputs: tuple[Any, ...], G: Tensor, signs: Optional[Tensor]) -> Blocks:
        """{attr: param.shape}: sum over B and K of s[b, k] * J[b, k]^2 (signs (B, K) or None: all 1)."""
        a, g = self._factors(inputs, G)
        if a.shape[1] != 1:
            blocks = self.per_sample(module, inputs, G)  # (B, K, *shape)
            s = 1.0 if signs is None else signs[..., None, None]
            return {"weight": (blocks["weight"] ** 2 * s).sum((0, 1)), **(
                {"bias": (blocks["bias"] ** 2 * (1.0 if signs is None else signs[..., None])).sum((0, 1))}
                if "bias" in blocks else {})}
        g2 = g[:, :, 0] ** 2  # (K, B, O)
        if signs is not None:
            g2 = g2 * signs.t()[:, :, None]
        out: Blocks = {}
        if module.weight is not None:  # a^2 a few hundred samples at a time: memory O(P), not O(B*I)
            w, a0 = g2.sum(0), a[:, 0]
            acc = w.new_zeros(w.shape[1], a0.shape[1])
            for b in range(0, a0.shape[0], 256):
                acc.addmm_(w[b:b + 256].t(), a0[b:b + 256].square())
            out["weight"] = acc
        if module.bias is not None:
            out["bias"] = g2.sum((0, 1))
        return out

    def gram(self, module: nn.Module, inputs1: tuple[Any, ...], G1: Tensor, inputs2: tuple[Any, ...], G2: Tensor,
             attrs: Sequence[str], trace: bool) -> Tensor:
        """sum over ``attrs`` of J1[b1, k1] . J2[b2, k2]: (B1, B2, K1, K2), or (B1, B2) summed over k1 = k2."""
        a1, g1 = self._factors(inputs1, G1)
        a2, g2 = self._factors(inputs2, G2)
        if a1.shape[1] != 1 or a2.shape[1] != 1:
            r1, r2 = self.per_sample(module, inputs1, G1), self.per_sample(module, inputs2, G2)
            spec = "bkp,ckp->bc" if trace else "bkp,czp->bckz"
            return sum(torch.einsum(spec, r1[n].flatten(2), r2[n].flatten(2)) for n in attrs)  # type: ignore[return-value]
        scale = (a1[:, 0] @ a2[:, 0].t() if "weight" in attrs else 0) + (1 if "bias" in attrs else 0)
        gg = torch.einsum("kbo,kco->bc" if trace else "kbo,zco->bckz", g1[:, :, 0], g2[:, :, 0])
        if not isinstance(scale, Tensor):  # the bias alone
            return gg
        return gg.mul_(scale if trace else scale[:, :, None, None])


RULES: dict[type, Rule] = {nn.Linear: LinearRule()}
