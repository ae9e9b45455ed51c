"""Run one drawn case through jacmode and through the oracle, and judge the outcome.

A case passes when jacmode's result matches the float64 oracle to the tolerance of its dtype and
order, or when jacmode raises one of its own clear errors (``clear_error``). It fails on a
mismatch, a raw error (torch's, an assert, a jacmode error that names no argument or fix), or a
result where an error is due (coupled samples, integer inputs differentiated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import traceback
from typing import Any, Callable, Optional

import grammar as G
import oracles as O
import torch
import vectors as V
from torch import Tensor, nn
from torch.func import functional_call

import jacmode as jm
from jacmode._capture import codegen

JACMODE_DIR = os.path.dirname(os.path.abspath(jm.__file__))

# max |got - want| <= TOL[dtype][order] * (max |want| + FLOOR)
TOL = {torch.float64: {1: 1e-9, 2: 1e-8, 3: 1e-7, 4: 1e-6}, torch.float32: {1: 2e-4, 2: 1e-3, 3: 5e-3, 4: 2e-2}}
FLOOR = 1e-2

# conventions that differentiate jacmode's result once more: compared at one order higher
DIFFERENTIATING = ("grad_create_graph", "fcall_autograd", "func_grad", "jacrev", "jacrev_nograph", "jacfwd")

CLEAR_TYPES = (TypeError, ValueError, MemoryError)  # jm.CoupledBatchError is a ValueError
NAMES_ARGUMENT = re.compile(r"^[A-Za-z_][\w.]*(\([\w, ]*\))?(\[[^\]]*\])?: ")
NAMES_FIX = re.compile(r"\b(use|pass|set|drop|call|select|wrap|raise|remove|split|fix|convert|give|ask|"
                       r"move|keep|cast|put|make|instead|must|expected)\b", re.IGNORECASE)


def clear_error(err: BaseException) -> Optional[str]:
    """None when ``err`` is one of jacmode's clear errors, else why not.

    Clear: a TypeError, ValueError (CoupledBatchError included) or MemoryError, raised by a
    ``raise`` statement in jacmode's own source (the innermost frame of the traceback is a file of
    the jacmode package), whose message names what was wrong (starts with an argument name and a
    colon, e.g. "x: expected ...", except for MemoryError, which names the sizes) and a fix (an
    imperative such as use / pass / set / drop / call / select, or what was "expected").
    """
    if not isinstance(err, CLEAR_TYPES):
        return f"{type(err).__name__} is not a TypeError, ValueError or MemoryError"
    frames = traceback.extract_tb(err.__traceback__)
    where = os.path.abspath(frames[-1].filename) if frames else "?"
    if not where.startswith(JACMODE_DIR):
        return f"raised outside jacmode ({where}:{frames[-1].lineno if frames else '?'})"
    msg = str(err)
    if not isinstance(err, MemoryError) and not NAMES_ARGUMENT.match(msg):
        return "the message does not start with the argument it is about ('name: ...')"
    if not NAMES_FIX.search(msg):
        return "the message names no fix"
    return None


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    status: str  # "match", "clear_error", "expected_error", or a failure: "mismatch", "raw_error", "no_error"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("match", "clear_error", "expected_error")


def expected_error(case: G.Case) -> Optional[str]:
    """The error jacmode owes for this case, if any."""
    if case.integer and case.entry in G.INPUT_ENTRIES:
        return "integer inputs have no input derivatives"
    if not case.coupled:
        return None
    if case.entry in G.PRODUCTS:
        return "coupled samples"
    if case.entry in ("jacobian", "jacobian_params") and not case.options["batched"]:
        return None
    if case.options.get("structure", "auto") == "auto":
        return "coupled samples"
    return None


INPUT_DERIVATIVES = (*G.INPUT_ENTRIES, *V.INPUT_VECTOR)


def locally_independent(case: G.Case, net64: nn.Module, batches: list[Tensor]) -> bool:
    """Whether the drawn batches are independent where the case differentiates, though the model couples
    samples in general: then no error is owed, and a result must match the samples-alone oracle.

    A coupled op can be inactive at the drawn point: a ReLU that zeroes every feature of a sample before
    ``cumsum(z, 0)`` (the other rows do not depend on it anywhere near x; the coupling probe cannot move
    it either), or samples that the model cannot tell apart before ``z - z.mean(0)`` or BatchNorm's
    batch statistics (ids whose bags hold the same multiset of rows: every sample's output is then
    that of the sample alone, as a function of the parameters). Input derivatives: the cross-sample
    blocks of the whole-batch Jacobian are exactly zero. Parameter derivatives: every sample's Jacobian
    rows in the batch equal its rows alone (float64). The functional parameters (other values than the
    convention's) and the conventions that run several batches (vmap) keep the general expectation.
    """
    if case.convention == "vmap" or case.entry in V.FUNCTIONAL:
        return False
    params = effective_params(case, net64)
    f64 = lambda z: functional_call(net64, params, (z,))  # noqa: E731
    for x in batches:
        if x is None:
            continue
        if case.entry == "derivative" and not (case.pointwise and not case.column):
            x = x.reshape(-1, 1)  # t (B,) as the oracle feeds it (oracles.derivative)
        b = x.shape[0]
        if case.entry in INPUT_DERIVATIVES and x.is_floating_point():
            jac = torch.autograd.functional.jacobian(f64, x).reshape(b, -1, b, math.prod(x.shape[1:]))
            cross = jac * (1 - torch.eye(b, dtype=jac.dtype))[:, None, :, None]
            if bool(cross.ne(0).any()):
                return False
            continue
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        ls = [leaves[n] for n, p in net64.named_parameters() if p.requires_grad]
        together = O._rows(functional_call(net64, leaves, (x,)), ls).detach().reshape(b, -1, sum(t.numel() for t in ls))
        alone = torch.stack([O._rows(functional_call(net64, leaves, (x[i : i + 1],))[0], ls).detach()
                             for i in range(b)])
        scale = float(alone.abs().max()) if alone.numel() else 0.0
        if not torch.allclose(together, alone, rtol=0, atol=1e-12 * (scale + 1)):
            return False
    return True


def valid(case: G.Case) -> bool:
    """Cases whose answer is the user's own promise are left out: structure='independent' on
    coupled samples (the user asserts what is false); models that torch itself cannot evaluate."""
    if any(b[1] == "batchnorm_train" for b in case.blocks) and case.batch == 1:
        return False  # torch itself refuses BatchNorm training statistics of one sample
    return not (case.coupled and case.options.get("structure") == "independent")


def effective_params(case: G.Case, net: nn.Module) -> dict[str, Tensor]:
    """The parameter values f really uses under the case's convention (float64)."""
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    if case.convention == "fcall_other":
        gen = torch.Generator().manual_seed(case.seed + 1)
        params = {k: v + 0.25 * torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v.dtype)
                  for k, v in params.items()}
    return params


def loss_setup(case: G.Case, gen: torch.Generator) -> tuple[Callable[..., Tensor], Optional[Tensor]]:
    kind = case.options["loss"]
    y = O.loss_targets(kind, case.out_shape, case.batch, gen)
    if kind == "cross_entropy_y" and len(case.out_shape) == 0:
        y = None
    return O.losses(kind), y


def call(case: G.Case, f: Any, net: nn.Module, x: Tensor, extra: dict, create_graph: bool = False) -> Any:
    """The jacmode entry point of ``case`` (``f`` for the input derivatives, ``net`` for products)."""
    if case.form:
        return flat_result(case, formed(case, f, net, x, create_graph))
    e, o = case.entry, case.options
    cg = {"create_graph": True} if create_graph else {}
    cg["chunk_size"] = o.get("chunk_size")
    if e == "jacobian":
        return jm.jacobian(f, x, mode=o["mode"], batched=o["batched"], structure=o["structure"], **cg)
    if e == "jacobian_params":
        return jm.jacobian(f, x, wrt="params", mode=o["mode"], batched=o["batched"], flatten=o["flatten"],
                           chunk_size=o["chunk_size"])
    if e == "derivative":
        return jm.derivative(f, x, order=o["order"], structure=o["structure"], **cg)
    if e == "partial":
        return jm.partial(f, x, o["dims"], structure=o["structure"], **cg)
    if e == "partials":
        return jm.partials(f, x, o["dims"], structure=o["structure"], **cg)
    if e in ("hessian", "laplacian", "divergence", "biharmonic"):
        return getattr(jm, e)(f, x, structure=o["structure"], **cg)
    if e == "operator":
        return jm.operator(f, x, o["terms"], structure=o["structure"], **cg)
    if e == "weighted_laplacian":
        S = torch.tensor(o["weight"], dtype=x.dtype)
        return jm.laplacian(f, x, weight=S, structure=o["structure"], **cg)
    if e == "per_sample_grads":
        return jm.per_sample_grads(net, x, extra["loss"], y=extra["y"])
    if e == "ntk":
        return jm.ntk(net, x, extra["x2"], method=o["method"], trace=o["trace"])
    return jm.ggn(net, x, o["loss"], diagonal=o["diagonal"])


# ---- call forms of several arguments (grammar._form) ---------------------------------------------

def _signature(case: G.Case) -> tuple[list[str], list[str]]:
    """(positional parameter names, keyword ones) of the function of several arguments."""
    names = [f"p{i}" for i in range(len(case.form["pieces"]))]
    return (names[:-1], names[-1:]) if case.form["keyword"] else (names, [])


def _several(case: G.Case, body: Callable[..., Any], method: bool = False) -> Callable[..., Any]:
    """A function (or forward) with parameters p0, p1, ... that calls ``body(p0, p1, ...)``."""
    pos, kw = _signature(case)
    head = ["self"] if method else []
    src = (f"def g({', '.join(head + pos + [k + '=None' for k in kw])}):\n"
           f"    return body({', '.join(head + pos + kw)})\n")
    ns: dict[str, Any] = {"body": body}
    exec(src, ns)  # noqa: S102 -- the names are the point: jacmode reads coordinates by them
    return ns["g"]


def _wrap_out(case: G.Case, out: Any) -> Any:
    out = {"tensor": out, "tuple": (out,), "dict": {"u": out}}[case.form["out"]]
    return (out, {"note": 1}) if case.form["aux"] else out


def _coordinate(case: G.Case, c: int) -> Any:
    """Flat column c of x as the form names it: "p1", ("p1", k), (1, k) or its position in z."""
    form = case.form
    i = next(i for i, (a, b) in enumerate(form["pieces"]) if a <= c < b)
    lo, hi = form["pieces"][i]
    if form["names"] == "names":
        return f"p{i}" if hi - lo == 1 else (f"p{i}", c - lo)
    if form["names"] == "pairs":
        return (i, c - lo)
    offset = 0
    for j in form["argnums"]:
        if j == i:
            return offset + c - lo
        offset += form["pieces"][j][1] - form["pieces"][j][0]
    raise AssertionError("a coordinate outside the differentiated arguments")


def formed(case: G.Case, f: Any, net: nn.Module, x: Tensor, create_graph: bool) -> Any:
    """The entry point called with x cut into the form's pieces."""
    form, e, o = case.form, case.entry, case.options
    pieces = [x[:, a:b] for a, b in form["pieces"]]
    pos, kw = _signature(case)
    args = pieces[:len(pos)]
    kwargs = {kw[0]: pieces[-1]} if kw else None
    argnums = form["argnums"][0] if form["int"] else form["argnums"]
    common: dict[str, Any] = dict(kwargs=kwargs, has_aux=form["aux"], chunk_size=o.get("chunk_size"))
    if e == "jacobian_params":
        base = type(net)
        forward = _several(case, lambda self, *ps: _wrap_out(case, base.forward(self, torch.cat(ps, 1))), method=True)
        split = type("Several" + base.__name__, (base,), {"forward": forward})
        model = split.__new__(split)
        object.__setattr__(model, "__dict__", net.__dict__)  # the same parameters under the same names
        return jm.jacobian(model, *args, wrt="params", mode=o["mode"], flatten=o["flatten"], **common)
    g = _several(case, lambda *ps: _wrap_out(case, f(torch.cat(ps, 1))))
    common.update(argnums=argnums, create_graph=create_graph, structure=o.get("structure", "auto"))
    if e == "jacobian":
        return jm.jacobian(g, *args, mode=o["mode"], **common)
    if e == "partial":
        return jm.partial(g, *args, dims=tuple(_coordinate(case, c) for c in o["dims"]), **common)
    if e == "partials":
        return jm.partials(g, *args, dims=[tuple(_coordinate(case, c) for c in d) for d in o["dims"]], **common)
    if e == "operator":
        return jm.operator(g, *args, terms=[(c, tuple(_coordinate(case, k) for k in d)) for c, d in o["terms"]],
                           **common)
    return getattr(jm, e)(g, *args, **common)


def _unwrap(case: G.Case, out: Any, what: str) -> Any:
    kind = case.form["out"]
    if kind == "tuple":
        assert isinstance(out, tuple) and len(out) == 1, f"{what}: expected f's tuple output, got {type(out).__name__}"
        return out[0]
    if kind == "dict":
        assert isinstance(out, dict) and list(out) == ["u"], f"{what}: expected f's dict output, got {type(out).__name__}"
        return out["u"]
    return out


def flat_result(case: G.Case, result: Any) -> Any:
    """The result of a call of several arguments in the flat form of the one-tensor call restricted to
    the differentiated columns, checking torch.func's layout on the way (AssertionError if not)."""
    form, e = case.form, case.entry
    if form["aux"]:
        assert isinstance(result, tuple) and len(result) == 2 and result[1] == {"note": 1}, "has_aux: no (result, aux)"
        result = result[0]
    order = form["argnums"]
    sorted_pieces = sorted(order)
    width = {i: form["pieces"][i][1] - form["pieces"][i][0] for i in order}

    def per_arg(v: Any, what: str) -> dict[int, Any]:
        if form["int"]:
            return {order[0]: v}
        assert isinstance(v, tuple) and len(v) == len(order), f"{what}: expected a tuple over argnums {order}"
        return dict(zip(order, v))

    if e == "jacobian_params":
        return result if case.options["flatten"] else _unwrap(case, result, "jacobian")
    if e in ("partial", "laplacian", "operator", "biharmonic"):
        return _unwrap(case, result, e)
    if e == "partials":
        assert isinstance(result, tuple), "partials: expected a tuple"
        return tuple(_unwrap(case, r, "partials") for r in result)
    if e == "divergence":
        return result
    if e == "jacobian":
        blocks = per_arg(_unwrap(case, result, "jacobian"), "jacobian")
        for i, b in blocks.items():
            assert b.shape[-1] == width[i], f"jacobian: block of argument {i} has {b.shape[-1]} columns, not {width[i]}"
        return torch.cat([blocks[i] for i in sorted_pieces], -1)
    rows = per_arg(_unwrap(case, result, "hessian"), "hessian")  # hessian: argnum i -> (argnum j -> block)
    full = []
    for i in sorted_pieces:
        cols = per_arg(rows[i], "hessian") if not form["int"] else {order[0]: rows[i]}
        full.append(torch.cat([cols[j] for j in sorted_pieces], -1))
    return torch.cat(full, -2)


def reference(case: G.Case, f64: Callable[[Tensor], Tensor], net64: nn.Module, x: Tensor, extra: dict) -> Any:
    """The oracle of ``call`` in float64 (restricted to the differentiated columns of a call form)."""
    if case.form and case.entry in ("jacobian", "hessian", "laplacian"):
        cols = case.differentiated()
        if case.entry == "laplacian":
            eye = torch.eye(math.prod(case.in_shape), dtype=torch.float64)
            return O.weighted_laplacian(f64, x, eye[:, cols])
        if case.entry == "jacobian":
            return O.input_jacobian(f64, x, True)[..., cols]
        return O.hessian(f64, x)[..., cols, :][..., cols]
    e, o = case.entry, case.options
    if e == "jacobian" and o["structure"] == "diagonal":
        return O.diagonal(f64, x, o["batched"])
    if e == "jacobian":
        return O.input_jacobian(f64, x, o["batched"])
    if e == "jacobian_params":
        return O.param_jacobian(net64, x, o["batched"])
    if e == "derivative":
        return O.derivative(f64, x, o["order"], as_given=case.pointwise and not case.column)
    if e == "partial":
        return O.partial(f64, x, o["dims"])
    if e == "partials":
        return tuple(O.partial(f64, x, d) for d in o["dims"])
    if e in ("hessian", "laplacian", "divergence", "biharmonic"):
        return getattr(O, e)(f64, x)
    if e == "operator":
        return O.operator(f64, x, o["terms"])
    if e == "weighted_laplacian":
        return O.weighted_laplacian(f64, x, torch.tensor(o["weight"], dtype=torch.float64))
    if e == "per_sample_grads":
        return O.per_sample_grads(net64, x, extra["loss"], extra["y"])
    if e == "ntk":
        return O.ntk(net64, x, extra["x2"], o["trace"])
    return O.ggn(net64, x, o["loss"], o["diagonal"])


def order(case: G.Case) -> int:
    if case.entry in V.VECTOR_ENTRIES:
        return V.order(case)
    o = case.options
    if case.entry == "derivative":
        return o["order"]
    if case.entry == "partial":
        return len(o["dims"])
    if case.entry == "partials":
        return max(len(d) for d in o["dims"])
    if case.entry in ("hessian", "laplacian", "weighted_laplacian"):
        return 2
    if case.entry == "operator":
        return max([1, *(len(dims) for _, dims in o["terms"])])
    if case.entry == "biharmonic":
        return 4
    return 1


def _weights(like: Any, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    if isinstance(like, tuple):
        return tuple(_weights(v, seed + i) for i, v in enumerate(like))
    with torch._C._DisableFuncTorch():  # a plain draw, also inside jacfwd (vmap refuses random ops)
        return torch.randn(like.shape, generator=gen, dtype=torch.float64)


def _scalar(result: Any, weights: Any) -> Tensor:
    if isinstance(result, tuple):
        return sum(_scalar(r, w) for r, w in zip(result, weights))
    return (result * weights.to(result.dtype)).sum()


def _gradients(loss: Tensor, leaves: list[Tensor]) -> tuple[Tensor, ...]:
    """d loss / d leaves; a loss that does not require grad is a constant (zero gradients), which the
    comparison with the oracle's gradients then checks (a derivative of a linear model above its
    degree is zero whatever the parameters)."""
    if not loss.requires_grad:
        return tuple(torch.zeros_like(v) for v in leaves)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return tuple(torch.zeros_like(v) if g is None else g for g, v in zip(grads, leaves))


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if t.is_floating_point() else t


# ---------------------------------------------------------------------------------------------


def run_jacmode(case: G.Case, net: nn.Module, x: Tensor, extra: dict, weights_seed: int) -> Any:
    """jacmode's answer under the case's calling convention (the model and x in case.dtype)."""
    c = case.convention
    params = {k: _cast(v, case.dtype) for k, v in effective_params(case, net).items()}
    if c == "lambda":
        return call(case, lambda z: net(z), net, x, extra)
    if c in ("fcall_same", "fcall_other"):
        return call(case, lambda z: functional_call(net, params, (z,)), net, x, extra)
    if c == "no_grad":
        with torch.no_grad():
            return call(case, net, net, x, extra)
    if c == "repeated":  # until the generated code (Taylor or probe engine) runs (codegen.AFTER_CALLS),
        for _ in range(codegen.AFTER_CALLS):  # and once more: a profile's code then runs straight away
            call(case, net, net, x, extra)  # (Profile.runs: _jacobian._direct, _operands.direct_call)
        return call(case, net, net, x, extra)
    if c == "inference_mode":
        with torch.inference_mode():
            return call(case, net, net, x, extra)
    if c == "grad_create_graph":
        xg = x.detach().clone().requires_grad_(x.is_floating_point())
        result = call(case, net, net, xg, extra, create_graph=True)
        return _gradients(_scalar(result, _weights(result, weights_seed)), [xg, *net.parameters()])
    if c == "fcall_autograd":
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        result = call(case, lambda z: functional_call(net, leaves, (z,)), net, x, extra, create_graph=True)
        return dict(zip(leaves, _gradients(_scalar(result, _weights(result, weights_seed)), list(leaves.values()))))
    if c == "func_grad":
        def loss_of(p: dict[str, Tensor]) -> Tensor:
            result = call(case, lambda z: functional_call(net, p, (z,)), net, x, extra, create_graph=True)
            return _scalar(result, _weights(result, weights_seed))
        return torch.func.grad(loss_of)(params)
    if c == "vmap":
        return torch.func.vmap(lambda xb: call(case, net, net, xb, extra))(extra["stack"])
    if c in ("jacrev", "jacrev_nograph", "jacfwd"):  # the last two with create_graph=False (the default)
        def vector(z: Tensor) -> Tensor:
            result = call(case, net, net, z, extra, create_graph=c == "jacrev")
            w = _weights(result, weights_seed)
            parts = result if isinstance(result, tuple) else (result,)
            ws = w if isinstance(result, tuple) else (w,)
            return sum((r * wi.to(r.dtype)).reshape(r.shape[0], -1).sum(1) for r, wi in zip(parts, ws))
        return (torch.func.jacfwd if c == "jacfwd" else torch.func.jacrev)(vector)(x)
    return call(case, net, net, x, extra)


def run_reference(case: G.Case, net64: nn.Module, x: Tensor, extra: dict, weights_seed: int) -> Any:
    """The oracle's answer under the same convention, in float64 on the primitive model."""
    c = case.convention
    params = effective_params(case, net64)
    f64 = lambda z: functional_call(net64, params, (z,))  # noqa: E731
    if c == "grad_create_graph":
        xg = x.detach().clone().requires_grad_(x.is_floating_point())
        result = reference(case, net64, net64, xg, extra)
        return _gradients(_scalar(result, _weights(result, weights_seed)), [xg, *net64.parameters()])
    if c == "fcall_autograd":
        leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        result = reference(case, lambda z: functional_call(net64, leaves, (z,)), net64, x, extra)
        return dict(zip(leaves, _gradients(_scalar(result, _weights(result, weights_seed)), list(leaves.values()))))
    if c == "func_grad":
        def loss_of(p: dict[str, Tensor]) -> Tensor:
            result = reference(case, lambda z: functional_call(net64, p, (z,)), net64, x, extra)
            return _scalar(result, _weights(result, weights_seed))
        return torch.func.grad(loss_of)(params)
    if c == "vmap":
        each = [reference(case, f64, net64, xb, extra) for xb in extra["stack"]]
        if isinstance(each[0], tuple):
            return tuple(torch.stack(parts) for parts in zip(*each))
        return torch.stack(each)
    if c in ("jacrev", "jacrev_nograph", "jacfwd"):
        def vector(z: Tensor) -> Tensor:
            result = reference(case, net64, net64, z, extra)
            w = _weights(result, weights_seed)
            parts = result if isinstance(result, tuple) else (result,)
            ws = w if isinstance(result, tuple) else (w,)
            return sum((r * wi).reshape(r.shape[0], -1).sum(1) for r, wi in zip(parts, ws))
        return torch.func.jacrev(vector)(x)
    return reference(case, f64, net64, x, extra)


def compare(got: Any, want: Any, case: G.Case, net: nn.Module, what: str = "result") -> Optional[str]:
    """None when ``got`` matches ``want``, else the difference."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return f"{what}: expected a dict with keys {list(want)}, got {type(got).__name__}"
        for k in want:
            bad = compare(got[k], want[k], case, net, f"{what}[{k!r}]")
            if bad:
                return bad
        return None
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"{what}: expected a tuple of {len(want)}, got {type(got).__name__}"
        for i, (g, w) in enumerate(zip(got, want)):
            bad = compare(g, w, case, net, f"{what}[{i}]")
            if bad:
                return bad
        return None
    if case.entry == "jacobian_params" and not case.options["flatten"]:
        lead = (case.batch, *case.out_shape)  # batched=False: (*f(x).shape, *param.shape)
        try:
            got = O.flat_dict(got, lead, {n: p.shape for n, p in net.named_parameters()})
        except AssertionError as err:
            return f"{what}: {err}"
        want = want.reshape(*lead, want.shape[-1])
    if isinstance(got, str):
        return f"{what}: {got}"
    if not isinstance(got, Tensor):
        return f"{what}: expected a tensor, got {type(got).__name__}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != case.dtype:
        return f"{what}: dtype {got.dtype}, expected {case.dtype} (the dtype of what is differentiated)"
    want = want.detach()
    got64 = got.detach().double()
    if not torch.isfinite(got64).all() and torch.isfinite(want).all():
        return f"{what}: non-finite values where the oracle is finite"
    err = (got64 - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    tol = TOL[case.dtype][min(4, order(case) + (case.convention in DIFFERENTIATING))] * (scale + FLOOR)
    if not err <= tol:
        return f"{what}: max |jacmode - oracle| = {err:.3g} > {tol:.3g} (max |oracle| = {scale:.3g})"
    return None


def run_case(case: G.Case) -> Outcome:
    """Build the model, run jacmode and the oracle, and judge."""
    if case.entry in V.VECTOR_ENTRIES:
        return run_vector_case(case)
    gen = torch.Generator().manual_seed(case.seed)
    net = G.build(case).to(case.dtype)
    net64 = G.build(case, primitive=True)
    x64 = G.make_input(case, gen)
    extra: dict[str, Any] = {"x2": None, "stack": None}
    if case.entry == "ntk" and case.options["x2"]:
        extra["x2"] = G.make_input(dataclasses.replace(case, batch=2), gen)
    if case.entry in ("per_sample_grads",):
        extra["loss"], extra["y"] = loss_setup(case, gen)
    if case.convention == "vmap":
        extra["stack"] = torch.stack([x64, G.make_input(case, gen)])
    extra64 = dict(extra)
    extra = {k: (_cast(v, case.dtype) if isinstance(v, Tensor) else v) for k, v in extra.items()}
    x = _cast(x64, case.dtype)
    owed = expected_error(case)
    if owed == "coupled samples" and locally_independent(case, net64, [x64, extra64["x2"]]):
        owed = None
    try:
        got = run_jacmode(case, net, x, extra, case.seed + 7)
    except Exception as err:  # noqa: BLE001 -- judged below
        why = clear_error(err)
        if why is not None:
            return Outcome("raw_error", f"{type(err).__name__}: {err} [{why}]\n{_where(err)}")
        return Outcome("expected_error" if owed else "clear_error", f"{type(err).__name__}: {str(err)[:200]}")
    if owed:
        return Outcome("no_error", f"expected an error ({owed}), got a result")
    want = run_reference(case, net64, x64, extra64, case.seed + 7)
    if case.convention == "grad_create_graph" and case.integer:
        got, want = got[1:], want[1:]
    bad = compare(got, want, case, net)
    return Outcome("mismatch", bad) if bad else Outcome("match")


def run_vector_case(case: G.Case) -> Outcome:
    """A case of the vector products or functional parameters (vectors.py); also checks the model is
    left as found (one parameter holds a .grad before the call)."""
    gen = torch.Generator().manual_seed(case.seed)
    net = G.build(case).to(case.dtype)
    net64 = G.build(case, primitive=True)
    x64 = G.make_input(case, gen)
    params64 = effective_params(case, net64)
    first = next(iter(net.parameters()), None)
    if first is not None:
        first.grad = torch.ones_like(first)
    before = V.state_of(net)
    owed = V.expected_error(case)
    if owed and locally_independent(case, net64, [x64]):
        owed = None
    try:
        thunk, want_of = V.run(case, net, net64, x64, gen, params64)
        with _context(case):
            got = thunk()
    except Exception as err:  # noqa: BLE001 -- judged below
        changed = V.state_changed(before, net)
        why = clear_error(err)
        if why is not None:
            return Outcome("raw_error", f"{type(err).__name__}: {err} [{why}]\n{_where(err)}")
        if changed:
            return Outcome("state", f"{changed} (after a clear error: {str(err)[:120]})")
        return Outcome("expected_error" if owed else "clear_error", f"{type(err).__name__}: {str(err)[:200]}")
    changed = V.state_changed(before, net)
    if changed:
        return Outcome("state", changed)
    if owed:
        return Outcome("no_error", f"expected an error ({owed}), got a result")
    bad = compare(got, want_of(), case, net)
    return Outcome("mismatch", bad) if bad else Outcome("match")


def _context(case: G.Case) -> Any:
    if case.convention == "no_grad":
        return torch.no_grad()
    if case.convention == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)[-4:]
    return "\n".join(f"  {os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in frames)

