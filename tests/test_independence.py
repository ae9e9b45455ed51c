"""Sample independence is established, not assumed.

Every coupling along dim 0, causal (cumsum, z - z[:1], an RNN run over dim 0), anti-causal or
through batch statistics (x - x.mean(0), BatchNorm in training mode), raises CoupledBatchError in
every entry point, and ``structure="coupled"`` gives the exact diagonal blocks of the whole-batch
derivatives, against float64 ``torch.func.jacrev`` of the whole batch.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev

import jacmode as jm

DT = torch.float64
B = 4


class Mixed(nn.Module):
    """Linear -> tanh -> a coupling over dim 0 -> Linear, on inputs (B, D)."""

    def __init__(self, mix: Callable[[Tensor], Tensor], d: int, out: int = 2) -> None:
        super().__init__()
        self.mix = mix
        self.a, self.b = nn.Linear(d, 3), nn.Linear(3, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.mix(torch.tanh(self.a(x))))


class Recurrent(nn.Module):
    """An RNN with batch_first=False fed (B, T, 1): dim 0 is read as time, so samples mix."""

    def __init__(self, kind: type, d: int) -> None:
        super().__init__()
        self.rnn = kind(1, 3)  # batch_first=False
        self.head = nn.Linear(3, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.rnn(x.unsqueeze(-1))[0]  # (B, T, 1) -> (B, T, 3), B taken as the sequence
        return self.head(h).squeeze(-1)  # (B, T)


class Normed(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(d, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


MAKERS: dict[str, Callable[[int], nn.Module]] = {
    "cumsum": lambda d: Mixed(lambda h: torch.cumsum(h, 0), d),
    "reverse cumsum": lambda d: Mixed(lambda h: h.flip(0).cumsum(0).flip(0), d),
    "minus first": lambda d: Mixed(lambda h: h - h[:1], d),
    "minus mean": lambda d: Mixed(lambda h: h - h.mean(0), d),
    "GRU": lambda d: Recurrent(nn.GRU, d),
    "LSTM": lambda d: Recurrent(nn.LSTM, d),
    "RNN": lambda d: Recurrent(nn.RNN, d),
    "BatchNorm train": lambda d: Normed(d),
}
CASES = list(MAKERS)
COUPLED = r"(samples of the batch are coupled: changing the input|BatchNorm layer\(s\) 'bn' are in training mode)"


def model(name: str, d: int) -> nn.Module:
    torch.manual_seed(0)
    return MAKERS[name](d).to(DT)


def batch(d: int) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(B, d, dtype=DT)


def whole_batch(net: nn.Module) -> nn.Module:
    """A copy whose BatchNorm layers use batch statistics without updating buffers (for jacrev)."""
    return torch.func.replace_all_batch_norm_modules_(copy.deepcopy(net))


def diag(full: Tensor, out_dims: int) -> Tensor:
    """The B diagonal blocks of a whole-batch (B, *out, B, *in) derivative."""
    moved = full.movedim(1 + out_dims, 1)  # (B, B, *out, *in)
    return torch.stack([moved[b, b] for b in range(moved.shape[0])])


def input_blocks(net: nn.Module, x: Tensor) -> Tensor:
    f = whole_batch(net)
    return diag(jacrev(f)(x), f(x).dim() - 1)  # (B, *out, D)


def hessian_blocks(net: nn.Module, x: Tensor) -> Tensor:
    f = whole_batch(net)
    full = jacrev(jacrev(f))(x)  # (B, *out, B, D, B, D)
    k = f(x).dim() - 1
    return torch.stack([full[(b, *[slice(None)] * k, b, slice(None), b)] for b in range(x.shape[0])])


def param_rows(net: nn.Module, x: Tensor) -> Tensor:
    f = whole_batch(net)
    params = {n: p.detach() for n, p in f.named_parameters()}
    jac = jacrev(lambda p: functional_call(f, p, (x,)))(params)
    return torch.cat([jac[n].reshape(x.shape[0], -1, params[n].numel()) for n in params], -1)


def loss(out: Tensor) -> Tensor:
    return out.pow(2).reshape(out.shape[0], -1).sum(1)


ENTRIES: dict[str, Callable[[nn.Module, Tensor], object]] = {
    "jacobian inputs": lambda f, x: jm.jacobian(f, x),
    "jacobian params": lambda f, x: jm.jacobian(f, x, wrt="params"),
    "derivative": lambda f, x: jm.derivative(f, x[:, :1]),
    "partials": lambda f, x: jm.partials(f, x, [(0,), (1, 1)]),
    "laplacian": lambda f, x: jm.laplacian(f, x),
    "hessian": lambda f, x: jm.hessian(f, x),
    "per_sample_grads": lambda f, x: jm.per_sample_grads(f, x, loss),
    "ntk": lambda f, x: jm.ntk(f, x),
    "ggn": lambda f, x: jm.ggn(f, x),
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("name", CASES)
def test_coupling_raises_everywhere(name: str, entry: str) -> None:
    jm.clear_cache()
    d = 1 if entry == "derivative" else 2
    net = model(name, d)
    x = batch(2)
    ways = "structure='coupled'" if entry not in ("per_sample_grads", "ntk", "ggn") else "wrt='params', structure='coupled'"
    with pytest.raises(jm.CoupledBatchError, match=COUPLED + r".*model\.eval\(\).*" + ways.replace("(", r"\(")):
        ENTRIES[entry](net, x)


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", CASES)
def test_coupled_jacobian_inputs_is_exact(name: str, mode: str) -> None:
    net, x = model(name, 2), batch(2)
    torch.testing.assert_close(jm.jacobian(net, x, mode=mode, structure="coupled"), input_blocks(net, x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
@pytest.mark.parametrize("name", CASES)
def test_coupled_jacobian_params_is_exact(name: str, mode: str) -> None:
    net, x = model(name, 2), batch(2)
    torch.testing.assert_close(jm.jacobian(net, x, wrt="params", mode=mode, structure="coupled"), param_rows(net, x))


@pytest.mark.parametrize("name", CASES)
def test_coupled_first_derivatives_are_exact(name: str) -> None:
    net, x = model(name, 2), batch(2)
    net1, t = model(name, 1), x[:, :1]
    torch.testing.assert_close(jm.derivative(net1, t, structure="coupled"), input_blocks(net1, t)[..., 0])
    first, _ = jm.partials(net, x, [(0,), (1, 1)], structure="coupled")
    torch.testing.assert_close(first, input_blocks(net, x)[..., 0])


# torch's forward-over-forward second derivative of batch_norm in training mode is wrong (nested
# jacfwd disagrees with nested jacrev by 0.57 on this model; a decomposition into mean, var and
# rsqrt agrees with jacrev): jacmode's generic engines differentiate that decomposition
# (_rules/decompositions.py), so BatchNorm in training mode is exact here too
@pytest.mark.parametrize("name", CASES)
def test_coupled_second_derivatives_are_exact(name: str) -> None:
    net, x = model(name, 2), batch(2)
    H = hessian_blocks(net, x)  # (B, *out, D, D)
    _, second = jm.partials(net, x, [(0,), (1, 1)], structure="coupled")
    torch.testing.assert_close(second, H[..., 1, 1])
    torch.testing.assert_close(jm.laplacian(net, x, structure="coupled"), H.diagonal(dim1=-2, dim2=-1).sum(-1))
    torch.testing.assert_close(jm.hessian(net, x, structure="coupled"), H)


def test_batchnorm_oracle_is_settled_by_a_decomposition() -> None:
    """The reference above (nested jacrev) agrees with BatchNorm written in primitive ops."""
    net, x = model("BatchNorm train", 2), batch(2)
    bn = net.bn

    def primitive(z: Tensor) -> Tensor:
        h = net.a(z)
        h = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + bn.eps) * bn.weight + bn.bias
        return net.b(torch.tanh(h))

    full = jacrev(jacrev(primitive))(x)
    torch.testing.assert_close(hessian_blocks(net, x), torch.stack([full[b, :, b, :, b] for b in range(B)]))


def test_message_names_the_samples_and_the_ways_out() -> None:
    x = batch(2)
    with pytest.raises(jm.CoupledBatchError, match=r"changing the input of sample\(s\) 1, 3 \(of those probed\) "
                       r"changed the output of sample 2.*batched=False.*structure='coupled'.*structure='independent'"):
        jm.jacobian(lambda z: z.cumsum(0), x)
    with pytest.raises(jm.CoupledBatchError, match=r"structure='coupled' for the exact derivatives.*structure='independent'"):
        jm.laplacian(lambda z: z.cumsum(0), x)


def test_derivative_only_coupling_is_caught() -> None:
    """The value of sample b does not move, but its derivative sees the others (straight-through)."""
    def f(z: Tensor) -> Tensor:
        m = z.mean(0)
        return torch.tanh(z) + m - m.detach()

    x = batch(2)
    with pytest.raises(jm.CoupledBatchError, match="have a nonzero derivative with respect to the input of sample"):
        jm.jacobian(f, x)
    torch.testing.assert_close(jm.jacobian(f, x, structure="coupled"), diag(jacrev(f)(x), 1))


def test_anticausal_and_pairwise_coupling_are_caught() -> None:
    x = torch.randn(16, 2, dtype=DT)
    pair_swap = lambda z: z.reshape(-1, 2, z.shape[1]).flip(1).reshape(z.shape)  # noqa: E731
    for f in (lambda z: z.flip(0).cumsum(0).flip(0), lambda z: z - z[-1:], pair_swap, lambda z: z.roll(1, 0)):
        jm.clear_cache()
        with pytest.raises(jm.CoupledBatchError):
            jm.jacobian(f, x)


def test_randomness_in_f_is_no_false_alarm() -> None:
    net = nn.Sequential(nn.Linear(2, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 2)).to(DT)
    noisy = lambda z: net(z) + 0.1 * torch.randn_like(z[:, :1])  # noqa: E731
    drop = lambda z: F.dropout(torch.tanh(z), 0.5)  # noqa: E731
    x = batch(2)
    state = torch.get_rng_state()
    for f in (net, noisy, drop):
        jm.clear_cache()
        jm._coupling.probe(f, x, check=True, validate=lambda out, n: out)
        assert torch.equal(torch.get_rng_state(), state)  # the probe leaves the generator as found
    assert jm.jacobian(noisy, x).shape == (B, 2, 2)
    assert jm.jacobian(net, x, wrt="params").shape[:2] == (B, 2)


def test_nan_rows_neither_hide_nor_fake_a_coupling() -> None:
    x = torch.randn(12, 2, dtype=DT)
    x[0, 0] = float("nan")
    x[5, 1] = float("inf")
    got = jm.jacobian(torch.tanh, x)  # independent: no false alarm from the non-finite rows
    torch.testing.assert_close(got[1:5], torch.diag_embed(1 - torch.tanh(x[1:5]) ** 2))
    with pytest.raises(jm.CoupledBatchError):  # the probe samples finite rows
        jm.jacobian(lambda z: z - z.mean(0), x)
    y = torch.full((6, 2), float("nan"), dtype=DT)  # nothing finite to probe: NaN == NaN, no alarm
    assert jm.jacobian(torch.tanh, y).isnan().all()


def test_value_dependent_coupling_in_the_probed_values() -> None:
    """A branch that couples samples only when some sample is large; then the batch has one."""
    f = lambda z: torch.where(z.abs().amax(0) > 1e3, z.cumsum(0), z)  # noqa: E731
    x = torch.randn(9, 2, dtype=DT).clamp(-1, 1)
    torch.testing.assert_close(jm.jacobian(f, x), torch.eye(2, dtype=DT).expand(9, 2, 2))  # not coupled here
    x[-1] = 2e3
    jm.clear_cache()
    with pytest.raises(jm.CoupledBatchError):
        jm.jacobian(f, x)


def test_integer_inputs_are_probed_by_other_rows() -> None:
    class Bag(nn.Module):
        def __init__(self, mix: bool) -> None:
            super().__init__()
            self.emb, self.head, self.mix = nn.Embedding(10, 3), nn.Linear(3, 2), mix

        def forward(self, ids: Tensor) -> Tensor:
            h = self.emb(ids).sum(1)
            return self.head(h.cumsum(0) if self.mix else h)

    ids = torch.randint(0, 10, (6, 4))
    with pytest.raises(jm.CoupledBatchError, match="changing the input"):
        jm.per_sample_grads(Bag(True), ids, loss)
    assert jm.jacobian(Bag(False), ids, wrt="params").shape == (6, 2, 38)


def test_independent_models_pass_and_the_verdict_is_cached() -> None:
    net = nn.Sequential(nn.Linear(2, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).to(DT)
    gru = nn.GRU(1, 3, batch_first=True).to(DT)
    x = batch(2)
    jm.jacobian(net, x)
    assert jm.jacobian(lambda z: gru(z.unsqueeze(-1))[0].sum(-1), x).shape == (B, 2, 2)  # batch_first: fine
    calls: list[int] = []

    def counted(z: Tensor) -> Tensor:
        calls.append(z.shape[0])
        return torch.tanh(z)

    jm.jacobian(counted, torch.randn(20, 2), mode="forward")
    first = len(calls)
    # the first call caches nothing, the second does (_guard.py); counted reads the list `calls`
    # (TorchDynamo guards it), so each call starts with it empty: the same state
    calls.clear()
    jm.jacobian(counted, torch.randn(20, 2), mode="forward")
    calls.clear()
    jm.jacobian(counted, torch.randn(20, 2), mode="forward")
    assert len(calls) < first and 8 not in calls  # the verdict is cached: no probe pass again


SAMPLE_MIXERS: dict[str, Callable[[Tensor], Tensor]] = {
    "flip": lambda z: z.flip(0),
    "roll": lambda z: z.roll(1, 0),
    "shift": lambda z: torch.cat([z[1:], z[:1]]),
    "fancy index": lambda z: z[torch.arange(z.shape[0] - 1, -1, -1)],
    "index_select": lambda z: z.index_select(0, torch.arange(z.shape[0] - 1, -1, -1)),
    "sum over batch": lambda z: z + z.sum(0, keepdim=True),
    "mean": lambda z: z - z.mean(0),
    "std": lambda z: z / z.std(0),
    "amax": lambda z: z * z.amax(0),
    "norm over batch": lambda z: z * z.norm(dim=0),
    "normalize dim 0": lambda z: F.normalize(z, dim=0),
    "softmax dim 0": lambda z: F.softmax(z, 0),
    "log_softmax dim 0": lambda z: F.log_softmax(z, 0),
    "logsumexp dim 0": lambda z: z - torch.logsumexp(z, 0, keepdim=True),
    "cumsum": lambda z: torch.cumsum(z, 0),
    "cumprod": lambda z: torch.cumprod(z, 0),
    "diff": lambda z: torch.diff(z, dim=0, prepend=z[:1]),
    "flat flip": lambda z: z.reshape(-1).flip(0).reshape(z.shape),
    "transpose round trip": lambda z: (z.t().flip(1)).t(),
    "gram": lambda z: (z @ z.t()) @ z,
    "einsum": lambda z: torch.einsum("bi,ci->bi", z, z),
    "row 0 broadcast": lambda z: z * z[0],
    "conv over batch": lambda z: F.conv1d(z.t().unsqueeze(0), torch.ones(1, 1, 3, dtype=z.dtype), padding=1)[0].t(),
    "pool over batch": lambda z: F.avg_pool1d(z.t().unsqueeze(0), 3, 1, 1)[0].t(),
    "layer_norm over all": lambda z: F.layer_norm(z, z.shape),
    "stack flipped": lambda z: torch.stack([z, z.flip(0)], -1).sum(-1),
    "detached mean": lambda z: z * z.mean(0).detach(),
}


@pytest.mark.parametrize("name", list(SAMPLE_MIXERS))
def test_captured_fast_path_never_assumes_independence(name: str) -> None:
    """The derivative operators skip the probe on captured graphs: every rule must see the mixing."""
    lin = nn.Linear(1, 1).to(DT)
    mix = SAMPLE_MIXERS[name]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, z: Tensor) -> Tensor:
            return torch.tanh(mix(torch.tanh(self.lin(z))))

    net, t = Net(), torch.linspace(0.1, 0.9, 6, dtype=DT).unsqueeze(1)
    J = diag(jacrev(net)(t), 1)[..., 0]  # (B, 1) whole-batch diagonal
    H = torch.stack([jacrev(jacrev(net))(t)[b, 0, b, 0, b, 0] for b in range(6)]).unsqueeze(1)
    for order, want in ((1, J), (2, H)):
        try:
            got = jm.derivative(net, t, order=order)
        except jm.CoupledBatchError:
            continue
        torch.testing.assert_close(got, want)


class _BagCentred(nn.Module):
    """Token bags whose embeddings are centred over the batch: coupled, whatever ids are drawn."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.e, self.lin = nn.EmbeddingBag(5, 3, mode="sum"), nn.Linear(3, 2)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.e(ids)
        return self.lin(h - h.mean(0))


@pytest.mark.parametrize("ids", [[[1], [1]], [[0], [0], [0]], [[2, 2], [2, 2]]])
@pytest.mark.parametrize("entry", ["per_sample_grads", "jacobian", "ntk", "ggn"])
def test_coupling_is_caught_when_every_sample_holds_the_same_ids(ids: list, entry: str) -> None:
    """Found by the differential harness: swapping in other samples' rows changed nothing when all
    samples held the same ids, so the coupling went unseen."""
    model, x = _BagCentred(), torch.tensor(ids)
    calls = {
        "per_sample_grads": lambda: jm.per_sample_grads(model, x, lambda o: o.pow(2).sum(1)),
        "jacobian": lambda: jm.jacobian(model, x, wrt="params"),
        "ntk": lambda: jm.ntk(model, x),
        "ggn": lambda: jm.ggn(model, x, "mse", diagonal=True),
    }
    with pytest.raises(jm.CoupledBatchError, match="samples of the batch are coupled"):
        calls[entry]()


class _MixInTraining(nn.Module):
    """Couples the samples only in training mode, behind a value-dependent branch (not traceable)."""

    def forward(self, x: Tensor) -> Tensor:
        if float(x.sum()) > -1e9 and self.training:
            return x - x.mean(0)
        return x * 2


def test_a_plain_functions_verdict_follows_the_training_flags_of_its_modules() -> None:
    """The cached verdict of a lambda ignored the training flags of the modules it calls, so a
    coupling that appears after model.train() went unseen (per-sample blocks returned)."""
    mix = _MixInTraining()
    g = lambda x: mix(x)  # noqa: E731
    x = torch.randn(4, 2, dtype=torch.float64)
    mix.eval()
    torch.testing.assert_close(jm.jacobian(g, x), 2 * torch.eye(2, dtype=torch.float64).expand(4, 2, 2))
    mix.train()
    with pytest.raises(jm.CoupledBatchError, match="samples of the batch are coupled"):
        jm.jacobian(g, x)
