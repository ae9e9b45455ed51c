"""Per-sample parameter Jacobians (B, Y, P) of any module graph from the probe engine and the rules.

NOTE: [Layer-wise reverse mode for parameters]
One probed forward pass (``_probes/probes.py``) and one reverse pass of the Y one-hot output
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
from .._rules.local import LOCAL
from .probes import Call, Coverage, Recording, record

def _check_calls(rec: Recording, batch: int) -> None:
    for c in rec.calls:
        if c.probe.dim() == 0 or c.probe.shape[0] != batch:
            raise NotCovered(f"{type(c.module).__name__} sees {tuple(c.probe.shape)}, not the {batch} samples first")
        if c.stale:
            raise NotCovered(f"the input of {type(c.module).__name__} was modified in place after the call")


def columns(named: Sequence[tuple[str, Tensor]]) -> dict[str, tuple[int, int]]:
    """name -> (first column, number of columns) in the flat (., P) layout."""
    out, start = {}, 0
    for name, p in named:
        out[name] = (start, p.numel())
        start += p.numel()
    return out


def _all_outputs(
    model: nn.Module, x: Tensor, cov: Coverage, create_graph: bool, n_out: Optional[int] = None, repeat: bool = False
) -> tuple[Recording, list[Tensor], int]:
    """One probed forward pass, and the Y one-hot output directions pulled back to every probe.

    With ``repeat`` (no random layers) and a known ``n_out`` = Y, small problems take repeated rows
    (see the note in :func:`_repeated_rows`); otherwise one reverse pass vectorised over Y.
    """
    if repeat and n_out is not None and not create_graph and _repeated_ok(cov, n_out * x.shape[0]):
        found = _repeated_rows(model, x, cov, n_out)
        if found is not None:
            return found
    rec = record(model, x, cov)
    _check_calls(rec, x.shape[0])
    n_out = rec.output.numel() // max(x.shape[0], 1)
    V = torch.eye(n_out, dtype=rec.output.dtype, device=rec.output.device).view(n_out, 1, *rec.output.shape[1:])
    return rec, rec.pullback(V.expand(n_out, *rec.output.shape), create_graph=create_graph), n_out


# Y * B rows at most, and the cost model's reverse-mode estimate (s) below which the repeated-rows
# pullback runs (measured on problem 1's class and a small CNN, 1 thread: it wins by 2-5% at
# B <= 2 on the MLP and loses up to 40% on the CNN at B = 1, whose forward pass is costlier)
REPEAT_ROWS = 64
REPEAT_COST = 2e-3


def _repeated_ok(cov: Coverage, rows: int) -> bool:
    return 1 < rows <= REPEAT_ROWS and all(r is not LOCAL for r in cov.rules.values())


def _repeated_rows(model: nn.Module, x: Tensor, cov: Coverage, n_out: int) -> Optional[tuple[Recording, list[Tensor], int]]:
    """Every G (Y, B, *out_layer) from one forward pass of Y copies of x and one plain reverse pass.

    NOTE: [Repeated rows]
    Samples are independent, so the rows of ``model(x.repeat(Y, ...))`` are Y copies of each
    sample's output; the cotangent e_k on copy k of every sample (row k*B + b) pulls back, in ONE
    ordinary reverse pass, to G[k, b] at every probe. For small Y*B this beats the vectorised pass
    over Y (``Recording.pullback``: its batching machinery has a fixed cost of about 0.1 ms);
    the rules read the first copy of each layer's input. Not with random layers (each copy would
    draw its own mask), and not for a batch of one sample: the coupling probe needs two samples, so
    at B = 1 nothing has shown that f treats dim 0 as samples (``h - h.mean(0)`` is 0 on one sample,
    not on Y copies of it). Returns None when a layer does not see the Y*B rows first (the caller
    then takes the vectorised pass).
    """
    B = x.shape[0]
    rows = n_out * B
    rec = record(model, x.repeat(n_out, *[1] * (x.dim() - 1)), cov)
    out = rec.output
    if out.dim() == 0 or out.shape[0] != rows or out.numel() != rows * n_out:
        return None
    for c in rec.calls:
        if c.probe.dim() == 0 or c.probe.shape[0] != rows:
            return None
        if c.stale:
            raise NotCovered(f"the input of {type(c.module).__name__} was modified in place after the call")
    probes = [c.probe for c in rec.calls]
    V = torch.eye(n_out, dtype=out.dtype, device=out.device).repeat_interleave(B, dim=0).view(out.shape)
    grads = torch.autograd.grad(out, probes, V, allow_unused=True) if probes else ()
    Gs = [
        (g if g is not None else torch.zeros_like(p)).view(n_out, B, *p.shape[1:]) for g, p in zip(grads, probes)
    ]
    calls = [
        Call(c.module, c.rule, tuple(t[:B] if isinstance(t, Tensor) and t.dim() and t.shape[0] == rows else t
                                     for t in c.inputs), c.probe[:B], c.versions)
        for c in rec.calls
    ]
    return Recording(out[:B], calls), Gs, n_out


def fill(
    model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage, result: Tensor,
    repeat: bool = False,
) -> None:
    """Write the covered parameters' columns of the (B, Y, P) ``result`` (P = all of ``named``).

    ``repeat``: small problems may take repeated rows (no random layers; see :func:`_repeated_rows`).
    """
    rec, Gs, _ = _all_outputs(model, x, cov, create_graph=False, n_out=result.shape[1], repeat=repeat)
    write(rec, Gs, cov, named, result)


def write(rec: Recording, Gs: Sequence[Tensor], cov: Coverage, named: Sequence[tuple[str, Tensor]],
          result: Tensor) -> None:
    """Write the blocks of a probed pass into the covered columns of the (B, K, P) ``result``.

    ``Gs`` are the cotangents of K output directions per call (K = Y for a Jacobian, 1 for a
    per-sample gradient); a covered module that the forward pass never called gets zero columns.
    """
    batch, k = result.shape[0], result.shape[1]
    cols, shapes = columns(named), {n: p.shape for n, p in named}
    called = {id(c.module) for c in rec.calls}
    # the smallest blocks first, the largest last (see the note [Order of the writes] in
    # _rules/linear.py); a module called twice adds its calls in either order
    size = {id(m): sum(cols[n][1] for n in attrs.values()) for m, attrs in cov.modules.items()}
    order = sorted(range(len(rec.calls)), key=lambda i: size[id(rec.calls[i].module)])
    seen: set[int] = set()
    with torch.no_grad():
        for name, (module, _) in cov.covered.items():
            if id(module) not in called:  # a covered module the forward pass never called
                lo, n = cols[name]
                result.narrow(-1, lo, n).zero_()
        for i in order:
            call, G = rec.calls[i], Gs[i]
            targets = {}
            for attr, name in cov.modules[call.module].items():
                lo, n = cols[name]
                targets[attr] = result.narrow(-1, lo, n).view(batch, k, *shapes[name])
            call.rule.write(call.module, call.inputs, G, targets, accumulate=id(call.module) in seen)
            seen.add(id(call.module))


Target = tuple[str, int, int, tuple[int, ...], tuple[int, ...]]  # attr, first column, columns, shape, its strides
Step = tuple[int, list[Target], bool]  # call index, its targets, whether it adds
RowsPlan = tuple[dict[int, list[Target]], dict[tuple[int, ...], tuple[list[Step], list[tuple[int, int]]]]]
MAX_ORDERS = 8  # selections a coverage keeps plans for, and call sequences a plan keeps steps for


def _rows_plan(cov: Coverage, named: Sequence[tuple[str, Tensor]]) -> RowsPlan:
    """For :func:`write_rows`, once per selection: each covered module's targets (attr, first column,
    number of columns, parameter shape) by the module's id, and the steps found for each sequence
    of module calls so far (see ``Target``)."""
    key = tuple(n for n, _ in named)
    plan = cov.plans.get(key)
    if plan is None:
        cols, shapes = columns(named), {n: tuple(p.shape) for n, p in named}
        plan = ({id(m): [(attr, *cols[name], shapes[name], torch.empty(shapes[name], device="meta").stride())
                         for attr, name in attrs.items()] for m, attrs in cov.modules.items()}, {})
        if len(cov.plans) < MAX_ORDERS:
            cov.plans[key] = plan
    return plan


def _steps(plan: RowsPlan, calls: Sequence[Call]) -> tuple[list[Step], list[tuple[int, int]]]:
    """The calls in the order of the writes (the modules with the fewest columns first, see [Order
    of the writes] in ``_rules/linear.py``; a module's later calls add), and the column ranges of
    the covered modules that no call reached (zeros)."""
    targets, orders = plan
    seq = tuple(id(c.module) for c in calls)
    found = orders.get(seq)
    if found is None:
        size = {m: sum(t[2] for t in ts) for m, ts in targets.items()}
        seen: set[int] = set()
        steps: list[Step] = []
        for i in sorted(range(len(calls)), key=lambda i: size[seq[i]]):
            steps.append((i, targets[seq[i]], seq[i] in seen))
            seen.add(seq[i])
        zeros = [(lo, n) for m, ts in targets.items() if m not in seen for _, lo, n, _, _ in ts]
        found = (steps, zeros)
        if len(orders) < MAX_ORDERS:
            orders[seq] = found
    return found


def write_rows(rec: Recording, gs: Sequence[Tensor], cov: Coverage, named: Sequence[tuple[str, Tensor]],
               result: Tensor) -> None:
    """:func:`write` for one output direction (per-sample gradients): the covered columns of the
    (B, P) ``result`` from the cotangents ``gs`` (B, *out_layer) of each call, without the K dim.

    The same blocks in the same order as :func:`write` with K = 1, through the rules'
    ``write_rows`` (fewer views per block) and with the columns and the order found once per
    selection and sequence of calls (at B = 2 on problem 1's class the write's fixed cost falls
    from about 120 to 50 microseconds); a module's second call adds through ``write``.
    """
    batch = result.shape[0]
    steps, zeros = _steps(_rows_plan(cov, named), rec.calls)
    calls = rec.calls
    row, start = result.stride(0), result.storage_offset()
    with torch.no_grad():
        for lo, n in zeros:  # a covered module the forward pass never called
            result.narrow(1, lo, n).zero_()
        for i, targets, adds in steps:
            call, g = calls[i], gs[i]
            if result.stride(1) == 1:  # one view of the columns per block, not a narrow and a view
                views = {attr: result.as_strided((batch, *shape), (row, *inner), start + lo)
                         for attr, lo, _, shape, inner in targets}
            else:
                views = {attr: result.narrow(1, lo, n).view(batch, *shape) for attr, lo, n, shape, _ in targets}
            if adds:  # a later call of the module adds to the first
                call.rule.write(call.module, call.inputs, g.unsqueeze(0), {a: t.unsqueeze(1) for a, t in views.items()},
                                accumulate=True)
            else:
                call.rule.write_rows(call.module, call.inputs, g, views)


def blocks(
    model: nn.Module, x: Tensor, named: Sequence[tuple[str, Tensor]], cov: Coverage
) -> Tensor:
    """The (B, Y, P) Jacobian as a differentiable concatenation (``create_graph=True``); all covered."""
    batch = x.shape[0]
    rec, Gs, n_out = _all_outputs(model, x, cov, create_graph=True)
    parts = rec.blocks(cov, Gs)
    flat = [
        parts[n].reshape(batch, n_out, -1) if n in parts else x.new_zeros(batch, n_out, p.numel(), dtype=rec.output.dtype)
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
        blks = rec.blocks(cov, Gs)
        sums: dict[str, list[Tensor]] = {n: [x.new_zeros(p.shape, dtype=out.dtype)] * 2 for n, p in params.items()}
        for name, blk in blks.items():
            b = blk[:, 0].detach()
            w = half.view(-1, *[1] * (b.dim() - 1))
            sums[name] = [b.sum(0), (b * w).sum(0)]
    except (NotCovered, RuntimeError):  # RuntimeError: a module-local vmap that torch cannot run
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
