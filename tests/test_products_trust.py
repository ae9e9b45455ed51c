"""Raw torch errors of the products and parameter Jacobians: dtypes, token ids, embeddings, recurrent layers,
torch's loss modules and tuples that are not data sets.

Every expectation is a float64 oracle written with plain ``torch.autograd.grad`` loops over
samples (each sample evaluated alone, as a user's loop would), never jacmode's own numbers.
"""

from __future__ import annotations

import warnings

from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import jacmode as jm
from conftest import assert_unchanged, snapshot

# --- float64 oracles: loops of autograd.grad over samples and outputs ---


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _flat(grads: tuple[Optional[Tensor], ...], params: list[nn.Parameter]) -> Tensor:
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def ref_jacobian(model: nn.Module, x: Tensor) -> Tensor:
    """(B, Y, P): one forward per sample, one autograd.grad per output."""
    params, blocks = _params(model), []
    for b in range(x.shape[0]):
        out = model(x[b:b + 1]).reshape(-1)
        blocks.append(torch.stack([_flat(torch.autograd.grad(o, params, retain_graph=True, allow_unused=True), params)
                                   for o in out]))
    return torch.stack(blocks)


def ref_grads(model: nn.Module, x: Tensor, loss_b: Callable[[Tensor, int], Tensor]) -> Tensor:
    """(B, P): the gradient of ``loss_b(model(x[b:b+1]), b)`` (a scalar) for every sample b."""
    params = _params(model)
    return torch.stack([_flat(torch.autograd.grad(loss_b(model(x[b:b + 1]), b), params, allow_unused=True), params)
                        for b in range(x.shape[0])])


def ref_ggn(model: nn.Module, x: Tensor, hess_b: Callable[[Tensor, int], Tensor]) -> Tensor:
    """(P, P): sum_b J_b^T H_b J_b with H_b the Hessian of sample b's loss in its flat output."""
    J = ref_jacobian(model, x)
    total = torch.zeros(J.shape[2], J.shape[2], dtype=J.dtype)
    for b in range(x.shape[0]):
        out = model(x[b:b + 1]).detach()
        H = torch.autograd.functional.hessian(lambda o: hess_b(o.reshape(out.shape), b), out.reshape(-1))
        total += J[b].t() @ H @ J[b]
    return total


def mse_b(out: Tensor, y: Tensor) -> Callable[[Tensor, int], Tensor]:
    return lambda o, b: 0.5 * ((o - y[b:b + 1]) ** 2).sum()


# --- models fed token ids ---


class Tokens(nn.Module):
    """Embedding with a padding row, fed (B, T) ids."""

    def __init__(self, padding_idx: Optional[int] = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=padding_idx)
        self.fc = nn.Linear(12, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.emb(x)).flatten(1))


class Bag(nn.Module):
    """EmbeddingBag over (B, L) ids, or 1-D ids with offsets, optionally weighted per id."""

    def __init__(self, mode: str = "sum", padding_idx: Optional[int] = None, weighted: bool = False,
                 offsets: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=padding_idx)
        self.scale = nn.Parameter(torch.tensor(0.3)) if weighted else None
        self.offsets = offsets
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        w = None if self.scale is None else torch.sigmoid(self.scale * x.to(self.scale.dtype) - 1.0)
        if self.offsets:
            offsets = torch.arange(0, x.numel(), x.shape[1], device=x.device)
            h = self.bag(x.reshape(-1), offsets, per_sample_weights=None if w is None else w.reshape(-1))
        else:
            h = self.bag(x, per_sample_weights=w)
        return self.fc(torch.tanh(h))


def _ids(batch: int = 5, length: int = 3, seed: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 10, (batch, length), generator=gen)
    x[0, 0] = 0          # a padding id
    x[1, :2] = 7         # an id repeated within a bag
    return x


def _seeded(model: nn.Module, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn_like(p) * 0.5)
    return model.double()


BAGS = {
    "sum": dict(mode="sum"),
    "mean": dict(mode="mean"),
    "max": dict(mode="max"),
    "sum-padding": dict(mode="sum", padding_idx=0),
    "mean-padding": dict(mode="mean", padding_idx=0),
    "weighted": dict(mode="sum", weighted=True),
    "weighted-padding": dict(mode="sum", weighted=True, padding_idx=0),
    "offsets": dict(mode="mean", offsets=True),
    "offsets-weighted": dict(mode="sum", offsets=True, weighted=True, padding_idx=0),
}


def _token_models() -> dict[str, Callable[[], nn.Module]]:
    models: dict[str, Callable[[], nn.Module]] = {
        "embedding": lambda: Tokens(None), "embedding-padding": lambda: Tokens(0)}
    models.update({f"bag-{k}": (lambda kw=kw: Bag(**kw)) for k, kw in BAGS.items()})
    return models


TOKEN_MODELS = _token_models()
CLOSE = dict(rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", list(TOKEN_MODELS))
def test_jacobian_wrt_params_of_token_models_matches_autograd(name: str) -> None:
    model, x = _seeded(TOKEN_MODELS[name]()), _ids()
    ref = ref_jacobian(model, x)
    for mode in ("auto", "reverse"):
        got = jm.jacobian(model, x, wrt="params", mode=mode)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, ref, **CLOSE)
    if name == "embedding":
        torch.testing.assert_close(jm.jacobian(model, x, wrt="params", mode="forward"), ref, **CLOSE)
    else:  # padding rows and bags: torch's forward mode is wrong or missing (see _rules/embedding.py)
        with pytest.raises(ValueError, match=r"mode: 'forward' (would not be exact for nn.Embedding 'emb' with padding_idx=0"
                           r"|would not be exact for nn.EmbeddingBag 'bag'|needs a forward-AD .* _embedding_bag).*mode='reverse'"):
            jm.jacobian(model, x, wrt="params", mode="forward")
    if name == "embedding-padding":  # with the padded weight left out of wrt, forward mode is exact again
        names = ["fc.weight", "fc.bias"]
        sub = jm.jacobian(model, x, wrt=names, mode="forward")
        cols = torch.cat([torch.full((p.numel(),), n in names) for n, p in model.named_parameters()])
        torch.testing.assert_close(sub, ref[:, :, cols], **CLOSE)


class TiedHead(nn.Module):
    """An output head tied to a padded embedding: the padding row is constant only through the lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.emb(x).sum(1)) @ self.emb.weight.t()


@pytest.mark.parametrize("model_cls", [Tokens, TiedHead])
def test_padding_row_follows_torch_in_every_mode(model_cls: type) -> None:
    """torch holds the padding row constant in the lookup (gradient 0) but not in a tied head; torch's
    forward mode ignores padding_idx, so jacmode must not take forward mode's word for it."""
    model, x = _seeded(model_cls()), _ids()
    ref = ref_jacobian(model, x)
    J = jm.jacobian(model, x, wrt="params")
    torch.testing.assert_close(J, ref, **CLOSE)
    if model_cls is Tokens:
        assert jm.jacobian(model, x, wrt="params", flatten=False)["emb.weight"][..., 0, :].abs().max() == 0
    else:
        assert ref[:, :, :4].abs().max() > 0   # the tied head's use of the padding row counts


@pytest.mark.parametrize("name", list(TOKEN_MODELS))
def test_products_of_token_models_match_autograd(name: str) -> None:
    model, x = _seeded(TOKEN_MODELS[name]()), _ids()
    y = torch.randn(x.shape[0], 2, dtype=torch.float64)
    before = snapshot(model)
    g = jm.per_sample_grads(model, x, lambda out, y: 0.5 * ((out - y) ** 2).sum(1), y=y)
    assert g.dtype == torch.float64
    torch.testing.assert_close(g, ref_grads(model, x, mse_b(None, y)), **CLOSE)  # type: ignore[arg-type]
    J = ref_jacobian(model, x)
    if name != "embedding":  # torch's forward mode is wrong (padding) or missing (bags) here
        with pytest.raises(ValueError, match="method: 'products' pushes rows of J.x1. forward .* not exact for nn.Embedding"):
            jm.ntk(model, x, method="products")
    for method in ("auto", "contraction", "products") if name == "embedding" else ("auto", "contraction"):
        k = jm.ntk(model, x, method=method)
        assert k.dtype == torch.float64
        torch.testing.assert_close(k, torch.einsum("byp,czp->bcyz", J, J), **CLOSE)
    G = jm.ggn(model, x)
    assert G.dtype == torch.float64
    torch.testing.assert_close(G, torch.einsum("byp,byq->pq", J, J), **CLOSE)
    torch.testing.assert_close(jm.ggn(model, x, diagonal=True), torch.einsum("byp,byp->p", J, J), **CLOSE)
    assert_unchanged(model, before)


def test_products_take_the_parameters_dtype_not_the_inputs() -> None:
    model, x = Tokens(0), _ids()   # float32 parameters, int64 ids
    y = torch.randn(x.shape[0], 2)
    assert jm.per_sample_grads(model, x, lambda out, y: ((out - y) ** 2).sum(1), y=y).dtype == torch.float32
    assert jm.ntk(model, x).dtype == torch.float32
    assert jm.ntk(model, x, trace=True, method="contraction").dtype == torch.float32
    assert jm.ggn(model, x).dtype == torch.float32
    assert jm.ggn(model, x, "cross_entropy", diagonal=True).dtype == torch.float32


def test_structured_ntk_and_layer_engine_serve_token_ids() -> None:
    """Integer inputs are first-class: the per-layer engines run on token ids too."""
    model, x = _seeded(Tokens(0)), _ids()
    J = ref_jacobian(model, x)
    torch.testing.assert_close(jm.ntk(model, x, method="structured"), torch.einsum("byp,czp->bcyz", J, J), **CLOSE)


# --- recurrent layers: vmap cannot batch torch's fused kernels over samples ---


class Recurrent(nn.Module):
    def __init__(self, cell: type) -> None:
        super().__init__()
        self.rnn = cell(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
def test_products_of_recurrent_layers_match_autograd(cell: type) -> None:
    model = _seeded(Recurrent(cell))
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    before = snapshot(model)
    with pytest.warns(jm.JacmodeWarning, match="per_sample_grads cannot vectorise f over samples"):
        g = jm.per_sample_grads(model, x, lambda out, y: 0.5 * ((out - y) ** 2).sum(1), y=y)
    torch.testing.assert_close(g, ref_grads(model, x, mse_b(None, y)), **CLOSE)  # type: ignore[arg-type]
    with warnings.catch_warnings():  # said once per model (_cache.warn_once), though the loop runs again
        warnings.simplefilter("error", jm.JacmodeWarning)
        sub = jm.per_sample_grads(model, x, lambda out, y: 0.5 * ((out - y) ** 2).sum(1), y=y,
                                  wrt=["rnn.bias_hh_l0"], flatten=False)
    ref = ref_grads(model, x, mse_b(None, y))
    lo = sum(p.numel() for n, p in model.named_parameters() if n in ("rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0"))
    torch.testing.assert_close(sub["rnn.bias_hh_l0"], ref[:, lo:lo + model.rnn.bias_hh_l0.numel()], **CLOSE)
    J = ref_jacobian(model, x)
    torch.testing.assert_close(jm.ntk(model, x), torch.einsum("byp,czp->bcyz", J, J), **CLOSE)
    torch.testing.assert_close(jm.ggn(model, x), torch.einsum("byp,byq->pq", J, J), **CLOSE)
    assert_unchanged(model, before)


@pytest.mark.parametrize("cell", [nn.RNN, nn.LSTM])
def test_per_sample_grads_of_recurrent_layers_under_inference_mode(cell: type) -> None:
    """The per-sample loop's autograd runs even inside torch.inference_mode() (found by the harness:
    torch's raw 'element 0 of tensors does not require grad')."""
    model = _seeded(Recurrent(cell))
    x, y = torch.randn(3, 5, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    loss = lambda out, y: 0.5 * ((out - y) ** 2).sum(1)  # noqa: E731
    with torch.inference_mode(), pytest.warns(jm.JacmodeWarning, match="cannot vectorise"):
        g = jm.per_sample_grads(model, x, loss, y=y)
    torch.testing.assert_close(g, ref_grads(model, x, mse_b(None, y)), **CLOSE)  # type: ignore[arg-type]


# --- torch's loss modules, any reduction; cross entropy with classes on dim 1 ---


def ref_torch_grads(model: nn.Module, x: Tensor, loss: nn.Module, y: Tensor) -> Tensor:
    """(B, P): row b differentiates torch's own batch loss through sample b's output only."""
    params, rows = _params(model), []
    for b in range(x.shape[0]):
        out = model(x)
        only_b = torch.zeros(out.shape[0], dtype=torch.bool)
        only_b[b] = True
        mixed = torch.where(only_b.view(-1, *[1] * (out.dim() - 1)), out, out.detach())
        rows.append(_flat(torch.autograd.grad(loss(mixed, y).sum(), params, allow_unused=True), params))
    return torch.stack(rows)


def ref_torch_ggn(model: nn.Module, x: Tensor, batch_loss: Callable[[Tensor], Tensor]) -> Tensor:
    """(P, P): J^T H J over the whole batch, H the Hessian of torch's batch loss in all outputs."""
    J = ref_jacobian(model, x).reshape(-1, sum(p.numel() for p in _params(model)))  # (B*Y, P)
    out = model(x).detach()
    H = torch.autograd.functional.hessian(lambda o: batch_loss(o.reshape(out.shape)).sum(), out.reshape(-1))
    return J.t() @ H @ J


class Seq(nn.Module):
    """(B, D, T) -> (B, C, T) logits: classes on dim 1, positions after (torch's convention)."""

    def __init__(self, log: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 3, 1)
        self.fc = nn.Linear(5, 5)
        self.log = log

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(torch.tanh(self.conv(x)))
        return torch.log_softmax(h, dim=1) if self.log else h


def _classes(batch: int = 4, positions: Optional[int] = 5, ignore: bool = False) -> Tensor:
    gen = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (batch,) if positions is None else (batch, positions), generator=gen)
    if ignore:
        y.view(-1)[::4] = -100
    return y


def _loss_cases() -> dict[str, tuple[nn.Module, str]]:
    cases: dict[str, tuple[nn.Module, str]] = {}
    for red in ("mean", "sum", "none"):
        cases[f"mse-{red}"] = (nn.MSELoss(reduction=red), "values")
        cases[f"ce-{red}"] = (nn.CrossEntropyLoss(reduction=red), "classes")
        cases[f"bce-{red}"] = (nn.BCEWithLogitsLoss(reduction=red, pos_weight=torch.rand(5, dtype=torch.float64)), "bits")
        cases[f"nll-{red}"] = (nn.NLLLoss(reduction=red, weight=torch.rand(3, dtype=torch.float64) + 0.5), "log-classes")
    cases["ce-weight-ignore-mean"] = (nn.CrossEntropyLoss(weight=torch.rand(3, dtype=torch.float64) + 0.5), "classes-ignore")
    cases["ce-smoothing-mean"] = (nn.CrossEntropyLoss(label_smoothing=0.2, weight=torch.rand(3, dtype=torch.float64) + 0.5),
                                  "classes-ignore")
    cases["ce-probabilities-mean"] = (nn.CrossEntropyLoss(), "probabilities")
    cases["ce-flat-mean"] = (nn.CrossEntropyLoss(), "flat")
    return cases


LOSSES = _loss_cases()


def _loss_problem(kind: str) -> tuple[nn.Module, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 4, 5, dtype=torch.float64, generator=gen)
    model = _seeded(Seq(log=kind == "log-classes"))
    if kind == "flat":  # (B, C) logits
        model = _seeded(nn.Sequential(nn.Flatten(), nn.Linear(20, 3)))
        return model, x, _classes(positions=None)
    if kind in ("classes", "log-classes", "classes-ignore"):
        return model, x, _classes(ignore=kind == "classes-ignore")
    if kind == "probabilities":
        return model, x, torch.softmax(torch.randn(4, 3, 5, dtype=torch.float64, generator=gen), 1)
    if kind == "bits":
        return model, x, torch.rand(4, 3, 5, dtype=torch.float64, generator=gen).round()
    return model, x, torch.randn(4, 3, 5, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("case", list(LOSSES))
def test_torch_loss_modules_give_the_per_sample_terms_of_torchs_loss(case: str) -> None:
    loss, kind = LOSSES[case]
    model, x, y = _loss_problem(kind)
    before = snapshot(model)
    ref = ref_torch_grads(model, x, loss, y)
    g = jm.per_sample_grads(model, x, loss, y=y)
    torch.testing.assert_close(g, ref, **CLOSE)
    if loss.reduction != "none":  # rows sum to the gradient of torch's batch loss (BackPACK's convention)
        total = torch.autograd.grad(loss(model(x), y), _params(model))
        torch.testing.assert_close(g.sum(0), torch.cat([t.reshape(-1) for t in total]), **CLOSE)
    G = ref_torch_ggn(model, x, lambda o: loss(o, y))
    torch.testing.assert_close(jm.ggn(model, x, loss, y=y), G, **CLOSE)
    torch.testing.assert_close(jm.ggn(model, x, loss, y=y, diagonal=True), G.diagonal(), **CLOSE)
    assert_unchanged(model, before)


@pytest.mark.parametrize("kind", ["flat", "classes"])
def test_cross_entropy_string_takes_classes_on_dim_1(kind: str) -> None:
    """"cross_entropy" is torch's F.cross_entropy(reduction='sum'): one softmax per position."""
    model, x, y = _loss_problem(kind)
    G = ref_torch_ggn(model, x, lambda o: F.cross_entropy(o, y, reduction="sum"))
    torch.testing.assert_close(jm.ggn(model, x, "cross_entropy"), G, **CLOSE)
    torch.testing.assert_close(jm.ggn(model, x, "cross_entropy", diagonal=True), G.diagonal(), **CLOSE)


def test_torch_loss_modules_over_a_data_set_take_targets_from_the_batches() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model, x, y = _loss_problem("classes")
    loss = nn.CrossEntropyLoss(reduction="sum")
    data = DataLoader(TensorDataset(x, y), batch_size=2)
    torch.testing.assert_close(jm.per_sample_grads(model, data, loss), jm.per_sample_grads(model, x, loss, y=y), **CLOSE)
    torch.testing.assert_close(jm.ggn(model, data, loss), jm.ggn(model, x, loss, y=y), **CLOSE)
    with pytest.raises(ValueError, match="y: with a data set as x, the targets come from"):
        jm.ggn(model, data, loss, y=y)


def test_torch_loss_errors_name_the_argument_and_the_fix() -> None:
    model, x, y = _loss_problem("classes")
    with pytest.raises(ValueError, match=r"y: ggn with nn.CrossEntropyLoss needs the targets .* pass y="):
        jm.ggn(model, x, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"y: per_sample_grads with nn.MSELoss needs the targets"):
        jm.per_sample_grads(model, x, nn.MSELoss())
    with pytest.raises(TypeError, match=r"loss: per_sample_grads takes torch's nn.MSELoss.*got KLDivLoss"):
        jm.per_sample_grads(model, x, nn.KLDivLoss(), y=y)
    with pytest.raises(TypeError, match=r"loss: ggn takes torch's .*got MultiMarginLoss"):
        jm.ggn(model, x, nn.MultiMarginLoss(), y=y)
    with pytest.raises(ValueError, match="y: a Hessian callable gets f.x. only, never targets"):
        jm.ggn(model, x, lambda out: torch.eye(15).expand(4, 15, 15), y=y)
    with pytest.raises(ValueError, match="y: expected"):
        jm.ggn(model, x, nn.CrossEntropyLoss(), y=y[:2])


# --- a tuple is never silently read as a data set ---


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        return self.fc(x if mask is None else x * mask)


class WithMask(nn.Module):
    """The fix the error names: one input, the mask held fixed."""

    def __init__(self, model: nn.Module, mask: Tensor) -> None:
        super().__init__()
        self.model, self.mask = model, mask

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x, self.mask)


TUPLE = r"got a (tuple|list) of 2 entries holding tensors, which jacmode reads neither as one input nor as a data set"


def test_a_list_of_tensors_is_refused_and_a_tuple_is_the_models_arguments() -> None:
    model = _seeded(Masked())
    x = torch.randn(5, 3, dtype=torch.float64)
    mask = (torch.rand(3) > 0.3).to(torch.float64)
    mse = lambda out: (out ** 2).sum(1)  # noqa: E731
    with pytest.raises(TypeError, match="x: " + TUPLE + r".*lambda x: model\(x, mask\).*iter\(\[x1, x2\]\)"):
        jm.per_sample_grads(model, [x, mask], mse)
    with pytest.raises(TypeError, match="x1: " + TUPLE):
        jm.ntk(model, [x, mask])
    with pytest.raises(TypeError, match="x2: " + TUPLE):
        jm.ntk(model, x, [x, mask])
    with pytest.raises(TypeError, match="x: " + TUPLE):
        jm.ggn(model, [x, mask])
    with pytest.raises(TypeError, match="batches: " + TUPLE):
        jm.jacobians(model, (x, mask))
    with pytest.raises(TypeError, match="x2: " + TUPLE):
        jm.ntk_plan(model, x, [x, mask])
    # a tuple is model(x, mask): the mask (3,) has no sample dimension, so in_dims must say broadcast
    with pytest.raises(ValueError, match=r"in_dims: argument 1 is batched along dim 0.*in_dims=\(0, None\)"):
        jm.per_sample_grads(model, (x, mask), mse)
    fixed = WithMask(model, mask)  # the wrapper of old: the same numbers as the users' loop, B rows not 2B
    before = snapshot(model)
    ref = ref_grads(fixed, x, lambda o, b: (o ** 2).sum())
    torch.testing.assert_close(jm.per_sample_grads(fixed, x, mse), ref, **CLOSE)
    torch.testing.assert_close(jm.per_sample_grads(model, (x, mask), mse, in_dims=(0, None)), ref, **CLOSE)
    J = ref_jacobian(fixed, x)
    torch.testing.assert_close(jm.ntk(fixed, x), torch.einsum("byp,czp->bcyz", J, J), **CLOSE)
    torch.testing.assert_close(jm.ntk(model, (x, mask), in_dims=(0, None)), torch.einsum("byp,czp->bcyz", J, J),
                               **CLOSE)
    torch.testing.assert_close(jm.ggn(model, (x, mask), in_dims=(0, None)), torch.einsum("byp,byq->pq", J, J), **CLOSE)
    assert jm.ntk_plan(model, (x, mask), in_dims=(0, None)).method
    assert_unchanged(model, before)


def test_explicit_data_sets_still_stream() -> None:
    model = _seeded(Masked())
    x = torch.randn(6, 3, dtype=torch.float64)
    mse = lambda out: (out ** 2).sum(1)  # noqa: E731
    whole = jm.per_sample_grads(model, x, mse)
    for data in (iter([x[:4], x[4:]]), [(x[:4],), (x[4:],)], (b for b in x.split(4))):
        torch.testing.assert_close(jm.per_sample_grads(model, data, mse), whole, **CLOSE)
    torch.testing.assert_close(jm.ggn(model, [(x[:4],), (x[4:],)]), jm.ggn(model, x), **CLOSE)


class PositionalBag(nn.Module):
    """Per-sample weights passed positionally, as the probes see them."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum", padding_idx=0)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.bag(x, None, torch.sigmoid(0.3 * x.to(self.fc.weight.dtype)))))


@pytest.mark.parametrize("name", ["embedding", "embedding-padding", "bag-sum", "bag-mean", "bag-sum-padding",
                                  "bag-mean-padding", "positional"])
def test_embeddings_take_the_per_layer_engine(name: str) -> None:
    """Closed forms (GGN diagonal, Gram blocks) against the oracle, repeated ids within a sample included."""
    model = _seeded(PositionalBag() if name == "positional" else TOKEN_MODELS[name]())
    x = _ids()
    J = ref_jacobian(model, x)
    torch.testing.assert_close(jm.ntk(model, x, method="structured"), torch.einsum("byp,czp->bcyz", J, J), **CLOSE)
    y = torch.randn(x.shape[0], 2, dtype=torch.float64)
    torch.testing.assert_close(jm.per_sample_grads(model, x, lambda out, y: 0.5 * ((out - y) ** 2).sum(1), y=y),
                               ref_grads(model, x, mse_b(None, y)), **CLOSE)  # type: ignore[arg-type]
    torch.testing.assert_close(jm.ggn(model, x, diagonal=True), torch.einsum("byp,byp->p", J, J), **CLOSE)
    signed = jm.ggn(model, x, nn.MSELoss(reduction="sum"), y=y, diagonal=True)  # H = 2 I through eigh, with signs
    torch.testing.assert_close(signed, 2 * torch.einsum("byp,byp->p", J, J), **CLOSE)
    torch.testing.assert_close(jm.ntk(model, x, x[:2], method="structured", trace=True),
                               torch.einsum("byp,cyp->bc", J, J[:2]), **CLOSE)


def test_data_sets_of_token_ids_give_float_results() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    model, x = _seeded(Tokens(0)), _ids(batch=7)
    y = torch.randn(7, 2, dtype=torch.float64)
    data = DataLoader(TensorDataset(x, y), batch_size=3)
    mse = lambda out, y: 0.5 * ((out - y) ** 2).sum(1)  # noqa: E731
    J = ref_jacobian(model, x)
    g = jm.per_sample_grads(model, data, mse)
    assert g.dtype == torch.float64
    torch.testing.assert_close(g, ref_grads(model, x, mse_b(None, y)), **CLOSE)  # type: ignore[arg-type]
    torch.testing.assert_close(jm.ggn(model, data), torch.einsum("byp,byq->pq", J, J), **CLOSE)
    torch.testing.assert_close(jm.ntk(model, data, trace=True), torch.einsum("byp,cyp->bc", J, J), **CLOSE)
    torch.testing.assert_close(torch.cat(list(jm.jacobians(model, data))), J, **CLOSE)
    out = jm.jacobians(model, data, out=torch.empty_like(J))
    torch.testing.assert_close(out, J, **CLOSE)


def test_a_loss_weighted_per_sample_is_refused_clearly() -> None:
    model, x, y = _loss_problem("bits")
    loss = nn.BCEWithLogitsLoss(weight=torch.rand(4, 3, 5, dtype=torch.float64))  # one weight row per sample
    with pytest.raises(ValueError, match="loss: BCEWithLogitsLoss cannot be evaluated on one sample alone"):
        jm.per_sample_grads(model, x, loss, y=y)
    with pytest.raises(ValueError, match="loss: BCEWithLogitsLoss cannot be evaluated on one sample alone"):
        jm.ggn(model, x, loss, y=y)
