"""A repeated call tests its last hit's key in place (``_profile.recheck``) instead of walking.

The direct paths of ``jacobian`` (``_jacobian._direct``) and of the derivative operators
(``_operands.direct_call``) remember the profile that served the last call of a function and token
(``_profile.remember``), and so does ``per_sample_grads`` (whose guard then reads the
modules' flags, slots and parameters from the check, ``_profile.survey``); the next call runs the profile's generated check of its key
(``Profile.check``) and, where it holds, that profile's code, without building the key. Each test
warms that path (and checks it is taken), changes one thing, checks that the key's test sees the
change where the key holds it (and lets the call through where it does not), and compares the
answer with a float64 torch.func oracle.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, jacrev, vmap
from torch.nn.modules import module as _module

import jacmode as jm
from jacmode import _guard, _profile
from jacmode._operands import ReadyRun
from jacmode._products import _PSG_TOKEN

DIMS = [(0,), (1, 1)]


class Net(nn.Module):
    """Linear layers, torch.tanh, a dropout layer (p = 0: exact in train mode too), a buffer and a
    Python scale read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 8)
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("s", torch.full((1,), 1.5))
        self.scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x)))) * self.s * self.scale


def _model() -> tuple[Net, Tensor]:
    torch.manual_seed(0)
    return Net().double(), torch.randn(5, 2, dtype=torch.float64)


OPS: dict[str, Callable[[Any, Tensor], Any]] = {
    "jacobian params": lambda f, x: jm.jacobian(f, x, wrt="params"),
    "jacobian inputs": lambda f, x: jm.jacobian(f, x),
    "partials": lambda f, x: jm.partials(f, x, DIMS),
    "laplacian": lambda f, x: jm.laplacian(f, x),
    "jacobian params transform": lambda f, x: jm.transform(jm.jacobian, f, wrt="params")(x),
    "per_sample_grads": lambda f, x: jm.per_sample_grads(f, x, _loss, y=_target(x)),
    "per_sample_grads transform": lambda f, x: jm.transform(jm.per_sample_grads, f, loss=_loss)(x, _target(x)),
    "laplacian transform": lambda f, x: jm.transform(jm.laplacian, f)(x),
}


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return ((out - y) ** 2).sum(1)


def _target(x: Tensor) -> Tensor:
    return torch.linspace(-1, 1, 3 * x.shape[0], dtype=x.dtype).reshape(x.shape[0], 3)


def _single(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda xi: f(xi[None])[0]


def _oracle(op: str, f: nn.Module, x: Tensor) -> Any:
    if op == "per_sample_grads":
        params = {n: p.detach() for n, p in f.named_parameters() if p.requires_grad}

        def term(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            return _loss(functional_call(f, p, (xi[None],)), yi[None])[0]

        g = vmap(grad(term), in_dims=(None, 0, 0))(params, x, _target(x))
        return torch.cat([g[n].reshape(x.shape[0], -1) for n in params], 1)
    if op == "jacobian params":
        names = [n for n, p in f.named_parameters() if p.requires_grad]
        params = {n: p.detach() for n, p in f.named_parameters() if p.requires_grad}

        def out(p: dict[str, Tensor], xi: Tensor) -> Tensor:
            return functional_call(f, p, (xi[None],))[0].reshape(-1)

        jac = vmap(jacrev(out), in_dims=(None, 0))(params, x)
        return torch.cat([jac[n].reshape(x.shape[0], -1, params[n].numel()) for n in names], -1)
    jac = vmap(jacrev(_single(f)))(x)  # (B, Y, D)
    if op == "jacobian inputs":
        return jac
    hess = vmap(jacfwd(jacrev(_single(f))))(x)  # (B, Y, D, D)
    if op == "laplacian":
        return hess.diagonal(dim1=-2, dim2=-1).sum(-1)
    return jac[..., 0], hess[..., 1, 1]


def _check(name: str, f: nn.Module, x: Tensor) -> None:
    got = OPS[name](f, x)
    with torch.enable_grad():
        want = _oracle(name.replace(" transform", ""), f, x)
    tol = dict(rtol=1e-4, atol=1e-5) if x.dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **tol)  # type: ignore[arg-type]
    else:
        torch.testing.assert_close(got, want, **tol)  # type: ignore[arg-type]


def _rechecks(f: Any, x: Tensor) -> list[Any]:
    """The profiles :func:`_profile.recheck` finds for f at x, per token remembered."""
    psg = (x, _target(x), _loss.__code__, ("params", None, None, True, str, type(None), type(None), bool))
    # in the scope of a call f(x), as an entry point enters it (the generation of f's state: _guard.py)
    return _guard.scoped_call(f, (x,), {}, lambda: [_profile.recheck(f, token, *(psg if token == _PSG_TOKEN else (x,)))
                                                    for token in _profile._LAST.get(f, {})])


def _warm(name: str, f: nn.Module, x: Tensor) -> None:
    for _ in range(6):
        _check(name, f, x)
    assert _profile._LAST.get(f), "the repeated call remembered no profile"
    assert all(p is not None for p in _rechecks(f, x)), "the last hit's key does not test true"


def _set(m: nn.Module, name: str, value: Any) -> None:
    setattr(m, name, value)


# (what is changed, whether the key holds it, the change: (f, x) -> the new x)
CHANGES: list[tuple[str, bool, Callable[[Net, Tensor], Tensor]]] = [
    ("forward hook", True, lambda f, x: (f.fc2.register_forward_hook(lambda m, i, o: o * 2), x)[1]),
    ("pre-hook on the root", True, lambda f, x: (f.register_forward_pre_hook(lambda m, i: (i[0] * 0.5,)), x)[1]),
    ("eval", True, lambda f, x: (f.eval(), x)[1]),
    ("dropout probability", True, lambda f, x: (f.drop.eval(), _set(f.drop, "p", 0.3), x)[2]),
    ("parameter replaced", True, lambda f, x: (_set(f.fc1, "weight", nn.Parameter(torch.randn(8, 2).double())), x)[1]),
    ("requires_grad off", True, lambda f, x: (f.fc1.bias.requires_grad_(False), x)[1]),
    ("child replaced", True, lambda f, x: (_set(f, "fc2", nn.Linear(8, 3).double()), x)[1]),
    ("buffer registered", True, lambda f, x: (f.fc1.register_buffer("extra", torch.zeros(1)), x)[1]),
    ("new dtype", True, lambda f, x: (f.float(), x.float())[1]),
    ("new batch size", True, lambda f, x: torch.randn(7, 2, dtype=torch.float64)),
    ("x requires grad", True, lambda f, x: x.clone().requires_grad_()),
    ("parameter in place", False, lambda f, x: (torch.no_grad()(lambda: f.fc1.weight.mul_(2))(), x)[1]),
    (".data replaced", False, lambda f, x: (_set(f.fc2.weight, "data", torch.randn(3, 8).double()), x)[1]),
    ("buffer replaced", False, lambda f, x: (_set(f, "s", torch.full((1,), -0.5).double()), x)[1]),
    ("python scale", False, lambda f, x: (_set(f, "scale", 3.0), x)[1]),
]


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_is_seen(name: str, change: tuple[str, bool, Callable[[Net, Tensor], Tensor]]) -> None:
    f, x = _model()
    _warm(name, f, x)
    what, keyed, apply = change
    x = apply(f, x)
    if keyed:
        assert all(p is None for p in _rechecks(f, x)), f"{what}: the key's test did not see it"
    for _ in range(5):  # the changed call, and its own repeated calls
        _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
def test_a_global_hook_is_seen(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    handle = _module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert all(p is None for p in _rechecks(f, x))
        _check(name, f, x)
    finally:
        handle.remove()
    _check(name, f, x)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "clear_cache"])
def test_modes_and_a_cleared_cache_are_seen(name: str, mode: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    if mode == "clear_cache":
        jm.clear_cache()
        assert all(p is None for p in _rechecks(f, x))
        for _ in range(5):
            _check(name, f, x)
        return
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        assert all(p is None for p in _rechecks(f, x))
        got = OPS[name](f, x)
    with torch.enable_grad():
        want = _oracle(name.replace(" transform", ""), f, x)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g.clone(), w, rtol=1e-9, atol=1e-10)


def test_a_forgotten_profile_is_not_rechecked() -> None:
    f, x = _model()
    _warm("laplacian", f, x)
    [(token, found)] = _profile._LAST[f].items()
    [key] = [k for k, p in _profile._PROFILES[f].items() if p is found]
    # key[0] is the generation of f's state under which it was kept: forget it in that state's scope
    _guard.scoped_call(f, (x,), {}, lambda: _profile.forget(f, key[1:]))
    assert not found.live and _guard.scoped_call(f, (x,), {}, lambda: _profile.recheck(f, token, x)) is None
    _check("laplacian", f, x)


def test_no_check_for_a_plain_function() -> None:
    f, x = _model()
    g = lambda z: f(z)  # noqa: E731 -- a function over a module: its modules are found by reference
    for _ in range(6):
        torch.testing.assert_close(jm.laplacian(g, x), _oracle("laplacian", f, x), rtol=1e-9, atol=1e-10)
    assert all(p.check in (None, False) for p in _profile._PROFILES.get(g, {}).values())


class Counting(Net):
    """Net with a buffer its forward updates in place (what the guard puts back)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        self.calls.add_(1)
        return super().forward(x)


def _loop(f: nn.Module, x: Tensor) -> Tensor:
    """Per-sample gradients by an autograd loop (the oracle where torch.func refuses f's in-place update)."""
    params = [p for p in f.parameters() if p.requires_grad]
    y = _target(x)
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(_loss(f(x[b:b + 1]), y[b:b + 1]).sum(), params)])
            for b in range(x.shape[0])]
    return torch.stack(rows)


def test_a_rechecked_per_sample_grads_leaves_the_model_as_found(monkeypatch: pytest.MonkeyPatch) -> None:
    surveys = []
    survey = _profile.survey
    monkeypatch.setattr(_profile, "survey", lambda found, f: surveys.append(found) or survey(found, f))
    torch.manual_seed(0)
    f, x = Counting().double(), torch.randn(5, 2, dtype=torch.float64)
    for _ in range(4):
        jm.per_sample_grads(f, x, _loss, y=_target(x))
    assert _profile._LAST.get(f), "the repeated call remembered no profile"
    grads = {n: torch.full_like(p, 0.25) for n, p in f.named_parameters()}
    for n, p in f.named_parameters():
        p.grad = grads[n]
    f.calls.zero_()
    buffer, params = f.calls, dict(f.named_parameters())
    want = _loop(f, x)
    f.calls.zero_()
    for _ in range(3):
        got = jm.per_sample_grads(f, x, _loss, y=_target(x))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
        assert f.calls is buffer and f.calls.item() == 0 and f.training
        assert all(p is params[n] and p.grad is grads[n] and p.requires_grad for n, p in f.named_parameters())
    assert len(surveys) >= 3  # the calls took the last hit's key, tested in place


class Rooted(Net):
    """Net with a parameter and a buffer of the root module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.tensor([0.1, -0.2, 0.3]))
        self.register_buffer("gain", torch.full((1,), 2.0))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * self.gain + self.shift


@pytest.mark.parametrize("name", list(OPS))
def test_a_remembered_profile_keeps_no_model_alive(name: str) -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    f, x = Rooted().double(), torch.randn(5, 2, dtype=torch.float64)
    for _ in range(6):
        _check(name, f, x)
    # the probe code covers no parameter of the root itself: jacobian(wrt="params") takes the guarded path
    assert bool(_profile._LAST.get(f)) is not name.startswith("jacobian params")
    f.shift.requires_grad_(False)  # a change the root's own slots must show
    assert all(p is None for p in _rechecks(f, x))
    for _ in range(4):
        _check(name, f, x)
    gone = weakref.ref(f)
    del f
    gc.collect()
    assert gone() is None, "a profile or its check keeps the model alive"


def test_a_repeated_call_sees_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from jacmode._planning import memory

    f, x = _model()
    _warm("jacobian params", f, x)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1_000)  # the (B, Y, P) result no longer fits
    with pytest.raises(MemoryError, match="result"):
        jm.jacobian(f, x, wrt="params")
    monkeypatch.undo()
    _check("jacobian params", f, x)


class Alike(nn.Linear):
    """A layer that calls every other of its kind equal: the check compares modules by identity."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Alike)

    __hash__ = nn.Linear.__hash__


@pytest.mark.parametrize("name", ["laplacian", "jacobian params"])
def test_a_child_replaced_by_an_equal_one_is_seen(name: str) -> None:
    f, x = _model()
    f.fc2 = Alike(8, 3).double()
    _warm(name, f, x)
    f.fc2 = Alike(8, 3).double()
    assert all(p is None for p in _rechecks(f, x))
    _check(name, f, x)


@pytest.mark.parametrize("name", ["laplacian", "jacobian params", "per_sample_grads"])
def test_an_input_on_another_device_is_seen(name: str) -> None:
    f, x = _model()
    _warm(name, f, x)
    assert all(p is None for p in _rechecks(f, torch.empty(5, 2, dtype=torch.float64, device="meta")))
    _check(name, f, x)


@pytest.mark.parametrize("name", ["laplacian", "partials"])
def test_a_rechecked_profile_without_ready_code(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile the check found has no code ready (dropped): the call goes on with the check's key
    and f's modules (no walk), answers exactly, and keeps the code again."""
    f, x = _model()
    _warm(name, f, x)
    [found] = [p for p in _rechecks(f, x) if p is not None]
    ready = {k: v for k, v in found.runs.items() if isinstance(v, ReadyRun)}
    assert ready
    for k in ready:
        del found.runs[k]
    walks = []
    walked = _profile.walked
    monkeypatch.setattr(_profile, "walked", lambda *a, **k: walks.append(1) or walked(*a, **k))
    _check(name, f, x)
    assert not walks  # the check's key served
    monkeypatch.undo()
    for _ in range(3):
        _check(name, f, x)
    assert any(isinstance(v, ReadyRun) for v in found.runs.values())
