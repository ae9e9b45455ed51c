"""Per-layer products from the probe engine: which layers serve, and their per-sample reductions.

NOTE: [Layer products]
The probe engine (``_probes/probes.py``) gives, for each call of a covered module, its inputs and
the cotangents G (K, B, *out_layer) of K output cotangents. Per-sample gradients, the GGN diagonal
and NTK blocks need three reductions of the per-sample blocks J (B, K, *param):
``write`` (the blocks themselves, K = 1), ``sq_sum`` (sum over B, K of s * J^2) and ``gram``
(J1 . J2 over the parameter, (B1, B2, K1, K2)). A rule may define the last two in closed form
(Linear: (sum_k s G^2)^T a^2 and (G1 G2^T) * (A1 A2^T), see ``_rules/linear.py``) so that no
per-sample block is formed; otherwise, and for a module called more than once (its blocks add up
before they are squared), they are computed here from ``per_sample``.

``usable`` says which selected parameters the probes serve (the completeness check of
``_probes/layerwise.py`` must pass, cached per model and signature); the callers run the generic
engine for the others (per-sample gradients, GGN diagonal) or for everything (NTK).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .._cache import Kind, problem_key
from .._functional import refreshed, selection_key
from .._rules.base import has
from . import layerwise, probes

Named = Sequence[tuple[str, Tensor]]
_COVERAGE = Kind("products coverage")


def usable(model: nn.Module, x: Tensor, named: Named) -> Optional[probes.Coverage]:
    """The probe engine's coverage (``uncovered`` may be non-empty), or None when it serves nothing.

    Completeness of the covered parameters is ``_probes/layerwise.py``'s check on a few samples;
    the verdict and the coverage are cached per model, per-sample signature and selection.
    """
    if x.shape[0] == 0:
        return None
    key = (*problem_key(model, x, True, "params", "products", False), selection_key(model, named))
    hit = _COVERAGE.get(model, key)
    if hit is None:
        # closed-form rules only: the module-local vmap rule records (args, kwargs), which the
        # per-layer products do not read; such modules take the generic engine here
        cov: Optional[probes.Coverage] = probes.coverage(model, named, local=False)
        if cov is not None and not (cov.covered and layerwise.complete(model, x[:8], named, cov)):
            cov = None
        hit = (cov,)
        _COVERAGE.put(model, key, hit)
    return refreshed(hit[0], named)  # a bound dict's tensors are new in each call (_functional.py)


def _once(rec: probes.Recording) -> bool:
    return len({id(c.module) for c in rec.calls}) == len(rec.calls) and not any(c.stale for c in rec.calls)


def sq_sum(rec: probes.Recording, cov: probes.Coverage, gs: Sequence[Tensor],
           signs: Optional[Tensor]) -> dict[str, Tensor]:
    """{name: param.shape}: sum over samples b and cotangents k of s_bk * J[b, k]^2."""
    out: dict[str, Tensor] = {}
    if _once(rec):
        for call, g in zip(rec.calls, gs):
            if has(call.rule, "sq_sum"):
                for attr, value in call.rule.sq_sum(call.module, call.inputs, g, signs).items():  # type: ignore[attr-defined]
                    name = cov.modules.get(call.module, {}).get(attr)
                    if name is not None:
                        out[name] = value
    rest = [i for i, c in enumerate(rec.calls) if not (_once(rec) and has(c.rule, "sq_sum"))]
    if rest:
        sub = probes.Recording(rec.output, [rec.calls[i] for i in rest])
        for name, block in sub.blocks(cov, [gs[i] for i in rest]).items():
            w = block * block
            if signs is not None:
                w = w * signs.reshape(*signs.shape, *([1] * (w.dim() - 2)))
            out[name] = w.sum((0, 1))
    return out


def gram(first: tuple[probes.Recording, Sequence[Tensor]], second: tuple[probes.Recording, Sequence[Tensor]],
         cov: probes.Coverage, trace: bool) -> Tensor:
    """sum over parameters of J1[b1, k1] . J2[b2, k2]: (B1, B2, K1, K2), or (B1, B2) summed over k1 = k2."""
    (rec1, gs1), (rec2, gs2) = first, second
    total: Optional[Tensor] = None
    fast = _once(rec1) and _once(rec2)
    by_module = {id(c.module): (c, g) for c, g in zip(rec2.calls, gs2)}
    for c1, g1 in zip(rec1.calls, gs1):
        if fast and has(c1.rule, "gram"):
            c2, g2 = by_module[id(c1.module)]
            attrs = [a for a in c1.rule.attrs if a in cov.modules.get(c1.module, {})]
            part = c1.rule.gram(c1.module, c1.inputs, g1, c2.inputs, g2, attrs, trace)  # type: ignore[attr-defined]
            total = part.contiguous() if total is None else total.add_(part)
    if not fast or any(not has(c.rule, "gram") for c in rec1.calls):
        keep = [i for i, c in enumerate(rec1.calls) if not (fast and has(c.rule, "gram"))]
        b1 = probes.Recording(rec1.output, [rec1.calls[i] for i in keep]).blocks(cov, [gs1[i] for i in keep])
        b2 = probes.Recording(rec2.output, [rec2.calls[i] for i in keep]).blocks(cov, [gs2[i] for i in keep])
        for name, r1 in b1.items():
            r1, r2 = r1.flatten(2), b2[name].flatten(2)
            part = torch.einsum("bkp,ckp->bc" if trace else "bkp,czp->bckz", r1, r2)
            total = part.contiguous() if total is None else total.add_(part)
    assert total is not None
    return total
