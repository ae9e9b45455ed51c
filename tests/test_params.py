"""Per-sample parameter Jacobians (B, Y, P) against the users' loop and float64 references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmode as jm
from conftest import assert_unchanged, mnist_mlp, ref_param_jacobian, snapshot

MODES = ["auto", "forward", "reverse"]


def small_cnn() -> nn.Module:
    net = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 3)
    ).double()
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    return net.eval()


class Tied(nn.Module):
    """An autoencoder whose decoder reuses the encoder weight: one parameter used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 3)
        self.dec = nn.Linear(3, 4)
        self.dec.weight = nn.Parameter(torch.randn(4, 3))
        self.extra = nn.Linear(3, 4)
        self.extra.weight = self.dec.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))
        return self.dec(h) + self.extra(h) ** 2


def frozen() -> nn.Module:
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    net[0].weight.requires_grad_(False)
    return net


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [2, 17])
def test_users_loop_on_the_problem_mlp(mode: str, batch: int) -> None:
    net = mnist_mlp().double()
    x = torch.randn(batch, 784, dtype=torch.float64)
    # the users' loop of problems.md, verbatim in spirit
    grads = torch.zeros(batch, 10, 15910, dtype=torch.float64)
    for i in range(batch):
        out = net(x[i])
        for j in range(10):
            g = torch.autograd.grad(out[j], net.parameters(), retain_graph=True)
            grads[i, j] = torch.cat([t.flatten() for t in g])
    # forward mode in chunks of 37 of the 15910 directions: 430 passes (chunks of 4 took 3978 for
    # the same path); 37 also puts a chunk across every boundary between two parameters
    got = jm.jacobian(net, x, wrt="params", mode=mode, chunk_size=37 if mode == "forward" else None)
    torch.testing.assert_close(got, grads)


MODELS = {
    "cnn_bn_eval": (small_cnn, (3, 1, 6, 6), None),
    "tied": (lambda: Tied().double(), (3, 4), None),
    "frozen": (frozen, (4, 3), None),
    "subset": (lambda: mnist_mlp().double(), (3, 784), ["2.bias", "0.bias"]),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_models_against_reference(name: str, mode: str, chunk_size: int | None) -> None:
    make, shape, names = MODELS[name]
    net, x = make(), torch.randn(*shape, dtype=torch.float64)
    before = snapshot(net)
    got = jm.jacobian(net, x, wrt=names or "params", mode=mode, chunk_size=chunk_size)
    assert_unchanged(net, before)
    torch.testing.assert_close(got, ref_param_jacobian(net, x, names))


def test_frozen_parameters_are_left_out() -> None:
    net = frozen()
    assert jm.jacobian(net, torch.randn(2, 3, dtype=torch.float64), wrt="params").shape == (2, 2, 5 + 10 + 2)


def test_subset_keeps_named_parameters_order() -> None:
    net = mnist_mlp().double()
    x = torch.randn(2, 784, dtype=torch.float64)
    d = jm.jacobian(net, x, wrt=["2.bias", "0.bias"], flatten=False)
    assert list(d) == ["0.bias", "2.bias"]
    torch.testing.assert_close(d["2.bias"], torch.eye(10, dtype=torch.float64).expand(2, 10, 10))
    p = jm.plan(net, x, wrt=["2.bias"])  # P = Y = 10: a near tie, settled by the measured cost model
    assert p.mode == min(p.costs, key=lambda m: p.costs[m]) and p.strategy in ("whole-batch", "per-sample")


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_dict_and_flat_agree(mode: str) -> None:
    net = small_cnn()
    x = torch.randn(2, 1, 6, 6, dtype=torch.float64)
    flat = jm.jacobian(net, x, wrt="params", mode=mode)
    d = jm.jacobian(net, x, wrt="params", mode=mode, flatten=False)
    assert list(d) == [n for n, _ in net.named_parameters()]
    for (name, p), block in zip(net.named_parameters(), d.values()):
        assert block.shape == (2, 3, *p.shape), name
    torch.testing.assert_close(torch.cat([b.reshape(2, 3, -1) for b in d.values()], dim=-1), flat)


def test_dict_keeps_per_sample_output_shape() -> None:
    net = nn.Sequential(nn.Linear(3, 6), nn.Unflatten(1, (2, 3))).double()
    d = jm.jacobian(net, torch.randn(4, 3, dtype=torch.float64), wrt="params", flatten=False)
    assert d["0.weight"].shape == (4, 2, 3, 6, 3)
    assert jm.jacobian(net, torch.randn(4, 3, dtype=torch.float64), wrt="params").shape == (4, 6, 24)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_out_buffer_is_filled_and_returned(mode: str) -> None:
    net = mnist_mlp().double()
    x = torch.randn(5, 784, dtype=torch.float64)
    buf = torch.full((5, 10, 15910), float("nan"), dtype=torch.float64)
    got = jm.jacobian(net, x, wrt="params", mode=mode, out=buf, chunk_size=37)  # chunks across parameters
    assert got is buf
    torch.testing.assert_close(buf, jm.jacobian(net, x, wrt="params", mode="reverse"))  # another engine, not 15910 more jvps


def test_unbatched_params() -> None:
    net = frozen()
    x = torch.randn(3, 3, dtype=torch.float64)
    for mode in MODES:
        got = jm.jacobian(net, x, wrt="params", batched=False, mode=mode)
        full = ref_param_jacobian(net, x.unsqueeze(0))[0]  # treat the batch as one point
        torch.testing.assert_close(got, full)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_coupled_batchnorm_training_exact_rows(mode: str) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    before = snapshot(net)
    got = jm.jacobian(net, x, wrt="params", mode=mode, structure="coupled")
    assert_unchanged(net, before)
    params = [p for p in net.parameters()]
    out = torch.func.functional_call(net, {n: p for n, p in net.named_parameters()}, (x,))
    rows = []
    for b in range(5):
        for y in range(2):
            g = torch.autograd.grad(out[b, y], params, retain_graph=True)
            rows.append(torch.cat([t.reshape(-1) for t in g]))
    torch.testing.assert_close(got, torch.stack(rows).reshape(5, 2, -1))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_dropout_training_one_mask_per_sample(mode: str) -> None:
    """Dropout in training mode: one mask per sample, shared by all of its output directions."""
    p = 0.5
    net = nn.Sequential(nn.Linear(3, 16), nn.Dropout(p), nn.Linear(16, 4)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    d = jm.jacobian(net, x, wrt=["0.bias"], mode=mode, flatten=False, chunk_size=2)["0.bias"]  # (B, 4, 16)
    w2 = net[2].weight.detach() / (1 - p)  # (4, 16)
    kept = d.abs().sum(1) > 0  # (B, 16): the mask of each sample
    for b in range(6):
        torch.testing.assert_close(d[b], w2 * kept[b])  # every output direction sees the same mask
    assert not (kept == kept[0]).all(), "samples should draw different masks"


def test_create_graph_gauss_newton_gradient() -> None:
    """Backpropagating through J (Laplace / Gauss-Newton users) matches autograd.grad create_graph."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    for mode in ["forward", "reverse"]:
        J = jm.jacobian(net, x, wrt="params", mode=mode, create_graph=True)
        got = torch.autograd.grad(J.square().sum(), list(net.parameters()), allow_unused=True, materialize_grads=True)
        params = list(net.parameters())
        rows = []
        for b in range(3):
            out = net(x[b : b + 1])[0]
            for y in range(2):
                g = torch.autograd.grad(out[y], params, create_graph=True)
                rows.append(torch.cat([t.reshape(-1) for t in g]))
        want = torch.autograd.grad(torch.stack(rows).square().sum(), params, allow_unused=True, materialize_grads=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_errors() -> None:
    net = mnist_mlp()
    x = torch.randn(2, 784)
    with pytest.raises(ValueError, match=r"wrt: '0.wieght' is not a parameter of Sequential. Did you mean '0.weight'"):
        jm.jacobian(net, x, wrt=["0.wieght"])
    with pytest.raises(ValueError, match="f: Sequential has no trainable parameters"):
        jm.jacobian(nn.Sequential(nn.ReLU()), x, wrt="params")
    with pytest.raises(TypeError, match="f: wrt='params' needs an nn.Module"):
        jm.jacobian(lambda z: z, x, wrt="params")
    with pytest.raises(ValueError, match=r"f: with batched=True, f\(x\) must keep the batch dimension"):
        jm.jacobian(nn.Sequential(nn.Linear(784, 3), nn.Flatten(0)), x, wrt="params")
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 10, 15910\) \(B, Y, P\), got \(2, 10, 15\)"):
        jm.jacobian(net, x, wrt="params", out=torch.empty(2, 10, 15))
    with pytest.raises(ValueError, match="out: expected dtype torch.float32"):
        jm.jacobian(net, x, wrt="params", out=torch.empty(2, 10, 15910, dtype=torch.float64))
    with pytest.raises(ValueError, match="out: expected device cpu"):
        jm.jacobian(net, x, wrt="params", out=torch.empty(2, 10, 15910, device="meta"))
    with pytest.raises(ValueError, match="out: only supported for wrt='params' with flatten=True"):
        jm.jacobian(net, x, out=torch.empty(2, 10, 784))
    with pytest.raises(TypeError, match="out: expected a torch.Tensor or None"):
        jm.jacobian(net, x, wrt="params", out=[1])


class Wrapped(nn.Module):
    """The same stack behind a custom forward: forces the generic vmap(vjp) path."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("act", [nn.Tanh, nn.ReLU, nn.Sigmoid, nn.SiLU, nn.Softplus, nn.GELU])
@pytest.mark.parametrize("last_activation", [False, True])
def test_layerwise_fast_path_equals_generic_path(act: type, last_activation: bool) -> None:
    layers = [nn.Linear(3, 6), act(), nn.Linear(6, 5), act(), nn.Linear(5, 2)]
    net = nn.Sequential(*layers, *([act()] if last_activation else [])).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    fast = jm.jacobian(net, x, wrt="params", mode="reverse")
    generic = jm.jacobian(Wrapped(net), x, wrt="params", mode="reverse")
    torch.testing.assert_close(fast, generic)
    sub = jm.jacobian(net, x, wrt=["2.weight"], mode="reverse", out=torch.empty(4, 2, 30, dtype=torch.float64))
    torch.testing.assert_close(sub, generic[:, :, 24:54])  # after 0.weight (18) and 0.bias (6)
    Jf = jm.jacobian(net, x, wrt="params", mode="reverse", create_graph=True)
    Jg = jm.jacobian(Wrapped(net), x, wrt="params", mode="reverse", create_graph=True)
    params = list(net.parameters())
    gf = torch.autograd.grad(Jf.sin().sum(), params, allow_unused=True, materialize_grads=True)
    gg = torch.autograd.grad(Jg.sin().sum(), params, allow_unused=True, materialize_grads=True)
    for a, b in zip(gf, gg):
        torch.testing.assert_close(a, b)


def test_layerwise_fast_path_skips_reused_layers() -> None:
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, nn.Tanh(), lin).double()  # one layer used twice: generic path
    x = torch.randn(2, 3, dtype=torch.float64)
    got = jm.jacobian(net, x, wrt="params")
    # functional_call leaves a transformed tensor in a module registered twice; jacmode restores it
    assert all(type(p) is nn.Parameter for p in lin.parameters()) and net(x).requires_grad
    torch.testing.assert_close(got, ref_param_jacobian(net, x))
