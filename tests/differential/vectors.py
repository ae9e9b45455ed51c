"""The vector products and the functional parameters in the differential harness.

Entry points (``VECTOR_ENTRIES``), drawn over the same model grammar (``grammar._head`` and
``grammar._blocks``):

- ``jvp`` / ``jvp_params``: ``jm.jvp(f, x, v)`` (whole batch J v) and ``jm.jvp(net, x, v,
  wrt="params")``; the oracle contracts the whole-batch Jacobian (autograd loops) with v;
- ``vjp`` / ``vjp_params``: ``jm.vjp(f, x)`` and ``jm.vjp(net, x, wrt="params",
  per_sample=..., flatten=...)``: per sample (B, P) rows u_b^T J_b (oracle: samples alone), or
  the sum over the batch (P,);
- ``hvp`` / ``hvp_params``: per-sample H_b v_b of a per-sample scalar output s(x) = sum(f(x) * w)
  (oracle: the Hessian of each sample alone, reverse over reverse); and the Hessian of a loss in
  the parameters times v (oracle: the gradient of grad L . v in float64);
- ``ggn_v``: ``jm.ggn(net, x, loss, v=v)`` against the full GGN (``oracles.ggn``) times v;
- ``linearize`` / ``linearize_params``: ``lin.out``, ``lin(v)`` and ``lin.vjp(u)``;
- ``jacobian_dict`` / ``psg_dict``: ``wrt=`` a dict of tensors (values not the module's, all
  of them or a subset) for ``jacobian`` and ``per_sample_grads``;
- ``jacobian_functional``: ``jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))`` with
  ``fn(p, v) = functional_call(net, p, (v,))`` of the batch v (jacmode's convention, as every f
  it takes), or, in a quarter of the cases, torch.func's per-sample spelling
  ``functional_call(net, p, (v[None],))[0]`` (jacmode reads the spelling and batches it with vmap,
  or a loop where vmap has no rule), against samples evaluated alone.

Every call also checks that the model is left as found: parameters (values and identity), buffers,
train/eval flags, requires_grad, ``.grad`` (one parameter holds a gradient before the call) and
hooks (``state_of``). All oracles are float64 ``torch.autograd.grad`` loops on the primitive
model (so they run on RNNs too, where torch.func has no batching rule).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import grammar as G
import oracles as O
import torch
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call

import jacmode as jm

INPUT_VECTOR = ("jvp", "vjp", "hvp", "linearize")
PARAM_VECTOR = ("jvp_params", "vjp_params", "hvp_params", "ggn_v", "linearize_params")
FUNCTIONAL = ("jacobian_dict", "psg_dict", "jacobian_functional")
VECTOR_ENTRIES = (*INPUT_VECTOR, *PARAM_VECTOR, *FUNCTIONAL)
SECOND_ORDER = ("hvp", "hvp_params")


# ---------------------------------------------------------------------------------------------
# Drawing.


@st.composite
def vector_cases(draw: st.DrawFn) -> G.Case:
    entry = draw(st.sampled_from(VECTOR_ENTRIES))
    head, spec, in_shape, width = draw(G._head("jacobian" if entry not in INPUT_VECTOR else "hessian"))
    coupled_ok = head not in ("rnn", "gru", "lstm") and entry != "jacobian_functional"
    blocks, width = draw(G._blocks(width, coupled_ok=coupled_ok))
    out_shape = draw(st.sampled_from([(1,), (2,), (3,), (2, 2), (1, 2)]))
    o: dict[str, Any] = {}
    if entry in ("vjp_params", "linearize_params"):
        o["per_sample"] = draw(st.booleans())
        o["flatten"] = draw(st.booleans())
    if entry == "hvp":
        o["mode"] = draw(st.sampled_from(["auto", "forward", "reverse"]))
        o["chunk_size"] = draw(st.one_of(st.none(), st.integers(1, 2)))
    if entry == "hvp_params":
        o["mode"] = draw(st.sampled_from(["auto", "forward", "reverse"]))
        o["loss"] = draw(st.sampled_from(["sq", "mse_y", "mse_module"] + ["cross_entropy_y"] * (out_shape[0] > 1)))
    if entry == "ggn_v":
        o["loss"] = draw(st.sampled_from(["mse"] + ["cross_entropy"] * (out_shape[0] > 1)))
    if entry == "psg_dict":
        o["loss"] = draw(st.sampled_from(["sq", "mse_y"] + ["cross_entropy_y"] * (out_shape[0] > 1)))
    if entry in ("jacobian_dict", "psg_dict", "jacobian_functional"):
        o["subset"] = draw(st.booleans())
        o["same"] = draw(st.integers(0, 3)) == 0  # the module's own values (detached copies)
    if entry == "jacobian_functional":  # fn(p, v) of the batch v, or of one sample (v[None] ... [0])
        o["spelling"] = draw(st.sampled_from(["batch", "batch", "batch", "sample"]))
    if entry == "jacobian_dict":
        o["flatten"] = draw(st.booleans())
        o["mode"] = draw(st.sampled_from(["auto", "forward", "reverse"]))
    if entry in INPUT_VECTOR:
        conventions = ["module", "lambda", "fcall_other", "no_grad", "inference_mode"]
    else:
        conventions = ["module", "no_grad", "inference_mode"]
    return G.Case(seed=draw(st.integers(0, 2**16)), head=head, head_spec=spec, in_shape=in_shape, blocks=blocks,
                  width=width, out_shape=out_shape, batch=draw(st.integers(1, 3)),
                  dtype=draw(st.sampled_from([torch.float64, torch.float32])), entry=entry, options=o,
                  convention=draw(st.sampled_from(conventions)))


def valid(case: G.Case) -> bool:
    """Inputs differentiated need float inputs (integer ids have no input derivatives: covered by the main draw)."""
    return not (case.entry in INPUT_VECTOR and case.integer)


def expected_error(case: G.Case) -> Optional[str]:
    """Per-sample results owe an error on coupled samples; whole-batch products (torch.func's) do not."""
    if not case.coupled:
        return None
    if case.entry in ("hvp", "ggn_v", "jacobian_dict", "psg_dict", "jacobian_functional"):
        return "coupled samples"
    if case.entry in ("vjp_params", "linearize_params") and case.options["per_sample"]:
        return "coupled samples"
    return None


# ---------------------------------------------------------------------------------------------
# Model state: what a call must leave as found.


def state_of(net: nn.Module) -> dict[str, Any]:
    return {
        "params": [(n, id(p), p.detach().clone(), p.requires_grad) for n, p in net.named_parameters()],
        "grads": [(n, None if p.grad is None else p.grad.clone()) for n, p in net.named_parameters()],
        "buffers": [(n, id(b), b.clone()) for n, b in net.named_buffers()],
        "flags": [(n, m.training) for n, m in net.named_modules()],
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for n, m in net.named_modules()],
    }


def state_changed(before: dict[str, Any], net: nn.Module) -> Optional[str]:
    after = state_of(net)
    for key in before:
        for a, b in zip(before[key], after[key]):
            same = len(a) == len(b) and all(
                (x is None and y is None) or (isinstance(x, Tensor) and isinstance(y, Tensor) and x.shape == y.shape
                                              and torch.equal(x, y)) or (not isinstance(x, Tensor) and x == y)
                for x, y in zip(a, b))
            if not same:
                return f"the model was left changed: {key} of {a[0]!r}"
        if len(before[key]) != len(after[key]):
            return f"the model was left changed: the number of {key}"
    return None


# ---------------------------------------------------------------------------------------------
# Oracles (float64, autograd loops on the primitive model).


def _leaves(params: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}


def _flat(gs: Any, like: list[Tensor]) -> Tensor:
    return torch.cat([(torch.zeros_like(v) if g is None else g).reshape(-1) for g, v in zip(gs, like)])


def _grad(scalar: Tensor, leaves: list[Tensor], create_graph: bool = False) -> tuple[Optional[Tensor], ...]:
    if not scalar.requires_grad:
        return tuple(None for _ in leaves)
    return torch.autograd.grad(scalar, leaves, allow_unused=True, create_graph=create_graph)


def _sample_rows(net64: nn.Module, params: dict[str, Tensor], x: Tensor, names: list[str]) -> Tensor:
    """(B, Y, P_sel) parameter Jacobian, each sample alone."""
    out = []
    for b in range(x.shape[0]):
        leaves = _leaves(params)
        y = functional_call(net64, leaves, (x[b : b + 1],))[0]
        out.append(O._rows(y, [leaves[n] for n in names]).detach())
    return torch.stack(out)


def _weights(shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# Running a case.


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _loss(kind: str, y: Optional[Tensor]) -> tuple[Callable[..., Tensor], Optional[Tensor]]:
    if kind == "mse_module":
        return nn.MSELoss(), y
    return O.losses(kind), y


def run(case: G.Case, net: nn.Module, net64: nn.Module, x64: Tensor, gen: torch.Generator,
        params64: dict[str, Tensor]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(a thunk giving jacmode's answer, one giving the oracle's) for a vector-product or functional
    case; the tensors are made here, outside the convention's context (no_grad, inference_mode) that
    the runner calls the first thunk in. ``params64``: the parameter values f uses."""
    e, o, dt = case.entry, case.options, case.dtype
    x = _cast(x64, dt)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    P = sum(p.numel() for n, p in net.named_parameters() if p.requires_grad)
    out_shape = (case.batch, *case.out_shape)
    params = {k: _cast(v, dt) for k, v in params64.items()}
    if case.convention == "fcall_other":
        f: Any = lambda z: functional_call(net, params, (z,))  # noqa: E731
    elif case.convention == "lambda":
        f = lambda z: net(z)  # noqa: E731
    else:
        f = net
    f64 = lambda z: functional_call(net64, params64, (z,))  # noqa: E731
    v_in, u = _weights(tuple(x64.shape), gen), _weights(out_shape, gen)
    v_p = _weights((P,), gen)
    vi, uu, vp = _cast(v_in, dt), _cast(u, dt), _cast(v_p, dt)

    def whole_input_jac() -> Tensor:
        xl = x64.detach().clone().requires_grad_(True)
        return O._rows(f64(xl), [xl]).detach()  # (B*Y, B*D)

    def whole_param_jac() -> Tensor:
        leaves = _leaves(params64)
        return O._rows(functional_call(net64, leaves, (x64,)), [leaves[n] for n in names]).detach()  # (B*Y, P)

    if e == "jvp":
        got = lambda: jm.jvp(f, x, vi)  # noqa: E731
        return got, lambda: (f64(x64).detach(), (whole_input_jac() @ v_in.reshape(-1)).reshape(out_shape))
    if e == "jvp_params":
        got = lambda: jm.jvp(net, x, vp, wrt="params")  # noqa: E731
        return got, lambda: (f64(x64).detach(), (whole_param_jac() @ v_p).reshape(out_shape))
    if e == "vjp":
        def got() -> Any:
            out, fn = jm.vjp(f, x)
            return (out, fn(uu))
        return got, lambda: (f64(x64).detach(), ((u.reshape(-1) @ whole_input_jac()).reshape(x64.shape),))
    if e == "vjp_params":
        def got() -> Any:
            out, fn = jm.vjp(net, x, wrt="params", per_sample=o["per_sample"], flatten=o["flatten"])
            return (out, _flatten_dict(fn(uu), net, names, o["per_sample"], case.batch))

        def want_vjp() -> Any:
            if o["per_sample"]:
                rows = _sample_rows(net64, params64, x64, names)  # (B, Y, P)
                return (f64(x64).detach(), torch.einsum("by,byp->bp", u.reshape(case.batch, -1), rows))
            return (f64(x64).detach(), u.reshape(-1) @ whole_param_jac())
        return got, want_vjp
    if e == "linearize":
        def got() -> Any:
            lin = jm.linearize(f, x)
            return (lin.out, lin(vi), lin.vjp(uu))

        def want_lin() -> Any:
            j = whole_input_jac()
            return (f64(x64).detach(), (j @ v_in.reshape(-1)).reshape(out_shape), ((u.reshape(-1) @ j).reshape(x64.shape),))
        return got, want_lin
    if e == "linearize_params":
        def got() -> Any:
            lin = jm.linearize(net, x, wrt="params", per_sample=o["per_sample"], flatten=o["flatten"])
            return (lin.out, lin(vp), _flatten_dict(lin.vjp(uu), net, names, o["per_sample"], case.batch))

        def want_linp() -> Any:
            j = whole_param_jac()
            if o["per_sample"]:
                back = torch.einsum("by,byp->bp", u.reshape(case.batch, -1), _sample_rows(net64, params64, x64, names))
            else:
                back = u.reshape(-1) @ j
            return (f64(x64).detach(), (j @ v_p).reshape(out_shape), back)
        return got, want_linp
    if e == "hvp":
        w = _weights(out_shape[1:], gen)
        w_dt = _cast(w, dt)
        s = lambda z: (f(z) * w_dt).flatten(1).sum(1)  # noqa: E731
        got = lambda: jm.hvp(s, x, vi, mode=o["mode"], chunk_size=o["chunk_size"])  # noqa: E731

        def want_hvp() -> Tensor:
            rows = []
            for b in range(case.batch):
                xb = x64[b : b + 1].detach().clone().requires_grad_(True)
                (g,) = _grad((f64(xb) * w).sum(), [xb], create_graph=True)
                if g is None or not g.requires_grad:
                    rows.append(torch.zeros_like(xb[0]))
                    continue
                (hv,) = _grad((g * v_in[b : b + 1]).sum(), [xb])
                rows.append(torch.zeros_like(xb[0]) if hv is None else hv[0])
            return torch.stack(rows)
        return got, want_hvp
    if e == "hvp_params":
        y = O.loss_targets("mse_y" if o["loss"] == "mse_module" else o["loss"], case.out_shape, case.batch, gen)
        loss, _ = _loss(o["loss"], y)
        y_dt = None if y is None else _cast(y, dt)
        got = lambda: jm.hvp(net, x, vp, wrt="params", loss=loss, y=y_dt, mode=o["mode"])  # noqa: E731

        def want_hvpp() -> Tensor:
            leaves = _leaves(params64)
            ls = [leaves[n] for n in names]
            out = functional_call(net64, leaves, (x64,))
            value = loss(out) if y is None else loss(out, y)
            gs = _grad(value.sum(), ls, create_graph=True)
            dot = sum((g * vv.reshape(g.shape)).sum() for g, vv in zip(gs, v_p.split([t.numel() for t in ls]))
                      if g is not None and g.requires_grad)
            if not isinstance(dot, Tensor):
                return torch.zeros(P, dtype=torch.float64)
            return _flat(_grad(dot, ls), ls)
        return got, want_hvpp
    if e == "ggn_v":
        got = lambda: jm.ggn(net, x, o["loss"], v=vp)  # noqa: E731
        return got, lambda: O.ggn(net64, x64, o["loss"], False) @ v_p
    # functional parameters
    chosen = names[-1:] if o["subset"] else names
    gen_p = torch.Generator().manual_seed(case.seed + 3)
    dict64 = {n: params64[n].detach().clone() + (0 if o["same"] else 0.3 * torch.randn(
        params64[n].shape, generator=gen_p, dtype=torch.float64)) for n in chosen}
    d = {n: _cast(t, dt) for n, t in dict64.items()}
    full64 = {**params64, **dict64}
    if e == "jacobian_dict":
        def got() -> Any:
            j = jm.jacobian(net, x, wrt=d, flatten=o["flatten"], mode=o["mode"])
            return j if o["flatten"] else _flat_blocks(j, chosen, net, (case.batch, *case.out_shape))
        lead = (case.batch, math.prod(case.out_shape)) if o["flatten"] else out_shape  # (B, Y, P), as wrt="params"
        return got, lambda: _sample_rows(net64, full64, x64, chosen).reshape(*lead, -1)
    if e == "psg_dict":
        y = O.loss_targets(o["loss"], case.out_shape, case.batch, gen)
        loss = O.losses(o["loss"])
        y_dt = None if y is None else _cast(y, dt)
        got = lambda: jm.per_sample_grads(net, x, loss, y=y_dt, wrt=d)  # noqa: E731

        def want_psg() -> Tensor:
            rows = []
            for b in range(case.batch):
                leaves = _leaves(full64)
                out = functional_call(net64, leaves, (x64[b : b + 1],))
                value = loss(out) if y is None else loss(out, y[b : b + 1])
                ls = [leaves[n] for n in chosen]
                rows.append(_flat(_grad(value.sum(), ls), ls))
            return torch.stack(rows)
        return got, want_psg
    assert e == "jacobian_functional", e

    def fn(p: dict[str, Tensor], v: Tensor) -> Tensor:
        if o["spelling"] == "sample":  # torch.func's per-sample spelling (_functional.py, [Per-sample spelling])
            return functional_call(net, p, (v.unsqueeze(0),))[0]
        return functional_call(net, p, (v,))

    def got() -> Any:
        return _flat_blocks(jm.jacobian(fn, d, x, argnums=0, in_dims=(None, 0)), chosen, net, (case.batch, *case.out_shape))
    return got, lambda: _sample_rows(net64, full64, x64, chosen).reshape(*out_shape, -1)


def _flat_blocks(value: Any, names: list[str], net: nn.Module, lead: tuple[int, ...]) -> Any:
    """A dict name -> (*lead, *shape) as (*lead, P) (a layout error is returned as a string)."""
    shapes = dict(net.named_parameters())
    try:
        return O.flat_dict(value, lead, {n: shapes[n].shape for n in names})
    except AssertionError as err:
        return f"layout: {err}"


def _flatten_dict(value: Any, net: nn.Module, names: list[str], per_sample: bool, batch: int) -> Any:
    if isinstance(value, dict):
        return _flat_blocks(value, names, net, (batch,) if per_sample else ())
    return value


def order(case: G.Case) -> int:
    return 2 if case.entry in SECOND_ORDER else 1
