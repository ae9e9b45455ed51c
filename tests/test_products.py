"""per_sample_grads, ntk and ggn against dense float64 references built from autograd.grad loops."""

from __future__ import annotations

from typing import Callable, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F
from torch import nn

import jacmode as jm
from conftest import assert_unchanged, ref_param_jacobian, snapshot
from bench.baselines import MLP


class Residual(nn.Module):
    """Functional activations and a skip connection: no nn.Sequential, no activation modules."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + torch.sin(self.mid(h))
        return self.out(self.norm(h))


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Tied(nn.Module):
    """A weight used outside its module: the probes cannot see it, the generic engine runs."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.enc(x)) @ self.enc.weight


class Twice(nn.Module):
    """One Linear layer called twice: its per-sample blocks add up over the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.fc(x)))


class Gate(nn.Module):
    """A custom layer with a parameter: no per-sample rule."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale)


class Mixed(nn.Module):
    """A custom layer between Linear layers: probes and the generic engine together."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 5)
        self.act = Gate(5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _mlp() -> nn.Module:
    return MLP(12, 5, 3)


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp-class": (_mlp, (12,)),
    "residual": (Residual, (4,)),
    "cnn": (Cnn, (1, 5, 5)),
    "tied": (Tied, (4,)),
    "twice": (Twice, (3,)),
    "mixed": (Mixed, (3,)),
}


def make(name: str, batch: int = 4, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    build, shape = MODELS[name]
    return build().double(), torch.randn(batch, *shape, dtype=torch.float64)


def ref_psg(model: nn.Module, x: torch.Tensor, loss: Callable, y: Optional[torch.Tensor]) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for b in range(x.shape[0]):
        out = model(x[b : b + 1])
        value = loss(out) if y is None else loss(out, y[b : b + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(value.sum(), params)]))
    return torch.stack(rows)


def hessians(model: nn.Module, x: torch.Tensor, loss: str) -> torch.Tensor:
    out = model(x).detach().reshape(x.shape[0], -1)
    if loss == "mse":
        return torch.eye(out.shape[1], dtype=out.dtype).expand(x.shape[0], -1, -1)
    p = out.softmax(1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("with_y", [False, True])
def test_per_sample_grads_matches_loop(name: str, with_y: bool) -> None:
    model, x = make(name)
    y = torch.randn_like(model(x).detach()) if with_y else None
    loss = (lambda out, y: ((out - y) ** 2).sum(1)) if with_y else (lambda out: (out**3).sum(1))
    before = snapshot(model)
    got = jm.per_sample_grads(model, x, loss, y=y)
    assert_unchanged(model, before)
    torch.testing.assert_close(got, ref_psg(model, x, loss, y))


def test_per_sample_grads_dict_subset_and_cross_entropy() -> None:
    model, x = make("mlp-class", batch=6)
    labels = torch.randint(0, 3, (6,))
    loss = lambda out, y: F.cross_entropy(out, y, reduction="none")  # noqa: E731
    got = jm.per_sample_grads(model, x, loss, y=labels, wrt=["fc2.weight"], flatten=False)
    assert isinstance(got, dict) and list(got) == ["fc2.weight"]
    full = ref_psg(model, x, loss, labels)
    torch.testing.assert_close(got["fc2.weight"].reshape(6, -1), full[:, 12 * 5 + 5 : 12 * 5 + 5 + 15])


def ref_ntk(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    return torch.einsum("byp,czp->bcyz", ref_param_jacobian(model, x1), ref_param_jacobian(model, x2))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("method", ["auto", "contraction", "products", "structured"])
def test_ntk_every_method(name: str, method: str) -> None:
    model, x1 = make(name, batch=3)
    x2 = torch.randn(4, *x1.shape[1:], dtype=x1.dtype)
    if method == "structured" and name in ("tied", "mixed"):
        with pytest.raises(ValueError, match="per-layer rule"):
            jm.ntk(model, x1, x2, method=method)
        return
    before = snapshot(model)
    ref = ref_ntk(model, x1, x2)
    torch.testing.assert_close(jm.ntk(model, x1, x2, method=method), ref)
    torch.testing.assert_close(jm.ntk(model, x1, x2, method=method, trace=True), torch.diagonal(ref, dim1=2, dim2=3).sum(-1))
    torch.testing.assert_close(jm.ntk(model, x1, method=method, chunk_size=2), ref_ntk(model, x1, x1))
    assert_unchanged(model, before)


def test_ntk_subset_and_plan() -> None:
    model, x = make("mlp-class", batch=3)
    J = ref_param_jacobian(model, x, ["fc1.bias"])
    k = jm.ntk(model, x, wrt=["fc1.bias"], method="structured")
    torch.testing.assert_close(k, torch.einsum("byp,czp->bcyz", J, J))
    plan = jm.ntk_plan(model, x)
    assert plan.method in plan.costs and set(plan.costs) == {"contraction", "products", "structured"}
    assert "why:" in repr(plan)
    assert set(jm.ntk_plan(Tied().double(), x[:, :4]).costs) == {"contraction", "products"}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "callable"])
def test_ggn_full_and_diagonal(name: str, loss: str) -> None:
    model, x = make(name, batch=5)
    J = ref_param_jacobian(model, x)
    if loss == "callable":  # an indefinite Hessian: exercises the signs of the factor
        torch.manual_seed(1)
        y = J.shape[1]
        a = torch.randn(y, y, dtype=x.dtype)
        H = (a + a.t()).expand(5, y, y)
        arg: object = lambda out: H  # noqa: E731
    else:
        H, arg = hessians(model, x, loss), loss
    ref = torch.einsum("byp,byz,bzq->pq", J, H, J)
    before = snapshot(model)
    torch.testing.assert_close(jm.ggn(model, x, arg), ref)
    torch.testing.assert_close(jm.ggn(model, x, arg, diagonal=True), ref.diagonal())
    torch.testing.assert_close(jm.ggn(model, x, arg, diagonal=True, chunk_size=2), ref.diagonal())
    assert_unchanged(model, before)


def test_ggn_subset() -> None:
    model, x = make("cnn")
    names = ["conv.weight", "fc.bias"]
    J = ref_param_jacobian(model, x, names)
    ref = torch.einsum("byp,byq->pq", J, J)
    torch.testing.assert_close(jm.ggn(model, x, wrt=names), ref)
    torch.testing.assert_close(jm.ggn(model, x, wrt=names, diagonal=True), ref.diagonal())


def test_float32_problem_class_matches_float64() -> None:
    model, x = make("mlp-class", batch=8)
    m32, x32 = MLP(12, 5, 3), x.float()
    m32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    loss = lambda out: (out**2).sum(1)  # noqa: E731
    torch.testing.assert_close(jm.per_sample_grads(m32, x32, loss).double(), jm.per_sample_grads(model, x, loss), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(jm.ntk(m32, x32).double(), jm.ntk(model, x), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(jm.ggn(m32, x32, "cross_entropy", diagonal=True).double(),
                               jm.ggn(model, x, "cross_entropy", diagonal=True), atol=1e-5, rtol=1e-4)


def test_dropout_per_sample_grads_one_mask_per_sample() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double().train()
    x = torch.randn(5, 4, dtype=torch.float64)
    g = jm.per_sample_grads(model, x, lambda out: out.sum(1))
    total = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    assert g.shape == (5, 4 * 8 + 8 + 16 + 2)  # a different mask than the check above: shapes only
    assert torch.isfinite(g).all() and len(total) == 4


# --- errors ---


def test_errors_name_the_argument() -> None:
    model, x = make("mlp-class")
    with pytest.raises(TypeError, match="loss: expected a callable"):
        jm.per_sample_grads(model, x, "mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss: expected per-sample losses of shape \(4,\)"):
        jm.per_sample_grads(model, x, lambda out: out.sum())
    with pytest.raises(ValueError, match=r"loss: expected per-sample losses of shape \(1,\)"):
        jm.per_sample_grads(Tied().double(), x[:, :4], lambda out: out.sum())
    with pytest.raises(TypeError, match="loss: expected a floating tensor"):
        jm.per_sample_grads(model, x, lambda out: out.argmax(1))
    with pytest.raises(ValueError, match="y: expected one target per sample"):
        jm.per_sample_grads(model, x, lambda out, y: out.sum(1), y=torch.zeros(3))
    with pytest.raises(TypeError, match="y: expected a torch.Tensor"):
        jm.per_sample_grads(model, x, lambda out, y: out.sum(1), y=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="wrt: per_sample_grads, ntk and ggn"):
        jm.ntk(model, x, wrt="inputs")
    with pytest.raises(ValueError, match="method: expected one of"):
        jm.ntk(model, x, method="fast")
    with pytest.raises(TypeError, match="trace: expected True or False"):
        jm.ntk(model, x, trace=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x2: expected a batch of samples like x1"):
        jm.ntk(model, x, x[:, :5])
    with pytest.raises(ValueError, match="loss: expected one of"):
        jm.ggn(model, x, "nll")
    with pytest.raises(TypeError, match="loss: expected 'mse'"):
        jm.ggn(model, x, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="diagonal: expected True or False"):
        jm.ggn(model, x, diagonal="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Hessian callable must return per-sample Hessians of shape \(4, 3, 3\)"):
        jm.ggn(model, x, lambda out: torch.zeros(4, 3))
    with pytest.raises(TypeError, match="f: wrt='params' needs an nn.Module"):
        jm.ggn(lambda t: t, x)  # type: ignore[arg-type]


def test_coupled_batch_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double().train()
    x = torch.randn(6, 3, dtype=torch.float64)
    before = snapshot(model)
    for call in (lambda: jm.per_sample_grads(model, x, lambda out: out.sum(1)), lambda: jm.ntk(model, x),
                 lambda: jm.ggn(model, x, diagonal=True)):
        with pytest.raises(jm.CoupledBatchError, match="BatchNorm"):
            call()
    assert_unchanged(model, before)


def test_model_left_as_found_when_loss_raises() -> None:
    model, x = make("residual")
    before = snapshot(model)

    def bad(out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        jm.per_sample_grads(model, x, bad)
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", list(MODELS))
def test_probes_serve_every_model_but_the_tied_one(name: str) -> None:
    from jacmode._probes import layerio

    model, x = make(name)
    usable = layerio.usable(model, x, list(model.named_parameters()))
    assert (usable is None) == (name == "tied")
    assert usable is None or bool(usable.uncovered) == (name == "mixed")


def test_ntk_cost_fit_recovers_constants_and_regret() -> None:
    from jacmode._planning import ntk as cost
    from bench import calibrate_ntk

    truth = {"contraction": (1e-3, 1e-9, 2e-11, 1e-9), "products": (1e-3, 2e-9, 3e-11, 0.0),
             "structured": (5e-4, 1e-11, 5e-11, 0.0)}
    rows = []
    for b, y, p, flops in [(16, 1, 100, 200.0), (64, 10, 5000, 1e4), (256, 4, 20000, 4e4), (32, 64, 3000, 6e3),
                           (128, 2, 800, 1e5), (8, 16, 90000, 2e5)]:
        sizes = cost.Sizes(b, b, y, p, flops, pair=float(y * y * 30 + 50))
        times = {m: 1e3 * sum(c * f for c, f in zip(truth[m], cost.features(m, sizes))) for m in truth}
        rows.append({"name": f"{b}", "times": times, "sizes": sizes})
    fitted = calibrate_ntk.fit(rows)
    for m in truth:
        for c, t in zip(fitted[m], truth[m]):
            assert abs(c - t) <= 1e-6 * max(t, 1e-12) + 1e-15
    saved = dict(cost.NTK_COST)
    try:
        cost.NTK_COST.update(fitted)
        assert all(ratio == pytest.approx(1.0) for *_, ratio in calibrate_ntk.regret(rows))
    finally:
        cost.NTK_COST.update(saved)
    plan = cost.choose(rows[0]["sizes"], "products", 4)
    assert plan.method == "products" and "asked for" in plan.reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu() -> None:
    model, x = make("cnn", batch=6)
    loss = lambda out: (out**2).sum(1)  # noqa: E731
    gpu = make("cnn", batch=6)[0].cuda()
    torch.testing.assert_close(jm.per_sample_grads(gpu, x.cuda(), loss).cpu(), jm.per_sample_grads(model, x, loss))
    for method in ("contraction", "products", "structured"):
        torch.testing.assert_close(jm.ntk(gpu, x.cuda(), method=method).cpu(), jm.ntk(model, x, method=method))
    torch.testing.assert_close(jm.ggn(gpu, x.cuda(), "cross_entropy", diagonal=True).cpu(),
                               jm.ggn(model, x, "cross_entropy", diagonal=True))


def test_ntk_contraction_within_a_small_budget_recomputes_blocks() -> None:
    model, x1 = make("residual", batch=5)
    x2 = torch.randn(3, 4, dtype=x1.dtype)
    got = jm.ntk(model, x1, x2, method="contraction", max_memory="6KB", chunk_size=2)  # J(x2) > budget / 2
    torch.testing.assert_close(got, ref_ntk(model, x1, x2))


class _Stack(nn.Module):
    """A class with functional activations, of any depth and width (hypothesis draws them)."""

    def __init__(self, sizes: list[int], act: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.act = getattr(torch, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=4), st.integers(1, 5), st.integers(1, 4),
       st.sampled_from(["tanh", "sin", "relu"]), st.integers(0, 2**16))
def test_products_agree_with_each_other_and_autograd(sizes: list[int], batch: int, y: int, act: str, seed: int) -> None:
    torch.manual_seed(seed)
    model = _Stack(sizes + [y], act).double()
    x = torch.randn(batch, sizes[0], dtype=torch.float64)
    params = list(model.parameters())
    grads = jm.per_sample_grads(model, x, lambda out: (out**2).sum(1))
    total = torch.autograd.grad((model(x) ** 2).sum(), params)
    torch.testing.assert_close(grads.sum(0), torch.cat([g.reshape(-1) for g in total]))
    kernels = [jm.ntk(model, x, method=m) for m in ("structured", "contraction", "products")]
    for k in kernels[1:]:
        torch.testing.assert_close(k, kernels[0])
    full = jm.ggn(model, x, "cross_entropy")
    torch.testing.assert_close(jm.ggn(model, x, "cross_entropy", diagonal=True), full.diagonal())
    # trace of the GGN for MSE is the trace of the NTK: both are sum_b ||J_b||_F^2
    torch.testing.assert_close(jm.ggn(model, x, diagonal=True).sum(), torch.einsum("bbyy->", kernels[0]))


def _old_ggn(model: nn.Module, x: torch.Tensor, loss: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The GGN of a torch loss module by torch.func: J_b^T (vmap(hessian) of the module's terms) J_b."""
    from torch.func import functional_call, hessian, jacrev, vmap
    from jacmode import _losses

    params = {n: p.detach() for n, p in model.named_parameters()}
    out = model(x).detach()
    H = _losses.hessians(loss, out, y)  # (B, Y, Y) through the module itself

    def one(p: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xb.unsqueeze(0),)).reshape(-1)

    J = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    J = torch.cat([J[n].reshape(x.shape[0], H.shape[1], -1) for n in params], dim=2)  # (B, Y, P)
    return torch.einsum("byp,byz,bzq->pq", J, H, J)


LOSS_MODULES = {
    "ce-mean": (lambda: nn.CrossEntropyLoss(), "index"),
    "ce-sum-weight": (lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0, 0.1], dtype=torch.float64),
                                                  reduction="sum"), "index"),
    "ce-none-smooth-ignore": (lambda: nn.CrossEntropyLoss(reduction="none", label_smoothing=0.2, ignore_index=1), "index"),
    "ce-mean-probabilities": (lambda: nn.CrossEntropyLoss(), "probabilities"),
    "mse-mean": (lambda: nn.MSELoss(), "values"),
    "mse-sum": (lambda: nn.MSELoss(reduction="sum"), "values"),
    "mse-none": (lambda: nn.MSELoss(reduction="none"), "values"),
}


@pytest.mark.parametrize("name", list(LOSS_MODULES))
def test_ggn_with_a_loss_module_takes_the_closed_form_factor(name: str, monkeypatch) -> None:
    from jacmode import _losses

    torch.manual_seed(3)
    make, targets = LOSS_MODULES[name]
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    x = torch.randn(7, 3, dtype=torch.float64)
    y = {"index": torch.tensor([0, 1, 2, 3, 1, 0, 2]),
         "probabilities": torch.softmax(torch.randn(7, 4, dtype=torch.float64), 1),
         "values": torch.randn(7, 4, dtype=torch.float64)}[targets]
    ref = _old_ggn(model, x, make(), y)

    def no_hessians(*a, **k):
        raise AssertionError("the closed-form factor serves torch's CrossEntropyLoss and MSELoss")

    monkeypatch.setattr(_losses, "hessians", no_hessians)
    full = jm.ggn(model, x, make(), y=y)
    torch.testing.assert_close(full, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.ggn(model, x, make(), y=y, diagonal=True), ref.diagonal(), rtol=1e-10, atol=1e-12)


def test_ggn_loss_module_equals_the_string_spelling() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    x = torch.randn(9, 3, dtype=torch.float64)
    labels = torch.randint(0, 4, (9,))
    for diagonal in (False, True):
        torch.testing.assert_close(jm.ggn(model, x, nn.CrossEntropyLoss(reduction="sum"), y=labels, diagonal=diagonal),
                                   jm.ggn(model, x, "cross_entropy", diagonal=diagonal), rtol=1e-12, atol=1e-13)
        # MSELoss(sum) = sum (f - y)^2 is twice the string's 0.5 * ||f - y||^2
        torch.testing.assert_close(jm.ggn(model, x, nn.MSELoss(reduction="sum"), y=torch.randn(9, 4, dtype=torch.float64),
                                          diagonal=diagonal),
                                   2 * jm.ggn(model, x, "mse", diagonal=diagonal), rtol=1e-12, atol=1e-13)


def test_ggn_loss_module_errors() -> None:
    model, x = nn.Linear(3, 4), torch.randn(5, 3)
    with pytest.raises(ValueError, match="needs the targets"):
        jm.ggn(model, x, nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="takes torch's"):
        jm.ggn(model, x, nn.KLDivLoss(), y=torch.randn(5, 4))
    bad = nn.CrossEntropyLoss()
    bad.reduction = "batchmean"
    with pytest.raises(ValueError, match="reduction must be"):
        jm.ggn(model, x, bad, y=torch.tensor([0, 1, 2, 3, 0]))
