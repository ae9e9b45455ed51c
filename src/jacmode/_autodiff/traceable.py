"""The operators inside a user's ``torch.compile`` region: plain torch.func, nothing Dynamo cannot trace.

NOTE: [jacmode inside torch.compile]
Under ``torch.compiler.is_dynamo_compiling()`` (Dynamo is tracing the user's function, with or without
``fullgraph=True``) the eager machinery of an entry point cannot run: its caches are weak
dictionaries written per call, the attention-kernel switch of ``_state`` holds a
``threading.Lock``, the graph capture (torch.fx) and the coupling probe run f eagerly and branch
on the values they see, and the Taylor interpreter dispatches on Python objects per call. The
entry points therefore hand such calls to this module, which computes the same results with
torch.func alone (``jvp``, ``vjp``, ``vmap``, ``functional_call``): Dynamo traces them into the
user's graph, AOTAutograd differentiates them again (``create_graph`` and a later ``backward``),
and the compiler then fuses them. Nothing is cached, locked or probed; the results are exact
(the same derivatives as torch.func's, in the same dtype).

What this path does not do it hands back to the eager engines through
``torch.compiler.disable`` (:func:`eager`, reasons in ``REASONS``): a graph break, so that without
``fullgraph=True`` the call runs eagerly (exact, with the eager call's own checks and errors), and
with it torch raises an error whose message gives the reason:

* ``structure="coupled"``, and a module with BatchNorm in training mode (the usual coupled model);
* Hutchinson estimates (``samples=``), ``structure="sparse"``, ``out=``, ``mode="autotune"`` and
  torch's loss modules in ``per_sample_grads`` (a plain per-sample loss function works).

The coupling probe does not run: ``structure="auto"`` is read as ``"independent"`` (one tangent
shared by all samples). A function that mixes samples by other means (``x - x.mean(0)``) gets the
result for independent samples, which is not its per-sample derivative; pass
``structure="coupled"`` for it (then it runs eagerly, see above).

Random layers (dropout in training mode) draw one mask per sample, shared by all of its
directions (``vmap(randomness="same")`` over directions, ``"different"`` over samples), as the
eager engines do; the masks are torch.compile's draws, not the eager call's.

Inside a compiled region every result stays differentiable (``create_graph`` as if True): Dynamo
runs the call as inside a torch.func transform (``_transforms.in_transform`` reads True there), so
``_checks.check_options`` keeps the graph, as it does for calls inside ``torch.func.grad``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vjp, vmap

Fn = Callable[[Tensor], Tensor]


def _call(again: Callable[[], Any]) -> Any:
    return again()


def _disabled(why: str) -> Callable[[Callable[[], Any]], Any]:
    """``_call`` marked for Dynamo to skip, the reason in its message (made at import: Dynamo cannot
    trace ``torch.compiler.disable`` itself)."""
    text = f"jacmode: {why} is not supported inside torch.compile; the call runs eagerly outside the graph"
    try:
        return torch.compiler.disable(_call, reason=text)
    except TypeError:  # a torch without reason=
        return torch.compiler.disable(_call)


REASONS = {
    "coupled": "structure='coupled' (call the operator outside the compiled region, use structure="
               "'independent', or compile without fullgraph=True)",
    "structure": "this structure (use structure='auto' or 'independent')",
    "batchnorm": "a model with BatchNorm in training mode, which couples the samples (call model.eval() first)",
    "loss module": "a torch loss module in per_sample_grads (pass the per-sample loss as a function, e.g. "
                   "lambda out, y: ((out - y) ** 2).sum(1))",
    "samples": "laplacian(samples=...), a random estimate (use the exact Laplacian, samples=None)",
    "jacobian option": "jacobian with structure='sparse', out= or mode='autotune' (drop it)",
    "several arguments": "a call of several arguments, pytrees, keyword arguments or has_aux (call it outside "
                         "the compiled region, or pass a function of one tensor)",
}


def simple(args: tuple[Any, ...], kwargs: Any, argnums: Any, has_aux: Any, trailing: int = 0) -> bool:
    """Whether a call inside a compiled region is the one-tensor form the traceable path serves:
    one tensor (and ``trailing`` option values given positionally, as before several arguments)."""
    return (len(args) in (1, 1 + trailing) and isinstance(args[0], torch.Tensor) and not kwargs and not has_aux
            and argnums == 0)
_EAGER = {key: _disabled(why) for key, why in REASONS.items()}


def eager(why: str, again: Callable[[], Any]) -> Any:
    """Run ``again()`` (the same jacmode call) outside Dynamo: a graph break, so that the eager
    engines serve it; under ``fullgraph=True`` torch raises instead, its message giving the reason
    ``REASONS[why]``."""
    return _EAGER[why](again)


def _why_not(f: Any, structure: str) -> Optional[str]:
    if structure == "coupled":
        return "coupled"
    if structure not in ("auto", "independent"):
        return "structure"
    if isinstance(f, nn.Module):
        for m in f.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                return "batchnorm"
    return None


def _out(r: Any, create_graph: bool) -> Any:
    if create_graph:
        return r
    if isinstance(r, dict):
        return {k: v.detach() for k, v in r.items()}
    if isinstance(r, tuple):
        return tuple(v.detach() for v in r)
    return r.detach()


def _flat(f: Fn, x: Tensor) -> tuple[Fn, Tensor, tuple[int, ...]]:
    """f as z (b, N) -> (b, Y), z, and the per-sample output shape."""
    batch, in_shape = x.shape[0], tuple(x.shape[1:])
    out = f(x[:1])  # traced, not run: only its shape is used
    out_shape = tuple(out.shape[1:])
    n_out = math.prod(out_shape)
    fn = lambda z: f(z.reshape(z.shape[0], *in_shape)).reshape(z.shape[0], n_out)  # noqa: E731
    return fn, x.reshape(batch, math.prod(in_shape)), out_shape


def _along(fn: Fn, e: Tensor) -> Fn:
    """z -> the directional derivative of fn at z along e (broadcast to z's shape)."""
    return lambda z: jvp(fn, (z,), (e.expand_as(z),))[1]


def _unit(z: Tensor, d: int) -> Tensor:
    return torch.zeros(z.shape[1], dtype=z.dtype, device=z.device).index_fill(0, torch.tensor(d, device=z.device), 1.0)


def partials(again: Callable[[], Any], f: Fn, x: Tensor, targets: Sequence[tuple[int, ...]], structure: str,
             create_graph: bool) -> Any:
    """One (B, *out) tensor per multiset of coordinates, by nested jvps along e_d."""
    why = _why_not(f, structure)
    if why is not None:
        return eager(why, again)
    fn, z, out_shape = _flat(f, x)
    results = []
    for dims in targets:
        g = fn
        for d in dims:
            g = _along(g, _unit(z, d))
        results.append(g(z).reshape(x.shape[0], *out_shape))
    return _out(tuple(results), create_graph)


def derivative(again: Callable[[], Any], f: Fn, t: Tensor, order: int, structure: str, create_graph: bool) -> Tensor:
    """d^k f / dt^k for t (B,) or (B, 1); a (B,) t goes in as a column when f's first layer takes one."""
    if t.dim() == 1 and _wants_column(f):
        t = t.unsqueeze(1)
    why = _why_not(f, structure)
    if why is not None:
        return eager(why, again)
    g: Fn = f
    for _ in range(order):
        g = _along(g, torch.ones_like(t))
    return _out(g(t), create_graph)


def _wants_column(f: Any) -> bool:
    """Whether the first layer of the module f (or of the module a plain function closes over) is
    ``nn.Linear(1, H)``: the eager call finds this out by calling f, which cannot be traced."""
    modules = [f] if isinstance(f, nn.Module) else [
        c.cell_contents for c in (getattr(f, "__closure__", None) or ()) if isinstance(c.cell_contents, nn.Module)]
    for root in modules:
        for m in root.modules():
            if isinstance(m, nn.Linear):
                return m.in_features == 1
            if isinstance(m, (nn.modules.conv._ConvNd, nn.Embedding)):
                return False
    return False


def laplacian(again: Callable[[], Any], f: Fn, x: Tensor, weight: Optional[Tensor], structure: str,
              create_graph: bool) -> Tensor:
    """Sum over directions v of v^T (Hess f) v: the coordinates, or the columns of weight (D, R) / (B, D, R)."""
    why = _why_not(f, structure)
    if why is not None:
        return eager(why, again)
    fn, z, out_shape = _flat(f, x)
    if weight is None:
        dirs = torch.eye(z.shape[1], dtype=z.dtype, device=z.device)[:, None, :].expand(-1, z.shape[0], -1)
    elif weight.dim() == 2:
        dirs = weight.to(z.dtype).T[:, None, :].expand(-1, z.shape[0], -1)
    else:
        dirs = weight.to(z.dtype).permute(2, 0, 1)  # (R, B, D)

    def second(v: Tensor) -> Tensor:
        return jvp(lambda w: jvp(fn, (w,), (v,))[1], (z,), (v,))[1]

    total = vmap(second, randomness="same")(dirs).sum(0)
    return _out(total.reshape(x.shape[0], *out_shape), create_graph)


def jacobian(again: Callable[[], Any], f: Fn, x: Tensor, *, wrt: Any, mode: str, batched: bool, structure: str,
             create_graph: bool, flatten: bool) -> Union[Tensor, dict[str, Tensor]]:
    """The eager call's result shapes (see :func:`jacmode.jacobian`), from vmap over jvp or vjp."""
    if batched and structure != "diagonal":
        why = _why_not(f, structure)
        if why is not None:
            return eager(why, again)
    if wrt == "inputs":
        return _out(_input_jacobian(f, x, mode, batched, structure), create_graph)
    if not isinstance(f, nn.Module):
        raise TypeError(f"f: wrt='params' needs an nn.Module, got {type(f).__name__}.")
    named = _selected(f, wrt)
    params = {n: p for n, p in named}
    rest = {n: t for n, t in [*f.named_parameters(), *f.named_buffers()] if n not in params}

    def one(p: dict[str, Tensor], xb: Tensor) -> Tensor:
        return functional_call(f, {**rest, **p}, (xb,)).reshape(-1)

    if batched:
        blocks = vmap(_jac_dict(lambda p, xb: one(p, xb[None]), mode), in_dims=(None, 0), randomness="different")(params, x)
        lead: tuple[int, ...] = (x.shape[0], *tuple(f(x[:1]).shape[1:]))
    else:
        blocks = _jac_dict(one, mode)(params, x)
        lead = tuple(f(x).shape)
    if flatten:
        head = (x.shape[0], math.prod(lead[1:])) if batched else (math.prod(lead),)
        flat = torch.cat([blocks[k].reshape(*head, -1) for k, _ in named], dim=-1)
        return _out(flat, create_graph)
    return _out({k: blocks[k].reshape(*lead, *params[k].shape) for k, _ in named}, create_graph)


def _jac_dict(fn: Callable[[dict[str, Tensor], Tensor], Tensor], mode: str) -> Callable[..., dict[str, Tensor]]:
    """Jacobian of fn (params dict, x) -> (Y,) with respect to the dict: {name: (Y, *shape)}."""
    def reverse(p: dict[str, Tensor], xb: Tensor) -> dict[str, Tensor]:
        out, pull = vjp(lambda q: fn(q, xb), p)[:2]
        return vmap(lambda c: pull(c)[0], randomness="same")(torch.eye(out.shape[0], dtype=out.dtype, device=out.device))

    def forward(p: dict[str, Tensor], xb: Tensor) -> dict[str, Tensor]:
        names = list(p)
        sizes = [p[k].numel() for k in names]
        total = sum(sizes)
        ref = p[names[0]]

        def column(v: Tensor) -> Tensor:
            parts = v.split(sizes)
            tangents = {k: parts[i].reshape(p[k].shape) for i, k in enumerate(names)}
            return jvp(lambda q: fn(q, xb), (p,), (tangents,))[1]

        cols = vmap(column, randomness="same")(torch.eye(total, dtype=ref.dtype, device=ref.device))  # (P, Y)
        return {k: c.T for k, c in zip(names, cols.T.split(sizes, dim=1))}

    return forward if mode == "forward" else reverse


def _selected(f: nn.Module, wrt: Any) -> list[tuple[str, Tensor]]:
    named: list[tuple[str, Tensor]] = [(n, p) for n, p in f.named_parameters() if p.requires_grad]
    if wrt == "params":
        return named
    wanted = list(wrt)
    found = dict(f.named_parameters())
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ValueError(f"wrt: no parameter named {missing[0]!r} in f; its parameters are {list(found)[:8]}.")
    return [(n, p) for n, p in f.named_parameters() if n in wanted]


def _input_jacobian(f: Fn, x: Tensor, mode: str, batched: bool, structure: str) -> Tensor:
    if not batched:
        out = f(x)
        n_in, n_out = x.numel(), out.numel()
        flat = lambda v: f(v.reshape(x.shape)).reshape(-1)  # noqa: E731
        forward = mode == "forward" or (mode != "reverse" and n_in <= n_out)
        jac = torch.func.jacfwd(flat)(x.reshape(-1)) if forward else torch.func.jacrev(flat)(x.reshape(-1))
        return jac.reshape(*out.shape, *x.shape)
    if structure == "diagonal":
        return jvp(f, (x,), (torch.ones_like(x),))[1]
    fn, z, out_shape = _flat(f, x)
    n_in, n_out, batch = z.shape[1], math.prod(out_shape), z.shape[0]
    forward = mode == "forward" or (mode != "reverse" and n_in <= n_out)
    if forward:
        eye = torch.eye(n_in, dtype=z.dtype, device=z.device)[:, None, :].expand(-1, batch, -1)
        cols = vmap(lambda e: jvp(fn, (z,), (e,))[1], randomness="same")(eye)  # (N, B, Y)
        jac = cols.permute(1, 2, 0)
    else:
        out, pull = vjp(fn, z)[:2]
        eye = torch.eye(n_out, dtype=out.dtype, device=out.device)[:, None, :].expand(-1, batch, -1)
        rows = vmap(lambda c: pull(c)[0], randomness="same")(eye)  # (Y, B, N)
        jac = rows.permute(1, 0, 2)
    return jac.reshape(batch, *out_shape, *x.shape[1:])


def per_sample_grads(again: Callable[[], Any], f: nn.Module, x: Tensor, loss: Callable[..., Tensor],
                     y: Optional[Tensor], wrt: Any, flatten: bool) -> Union[Tensor, dict[str, Tensor]]:
    """vmap over samples of grad of each sample's loss (a per-sample loss function, (B, *out) -> (B,))."""
    if isinstance(loss, nn.Module) and type(loss).__module__.startswith("torch."):
        return eager("loss module", again)
    why = _why_not(f, "auto")
    if why is not None:
        return eager(why, again)
    named = _selected(f, wrt)
    params = {n: p for n, p in named}
    rest = {n: t for n, t in [*f.named_parameters(), *f.named_buffers()] if n not in params}

    def one(p: dict[str, Tensor], xb: Tensor, yb: Optional[Tensor]) -> Tensor:
        out = functional_call(f, {**rest, **p}, (xb[None],))
        return (loss(out) if yb is None else loss(out, yb[None])).reshape(())

    if y is None:
        grads = vmap(grad(lambda p, xb: one(p, xb, None)), in_dims=(None, 0), randomness="different")(params, x)
    else:
        grads = vmap(grad(one), in_dims=(None, 0, 0), randomness="different")(params, x, y)
    if flatten:
        return torch.cat([grads[n].reshape(x.shape[0], -1) for n, _ in named], dim=1).detach()
    return {n: grads[n].detach() for n, _ in named}
