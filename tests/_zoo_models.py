"""The model zoo: tiny float64 models people really use, each with the outcome it must give.

Every :class:`Case` builds a model and an input and declares, for each way of calling
:func:`jacmode.jacobian`, either "correct" (compared with a float64 autograd.grad loop) or the
clear error it must raise. ``tests/test_zoo.py`` checks the declarations; running this file
executes every call and prints the coverage table of ``docs/coverage.md`` from the actual
outcomes::

    PYTHONPATH=src:tests .venv/bin/python tests/_zoo_models.py > docs/coverage.md

Models are a few hundred parameters, B = 2..3, so the whole zoo runs in seconds on two cores.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

import jacmode as jm


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Any:
    """Tensors here are tiny: intra-op threads only add overhead, and on a loaded machine their
    spin-waits made these tests 2.5x slower (48 s vs 18 s). Test modules import this fixture."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# The calls every case is run through: (label, keyword arguments of jm.jacobian).
CALLS: list[tuple[str, dict[str, Any]]] = [
    ("inputs/auto", dict(wrt="inputs", mode="auto")),
    ("inputs/forward", dict(wrt="inputs", mode="forward")),
    ("inputs/reverse", dict(wrt="inputs", mode="reverse")),
    ("inputs/unbatched", dict(wrt="inputs", mode="auto", batched=False)),
    ("params/auto", dict(wrt="params", mode="auto")),
    ("params/forward", dict(wrt="params", mode="forward")),
    ("params/reverse", dict(wrt="params", mode="reverse")),
    ("params/dict", dict(wrt="params", mode="auto", flatten=False)),
    ("params/unbatched", dict(wrt="params", mode="auto", batched=False)),
]
LABELS = [label for label, _ in CALLS]

Outcome = Union[str, tuple[type, str]]  # "correct", "n/a", or (exception type, regex of message)
CORRECT = "correct"
NA = "n/a"


@dataclass
class Case:
    """A zoo entry.

    ``build()`` returns (model, x) (cast to float64 by the runner). ``expect`` maps call labels to
    outcomes; unlisted labels must be correct. ``gaps`` maps labels that should be
    correct, but that the library does not get right yet, to (the exception raised today, why);
    their tests are strict xfails, so they turn red, to be removed, once a fix lands.
    """

    name: str
    build: Callable[[], tuple[nn.Module, Tensor]]
    expect: dict[str, Outcome] = field(default_factory=dict)
    gaps: dict[str, tuple[type, str]] = field(default_factory=dict)
    structure: str = "auto"
    note: str = ""

    def outcome(self, label: str) -> Outcome:
        return self.expect.get(label, CORRECT)

    def cell(self, label: str) -> str:
        """The coverage-table cell these declarations promise."""
        if label in self.gaps:
            return f"not yet: `{self.gaps[label][0].__name__}`"
        outcome = self.outcome(label)
        return outcome if isinstance(outcome, str) else f"clear error: `{outcome[0].__name__}`"


# ---------------------------------------------------------------------------------------------
# models


def _mlp() -> tuple[nn.Module, Tensor]:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), torch.randn(3, 4)


def _cnn() -> tuple[nn.Module, Tensor]:
    net = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2, 2, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3),
    )
    return net, torch.randn(2, 1, 6, 6)


class BasicBlock(nn.Module):
    """The ResNet basic block: conv-BN-ReLU-conv-BN plus the identity, then ReLU (BN in eval)."""

    def __init__(self, c: int = 2) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + x)


def _warm_batchnorm(model: nn.Module, x: Tensor) -> None:
    """Give running statistics non-trivial values, then switch to eval mode."""
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(x + torch.randn_like(x))
    model.eval()


def _resnet_block() -> tuple[nn.Module, Tensor]:
    net, x = BasicBlock(), torch.randn(2, 2, 3, 3)
    _warm_batchnorm(net, x)
    return net, x


def _batchnorm_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


def _batchnorm_eval() -> tuple[nn.Module, Tensor]:
    net, x = _batchnorm_net(), torch.randn(3, 4)
    _warm_batchnorm(net, x)
    return net, x


def _batchnorm_train() -> tuple[nn.Module, Tensor]:
    net, x = _batchnorm_eval()
    return net.train(), x


def _layernorm() -> tuple[nn.Module, Tensor]:
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 3)), torch.randn(3, 4)


def _groupnorm() -> tuple[nn.Module, Tensor]:
    net = nn.Sequential(nn.Conv1d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU(), nn.Flatten(), nn.Linear(12, 2))
    return net, torch.randn(3, 2, 5)


def _dropout_eval() -> tuple[nn.Module, Tensor]:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))
    return net.eval(), torch.randn(3, 4)


class Bag(nn.Module):
    """Token ids (B, T) -> mean of their embeddings -> linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.emb(ids).mean(1)))


def _embedding() -> tuple[nn.Module, Tensor]:
    return Bag(), torch.randint(0, 10, (3, 5))


class Recurrent(nn.Module):
    """An LSTM or GRU (batch_first) returning the last hidden state or all outputs."""

    def __init__(self, cell: type, last: bool) -> None:
        super().__init__()
        self.rnn = cell(3, 4, batch_first=True)
        self.last = last

    def forward(self, x: Tensor) -> Tensor:
        out, state = self.rnn(x)
        if not self.last:
            return out  # (B, T, H)
        h = state[0] if isinstance(state, tuple) else state
        return h[-1]  # (B, H)


def _rnn(cell: type, last: bool) -> Callable[[], tuple[nn.Module, Tensor]]:
    return lambda: (Recurrent(cell, last), torch.randn(2, 4, 3))


def _transformer() -> tuple[nn.Module, Tensor]:
    layer = nn.TransformerEncoderLayer(d_model=4, nhead=2, dim_feedforward=8, dropout=0.1, batch_first=True)
    return layer.eval(), torch.randn(2, 3, 4)


class TiedAutoencoder(nn.Module):
    """Decoder weight tied to the encoder's (``dec.weight is enc.weight``), plus a reused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight
        self.mid = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.enc(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))  # the same layer applied twice
        return self.dec(h)


def _tied() -> tuple[nn.Module, Tensor]:
    return TiedAutoencoder(), torch.randn(3, 4)


class CubeNoJvp(torch.autograd.Function):
    """x**3 with a backward rule only (setup_context style, vmap rule generated): forward-mode AD
    has no rule for it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x**3

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class CubeWithJvp(CubeNoJvp):
    """The same with a jvp rule as well: forward-mode AD works."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.save_for_forward(inputs[0])

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * tangent


class CubeOldStyle(torch.autograd.Function):
    """x**3 written the pre-2.0 way (``forward(ctx, x)``, no setup_context): torch.func cannot
    transform it at all."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class Sandwich(nn.Module):
    """Linear -> the behaviour under test (``middle``) -> Linear."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, d_hidden)
        self.b = nn.Linear(d_hidden, d_out)

    def middle(self, h: Tensor, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.middle(self.a(x), x))


class WithFunction(Sandwich):
    def __init__(self, fn: type) -> None:
        super().__init__(3, 4, 2)
        self.fn = fn

    def middle(self, h: Tensor, x: Tensor) -> Tensor:
        return self.fn.apply(torch.tanh(h))


def _function(fn: type) -> Callable[[], tuple[nn.Module, Tensor]]:
    return lambda: (WithFunction(fn), torch.randn(3, 3))


class ItemBranch(Sandwich):
    """Python control flow on ``.item()``: a clamp applied only when the input is large."""

    def __init__(self) -> None:
        super().__init__(3, 5, 2)

    def middle(self, h: Tensor, x: Tensor) -> Tensor:
        if h.abs().max().item() > 1e3:  # never true here; reading it is what matters
            h = h.clamp(-1e3, 1e3)
        return torch.sin(h)


def _item() -> tuple[nn.Module, Tensor]:
    return ItemBranch(), torch.randn(3, 3)


class InplaceNet(Sandwich):
    """An in-place residual update, then ReLU(inplace=True)."""

    def __init__(self) -> None:
        super().__init__(4, 4, 3)
        self.act = nn.ReLU(inplace=True)

    def middle(self, h: Tensor, x: Tensor) -> Tensor:
        h += x
        return self.act(h)


def _inplace() -> tuple[nn.Module, Tensor]:
    return InplaceNet(), torch.randn(3, 4)


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"logits": self.lin(x)}


def _dict_out() -> tuple[nn.Module, Tensor]:
    return DictOut(), torch.randn(3, 4)


def _tuple_out() -> tuple[nn.Module, Tensor]:
    return nn.LSTM(3, 4, batch_first=True), torch.randn(2, 4, 3)  # returns (output, (h, c))


# ---------------------------------------------------------------------------------------------
# the zoo and its declared outcomes


def _every(labels: Any, outcome: Any) -> dict[str, Any]:
    return {label: outcome for label in LABELS if label in labels or labels == "all"}


_NOT_PER_SAMPLE = (ValueError, r"every output must have the batch dimension 2 first.*lambda x: model\(x\)\[0\]")
_BN_TRAIN = (jm.CoupledBatchError, r"BatchNorm layer\(s\) '1' are in training mode.*structure='coupled'")
_INT_INPUT = (TypeError, r"x: differentiating with respect to the inputs needs a real floating dtype.*wrt='params'")
# explicit modes that cannot run the model raise; mode="auto" falls back (docs/modes.md, "Fallbacks")
_NO_RNN_RULE = (ValueError, r"mode: 'reverse' vectorises over samples with vmap, which cannot run aten::(lstm|gru)")
_RNN_NOTE = "vmap over samples has no rule for the fused RNN op: auto loops over samples or uses forward mode"
_NO_ITEM = (ValueError, r"mode: 'reverse' vectorises over samples .*\.item\(\).*torch\.where")
_NO_FUNC = (ValueError, r"mode: '(forward|reverse)' runs f under torch\.func transforms.*CubeOldStyle.*setup_context")
_NO_JVP = (ValueError, r"mode: 'forward' needs a forward-AD .*CubeNoJvp without jvp.*Use mode='reverse'")

ZOO: list[Case] = [
    Case("MLP", _mlp),
    Case("CNN with pooling", _cnn),
    Case("ResNet basic block (BN eval)", _resnet_block),
    Case("BatchNorm eval", _batchnorm_eval),
    Case("BatchNorm train", _batchnorm_train,
         expect=_every([lb for lb in LABELS if "unbatched" not in lb], _BN_TRAIN),
         note="`CoupledBatchError` names the layer and the ways out; `batched=False` is exact"),
    Case("BatchNorm train, `structure='coupled'`", _batchnorm_train, structure="coupled",
         expect=_every(["inputs/unbatched", "params/unbatched"], NA),
         note="the exact diagonal blocks of the whole-batch Jacobian"),
    Case("LayerNorm", _layernorm),
    Case("GroupNorm", _groupnorm),
    Case("Dropout eval", _dropout_eval),
    Case("Embedding (integer ids)", _embedding,
         expect=_every([lb for lb in LABELS if lb.startswith("inputs")], _INT_INPUT),
         note="`wrt='inputs'` is undefined for token ids; the error points to `wrt='params'`"),
    Case("LSTM, last hidden state", _rnn(nn.LSTM, last=True), expect=_every(["params/reverse"], _NO_RNN_RULE),
         note=_RNN_NOTE),
    Case("LSTM, all outputs", _rnn(nn.LSTM, last=False), expect=_every(["params/reverse"], _NO_RNN_RULE),
         note=_RNN_NOTE),
    Case("GRU, last hidden state", _rnn(nn.GRU, last=True), expect=_every(["params/reverse"], _NO_RNN_RULE),
         note=_RNN_NOTE),
    Case("GRU, all outputs", _rnn(nn.GRU, last=False), expect=_every(["params/reverse"], _NO_RNN_RULE),
         note=_RNN_NOTE),
    Case("TransformerEncoderLayer (eval)", _transformer,
         note="eval mode, `batch_first=True`; forward mode switches the fused inference fast path off"),
    Case("Tied and reused weights", _tied, note="a tied parameter is counted once, as in `named_parameters()`"),
    Case("autograd.Function with jvp", _function(CubeWithJvp)),
    Case("autograd.Function without jvp", _function(CubeNoJvp),
         expect=_every(["inputs/forward", "params/forward"], _NO_JVP),
         note="forward mode has no rule: auto falls back to reverse mode with a warning naming the Function"),
    Case("autograd.Function, old style (no setup_context)", _function(CubeOldStyle),
         expect=_every(["inputs/forward", "inputs/reverse", "params/forward", "params/reverse"], _NO_FUNC),
         note="`forward(ctx, x)` without `setup_context`: auto falls back to `torch.autograd.grad` loops"),
    Case("ReLU(inplace=True), in-place residual", _inplace),
    Case("`.item()` control flow", _item, expect=_every(["params/reverse"], _NO_ITEM),
         note="a Python branch on `.item()`: fine under jvp and vjp; auto loops over samples"),
    Case("Returns a dict", _dict_out, note="the matching dict of Jacobians, as `vmap(jacrev(model))` gives"),
    Case("Returns a tuple (raw `nn.LSTM`)", _tuple_out,
         expect=_every([lb for lb in LABELS if "unbatched" not in lb], _NOT_PER_SAMPLE),
         note="h and c hold the batch in dim 1, so per-sample Jacobians of every output are not defined: the "
              "error names the fix, `lambda x: model(x)[0]`; `batched=False` gives the matching tuple"),
]


# ---------------------------------------------------------------------------------------------
# running a cell and its float64 reference


def instantiate(case: Case) -> tuple[nn.Module, Tensor]:
    """The case's model and input, in float64, from a fixed seed."""
    torch.manual_seed(0)
    model, x = case.build()
    return model.double(), (x.double() if x.is_floating_point() else x)


def call(case: Case, label: str, model: nn.Module, x: Tensor) -> Any:
    """The jacmode call behind a coverage cell."""
    return jm.jacobian(model, x, structure=case.structure, **dict(CALLS)[label])


def _rows(out: Tensor, params: list[Tensor]) -> Tensor:
    rows = []
    for o in out.reshape(-1):
        gs = torch.autograd.grad(o, params, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]))
    return torch.stack(rows)


def whole_batch_param_jacobian(model: nn.Module, x: Tensor, batched: bool) -> Tensor:
    """d model(x)[b] / d params from one forward pass of the whole batch: (B, Y, P); (Y, P) unbatched."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(x)
    if not batched:
        return _rows(out, params)
    return torch.stack([_rows(out[b], params) for b in range(x.shape[0])])


def diagonal_blocks(full: Tensor, batch: int, out_dims: int) -> Tensor:
    """(B, *out, B, *in) -> (B, *out, *in): the block of every sample with itself."""
    out_shape, in_shape = full.shape[1 : 1 + out_dims], full.shape[2 + out_dims :]
    flat = full.reshape(batch, math.prod(out_shape), batch, math.prod(in_shape))
    idx = torch.arange(batch)
    return flat[idx, :, idx].reshape(batch, *out_shape, *in_shape)


_REFERENCES: dict[tuple, Any] = {}


def reference(case: Case, label: str, model: nn.Module, x: Tensor) -> Any:
    """The float64 autograd.grad loop for a cell, run on a copy of the model (it may be training).

    ``model`` and ``x`` must come from ``instantiate(case)`` (possibly moved to a device): the
    loop is run once per case, wrt, batched and device, and shared by the cells that need it.
    """
    opts = dict(CALLS)[label]
    key = (case.name, opts["wrt"], opts.get("batched", True), str(x.device))
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(case, label, copy.deepcopy(model), x)
    return _REFERENCES[key]


class _Pick(nn.Module):
    """Output leaf ``i`` of a model that returns a tuple, list or dict: its references, leaf by leaf."""

    def __init__(self, model: nn.Module, i: int) -> None:
        super().__init__()
        self.model, self.i = model, i

    def forward(self, x: Tensor) -> Tensor:
        return tree_flatten(self.model(x))[0][self.i]


def _reference(case: Case, label: str, model: nn.Module, x: Tensor) -> Any:
    from conftest import ref_input_jacobian, ref_param_jacobian

    with torch.no_grad():
        out = copy.deepcopy(model)(x)
    if not isinstance(out, Tensor):  # the pytree of the leaves' references; for parameters Y runs over the leaves
        leaves, spec = tree_flatten(out)
        parts = [_reference(case, label, _Pick(model, i), x) for i in range(len(leaves))]
        return tree_unflatten(parts, spec) if dict(CALLS)[label]["wrt"] == "inputs" else torch.cat(parts, dim=-2)
    opts = dict(CALLS)[label]
    batched = opts.get("batched", True)
    coupled = case.structure == "coupled"
    if opts["wrt"] == "inputs":
        if not batched or not coupled:
            return ref_input_jacobian(model, x, batched=batched)
        full = ref_input_jacobian(model, x, batched=False)
        return diagonal_blocks(full, x.shape[0], full.dim() - x.dim() - 1)
    if batched and not coupled:
        return ref_param_jacobian(model, x)
    return whole_batch_param_jacobian(model, x, batched)


TOL = dict(rtol=1e-7, atol=1e-9)  # float64 throughout the zoo


def check_result(case: Case, label: str, model: nn.Module, x: Tensor, result: Any) -> None:
    """Assert that ``result`` equals the float64 reference, in shape, dtype, device and value."""
    want = reference(case, label, model, x)
    if not isinstance(want, Tensor):  # a model that returns a pytree, wrt inputs: the matching pytree
        got, got_spec = tree_flatten(result)
        wanted, want_spec = tree_flatten(want)
        assert got_spec == want_spec
        for g, w in zip(got, wanted):
            assert g.dtype == w.dtype and g.device == x.device
            torch.testing.assert_close(g, w, **TOL)
        return
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if isinstance(result, dict):  # flatten=False: name -> (B, *out, *param.shape), per output leaf of a pytree
        with torch.no_grad():
            out = copy.deepcopy(model)(x)
        outs, out_spec = tree_flatten(out)
        blocks, spec = tree_flatten(result, is_leaf=lambda v: isinstance(v, dict) and list(v) == [n for n, _ in named])
        assert spec == out_spec
        rows = want.split([math.prod(o.shape[1:]) for o in outs], dim=1)
        for block, o, r in zip(blocks, outs, rows):
            assert list(block) == [n for n, _ in named]
            for (name, p), w in zip(named, r.split([p.numel() for _, p in named], dim=-1)):
                assert block[name].shape == (x.shape[0], *o.shape[1:], *p.shape), name
                torch.testing.assert_close(block[name].reshape(w.shape), w, **TOL)
        return
    assert result.dtype == want.dtype and result.device == x.device
    torch.testing.assert_close(result, want, **TOL)


def classify(case: Case, label: str) -> str:
    """Run one cell; the same text as ``case.cell(label)`` when it behaves as declared."""
    import re
    import warnings

    if case.outcome(label) == NA:
        return NA
    model, x = instantiate(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jm.JacmodeWarning)  # a fallback may say that it was taken
        try:
            result = call(case, label, model, x)
        except Exception as err:  # noqa: BLE001 -- every outcome goes into the table
            expected = case.gaps.get(label) or case.outcome(label)
            if isinstance(expected, tuple) and isinstance(err, expected[0]):
                if label in case.gaps or re.search(expected[1], str(err), flags=re.S):
                    return case.cell(label)
            first = (str(err).strip().splitlines() or [""])[0][:70]
            return f"UNEXPECTED: `{type(err).__name__}: {first}`"
    try:
        check_result(case, label, model, x, result)
    except AssertionError:
        return "WRONG: differs from the reference"
    return CORRECT if case.outcome(label) == CORRECT else "UNEXPECTED: correct, error declared"


# ---------------------------------------------------------------------------------------------
# the coverage table of docs/coverage.md

DOC = "docs/coverage.md"
BEGIN, END = "<!-- zoo-table:begin -->", "<!-- zoo-table:end -->"


def table(cells: Callable[[Case, str], str]) -> str:
    """The markdown table, one row per zoo case, with its notes as footnotes."""
    lines = ["| model | " + " | ".join(f"`{lb}`" for lb in LABELS) + " |", "|---|" + "---|" * len(LABELS)]
    notes = []
    for case in ZOO:
        mark = ""
        reasons = sorted({why for _, why in case.gaps.values()})
        if case.note or reasons:
            notes.append(f"{len(notes) + 1}. **{case.name}**: " + "; ".join(filter(None, [case.note, *reasons])) + ".")
            mark = f" [{len(notes)}]"
        lines.append(f"| {case.name}{mark} | " + " | ".join(cells(case, lb) for lb in LABELS) + " |")
    return "\n".join(lines + [""] + notes)


def table_in_doc(text: str) -> str:
    """The generated part of docs/coverage.md."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
    import pathlib
    import sys

    generated = table(classify)
    if "--write" in sys.argv:
        path = pathlib.Path(__file__).resolve().parents[1] / DOC
        text = path.read_text()
        head, tail = text.split(BEGIN, 1)[0], text.split(END, 1)[1]
        path.write_text(f"{head}{BEGIN}\n{generated}\n{END}{tail}")
    print(generated)
