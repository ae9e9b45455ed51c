"""The grammar of the differential harness: models, inputs, calling conventions and entry points.

A case is plain data (a ``Case``): the model as a head (what turns the input into features
(B, W)), a list of blocks on (B, W) and a linear tail to the output (B, *out); the input (shape,
dtype, integer ids); the entry point with its options; the calling convention. ``build`` turns
the model spec into a module. Every block has two spellings of the same function: the one jacmode
sees (modules, torch functions, methods, fused norms, as users write them) and a decomposition
into primitive ops that the float64 oracle differentiates (``primitive=True``), so the oracle
never leans on torch's own higher-order formulas of a fused op (wrong above order 1 for
LayerNorm).

The grammar only draws cases whose answer is defined: either a number (a float64 torch.func /
autograd oracle exists) or an error that jacmode must raise (coupled samples, integer inputs
differentiated). ``Case.expect`` says which.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------------
# Blocks: (B, W) -> (B, W'), each with the user's spelling and a primitive one.

# name -> (module class, torch function, functional, method name); None where no such spelling.
ACTIVATIONS: dict[str, tuple[Any, Any, Any, Optional[str]]] = {
    "tanh": (nn.Tanh, torch.tanh, F.tanh, "tanh"),
    "sigmoid": (nn.Sigmoid, torch.sigmoid, F.sigmoid, "sigmoid"),
    "gelu": (nn.GELU, None, F.gelu, None),
    "silu": (nn.SiLU, None, F.silu, None),
    "softplus": (nn.Softplus, None, F.softplus, None),
    "elu": (nn.ELU, None, F.elu, None),
    "sin": (None, torch.sin, None, "sin"),
    "relu": (nn.ReLU, torch.relu, F.relu, "relu"),
}
SPELLINGS = ("module", "torch", "functional", "method")


def spellings(name: str) -> list[str]:
    return [s for s, v in zip(SPELLINGS, ACTIVATIONS[name]) if v is not None]


class Act(nn.Module):
    """An activation in one of its spellings (nn.Tanh(), torch.tanh, F.tanh, x.tanh())."""

    def __init__(self, name: str, spelling: str) -> None:
        super().__init__()
        self.name, self.spelling = name, spelling
        if spelling == "module":
            self.act = ACTIVATIONS[name][0]()

    def forward(self, x: Tensor) -> Tensor:
        module, fn, functional, method = ACTIVATIONS[self.name]
        if self.spelling == "module":
            return self.act(x)
        if self.spelling == "torch":
            return fn(x)
        if self.spelling == "functional":
            return functional(x)
        return getattr(x, method)()


class Lin(nn.Module):
    def __init__(self, w_in: int, w_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w_in, w_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x)


class Norm(nn.Module):
    """LayerNorm, GroupNorm, RMSNorm, BatchNorm1d (eval, or training: coupled), softmax."""

    def __init__(self, kind: str, width: int, groups: int = 1) -> None:
        super().__init__()
        self.kind, self.primitive = kind, False
        if kind == "layernorm":
            self.norm: nn.Module = nn.LayerNorm(width)
        elif kind == "groupnorm":
            self.norm = nn.GroupNorm(groups, width)
        elif kind == "rmsnorm":
            self.norm = nn.RMSNorm(width, eps=1e-6)
        elif kind in ("batchnorm", "batchnorm_train"):
            self.norm = nn.BatchNorm1d(width)
            with torch.no_grad():  # running statistics that are not 0 and 1
                self.norm.running_mean.uniform_(-0.5, 0.5)
                self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.train(kind == "batchnorm_train")
        if hasattr(self, "norm") and getattr(self.norm, "weight", None) is not None:
            with torch.no_grad():  # affine parameters that are not 1 and 0
                self.norm.weight.uniform_(0.5, 1.5)
                if getattr(self.norm, "bias", None) is not None:
                    self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        if self.primitive:
            return self.decomposed(x)
        if self.kind == "softmax":
            return torch.softmax(x, dim=-1)
        if self.kind == "log_softmax":
            return F.log_softmax(x, dim=-1)
        return self.norm(x)

    def decomposed(self, x: Tensor) -> Tensor:
        """The same function in primitive ops (mean, subtract, rsqrt, exp, sum)."""
        n = self.norm if hasattr(self, "norm") else None
        if self.kind == "softmax":
            e = torch.exp(x)
            return e / e.sum(-1, keepdim=True)
        if self.kind == "log_softmax":
            return x - torch.log(torch.exp(x).sum(-1, keepdim=True))
        if self.kind == "layernorm":
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) * torch.rsqrt(var + n.eps) * n.weight + n.bias
        if self.kind == "rmsnorm":
            return x * torch.rsqrt((x**2).mean(-1, keepdim=True) + n.eps) * n.weight
        if self.kind == "groupnorm":
            g = x.reshape(x.shape[0], n.num_groups, -1)
            mu = g.mean(-1, keepdim=True)
            var = ((g - mu) ** 2).mean(-1, keepdim=True)
            return ((g - mu) * torch.rsqrt(var + n.eps)).reshape(x.shape) * n.weight + n.bias
        if self.kind == "batchnorm":
            return (x - n.running_mean) * torch.rsqrt(n.running_var + n.eps) * n.weight + n.bias
        mu = x.mean(0, keepdim=True)  # batchnorm_train: batch statistics (biased variance)
        var = ((x - mu) ** 2).mean(0, keepdim=True)
        return (x - mu) * torch.rsqrt(var + n.eps) * n.weight + n.bias


class Op(nn.Module):
    """Products, quotients, residuals, shape ops and ops that couple the samples."""

    def __init__(self, kind: str, width: int, arg: int = 0) -> None:
        super().__init__()
        self.kind, self.arg = kind, arg
        if kind in ("product", "residual"):
            self.lin = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        k = self.kind
        if k == "product":  # x * net(x)
            return x * torch.tanh(self.lin(x))
        if k == "quotient":
            return x / (1 + x**2)
        if k == "residual":
            return x + torch.tanh(self.lin(x))
        if k == "square":
            return x * (1 - x)
        if k == "cat":
            return torch.cat([x, x.sin()], dim=1)
        if k == "slice":
            return x[:, : self.arg]
        if k == "transpose":
            return x.reshape(x.shape[0], 2, -1).transpose(1, 2).reshape(x.shape[0], -1)
        if k == "flatten":
            return x.unsqueeze(-1).flatten(1)
        if k == "center":
            return x - x.mean(0)
        if k == "cumsum":
            return torch.cumsum(x, 0)
        raise AssertionError(k)  # pragma: no cover -- the grammar draws known kinds only


COUPLED_OPS = ("center", "cumsum")


# ---------------------------------------------------------------------------------------------
# Heads: the input (B, *in) -> features (B, W); the tail: (B, W) -> (B, *out).


class Head(nn.Module):
    def __init__(self, kind: str, in_shape: tuple[int, ...], spec: dict) -> None:
        super().__init__()
        self.kind, self.spec = kind, spec
        if kind == "conv1d":
            self.conv: nn.Module = nn.Conv1d(in_shape[0], spec["channels"], spec["kernel"])
        elif kind == "conv2d":
            self.conv = nn.Conv2d(in_shape[0], spec["channels"], spec["kernel"])
        elif kind == "embedding":
            self.emb: nn.Module = nn.Embedding(spec["vocab"], spec["dim"], padding_idx=spec["padding_idx"])
        elif kind == "embeddingbag":
            self.emb = nn.EmbeddingBag(spec["vocab"], spec["dim"], mode=spec["mode"], padding_idx=spec["padding_idx"])
        elif kind in ("rnn", "gru", "lstm"):
            cls = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[kind]
            self.seq: nn.Module = cls(in_shape[1], spec["hidden"], batch_first=True)

    def bag(self, x: Tensor) -> Tensor:
        """EmbeddingBag of ids (B, L) in primitive ops (indexing, mask, sum): torch defines neither the forward-mode
        formula of _embedding_bag nor the derivative of its backward, which the oracle's Hessians need."""
        e = self.emb
        rows = e.weight[x]  # (B, L, E)
        keep = torch.ones(x.shape, dtype=rows.dtype) if e.padding_idx is None else (x != e.padding_idx).to(rows.dtype)
        total = (rows * keep.unsqueeze(-1)).sum(1)
        return total if e.mode == "sum" else total / keep.sum(1).clamp(min=1).unsqueeze(-1)

    def forward(self, x: Tensor) -> Tensor:
        k = self.kind
        if k == "flat":
            return x
        if k == "multi":
            return x.flatten(1)
        if k == "transpose":
            return x.transpose(1, 2).reshape(x.shape[0], -1)
        if k in ("conv1d", "conv2d"):
            return torch.tanh(self.conv(x)).flatten(1)
        if k == "embedding":
            return self.emb(x).flatten(1)
        if k == "embeddingbag":
            return self.bag(x) if getattr(self, "primitive", False) else self.emb(x)
        out = self.seq(x)[0]
        return out[:, -1] if self.spec["last"] else out.flatten(1)


class Net(nn.Module):
    """head -> blocks -> Linear tail -> reshape to the output shape; or, pointwise, the blocks alone
    (elementwise ops on x of any shape: structure="diagonal" is valid)."""

    def __init__(self, head: Head, blocks: list[nn.Module], width: int, out_shape: tuple[int, ...],
                 pointwise: bool = False) -> None:
        super().__init__()
        self.head, self.blocks = head, nn.ModuleList(blocks)
        self.tail = None if pointwise else nn.Linear(width, math.prod(out_shape))
        self.out_shape = out_shape

    def forward(self, x: Tensor) -> Tensor:
        if self.tail is None:
            for block in self.blocks:
                x = block(x)
            return x
        h = self.head(x)
        for block in self.blocks:
            h = block(h)
        return self.tail(h).reshape(x.shape[0], *self.out_shape)


# ---------------------------------------------------------------------------------------------
# The case: plain data, drawn by ``cases()``.

INPUT_ENTRIES = ("jacobian", "derivative", "partial", "partials", "hessian", "laplacian", "divergence",
                 "operator", "weighted_laplacian", "biharmonic")
PRODUCTS = ("per_sample_grads", "ntk", "ggn")
ENTRIES = (*INPUT_ENTRIES, "jacobian_params", *PRODUCTS)
# module: f = net; lambda: f = lambda x: net(x); fcall_same / fcall_other: functional_call(net, params, (x,))
# with params equal to / different from net's; no_grad, inference_mode: the call inside that context;
# grad_create_graph: autograd.grad of a create_graph=True result wrt x and net's parameters;
# fcall_autograd: the same wrt leaf tensors passed through functional_call; func_grad: torch.func.grad
# over those parameters; vmap: torch.func.vmap over two stacked batches; jacrev: torch.func.jacrev wrt x;
# repeated: the same call made until its generated code runs (codegen.AFTER_CALLS calls), then once more
# (a profile hit that runs that code straight away), the last judged.
CONVENTIONS = ("module", "lambda", "fcall_same", "fcall_other", "no_grad", "inference_mode",
               "grad_create_graph", "fcall_autograd", "func_grad", "vmap", "jacrev", "repeated")
INT_HEADS = ("embedding", "embeddingbag")


@dataclasses.dataclass
class Case:
    seed: int
    head: str
    head_spec: dict
    in_shape: tuple[int, ...]  # per sample
    blocks: list[tuple]  # ("lin", w_in, w_out) | ("act", name, spelling) | ("norm", kind, w, groups) | ("op", kind, w, arg)
    width: int
    out_shape: tuple[int, ...]
    batch: int
    dtype: torch.dtype
    entry: str
    options: dict
    convention: str
    column: bool = True  # derivative: t of shape (B, 1) rather than (B,)
    pointwise: bool = False  # elementwise blocks on x, no head or tail (Net's docstring)
    form: Optional[dict] = None  # the call form of several arguments (see ``_form``), None: f(x)

    @property
    def integer(self) -> bool:
        return self.head in INT_HEADS

    @property
    def coupled(self) -> bool:
        """Some sample's output depends on another sample's input (the batch has > 1 sample)."""
        kinds = {b[1] for b in self.blocks if b[0] in ("op", "norm")}
        return self.batch > 1 and bool(kinds & {*COUPLED_OPS, "batchnorm_train"})

    def model_key(self) -> str:
        parts = ["pointwise" if self.pointwise else self.head] + ["-".join(str(v) for v in b[:3] if not isinstance(v, int)) for b in self.blocks]
        return "/".join(parts)

    def entry_key(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()) if k not in ("dims", "chunk_size"))
        return f"{self.entry}({opts})"

    def describe(self) -> str:
        return (f"{self.model_key()} in={self.in_shape} out={self.out_shape} B={self.batch} {self.dtype} "
                f"{self.entry_key()} dims={self.options.get('dims')} via {self.convention}"
                + (f" form={self.form}" if self.form else ""))

    def differentiated(self) -> list[int]:
        """The columns of x that are differentiated (all of them for a call of one tensor)."""
        if not self.form:
            return list(range(math.prod(self.in_shape)))
        return sorted(c for i in self.form["argnums"] for c in range(*self.form["pieces"][i]))


def build(case: Case, primitive: bool = False) -> Net:
    """The model of ``case`` in float64, seeded by case.seed (so every build has the same weights)."""
    torch.manual_seed(case.seed)
    head = Head(case.head, case.in_shape, case.head_spec)
    blocks: list[nn.Module] = []
    for b in case.blocks:
        if b[0] == "lin":
            blocks.append(Lin(b[1], b[2]))
        elif b[0] == "act":
            blocks.append(Act(b[1], b[2]))
        elif b[0] == "norm":
            blocks.append(Norm(b[1], b[2], b[3]))
        else:
            blocks.append(Op(b[1], b[2], b[3]))
    net = Net(head, blocks, case.width, case.out_shape, case.pointwise).double()
    for m in net.modules():
        if isinstance(m, (Norm, Head)):
            m.primitive = primitive
    return net


def make_input(case: Case, gen: torch.Generator) -> Tensor:
    shape = (case.batch, *case.in_shape)
    if case.integer:
        return torch.randint(0, case.head_spec["vocab"], shape, generator=gen)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    if case.entry == "derivative" and not case.column:
        x = x.reshape(case.batch)
    return x


# ---------------------------------------------------------------------------------------------
# Strategies.


@st.composite
def _head(draw: st.DrawFn, entry: str) -> tuple[str, dict, tuple[int, ...], int]:
    """(kind, spec, per-sample input shape, feature width W)."""
    if entry == "derivative":
        return "flat", {}, (1,), 1
    if entry == "biharmonic":  # fourth order: the oracle's nested jacfwd stays small
        d = draw(st.integers(1, 3))
        return "flat", {}, (d,), d
    if entry in ("partial", "partials", "hessian", "laplacian", "divergence", "operator", "weighted_laplacian"):
        kinds = ["flat", "multi"]
    else:
        kinds = ["flat", "multi", "transpose", "conv1d", "conv2d", "embedding", "embeddingbag", "rnn", "gru", "lstm"]
    kind = draw(st.sampled_from(kinds))
    small = st.integers(1, 3)
    if kind == "flat":
        d = draw(st.integers(1, 4))
        return kind, {}, (d,), d
    if kind in ("multi", "transpose"):
        a, b = draw(small), draw(small)
        return kind, {}, (a, b), a * b
    if kind == "conv1d":
        c, length, k = draw(st.integers(1, 2)), draw(st.integers(2, 4)), draw(st.integers(1, 2))
        ch = draw(st.integers(1, 2))
        return kind, {"channels": ch, "kernel": k}, (c, length), ch * (length - k + 1)
    if kind == "conv2d":
        c, h, w, k = draw(st.integers(1, 2)), draw(st.integers(2, 3)), draw(st.integers(2, 3)), draw(st.integers(1, 2))
        return kind, {"channels": 1, "kernel": k}, (c, h, w), (h - k + 1) * (w - k + 1)
    if kind in INT_HEADS:
        vocab, dim, length = draw(st.integers(3, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
        spec = {"vocab": vocab, "dim": dim, "padding_idx": draw(st.sampled_from([None, 0]))}
        if kind == "embeddingbag":
            spec["mode"] = draw(st.sampled_from(["sum", "mean"]))
            return kind, spec, (length,), dim
        return kind, spec, (length,), length * dim
    t, d, hidden, last = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.booleans())
    return kind, {"hidden": hidden, "last": last}, (t, d), hidden if last else t * hidden


@st.composite
def _blocks(draw: st.DrawFn, width: int, coupled_ok: bool) -> tuple[list[tuple], int]:
    blocks: list[tuple] = []
    kinds = ["lin", "act", "act", "norm", "product", "quotient", "residual", "square", "cat", "slice",
             "transpose", "flatten"]
    if coupled_ok:
        kinds += ["coupled"]
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(kinds))
        if kind == "lin":
            w = draw(st.integers(1, 5))
            blocks.append(("lin", width, w))
            width = w
        elif kind == "act":
            name = draw(st.sampled_from(sorted(ACTIVATIONS)))
            blocks.append(("act", name, draw(st.sampled_from(spellings(name)))))
        elif kind == "norm":
            norm = draw(st.sampled_from(["layernorm", "groupnorm", "rmsnorm", "batchnorm", "softmax", "log_softmax"]))
            if norm in ("layernorm", "groupnorm", "softmax", "log_softmax") and width == 1:
                continue  # constant (or trivial) over one feature: nothing to differentiate
            groups = draw(st.sampled_from([g for g in (1, 2) if width % g == 0 and width // g > 1] or [1]))
            blocks.append(("norm", norm, width, groups))
        elif kind == "coupled":
            op = draw(st.sampled_from([*COUPLED_OPS, "batchnorm_train"]))
            blocks.append(("norm", op, width, 1) if op == "batchnorm_train" else ("op", op, width, 0))
        elif kind == "cat":
            blocks.append(("op", "cat", width, 0))
            width *= 2
        elif kind == "slice":
            if width > 1:
                k = draw(st.integers(1, width - 1))
                blocks.append(("op", "slice", width, k))
                width = k
        elif kind == "transpose":
            if width % 2 == 0:
                blocks.append(("op", "transpose", width, 0))
        else:
            blocks.append(("op", kind, width, 0))
    return blocks, width


def _entry_options(draw: st.DrawFn, entry: str, case_in: tuple[int, ...], out_shape: tuple[int, ...],
                   pointwise: bool) -> dict:
    d = math.prod(case_in)
    structures = ["auto", "independent", "coupled"]
    chunk = {"chunk_size": draw(st.one_of(st.none(), st.integers(1, 3)))}
    if entry == "jacobian":
        return {"mode": draw(st.sampled_from(["auto", "forward", "reverse"])), "batched": draw(st.booleans()),
                "structure": draw(st.sampled_from(structures + ["diagonal"] * pointwise)), **chunk}
    if entry == "jacobian_params":
        return {"mode": draw(st.sampled_from(["auto", "forward", "reverse"])), "batched": draw(st.booleans()),
                "flatten": draw(st.booleans()), **chunk}
    structure = {"structure": draw(st.sampled_from(structures)), **chunk}
    if entry == "derivative":
        return {"order": draw(st.integers(1, 4)), **structure}
    coordinate = st.integers(-d, d - 1)  # negative ones count from the end
    if entry == "partial":
        order = draw(st.integers(1, 3))
        return {"dims": tuple(draw(coordinate) for _ in range(order)), **structure}
    if entry == "partials":
        n = draw(st.integers(1, 3))
        dims = [tuple(draw(coordinate) for _ in range(draw(st.integers(1, 3)))) for _ in range(n)]
        return {"dims": dims, **structure}
    if entry == "operator":  # sum_k c_k d^(dims_k) f, dims () being f itself
        n = draw(st.integers(1, 3))
        terms = [(draw(st.sampled_from([1.0, -0.5, 2.0])), tuple(draw(coordinate) for _ in range(draw(st.integers(0, 3)))))
                 for _ in range(n)]
        return {"terms": terms, **structure}
    if entry == "weighted_laplacian":  # tr(S S^T Hess f) with S (D, m) drawn as plain numbers
        m = draw(st.integers(1, 2))
        weight = [[draw(st.sampled_from([1.0, -0.5, 0.25, 2.0])) for _ in range(m)] for _ in range(d)]
        return {"weight": weight, **structure}
    if entry in ("hessian", "laplacian", "divergence", "biharmonic"):
        return structure
    if entry == "per_sample_grads":  # cross-entropy over one class is constant: left out
        return {"loss": draw(st.sampled_from(["sq", "mse_y"] + ["cross_entropy_y"] * (out_shape[0] > 1)))}
    if entry == "ntk":
        return {"method": draw(st.sampled_from(["auto", "contraction", "products", "structured"])),
                "trace": draw(st.booleans()), "x2": draw(st.booleans())}
    return {"loss": draw(st.sampled_from(["mse", "cross_entropy"])), "diagonal": draw(st.booleans())}


def _conventions(entry: str, options: dict, head: str) -> list[str]:
    if entry in PRODUCTS:
        return ["module", "no_grad", "inference_mode"]
    if entry == "jacobian_params":  # torch.func transforms over x (integer ids: nothing to differentiate)
        around = (["vmap"] * options["batched"] + ["jacfwd", "jacrev_nograph"]) * options["flatten"]
        return (["module", "no_grad", "inference_mode", "repeated"]
                + around * (head not in (*INT_HEADS, "rnn", "gru", "lstm")))
    if head in INT_HEADS:  # differentiating integer inputs: the error is the answer
        return ["module", "lambda", "no_grad", "inference_mode"]
    conv = ["module", "lambda", "fcall_same", "fcall_other", "no_grad", "inference_mode", "grad_create_graph",
            "fcall_autograd", "func_grad", "vmap", "jacrev", "jacrev_nograph", "jacfwd", "repeated"]
    if (entry == "jacobian" and not options["batched"]) or head in ("rnn", "gru", "lstm"):
        conv.remove("vmap")  # nothing to stack over; torch.func has no batching rule for RNNs
    if head in ("rnn", "gru", "lstm"):
        conv.remove("jacfwd")  # nor a forward-mode batching rule
    return conv


# Call forms of several arguments: x (B, d) of a flat head is cut into pieces along its
# columns, each a positional argument p0, p1, ... of f (the last one possibly a keyword argument);
# argnums picks the differentiated ones (the others are batched riders), dims and terms name
# coordinates by argument name, by (name, i) or count them flat in the differentiated arguments;
# f returns the output as is, as a tuple or a dict, with or without an auxiliary output. The
# oracle is the one-tensor oracle restricted to the differentiated columns; ``runner.flat_result``
# checks torch.func's layout while turning the result back into that flat form.
FORM_ENTRIES = ("jacobian", "partial", "partials", "hessian", "laplacian", "divergence", "operator", "biharmonic",
                "jacobian_params")
ALL_DIFFERENTIATED = ("divergence", "biharmonic")  # their oracles sum over every coordinate


@st.composite
def _form(draw: st.DrawFn, entry: str, d: int, options: dict, always: bool = False) -> Optional[dict]:
    if entry not in FORM_ENTRIES or d < 2 or (not always and draw(st.integers(0, 2)) != 0):
        return None
    cuts = sorted(draw(st.sets(st.integers(1, d - 1), min_size=1, max_size=min(2, d - 1))))
    bounds = [0, *cuts, d]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    n = len(pieces)
    if entry == "jacobian_params" or entry in ALL_DIFFERENTIATED:
        chosen = list(range(n))
    else:
        chosen = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    order = chosen if entry == "divergence" else draw(st.permutations(chosen))  # (output d pairs with z's d)
    as_int = len(order) == 1 and draw(st.booleans())
    riders = [i for i in range(n) if i not in chosen]
    keyword = bool(riders) and riders[-1] == n - 1 and draw(st.booleans())  # the last piece as p{n-1}=...
    return {"pieces": pieces, "argnums": tuple(order), "int": as_int, "keyword": keyword,
            "names": draw(st.sampled_from(["names", "pairs", "ints"])),
            "out": draw(st.sampled_from(["tensor", "tuple", "dict"])), "aux": draw(st.booleans())}


def _restrict(options: dict, cols: list[int], d: int) -> dict:
    """dims / terms with every coordinate moved into the differentiated columns ``cols``."""
    o = dict(options)
    move = lambda c: cols[(c % d) % len(cols)]  # noqa: E731
    if "dims" in o and o["dims"] and isinstance(o["dims"][0], tuple):
        o["dims"] = [tuple(move(c) for c in dims) for dims in o["dims"]]
    elif "dims" in o:
        o["dims"] = tuple(move(c) for c in o["dims"])
    if "terms" in o:
        o["terms"] = [(c, tuple(move(k) for k in dims)) for c, dims in o["terms"]]
    return o


@st.composite
def cases(draw: st.DrawFn, forms: bool = False) -> Case:
    """A case; ``forms=True``: always a call form of several arguments (a flat input of 2..4 columns)."""
    entry = draw(st.sampled_from(FORM_ENTRIES if forms else ENTRIES))
    if forms:
        d = draw(st.integers(2, 3 if entry == "biharmonic" else 4))
        head, spec, in_shape, width = "flat", {}, (d,), d
    else:
        head, spec, in_shape, width = draw(_head(entry))
    batch = draw(st.integers(1, 3))
    pointwise = entry in INPUT_ENTRIES and head in ("flat", "multi") and draw(st.integers(0, 3)) == 0
    if pointwise:  # elementwise ops on x itself: the output has the input's shape
        blocks = [draw(_elementwise()) for _ in range(draw(st.integers(1, 3)))]
        out_shape = in_shape
    else:
        blocks, width = draw(_blocks(width, coupled_ok=head not in ("rnn", "gru", "lstm")))
        if entry == "divergence":
            out_shape = in_shape
        else:
            out_shape = draw(st.sampled_from([(1,), (2,), (3,), (2, 2), (1, 2)]))
    options = _entry_options(draw, entry, in_shape, out_shape, pointwise)
    if forms and "batched" in options:
        options["batched"] = True
        if options.get("structure") == "diagonal":
            options["structure"] = "auto"
    convention = draw(st.sampled_from([c for c in _conventions(entry, options, head)
                                       if not forms or c not in ("jacrev", "jacrev_nograph", "jacfwd")]))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    column = draw(st.booleans()) if entry == "derivative" else True
    form = None
    batched = options.get("batched", True) and options.get("structure") != "diagonal"
    if head == "flat" and len(in_shape) == 1 and batched and convention not in ("jacrev", "jacrev_nograph", "jacfwd"):
        form = draw(_form(entry, in_shape[0], options, always=forms))
    case = Case(seed=draw(st.integers(0, 2**16)), head=head, head_spec=spec, in_shape=in_shape, blocks=blocks,
                width=width, out_shape=out_shape, batch=batch, dtype=dtype, entry=entry, options=options,
                convention=convention, column=column, pointwise=pointwise, form=form)
    if form is not None:
        case.options = _restrict(options, case.differentiated(), in_shape[0])
    return case


@st.composite
def _elementwise(draw: st.DrawFn) -> tuple:
    kind = draw(st.sampled_from(["act", "act", "quotient", "square"]))
    if kind == "act":
        name = draw(st.sampled_from(sorted(ACTIVATIONS)))
        return ("act", name, draw(st.sampled_from(spellings(name))))
    return ("op", kind, 0, 0)

