"""Per-sample parameter Jacobians (B, Y, P) of any module graph from the probe engine and the rules.

NOTE: [Layer-wise reverse mode for parameters]
One probed forward pass (``_engines/probes.py``) and one reverse pass of the Y one-hot output
directions, shared by all samples and vectorised over Y, give every covered module call its output
cotangents G (Y, B, *out_layer); its rule writes the per-sample blocks straight into their columns
of the (B, Y, P) result or of ``out=`` (a module called twice adds its second call). Parameters no
rule covers are left to the caller (the generic vmap engine fills their columns). With
``differentiable`` the blocks are plain torch functions of the parameters and are concatenated.

Completeness is checked once per model and signature (:func:`complete`, cached by the caller): for a random v (B, Y),
``sum_b J_b^T v_b`` from the rules (one probe pass with K = 1) must equal ``autograd.grad`` of the
output with v, and so must the sum over a random half of the samples (this catches layers that see
the samples regrouped, e.g. sequence-first reshapes). Any mismatch, a stale recorded input or a
layer whose leading dim is not the batch means the generic engine for the whole call.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .._rules.base import NotCovered
from .probes import Coverage, Recording, record

def _check_calls(rec: Recording, batch: int) -> None:
    for c in rec.calls:
        if c.probe.dim() == 0 or c.probe.shape[0] != batch:
            raise NotCovered(f"{type(c.module).__name__} sees {tuple(c.probe.shape)}, not the {batch} samples first")
        if c.stale:
            raise NotCovered(f"the input of {type(c.module).__name__} was modified in place after the call")


def _columns(names: Sequence[str], sizes: Sequence[int]) -> dict[str, tuple[int, int]]:
    out, start = {}, 0
    for n, s in zip(names, sizes):
        out[n] = (start, s)
        start += s
    return out


def fill(
    model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage, result: Tensor
) -> None:
    """Write the covered parameters' columns of the (B, Y, P) ``result`` (P = all of ``named``)."""
    rec = record(model, x, cov)
    batch = x.shape[0]
    _check_calls(rec, batch)
    n_out = rec.output.numel() // max(batch, 1)
    V = torch.eye(n_out, dtype=rec.output.dtype, device=rec.output.device).view(n_out, 1, *rec.output.shape[1:])
    Gs = rec.pullback(V.expand(n_out, *rec.output.shape))
    cols = _columns([n for n, _ in named], [p.numel() for _, p in named])
    shapes = {n: p.shape for n, p in named}
    seen: set[int] = set()
    with torch.no_grad():
        for call, G in zip(rec.calls, Gs):
            targets = {}
            for attr, name in cov.modules[call.module].items():
                lo, n = cols[name]
                targets[attr] = result[..., lo : lo + n].view(batch, n_out, *shapes[name])
            call.rule.write(call.module, call.inputs, G, targets, accumulate=id(call.module) in seen)
            seen.add(id(call.module))
        for name, (module, _) in cov.covered.items():
            if id(module) not in seen:  # a covered module the forward pass never called
                lo, n = cols[name]
                result[..., lo : lo + n].zero_()


def blocks(
    model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage
) -> Tensor:
    """The (B, Y, P) Jacobian as a differentiable concatenation (``create_graph=True``); all covered."""
    rec = record(model, x, cov)
    batch = x.shape[0]
    _check_calls(rec, batch)
    n_out = rec.output.numel() // max(batch, 1)
    V = torch.eye(n_out, dtype=rec.output.dtype, device=rec.output.device).view(n_out, 1, *rec.output.shape[1:])
    Gs = rec.pullback(V.expand(n_out, *rec.output.shape), create_graph=True)
    parts: dict[str, Tensor] = {}
    for call, G in zip(rec.calls, Gs):
        for attr, blk in call.rule.per_sample(call.module, call.inputs, G).items():
            name = cov.modules[call.module].get(attr)
            if name is not None:
                parts[name] = parts[name] + blk if name in parts else blk
    flat = [
        parts[n].reshape(batch, n_out, -1) if n in parts else x.new_zeros(batch, n_out, p.numel(), dtype=G.dtype)
        for n, p in named
    ]
    return torch.cat(flat, dim=-1)


def complete(model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage) -> bool:
    """Whether the rules' blocks are complete for this model and input (see the note; callers cache it)."""
    params = {n: p for n, p in named if n in cov.covered}
    flags = {n: p.requires_grad for n, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        with torch.enable_grad():
            rec = record(model, x, cov)
            _check_calls(rec, x.shape[0])
            out = rec.output
            gen = torch.Generator(device=out.device).manual_seed(0)
            v = torch.randn(out.shape, generator=gen, dtype=out.dtype, device=out.device)
            half = (torch.rand(out.shape[0], generator=gen, device=out.device) < 0.5).to(out.dtype)
            half = half.view(-1, *[1] * (out.dim() - 1))
            Gs = rec.pullback(v.unsqueeze(0), retain_graph=True)
            full = torch.autograd.grad(out, list(params.values()), v, retain_graph=True, allow_unused=True)
            part = torch.autograd.grad(out, list(params.values()), v * half, allow_unused=True)
        sums: dict[str, list[Tensor]] = {n: [x.new_zeros(p.shape, dtype=out.dtype)] * 2 for n, p in params.items()}
        for call, G in zip(rec.calls, Gs):
            for attr, blk in call.rule.per_sample(call.module, call.inputs, G).items():
                name = cov.modules[call.module].get(attr)
                if name is not None:
                    b = blk[:, 0].detach()
                    w = half.view(-1, *[1] * (b.dim() - 1))
                    sums[name] = [sums[name][0] + b.sum(0), sums[name][1] + (b * w).sum(0)]
    except NotCovered:
        return False
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
    tol = 1e-4 if out.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
    for (n, (s_full, s_part)), g_full, g_part in zip(sums.items(), full, part):
        for s, g in ((s_full, g_full), (s_part, g_part)):
            g = torch.zeros_like(s) if g is None else g.detach()
            scale = max(1.0, float(g.abs().max()))
            if not torch.allclose(s, g, rtol=tol, atol=tol * scale):
                return False
    return True
