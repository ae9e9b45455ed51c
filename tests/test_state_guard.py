"""Repeated calls after ordinary Python state that forward reads has changed (the guard of ``_guard.py``).

Each case makes six calls; the state changes before call 3 (the path of a call changes on the
2nd and 3rd: the guard is made on the 2nd, reused from the 3rd), and every call is checked
against a float64 torch.func oracle of the model as it is at that moment.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, vmap

import jacmode as jm
from jacmode import _guard

CALLS = 6
CHANGE_AT = 2  # the state changes before the third call


class Config:
    """A plain config object, as training scripts pass them around."""

    def __init__(self) -> None:
        self.scale = 1.0


def _helper(h: Tensor) -> Tensor:
    return torch.tanh(h)


class Net(nn.Module):
    """A PINN-style class whose forward reads Python state of every kind the guard must watch."""

    shift = 0.0  # a class attribute

    def __init__(self, d_in: int = 2, d_out: int = 3) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, 16), nn.Linear(16, d_out)
        self.act: Callable[[Tensor], Tensor] = torch.tanh
        self.table = {"act": torch.tanh}
        self.acts = [torch.tanh]
        self.cfg = Config()
        self.scale = 1.0
        self.gain = np.float64(1.0)
        self.center = False
        self.n_out = d_out

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.fc1(x)) * self.cfg.scale * self.scale * float(self.gain) + type(self).shift
        h = self.acts[0](self.table["act"](h))
        h = _helper(h)
        if self.center:
            h = h - h.mean(0)
        return self.fc2(h)[:, : self.n_out]


def _set_helper(fn: Callable[[Tensor], Tensor]) -> None:
    globals()["_helper"] = fn


CHANGES: dict[str, Callable[[Net], None]] = {
    "attribute function": lambda n: setattr(n, "act", torch.sin),
    "dict entry": lambda n: n.table.__setitem__("act", torch.sin),
    "list entry": lambda n: n.acts.__setitem__(0, torch.sin),
    "config object": lambda n: setattr(n.cfg, "scale", 0.5),
    "float attribute": lambda n: setattr(n, "scale", 0.25),
    "numpy scalar": lambda n: setattr(n, "gain", np.float64(2.0)),
    "class attribute": lambda n: setattr(Net, "shift", 0.5),
    "global function": lambda n: _set_helper(torch.sin),
    "narrower output": lambda n: setattr(n, "n_out", 2),
}


_ORIGINAL_HELPER = _helper


@pytest.fixture(autouse=True)
def _restore_globals() -> Any:
    yield
    Net.shift = 0.0
    _set_helper(_ORIGINAL_HELPER)


def _double(net: nn.Module) -> nn.Module:
    return copy.deepcopy(net).double()


def _per_sample(net: nn.Module, fn: Callable[..., Tensor], x: Tensor) -> Tensor:
    return vmap(fn(lambda xb: net(xb[None])[0]))(x.double())


def _oracle(entry: str, net: nn.Module, x: Tensor) -> Tensor:
    d = _double(net)
    if entry.startswith("jacobian inputs") or entry == "transform jacobian":
        return _per_sample(d, jacrev, x)
    if entry == "hessian":
        return _per_sample(d, hessian, x)
    if entry == "laplacian":
        return _per_sample(d, hessian, x).diagonal(dim1=-2, dim2=-1).sum(-1)
    if entry == "partials":
        H = _per_sample(d, hessian, x)
        J = _per_sample(d, jacrev, x)
        return torch.stack([J[..., 0], H[..., 1, 1]])
    if entry == "jacobian params":
        params = {k: v.detach() for k, v in d.named_parameters()}

        def one(xb: Tensor) -> Tensor:
            jac = jacrev(lambda p: functional_call(d, p, (xb[None],))[0])(params)
            return torch.cat([j.reshape(j.shape[0], -1) for j in jac.values()], 1)

        return vmap(one)(x.double())
    raise AssertionError(entry)


def _call(entry: str, net: nn.Module, x: Tensor, transformed: dict[str, Any]) -> Tensor:
    if entry.startswith("jacobian inputs"):
        return jm.jacobian(net, x, mode=entry.split()[-1])
    if entry == "transform jacobian":
        t = transformed.setdefault("t", jm.transform(jm.jacobian, net))
        return t(x)
    if entry == "hessian":
        return jm.hessian(net, x)
    if entry == "laplacian":
        return jm.laplacian(net, x)
    if entry == "partials":
        return torch.stack(jm.partials(net, x, dims=[(0,), (1, 1)]))
    if entry == "jacobian params":
        return jm.jacobian(net, x, wrt="params")
    raise AssertionError(entry)


ENTRIES = ["jacobian inputs auto", "jacobian inputs forward", "jacobian inputs reverse", "transform jacobian",
           "hessian", "laplacian", "partials", "jacobian params"]


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("entry", ENTRIES)
def test_every_call_follows_the_current_state(change: str, entry: str) -> None:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 2)
    transformed: dict[str, Any] = {}
    for i in range(CALLS):
        if i == CHANGE_AT:
            CHANGES[change](net)
        got = _call(entry, net, x, transformed)
        want = _oracle(entry, net, x)
        assert got.shape == want.shape, f"call {i + 1}"
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5, msg=f"call {i + 1} after {change}")


def test_a_change_and_back_reuses_the_first_state() -> None:
    """A state seen before passes its old guard again: no new trace, and the right numbers."""
    net, x = Net(), torch.randn(4, 2)
    for _ in range(3):
        jm.jacobian(net, x)
    made = _guard.peek(net).seen.made
    for act in (torch.sin, torch.tanh, torch.sin, torch.tanh):
        net.act = act
        for _ in range(2):
            torch.testing.assert_close(jm.jacobian(net, x).double(), _oracle("jacobian inputs auto", net, x),
                                       atol=2e-5, rtol=2e-5)
    assert _guard.peek(net).seen.made <= made + 1  # sin traced at most once (another Net may have), tanh kept


class Centred(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return h - h.mean(0)


class Switch(nn.Module):
    """A model whose samples become coupled when a flag is set, or a child module is swapped."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.mid, self.fc2 = nn.Linear(3, 8), nn.Identity(), nn.Linear(8, 2)
        self.couple = False

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.mid(self.fc1(x)))
        if self.couple:
            h = h - h.mean(0)
        return self.fc2(h)


COUPLINGS: dict[str, Callable[[Switch], None]] = {
    "flag": lambda m: setattr(m, "couple", True),
    "module swapped": lambda m: setattr(m, "mid", Centred()),
}
COUPLED_ENTRIES: dict[str, Callable[[nn.Module, Tensor], Any]] = {
    "jacobian params": lambda m, x: jm.jacobian(m, x, wrt="params"),
    "jacobian inputs": lambda m, x: jm.jacobian(m, x),
    "per_sample_grads": lambda m, x: jm.per_sample_grads(m, x, lambda out: out.pow(2).sum(1)),
    "ntk": lambda m, x: jm.ntk(m, x),
    "laplacian": lambda m, x: jm.laplacian(m, x),
}


@pytest.mark.parametrize("coupling", list(COUPLINGS))
@pytest.mark.parametrize("entry", list(COUPLED_ENTRIES))
def test_samples_that_become_coupled_raise(coupling: str, entry: str) -> None:
    model, x = Switch(), torch.randn(6, 3)
    call = COUPLED_ENTRIES[entry]
    for _ in range(4):
        call(model, x)
    COUPLINGS[coupling](model)
    for i in range(3):
        with pytest.raises(jm.CoupledBatchError, match="coupled"):
            call(model, x)


def test_a_parameter_verdict_does_not_carry_over_to_inputs() -> None:
    model, x = Switch(), torch.randn(6, 3)
    for _ in range(3):
        jm.jacobian(model, x, wrt="params")
    model.couple = True
    for _ in range(2):
        with pytest.raises(jm.CoupledBatchError):
            jm.jacobian(model, x, wrt="params")
        with pytest.raises(jm.CoupledBatchError):
            jm.jacobian(model, x)


@pytest.mark.parametrize("entry", ["jacobian params", "ntk", "ggn"])
def test_a_narrower_output_is_seen(entry: str) -> None:
    """Each call against a float64 oracle (parameters) or a first call on a copy of the model as it is."""
    net, x = Net(), torch.randn(5, 2)
    calls: dict[str, Callable[[nn.Module], Tensor]] = {
        "jacobian params": lambda m: jm.jacobian(m, x, wrt="params"),
        "ntk": lambda m: jm.ntk(m, x),
        "ggn": lambda m: jm.ggn(m, x, "mse", diagonal=True),
    }
    for i in range(CALLS):
        if i == CHANGE_AT:
            net.n_out = 2
        got = calls[entry](net)
        if entry == "jacobian params":
            want = _oracle("jacobian params", net, x)
        else:
            want = calls[entry](copy.deepcopy(net))  # a model jacmode has never seen
        assert got.shape == want.shape, f"call {i + 1}"
        torch.testing.assert_close(got.double(), want.double(), atol=2e-5, rtol=2e-5, msg=f"call {i + 1}")


def test_batchnorm_statistics_set_to_none_gives_the_coupling_error() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).eval()
    x = torch.randn(6, 3)
    for _ in range(3):
        jm.jacobian(model, x, wrt="params")
    model[1].running_mean = None
    model[1].running_var = None
    for _ in range(2):
        with pytest.raises(jm.CoupledBatchError):
            jm.jacobian(model, x, wrt="params")
    jm.clear_cache()
    with pytest.raises(jm.CoupledBatchError):
        jm.jacobian(model, x, wrt="params")


def test_closure_cell_and_lambda() -> None:
    net = Net()
    x = torch.randn(4, 2)
    k = [1.0]

    def f(z: Tensor) -> Tensor:
        return net(z) * k[0]

    for i in range(CALLS):
        if i == CHANGE_AT:
            k[0] = 3.0
        torch.testing.assert_close(jm.jacobian(f, x).double(), 3.0 ** (i >= CHANGE_AT) *
                                   _oracle("jacobian inputs auto", net, x), atol=2e-5, rtol=2e-5)


def test_a_function_called_once_is_never_traced() -> None:
    net = Net()
    jm.jacobian(net, torch.randn(3, 2))
    assert _guard.peek(net).seen.last is None


def test_an_untraceable_function_reuses_nothing_and_stays_exact() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: Tensor) -> Tensor:
            h = self.fc(x)
            return torch.tanh(h) if float(h.sum()) > 0 else torch.sin(h)

    m, x = Branchy(), torch.randn(4, 2)
    for _ in range(4):
        want = _per_sample(_double(m), jacrev, x) if float(m.fc(x).sum()) > 0 else None
        got = jm.jacobian(m, x, mode="reverse")
        if want is not None:
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert "TorchDynamo" in _guard.why_not(m)


def test_clear_cache_forgets_the_guards() -> None:
    net = Net()
    for _ in range(3):
        jm.jacobian(net, torch.randn(3, 2))
    assert _guard.peek(net).seen is not None
    jm.clear_cache()
    assert _guard.peek(net) is None and len(_guard._STATES) == 0


class _Act(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.out = nn.Linear(2, 16), nn.Linear(16, 3)
        self.act = torch.tanh

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.act(self.fc1(x)))


@pytest.mark.parametrize("entry", ["laplacian", "jacobian"])
def test_calls_inside_vmap_reuse_and_follow_the_state(entry: str) -> None:
    """``vmap(lambda xx: jm.<entry>(net, xx))`` (an ensemble of input batches): the calls inside the
    transform are guarded like the calls outside it, so each of eight calls follows the model's
    state (a function attribute swapped, a weight scaled in place) and repeated calls reuse."""
    torch.manual_seed(0)
    net = _Act().double()
    xs = torch.randn(3, 5, 2, dtype=torch.float64)

    def want() -> Tensor:
        if entry == "jacobian":
            return vmap(vmap(jacrev(lambda p: net(p[None])[0])))(xs)
        h = vmap(vmap(hessian(lambda p: net(p[None])[0])))(xs)  # (3, 5, 3, 2, 2)
        return h.diagonal(dim1=-2, dim2=-1).sum(-1)

    op = getattr(jm, entry)
    run = vmap(lambda xx: op(net, xx))
    for i in range(8):
        if i == 4:
            net.act = torch.sin
        if i == 6:
            with torch.no_grad():
                net.fc1.weight.mul_(2)
        got = run(xs)
        torch.testing.assert_close(got.reshape(want().shape), want(), msg=f"call {i + 1}")
    assert _guard.why_not(net) == ""
    assert _guard.current(net) is None  # no scope left behind
    from jacmode import _profile

    assert _profile.count(net) >= 1  # reused: the calls inside the transform kept what they found


def test_the_guard_is_made_on_a_frame_of_its_own_for_every_state() -> None:
    """Each state is traced through a new code object that has a source file: torch.compile before
    2.13 wraps a function without one in a frame shared by all (its guards then out of reach, and
    the recompile limit reached after eight states). Ten states of one function all get a guard."""
    import inspect

    first, second = _guard._sentinel(), _guard._sentinel()
    assert first.__code__ is not second.__code__
    assert inspect.getsourcefile(first) is not None

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(2, 2), 1.0

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) * self.scale

    net, x = Scaled(), torch.randn(3, 2)
    jm.jacobian(net, x)
    for k in range(10):
        net.scale = float(k + 2)
        assert _guard.generation(net, (x,), {}) is not None, f"state {k}: {_guard.why_not(net)}"


_WIDTH = {"n": 3}


def _narrowing(w: Tensor, x: Tensor) -> Tensor:
    return torch.tanh(x @ w)[:, : _WIDTH["n"]]


def test_a_functional_style_output_that_narrows_between_calls_is_followed() -> None:
    """fn(params, x) whose output narrows when a global it reads changes: every call of the sequence
    is the Jacobian of fn as it is at that call (not an error about an output that changed within a call)."""
    w = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    try:
        for k, n in enumerate([3, 3, 3, 2, 2, 2, 3]):
            _WIDTH["n"] = n
            got = jm.jacobian(_narrowing, w, x, argnums=0, in_dims=(None, 0))
            want = vmap(jacrev(lambda w_, xb: _narrowing(w_, xb[None])[0]), in_dims=(None, 0))(w, x)
            torch.testing.assert_close(got, want, msg=lambda m: f"call {k + 1}: {m}")
    finally:
        _WIDTH["n"] = 3


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 3), 1.0

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.fc(x) * mask * self.scale


def test_products_of_a_model_of_several_arguments_are_guarded() -> None:
    """per_sample_grads and ntk with x a tuple of the model's arguments trace ``model(*x)``: their
    calls are guarded (repeated calls reuse), and a value the model reads is followed."""
    torch.manual_seed(0)
    m = _Masked().double()
    x, mask = torch.randn(6, 4, dtype=torch.float64), (torch.rand(6, 3) > 0.3).double()
    y = torch.randn(6, 3, dtype=torch.float64)
    for k, scale in enumerate([1.0, 1.0, 1.0, 2.0, 2.0]):
        m.scale = scale
        got = jm.per_sample_grads(m, (x, mask), nn.MSELoss(reduction="sum"), y=y)
        params = dict(m.named_parameters())
        want = vmap(torch.func.grad(lambda p, xb, mb, yb: ((functional_call(m, p, (xb[None], mb[None])) - yb) ** 2)
                                    .sum()), in_dims=(None, 0, 0, 0))(params, x, mask, y)
        torch.testing.assert_close(got, torch.cat([want[n].reshape(6, -1) for n in params], 1),
                                   msg=lambda s: f"call {k + 1}: {s}")
        assert _guard.why_not(m) == "", _guard.why_not(m)
    assert _guard.generation(m, (x, mask), {}) is not None


class _Trainer:
    """A plain object that holds the model, as a trainer or a config does."""

    def __init__(self, net: nn.Module) -> None:
        self.net = net


def test_a_model_held_by_a_plain_object_is_left_as_found() -> None:
    """fn(params, x) reaching the model through a plain object (``self.model`` of a trainer): its
    BatchNorm in training mode couples the samples (a clear error, every call), and its running
    statistics are left as they were, also as the state changes between calls."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    trainer = _Trainer(net)
    fn = lambda p, xb: functional_call(trainer.net, p, (xb,))  # noqa: E731
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(5, 3)
    for k in range(4):
        net[1].momentum = 0.1 * (k + 1)
        before = {n: b.clone() for n, b in net.named_buffers()}
        with pytest.raises(jm.CoupledBatchError):
            jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))
        assert all(torch.equal(before[n], b) for n, b in net.named_buffers()), f"call {k + 1}"
