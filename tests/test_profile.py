"""One profile per function and signature (``_profile.py``): hits are bit-identical to the full path,
values never invalidate, and every change of the key's ingredients does (checked against float64
torch.func oracles)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, hessian, jacrev, vmap

import jacmode as jm
from jacmode import _profile


class Net(nn.Module):
    """Linear-tanh-Linear whose function depends on its training flag."""

    def __init__(self, d: int = 3, h: int = 5, y: int = 2) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, y)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc1(x))
        if self.training:
            h = h * 1.5
        return self.fc2(h)


def _one(f: nn.Module, xb: Tensor) -> Tensor:
    return f(xb.unsqueeze(0))[0]


def _jac_inputs(f: nn.Module, x: Tensor) -> Tensor:
    return vmap(jacrev(lambda xb: _one(f, xb)))(x)


def _trainable(f: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in f.named_parameters() if p.requires_grad}


def _jac_params(f: nn.Module, x: Tensor) -> Tensor:
    params = _trainable(f)

    def one(ps: dict[str, Tensor], xb: Tensor) -> Tensor:
        return functional_call(f, ps, (xb.unsqueeze(0),))[0]

    jac = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    return torch.cat([jac[n].flatten(2) for n in params], 2)


def _laplacian(f: nn.Module, x: Tensor) -> Tensor:
    return vmap(hessian(lambda xb: _one(f, xb)))(x).diagonal(dim1=-2, dim2=-1).sum(-1)


def _partials(f: nn.Module, x: Tensor) -> Tensor:
    j = _jac_inputs(f, x)
    h = vmap(hessian(lambda xb: _one(f, xb)))(x)
    return torch.stack([j[..., 0], h[..., 1, 1]])


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


def _psg(f: nn.Module, x: Tensor) -> Tensor:
    params = _trainable(f)
    y = torch.ones(x.shape[0], 2, dtype=x.dtype)

    def one(ps: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return _loss(functional_call(f, ps, (xb.unsqueeze(0),)), yb.unsqueeze(0))[0]

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[n].flatten(1) for n in params], 1)


CASES: dict[str, tuple[Callable[[nn.Module, Tensor], Any], Callable[[nn.Module, Tensor], Tensor]]] = {
    "jacobian inputs": (lambda f, x: jm.jacobian(f, x), _jac_inputs),
    "jacobian params": (lambda f, x: jm.jacobian(f, x, wrt="params"), _jac_params),
    "jacobian transform": (lambda f, x: jm.jacfn(f, wrt="params")(x), _jac_params),
    "laplacian": (lambda f, x: jm.laplacian(f, x), _laplacian),
    "partials": (lambda f, x: torch.stack(jm.partials(f, x, [(0,), (1, 1)])), _partials),
    "per_sample_grads": (lambda f, x: jm.per_sample_grads(f, x, _loss, y=torch.ones(x.shape[0], 2, dtype=x.dtype)),
                         _psg),
}


def _check(name: str, f: nn.Module, x: Tensor) -> Tensor:
    call, oracle = CASES[name]
    got = call(f, x)
    torch.testing.assert_close(got, oracle(f, x), rtol=1e-9, atol=1e-10)
    return got


def _model() -> tuple[Net, Tensor]:
    torch.manual_seed(0)
    return Net().double(), torch.randn(4, 3, dtype=torch.float64)


# Parameter Jacobians: from the fourth call on, a hit runs the probe engine's generated code, whose
# rewrites order some products' sums differently (checked against the engine to 1e-12 when made,
# _probes/generated.py): the same numbers to the last bits, which can differ on some CPUs. Every
# other hit computes what the full path computes, in the same order: the same bits.
_REORDERED = {"jacobian params", "jacobian transform"}


def _same(name: str, got: Tensor, want: Tensor) -> bool:
    if name in _REORDERED:
        return bool(torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())))
    return torch.equal(got, want)


@pytest.mark.parametrize("name", list(CASES))
def test_a_hit_is_bit_identical_to_the_full_path_and_values_keep_the_profile(name: str) -> None:
    f, x = _model()
    jm.clear_cache()
    first = _check(name, f, x)  # the first call caches nothing (_guard.py)
    assert _profile.count(f) == 0
    assert torch.equal(_check(name, f, x), first)  # the second call makes the guard and the profile
    assert _profile.count(f) == 1
    assert torch.equal(CASES[name][0](f, x), first)  # the hit (the third call)
    with torch.no_grad():  # an optimizer step: new values, same profile
        for p in f.parameters():
            p.mul_(0.9).add_(0.01)
    _check(name, f, torch.randn(4, 3, dtype=torch.float64))
    assert _profile.count(f) == 1
    x2 = torch.randn(4, 3, dtype=torch.float64)
    hit = CASES[name][0](f, x2)
    jm.clear_cache()
    assert _profile.count(f) == 0
    assert _same(name, CASES[name][0](f, x2), hit)  # full path again: the same bits (see _REORDERED)


def _train_eval(f: Net) -> None:
    f.eval()


def _hook(f: Net) -> None:
    f.fc2.register_forward_hook(lambda m, a, out: out * 2.0)


def _pre_hook(f: Net) -> None:
    f.fc1.register_forward_pre_hook(lambda m, a: (a[0] * 0.5,))


def _replace(f: Net) -> None:
    f.fc1.weight = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))


def _requires_grad(f: Net) -> None:
    f.fc1.bias.requires_grad_(False)


def _dtype(f: Net) -> None:
    f.float()


def _shape(f: Net) -> None:
    f.fc2.bias.data = torch.zeros(2, dtype=torch.float64)  # same shape: a new tensor behind the same parameter
    f.fc1 = nn.Linear(3, 5).double()  # a new submodule


TRIGGERS = {"train/eval": _train_eval, "forward hook": _hook, "forward pre-hook": _pre_hook,
            "parameter replaced": _replace, "requires_grad flipped": _requires_grad, "dtype": _dtype,
            "module replaced": _shape}


@pytest.mark.parametrize("trigger", list(TRIGGERS))
@pytest.mark.parametrize("name", list(CASES))
def test_every_change_of_the_key_takes_the_full_path_and_stays_exact(name: str, trigger: str) -> None:
    f, x = _model()
    jm.clear_cache()
    _check(name, f, x)
    _check(name, f, x)  # the second call makes the profile (_guard.py)
    _check(name, f, x)  # and the third hits it
    TRIGGERS[trigger](f)
    if trigger == "dtype":
        x = x.float()
        call, oracle = CASES[name]
        got = call(f, x)
        torch.testing.assert_close(got, oracle(f.double(), x.double()).to(got.dtype), rtol=1e-4, atol=1e-5)
        return
    _check(name, f, x)
    _check(name, f, x)  # and its own profile hits


@pytest.mark.parametrize("name", list(CASES))
def test_a_new_batch_size_and_input_dtype_have_profiles_of_their_own(name: str) -> None:
    f, x = _model()
    jm.clear_cache()
    _check(name, f, x)
    _check(name, f, x)  # the first call caches nothing; the second makes the profile (_guard.py)
    assert _profile.count(f) == 1
    _check(name, f, torch.randn(7, 3, dtype=torch.float64))
    assert _profile.count(f) == 2
    _check(name, f, x)
    assert _profile.count(f) == 2


@pytest.mark.parametrize("name", [n for n in CASES if n != "per_sample_grads"])
def test_inference_mode_has_a_profile_of_its_own(name: str) -> None:
    f, x = _model()
    jm.clear_cache()
    _check(name, f, x)
    _check(name, f, x)  # the plain profile (made by the second call: _guard.py)
    with torch.inference_mode():
        got = CASES[name][0](f, x)
    torch.testing.assert_close(got, CASES[name][1](f, x), rtol=1e-9, atol=1e-10)
    _check(name, f, x)


def test_a_hit_under_a_torch_func_transform_is_not_the_plain_profile() -> None:
    f, x = _model()
    jm.clear_cache()
    lap = jm.laplacian(f, x)
    jm.laplacian(f, x)  # the plain profile (made by the second call: _guard.py)
    outer = vmap(lambda xb: jm.laplacian(f, xb.unsqueeze(0))[0])(x)
    torch.testing.assert_close(outer, lap, rtol=1e-9, atol=1e-10)
    gx = grad(lambda x: jm.laplacian(f, x).sum())(x)
    want = grad(lambda x: _laplacian(f, x).sum())(x)
    torch.testing.assert_close(gx, want, rtol=1e-9, atol=1e-10)


def test_create_graph_hits_stay_differentiable() -> None:
    f, x = _model()
    jm.clear_cache()
    for _ in range(4):  # the profile is made by the second call (_guard.py), the third and fourth hit
        u_t, u_xx = jm.partials(f, x, [(0,), (1, 1)], create_graph=True)
        g = torch.autograd.grad((u_t + u_xx).sum(), f.fc1.weight)[0]
        want = torch.autograd.grad(_partials(f, x).sum(), f.fc1.weight)[0]
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-10)


def test_clear_cache_forgets_profiles_and_a_model_is_left_as_found() -> None:
    f, x = _model()
    for _ in range(2):  # the first call caches nothing, the second makes the profiles (_guard.py)
        jm.jacobian(f, x, wrt="params")
        jm.laplacian(f, x)
    assert _profile.count(f) == 2
    flags = [p.requires_grad for p in f.parameters()]
    jm.clear_cache()
    assert _profile.count(f) == 0
    assert [p.requires_grad for p in f.parameters()] == flags and f.training


def test_the_key_ignores_values_and_names_everything_else() -> None:
    f, x = _model()
    mods = list(f.modules())
    k = _profile.key(0, (x,), {}, mods)
    with torch.no_grad():
        f.fc1.weight.add_(1.0)
    assert _profile.key(0, (x + 1,), {}, mods) == k
    assert _profile.key(0, (x.float(),), {}, mods) != k
    assert _profile.key(1, (x,), {}, mods) != k
    handle = f.fc2.register_forward_hook(lambda m, a, o: o)
    assert _profile.key(0, (x,), {}, mods) != k
    handle.remove()
    assert _profile.key(0, (x,), {}, mods) == k
    glob = nn.modules.module.register_module_forward_hook(lambda m, a, o: o)
    try:
        assert _profile.key(0, (x,), {}, mods) != k
    finally:
        glob.remove()
    with torch.no_grad():
        assert _profile.key(0, (x,), {}, mods) != k


@pytest.mark.parametrize("name", ["jacobian inputs", "jacobian params", "laplacian", "per_sample_grads"])
def test_a_hook_added_later_that_couples_the_samples_is_detected(name: str) -> None:
    f, x = _model()
    jm.clear_cache()
    _check(name, f, x)
    _check(name, f, x)  # the profile (made by the second call: _guard.py)
    _check(name, f, x)  # its hit
    f.fc2.register_forward_hook(lambda m, a, out: out - out.mean(0))
    with pytest.raises(jm.CoupledBatchError, match="coupled|mix"):
        CASES[name][0](f, x)


class Scaled(nn.Module):
    """A module whose forward reads a Python scalar attribute (frozen into a captured program)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.scale = 2.0

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x)) * self.scale


SCALE = 2.0


@pytest.mark.parametrize("name", ["jacobian inputs", "laplacian", "partials"])
def test_a_changed_python_value_of_f_is_seen_on_a_hit(name: str) -> None:
    global SCALE
    torch.manual_seed(3)
    m = Scaled().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    net = Net().double().eval()
    f = lambda x: net(x) * SCALE  # noqa: E731 -- reads the global at call time
    jm.clear_cache()
    for _ in range(3):  # the profile (made by the second call: _guard.py) and its hit
        _check(name, m, x)
        torch.testing.assert_close(CASES[name][0](f, x), CASES[name][1](f, x), rtol=1e-9, atol=1e-10)
    m.scale = 3.0
    SCALE = 3.0
    try:
        _check(name, m, x)
        torch.testing.assert_close(CASES[name][0](f, x), CASES[name][1](f, x), rtol=1e-9, atol=1e-10)
    finally:
        SCALE = 2.0


def test_a_dropout_switched_on_later_draws_one_mask_per_sample() -> None:
    torch.manual_seed(4)
    f = nn.Sequential(nn.Linear(3, 64), nn.Dropout(0.0), nn.Tanh(), nn.Linear(64, 2)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    jm.clear_cache()
    for _ in range(3):  # the profile (made by the second call: _guard.py) and its hit
        jm.jacobian(f, x, wrt="params")
    f[1].p = 0.5
    J = jm.jacobian(f, x, wrt="params", chunk_size=1)  # chunks share the sample's mask
    # the rows of each sample's Jacobian for the second Linear's bias are the identity, and its
    # weight rows are one mask times tanh(h): both outputs see the same mask (zeros in the same places)
    w2 = J[:, :, 3 * 64 + 64: 3 * 64 + 64 + 2 * 64].reshape(4, 2, 2, 64)
    torch.testing.assert_close(w2[:, 0, 0], w2[:, 1, 1], rtol=0, atol=0)


def test_at_most_a_bounded_number_of_profiles_per_function() -> None:
    f, _ = _model()
    jm.clear_cache()
    # two operators per batch size: more profiles than PER_FUNCTION from fewer states than the
    # guard's MAX_STATES (a function whose state changes more often stops being cached: _guard.py)
    for b in range(1, _profile.PER_FUNCTION // 2 + 4):
        xb = torch.randn(b, 3, dtype=torch.float64)
        jm.laplacian(f, xb)
        jm.jacobian(f, xb)
    assert _profile.count(f) == _profile.PER_FUNCTION
    x = torch.randn(3, 3, dtype=torch.float64)  # an evicted signature: profiled again, still exact
    torch.testing.assert_close(jm.laplacian(f, x), _laplacian(f, x), rtol=1e-9, atol=1e-10)



def test_the_module_walk_is_modules_order_each_module_once() -> None:
    from jacmode._state import modules_of

    shared = nn.Linear(2, 2)
    m = nn.Sequential(nn.Sequential(shared, nn.Tanh()), shared,
                      nn.ModuleList([nn.ReLU(), nn.Sequential(nn.Linear(2, 2))]), nn.Sequential())
    m.add_module("empty", None)
    assert [id(x) for x in modules_of(m)] == [id(x) for x in m.modules()]
