"""Regression tests for what the differential harness found, each settled by a third method.

Fixed here: layer-wise reverse mode for parameters ran Y copies of a one-sample batch through f
(repeated rows), which is a different function when f reduces over dim 0; forward mode under
torch.inference_mode() wrote zero columns for chunks of one direction; the coupling probe inside
torch.func.vmap (structure="auto") took Python bools of batched values. Fixed since (see
tests/test_raw_errors.py for more): LSTM float32 reverse mode under no_grad, BatchNorm training
statistics behind a lambda, torch's forward-mode batch_norm above first order (the decompositions).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import jacmode as jm


class CentredConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.tail = nn.Conv2d(1, 1, 1), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.tail(h - h.mean(0))


def _loop_param_jacobian(net: nn.Module, x: Tensor) -> Tensor:
    params = list(net.parameters())
    out = net(x)[0]
    return torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
                        for o in out]).unsqueeze(0)


@pytest.mark.parametrize("mode", ["auto", "reverse", "forward"])
def test_param_jacobian_of_one_sample_is_fs_own_when_f_reduces_over_dim_0(mode: str) -> None:
    """At B = 1, h - h.mean(0) is 0: the conv parameters have no influence (truth: exactly 0, from
    the autograd loop and from forward mode); reverse mode returned nonzero blocks from Y copies."""
    torch.manual_seed(0)
    net = CentredConv().double()
    x = torch.randn(1, 1, 2, 3, dtype=torch.float64)
    want = _loop_param_jacobian(net, x)
    assert want[..., :2].abs().max() == 0
    torch.testing.assert_close(jm.jacobian(net, x, wrt="params", mode=mode), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jm.ggn(net, x, "mse"), torch.einsum("byp,byq->pq", want, want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 2, 5])
def test_forward_mode_param_jacobian_under_inference_mode(chunk_size: int) -> None:
    """Under torch.inference_mode() dual tensors lose their tangent (torch's make_dual), and the
    chunk of one direction read the missing tangent as "independent": zero columns, no error.
    Settled by reverse mode and the autograd loop outside inference mode."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    x = torch.randn(3, 2, dtype=torch.float64)
    want = torch.cat([_loop_param_jacobian(net, x[b : b + 1]) for b in range(3)])
    with torch.inference_mode():
        got = jm.jacobian(net, x, wrt="params", mode="forward", chunk_size=chunk_size)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_lstm_float32_reverse_mode() -> None:
    torch.manual_seed(0)
    lstm = nn.LSTM(2, 2, batch_first=True)

    def f(x: Tensor) -> Tensor:
        return lstm(x)[0][:, -1]

    x = torch.randn(2, 2, 2)
    want = torch.stack([jacrev(lambda xb: f(xb[None])[0])(x[b]) for b in range(2)])
    torch.testing.assert_close(jm.jacobian(f, x, mode="reverse"), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("traceable", [True, False])
def test_vmap_around_a_jacmode_call(traceable: bool) -> None:
    """Also where torch.fx cannot trace f, so the coupling probe runs inside vmap (on all slices)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()

    def per_row(x: Tensor) -> Tensor:
        return torch.cat([net(x[b : b + 1]) for b in range(x.shape[0])])

    f = net if traceable else per_row
    xs = torch.randn(2, 3, 3, dtype=torch.float64)
    got = torch.func.vmap(lambda x: jm.jacobian(f, x))(xs)
    want = torch.stack([torch.func.vmap(jacrev(lambda xb: net(xb[None])[0]))(x) for x in xs])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_batchnorm_training_behind_a_lambda_is_a_coupled_batch() -> None:
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).double().train()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        jm.jacobian(lambda x: functional_call(net, params, (x,)), torch.randn(2, 2, dtype=torch.float64))


def test_coupled_hessian_through_batchnorm_training() -> None:
    """structure='coupled' Hessian of sample b with the others fixed, against reverse-over-reverse
    autograd on the op in primitives (which agrees with central differences, see
    test_differential.test_batch_norm_training_forward_ad_is_wrong_above_first_order)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3, track_running_stats=False).double()
    w = torch.randn(3, dtype=torch.float64)
    x = torch.randn(3, 3, dtype=torch.float64)

    def primitive(z: Tensor) -> Tensor:
        mu = z.mean(0, keepdim=True)
        return ((z - mu) * torch.rsqrt(((z - mu) ** 2).mean(0, keepdim=True) + bn.eps) @ w).unsqueeze(1)

    want = []
    for b in range(3):
        g = lambda xb, b=b: primitive(torch.cat([x[:b], xb[None], x[b + 1:]]))[b]  # noqa: E731
        want.append(jacrev(jacrev(g))(x[b]))
    got = jm.hessian(lambda z: (bn(z) @ w).unsqueeze(1), x, structure="coupled")
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-9, atol=1e-9)


# ---- found by the vector-product draws (vectors.py) ------------------------------------------


def _padded_embedding_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(4, 2, padding_idx=0), nn.Flatten(), nn.Linear(6, 1)).double()


def test_parameter_jvp_and_ggn_vector_through_an_embedding_with_padding_idx() -> None:
    """torch's forward formula of embedding ignores padding_idx: jvp(wrt="params") and ggn(v=) gave the
    padding row a tangent (off by O(1)); settled by the (B, Y, P) Jacobian of autograd loops."""
    net = _padded_embedding_net()
    x = torch.tensor([[0, 1, 2], [0, 0, 3]])
    want = torch.cat([_loop_param_jacobian(net, x[b : b + 1]) for b in range(2)])  # (B, Y, P)
    v = torch.randn(want.shape[-1], dtype=torch.float64)
    torch.testing.assert_close(jm.jvp(net, x, v, wrt="params")[1], want @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jm.ggn(net, x, "mse", v=v), torch.einsum("byp,byq,q->p", want, want, v),
                               rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="mode: 'forward'.*padding_idx"):
        jm.hvp(net, x, v, wrt="params", loss=lambda o: (o**2).sum(1), mode="forward")


@pytest.mark.parametrize("entry", ["jvp", "vjp", "hvp", "linearize", "ggn"])
def test_vector_products_refuse_inference_mode(entry: str) -> None:
    """Under torch.inference_mode() autograd and dual tensors are off: the products were zeros (jvp, vjp,
    linearize, ggn(v=)) or torch's 'does not require grad' (hvp). A clear error now."""
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    x = torch.randn(2, 2, dtype=torch.float64)
    calls = {"jvp": lambda: jm.jvp(net, x, x), "vjp": lambda: jm.vjp(net, x),
             "hvp": lambda: jm.hvp(lambda z: net(z).sum(1), x, x), "linearize": lambda: jm.linearize(net, x),
             "ggn": lambda: jm.ggn(net, x, "mse", v=torch.ones(13, dtype=torch.float64))}
    with torch.inference_mode(), pytest.raises(ValueError, match=f"{entry}: .*inference_mode"):
        calls[entry]()


@pytest.mark.parametrize("spelling", ["module", "lambda"])
def test_input_jvp_and_vjp_leave_batchnorm_running_statistics(spelling: str) -> None:
    """jvp and vjp with respect to the inputs ran f outside preserved_state: a BatchNorm in training mode
    updated its running statistics (the model was left changed)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Tanh(), nn.Linear(3, 1)).double()
    f = net if spelling == "module" else (lambda z: net(z))
    x, v = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    mean, var, count = (t.clone() for t in (net[1].running_mean, net[1].running_var, net[1].num_batches_tracked))
    out, jv = jm.jvp(f, x, v)
    _, vjp_fn = jm.vjp(f, x)
    (gx,) = vjp_fn(torch.ones(4, 1, dtype=torch.float64))
    assert torch.equal(net[1].running_mean, mean) and torch.equal(net[1].running_var, var)
    assert torch.equal(net[1].num_batches_tracked, count)
    def g(z: Tensor) -> Tensor:  # the same function without touching the buffers
        h = nn.functional.batch_norm(net[0](z), None, None, net[1].weight, net[1].bias, training=True, eps=net[1].eps)
        return net[3](torch.tanh(h))

    torch.testing.assert_close(jv, torch.func.jvp(g, (x,), (v,))[1], rtol=1e-12, atol=1e-12)
    xl = x.clone().requires_grad_(True)
    torch.testing.assert_close(gx, torch.autograd.grad(g(xl).sum(), xl)[0], rtol=1e-12, atol=1e-12)


def test_forward_over_reverse_hvp_of_torchs_mse_loss() -> None:
    """torch's forward formula of mse_loss_backward writes into a ZeroTensor (torch.func.jvp(grad(...))
    raises 'ZeroTensors are immutable' too): hvp(mode="forward") now takes reverse over reverse there."""
    torch.manual_seed(0)
    net = nn.Linear(1, 1).double()
    x, y = torch.randn(3, 1, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64)
    v = torch.randn(2, dtype=torch.float64)
    want = jm.hvp(net, x, v, wrt="params", loss=nn.MSELoss(), y=y, mode="reverse")
    torch.testing.assert_close(jm.hvp(net, x, v, wrt="params", loss=nn.MSELoss(), y=y, mode="forward"), want,
                               rtol=1e-12, atol=1e-12)
    w = torch.cat([x, torch.ones_like(x)], 1)  # L = mean((w @ theta - y)^2): H = 2 w^T w / B
    torch.testing.assert_close(want, 2 * w.T @ w @ v / 3, rtol=1e-12, atol=1e-12)


# ---- torch.func's per-sample spelling in the functional style (was KNOWN) ----------------------------------------


class _Reshaping(nn.Module):
    """A model whose forward reshapes by x.shape[0], as the harness's Net: a per-sample fn fails on the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.tail = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.tail(torch.tanh(self.lin(x))).reshape(x.shape[0], 2)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_functional_style_batches_a_per_sample_fn_as_vmap_does(batch: int) -> None:
    """fn(p, v) = functional_call(net, p, (v[None],))[0] is written for one sample: jacmode gives torch.func's
    vmap(jacrev(fn), in_dims=(None, 0)) (at B = 1 the batched reading would drop the output's dim)."""
    torch.manual_seed(0)
    net = _Reshaping().double()
    x = torch.randn(batch, 3, dtype=torch.float64)
    params = {n: p.detach() + 0.1 for n, p in net.named_parameters()}

    def fn(p: dict, v: Tensor) -> Tensor:
        return functional_call(net, p, (v[None],))[0]

    got = jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))
    want = torch.func.vmap(jacrev(fn), in_dims=(None, 0))(params, x)
    assert list(got) == list(want)
    for n in want:
        assert got[n].shape == want[n].shape
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12)
    y = torch.randn(batch, 2, dtype=torch.float64)
    gs = jm.per_sample_grads(fn, (params, x), lambda o, t: ((o - t) ** 2).sum(1), y=y, argnums=0, in_dims=(None, 0))
    one = torch.func.grad(lambda p, v, t: ((fn(p, v) - t) ** 2).sum())
    ref = torch.func.vmap(one, in_dims=(None, 0, 0))(params, x, y)
    for n in ref:
        torch.testing.assert_close(gs[n], ref[n], rtol=1e-12, atol=1e-12)


def test_functional_style_per_sample_fn_without_a_vmap_rule_is_a_loop() -> None:
    """A GRU has no vmap batching rule: the per-sample fn runs sample by sample, exactly."""
    torch.manual_seed(0)
    gru = nn.GRU(2, 3, batch_first=True).double()
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    params = {n: p.detach() for n, p in gru.named_parameters()}

    def fn(p: dict, v: Tensor) -> Tensor:
        return functional_call(gru, p, (v[None],))[0][0, -1]

    got = jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))
    for b in range(3):
        want = jacrev(fn)(params, x[b])
        for n in want:
            torch.testing.assert_close(got[n][b], want[n], rtol=1e-12, atol=1e-12)


def test_functional_style_batched_fn_keeps_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched fn is read as batched (the documented convention): called on the batch as is."""
    from jacmode import _functional

    # the spellings read (None: batched). Read where the call happens rather than from the cache
    # _functional._SPELLINGS: that cache is kept under the generation of fn's state (_guard.py), and
    # a routed call fn(params, x) reads the spelling before any scope for fn is entered
    read: list[object] = []
    real = _functional._read_spelling
    monkeypatch.setattr(_functional, "_read_spelling", lambda f, prep: read.append(real(f, prep)) or read[-1])
    torch.manual_seed(0)
    net = _Reshaping().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    params = {n: p.detach() for n, p in net.named_parameters()}
    fn = lambda p, v: functional_call(net, p, (v,))  # noqa: E731
    got = jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))
    want = torch.func.vmap(jacrev(lambda p, v: fn(p, v[None])[0]), in_dims=(None, 0))(params, x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-12, atol=1e-12)
    assert read == [None]


def test_functional_style_fn_that_runs_under_neither_reading() -> None:
    net = _Reshaping().double()
    params = {n: p.detach() for n, p in net.named_parameters()}
    x = torch.randn(2, 5, dtype=torch.float64)  # 5 features where the model takes 3
    with pytest.raises(ValueError, match=r"^f: runs neither on the whole batch nor on one sample.*fix f"):
        jm.jacobian(lambda p, v: functional_call(net, p, (v,)), params, x, argnums=0, in_dims=(None, 0))


# ---- EmbeddingBag parameters in J v and H v products (was KNOWN) --------------------------------------------------


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_vector_products_over_embedding_bag_parameters(mode: str, padding_idx: "int | None") -> None:
    """torch has no forward formula for _embedding_bag and no derivative of its backward: the products run the
    bag in primitive ops, checked against the whole-batch Jacobian and Hessian of a primitive spelling."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.EmbeddingBag(5, 3, mode=mode, padding_idx=padding_idx), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.tensor([[1, 0, 3], [2, 2, 4], [0, 0, 0]])
    names = [n for n, _ in net.named_parameters()]
    P = sum(p.numel() for p in net.parameters())
    v = torch.randn(P, dtype=torch.float64)

    def prim(flat: Tensor) -> Tensor:  # the same model with the bag written out (index, mask, reduce)
        w, lw, lb = flat.split([p.numel() for p in net.parameters()])
        w, lw = w.reshape(5, 3), lw.reshape(2, 3)
        rows = w[x]
        keep = torch.ones(x.shape, dtype=w.dtype) if padding_idx is None else (x != padding_idx).to(w.dtype)
        if mode == "max":
            h = rows.masked_fill(keep[..., None] == 0, float("-inf")).amax(1)
            h = torch.where(keep.any(1, keepdim=True) > 0, h, torch.zeros_like(h))
        else:
            h = (rows * keep[..., None]).sum(1)
            h = h if mode == "sum" else h / keep.sum(1, keepdim=True).clamp(min=1)
        return torch.tanh(h) @ lw.T + lb

    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    J = torch.autograd.functional.jacobian(prim, theta).reshape(-1, P)
    jv = jm.jvp(net, x, v, wrt="params")[1]
    torch.testing.assert_close(jv.reshape(-1), J @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.linearize(net, x, wrt="params")(v).reshape(-1), J @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jm.ggn(net, x, "mse", v=v), J.T @ (J @ v), rtol=1e-10, atol=1e-12)
    loss = lambda o: (o**2).sum(1)  # noqa: E731
    H = torch.autograd.functional.hessian(lambda t: loss(prim(t)).sum(), theta)
    torch.testing.assert_close(jm.hvp(net, x, v, wrt="params", loss=loss), H @ v, rtol=1e-10, atol=1e-12)
    assert names == [n for n, _ in net.named_parameters()]  # the model is left as found


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's own jacrev of _embedding_bag, the oracle
def test_embedding_bag_by_offsets_in_primitive_ops() -> None:
    """1-D ids with offsets (empty bags, include_last_offset, per_sample_weights) give torch's values and
    derivatives in primitive ops, forward mode included."""
    import torch.nn.functional as F

    from jacmode._autodiff.bags import primitive_bags

    torch.manual_seed(0)
    w = torch.randn(6, 3, dtype=torch.float64)
    ids, psw = torch.tensor([1, 4, 0, 5, 5, 2, 3]), torch.randn(7, dtype=torch.float64)
    for kw in (dict(offsets=torch.tensor([0, 2, 2, 5]), mode="mean", padding_idx=5),
               dict(offsets=torch.tensor([0, 3, 3, 7]), mode="max", include_last_offset=True),
               dict(offsets=torch.tensor([0, 1, 4]), mode="sum", per_sample_weights=psw, padding_idx=0)):
        bag = lambda t: F.embedding_bag(ids, t, **kw)  # noqa: E731
        want = jacrev(bag)(w)
        with primitive_bags():
            torch.testing.assert_close(bag(w), F.embedding_bag(ids, w, **kw), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(jacrev(bag)(w), want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(torch.func.jacfwd(bag)(w), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ids", [[[2, 0], [0, 2]], [[2, 0], [2, 0]], [[0, 0, 2], [0, 2, 0]], [[2, 0], [2, 2]]])
@pytest.mark.parametrize("mode, padding_idx", [("sum", None), ("mean", None), ("sum", 0), ("mean", 0)])
def test_coupling_probe_sees_a_pooling_layer_over_permuted_ids(ids: list, mode: str, padding_idx: "int | None") -> None:
    """The probe changed every id to another value seen in the batch; of two values that is a permutation of a
    bag, the same bag to EmbeddingBag's sum: the probe missed cumsum(z, 0) after it and gave the samples-alone
    gradients, which are not the batch's (soak: embeddingbag ... per_sample_grads, B = 2). [2, 0] -> [2, 2] is
    the same bag too, to mean with padding_idx 0: a changed sample now holds one id it did not hold."""
    torch.manual_seed(0)

    class Bagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.tail = nn.EmbeddingBag(4, 2, mode=mode, padding_idx=padding_idx), nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.tail(torch.cumsum(self.emb(x), 0))

    net = Bagged().double()
    with pytest.raises(jm.CoupledBatchError, match=r"^f: the samples of the batch are coupled"):
        jm.per_sample_grads(net, torch.tensor(ids), lambda o: (o**2).sum(1))
