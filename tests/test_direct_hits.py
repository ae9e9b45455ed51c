"""A repeated call of laplacian / partials runs the generated code its profile holds ready.

``_operands.direct_call`` and ``evaluate(..., direct=)`` keep, in the profile of a captured
program, the generated code that the call's body ran as its one engine call
(``Profile.runs``, ``_capture/codegen.Ready``); the next call with the same key runs it before
any other work, trusting the profile's key for what it holds and re-checking the rest (the
program's freshness, the tensors it reads, their strides, the leaf modules' settings, x's
strides). Each test warms that path (and checks that it is taken), changes one thing, and
compares the answer with a float64 torch.func oracle.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import jacfwd, jacrev, vmap

import jacmode as jm
from jacmode import _profile
from jacmode._capture import codegen
from jacmode._operands import ReadyRun
from jacmode._state import modules_of

DIMS = [(0,), (1, 1)]


class Pinn(nn.Module):
    """Linear layers, torch.tanh in forward, a leaf Softplus with a setting, a Python scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 8)
        self.act = nn.Softplus(beta=2.0)
        self.fc2 = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.fc2(self.act(self.fc1(x))))) * self.scale


def _model() -> tuple[Pinn, Tensor]:
    torch.manual_seed(0)
    return Pinn().double(), torch.randn(5, 2, dtype=torch.float64)


def _single(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda xi: f(xi[None])[0]


def _oracle(op: str, f: Any, x: Tensor) -> Any:
    hess = vmap(jacfwd(jacrev(_single(f))))(x)  # (B, Y, D, D)
    if op == "laplacian":
        return hess.diagonal(dim1=-2, dim2=-1).sum(-1)
    jac = vmap(jacrev(_single(f)))(x)  # (B, Y, D)
    return jac[..., 0], hess[..., 1, 1]


OPS: dict[str, Callable[[Any, Tensor], Any]] = {
    "laplacian": lambda f, x: jm.laplacian(f, x),
    "partials": lambda f, x: jm.partials(f, x, DIMS),
    "laplacian transform": lambda f, x: jm.transform(jm.laplacian, f)(x),
    "partials transform": lambda f, x: jm.transform(jm.partials, f, dims=DIMS)(x),
}


def _ready(f: Any) -> bool:
    """Some profile of f holds generated code ready for a direct hit."""
    return any(isinstance(r, ReadyRun) for p in _profile._PROFILES.get(f, {}).values() for r in p.runs.values())


def _check(name: str, f: Any, x: Tensor, **kw: Any) -> None:
    got = OPS[name](f, x, **kw)
    want = _oracle(name.split()[0], f, x)
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    else:
        torch.testing.assert_close(got, want)


def _warm(name: str, f: Any, x: Tensor) -> None:
    for _ in range(codegen.AFTER_CALLS + 2):
        _check(name, f, x)
    assert _ready(f), "the direct path was not taken"


@pytest.fixture(autouse=True)
def _fresh_caches() -> Any:
    jm.clear_cache()
    yield
    jm.clear_cache()


@pytest.mark.parametrize("name", list(OPS))
def test_a_direct_hit_is_exact_and_follows_in_place_updates(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    with torch.no_grad():
        for p in f.parameters():
            p.mul_(1.5).add_(0.1)
    _check(name, f, x)
    _check(name, f, x)
    assert _ready(f)


@pytest.mark.parametrize("name", list(OPS))
def test_a_parameter_reassigned_is_read(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    f.fc2.weight = nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    for _ in range(3):
        _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
def test_a_parameter_with_other_strides_through_data_is_exact(name: str) -> None:
    """``p.data = t`` keeps the object and the shape, so the profile's key is the same: the code's
    strides are checked again (the vouched tensors compare identity and strides)."""
    f, x = _model()
    _warm(name, f, x)
    w = f.fc2.weight
    f.fc2.weight.data = torch.randn(8, 8, dtype=torch.float64).t()  # same shape, transposed strides
    assert f.fc2.weight is w and not w.is_contiguous()
    for _ in range(3):
        _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
def test_a_leaf_modules_setting_is_read(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    f.act.beta = 3.0
    for _ in range(3):
        _check(name, f, x)
    f.act.beta = 2.0
    _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
def test_a_python_value_of_the_model_is_read(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    f.scale = 3.0
    for _ in range(3):
        _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
def test_a_hook_added_and_a_mode_flipped_are_read(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    handle = f.fc2.register_forward_hook(lambda m, a, out: out * 2.0)
    try:
        for _ in range(2):
            _check(name, f, x)
    finally:
        handle.remove()
    f.eval()
    _check(name, f, x)
    f.train()
    _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
def test_x_with_other_strides_and_other_dtypes(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    wide = torch.randn(2, 5, dtype=torch.float64).t()  # (5, 2), not contiguous
    assert wide.shape == x.shape and not wide.is_contiguous()
    for _ in range(2):
        _check(name, f, wide)
    g = f.float()
    for _ in range(2):
        got, want = OPS[name](g, x.float()), _oracle(name.split()[0], g, x.float())
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["laplacian", "partials"])
def test_create_graph_on_a_direct_hit_is_differentiable(op: str) -> None:
    f, x = _model()
    run = (lambda: jm.laplacian(f, x, create_graph=True)) if op == "laplacian" else (
        lambda: jm.partials(f, x, DIMS, create_graph=True)[1])
    for _ in range(codegen.AFTER_CALLS + 2):
        run()
    assert _ready(f)
    loss = run().pow(2).sum()
    grads = torch.autograd.grad(loss, list(f.parameters()), allow_unused=True, materialize_grads=True)
    want_out = _oracle(op, f, x)
    want = (want_out if op == "laplacian" else want_out[1]).pow(2).sum()
    want_grads = torch.autograd.grad(want, list(f.parameters()), allow_unused=True, materialize_grads=True)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w)
    with torch.no_grad():  # create_graph under no_grad (another key): as the full path gives it
        results = [run() for _ in range(codegen.AFTER_CALLS + 3)]
    assert len({r.requires_grad for r in results}) == 1
    for r in results:
        torch.testing.assert_close(r, results[0])


def test_chunks_and_a_transform_around_the_call() -> None:
    f, x = _model()
    _warm("laplacian", f, x)
    torch.testing.assert_close(jm.partials(f, x, DIMS, chunk_size=2)[1], _oracle("partials", f, x)[1])
    torch.testing.assert_close(jm.laplacian(f, x, chunk_size=1), _oracle("laplacian", f, x))
    # inside torch.func: the gradient of the summed Laplacian in x, against nested torch.func
    got = torch.func.grad(lambda z: jm.laplacian(f, z).sum())(x)
    want = torch.func.grad(lambda z: _oracle("laplacian", f, z).sum())(x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["laplacian", "partials"])
def test_devices_are_checked_where_no_profile_is_found(name: str) -> None:
    """``validated(..., devices=False)``: evaluate checks the devices where no profile is found."""
    f, x = _model()
    _warm(name, f, x)
    f.to("meta")
    with pytest.raises(ValueError, match="x: is on cpu but parameter 'fc1.weight' of the model is on meta"):
        OPS[name](f, x)


def test_a_key_without_the_survey_is_the_same_key() -> None:
    f, x = _model()
    mods = modules_of(f)
    with_survey = _profile.walked(-1, (x,), {}, mods)
    without = _profile.walked(-1, (x,), {}, mods, guard=False)
    assert with_survey[0] == without[0] and without[1] is None and with_survey[1] is not None
    f.fc1.bias = None
    assert _profile.walked(-1, (x,), {}, mods)[0] == _profile.walked(-1, (x,), {}, mods, guard=False)[0]


def test_modules_of_is_f_modules_for_shared_and_nested_modules() -> None:
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.Tanh(), nn.Sequential(nn.Linear(2, 2), shared))
    net = nn.Sequential(inner, shared, nn.ModuleList([nn.Sequential(inner), nn.Identity()]))
    assert modules_of(net) == list(net.modules())
    deep: nn.Module = nn.Linear(1, 1)
    for _ in range(1200):  # deeper than the recursion limit: the stack walk, the same order
        deep = nn.Sequential(deep)
    found = modules_of(deep)
    assert len(found) == 1201 and found[0] is deep and isinstance(found[-1], nn.Linear)


_G = {"w": torch.randn(2, 6, dtype=torch.float64)}


@pytest.mark.parametrize("name", list(OPS))
def test_a_closure_tensor_rebound_or_updated_is_read(name: str) -> None:
    """A plain function over closure tensors (read by the program's reading steps, not vouched
    for by any module): rebinding, an in-place update and a new shape are followed."""
    torch.manual_seed(1)
    w1 = torch.randn(2, 6, dtype=torch.float64)
    w2 = torch.randn(6, 1, dtype=torch.float64)

    def f(x: Tensor) -> Tensor:
        return torch.tanh(torch.tanh(x @ w1) @ w2)

    x = torch.randn(4, 2, dtype=torch.float64)
    _warm(name, f, x)
    w1 = w1 * 0.5 + 0.1  # rebound: a new tensor in the cell
    for _ in range(2):
        _check(name, f, x)
    with torch.no_grad():
        w2.mul_(2.0)
    _check(name, f, x)
    w1 = torch.randn(2, 3, dtype=torch.float64)  # another shape: captured again
    w2 = torch.randn(3, 1, dtype=torch.float64)
    for _ in range(2):
        _check(name, f, x)


def _global_f(x: Tensor) -> Tensor:
    return torch.sin(x @ _G["w"]).sum(1, keepdim=True)


@pytest.mark.parametrize("name", list(OPS))
def test_a_global_tensor_replaced_is_read(name: str) -> None:
    x = torch.randn(4, 2, dtype=torch.float64)
    _warm(name, _global_f, x)
    old = _G["w"]
    try:
        _G["w"] = torch.randn(2, 6, dtype=torch.float64)
        for _ in range(2):
            _check(name, _global_f, x)
    finally:
        _G["w"] = old


@pytest.mark.parametrize("name", list(OPS))
def test_a_bias_removed_later_is_read(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    f.fc2.bias = None
    for _ in range(3):
        _check(name, f, x)
