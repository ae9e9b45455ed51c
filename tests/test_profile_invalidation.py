"""The repeated call's shortcuts keep every answer exact (they cut the fixed cost of a repeated call).

A repeated call walks its modules once for the profile's key and the state guard
(``_profile.walked``), remembers validated options (``_checks.check_options``) and its transform by
the options' values (``_transform.eager_hit``), skips the front for ``jacobian(f, x)``, and makes
the parameter problem's flat copy z only when an engine reads it (``_problem._LazyParams``). Each
test here is one way a shortcut could hand back a stale or wrong answer, checked against a
float64 torch.func oracle (or the error the full path raises); ``test_profile.py`` holds the
others (train/eval, hooks on a module, parameters replaced, requires_grad, dtype, modules
replaced, batch size, inference mode, torch.func transforms, Python values, dropout).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

import jacmode as jm
from jacmode import _checks, _profile
from jacmode._state import modules_of, preserved_state

from test_profile import CASES, Net, _check, _jac_params, _model


def _global_scale(m: nn.Module, args: Any, out: Any) -> Any:
    return out * 2.0 if isinstance(m, nn.Linear) else out


@pytest.mark.parametrize("name", list(CASES))
def test_a_global_module_hook_added_later_changes_the_answer(name: str) -> None:
    """A process-wide forward hook (``register_module_forward_hook``) is in the key: a profile made
    without it would differentiate the model without the scaling it adds."""
    f, x = _model()
    jm.clear_cache()
    _check(name, f, x)
    _check(name, f, x)
    handle = nn.modules.module.register_module_forward_hook(_global_scale)
    try:
        _check(name, f, x)  # the oracle runs with the hook too
        _check(name, f, x)
    finally:
        handle.remove()
    _check(name, f, x)  # and without it again


def test_a_hook_removed_later_gives_the_plain_answer_again() -> None:
    f, x = _model()
    jm.clear_cache()
    handle = f.fc2.register_forward_hook(lambda m, a, out: out * 3.0)
    _check("jacobian params", f, x)
    _check("jacobian params", f, x)
    handle.remove()
    _check("jacobian params", f, x)


def test_backward_hooks_are_in_the_key() -> None:
    f, x = _model()
    mods = modules_of(f)
    k = _profile.key(0, (x,), {}, mods)
    handle = f.fc1.register_full_backward_hook(lambda m, gi, go: None)
    assert _profile.key(0, (x,), {}, mods) != k
    handle.remove()
    handle = f.fc1.register_full_backward_pre_hook(lambda m, go: None)
    assert _profile.key(0, (x,), {}, mods) != k
    handle.remove()
    assert _profile.key(0, (x,), {}, mods) == k


@pytest.mark.parametrize("name", ["jacobian params", "jacobian transform", "per_sample_grads"])
def test_a_parameter_resized_through_data_is_a_new_signature(name: str) -> None:
    """``p.data = ...`` keeps the parameter object (and its version counter) but changes its shape:
    a profile keyed by identity alone would assemble a Jacobian of the old size."""
    f, x = _model()
    jm.clear_cache()
    _check("jacobian params", f, x)
    _check("jacobian params", f, x)
    f.fc1.weight.data = torch.randn(7, 3, dtype=torch.float64)
    f.fc1.bias.data = torch.randn(7, dtype=torch.float64)
    f.fc2.weight.data = torch.randn(2, 7, dtype=torch.float64)
    got = CASES[name][0](f, x)
    torch.testing.assert_close(got, CASES[name][1](f, x), rtol=1e-9, atol=1e-10)
    assert got.shape[-1] == 7 * 3 + 7 + 2 * 7 + 2


class Shifted(nn.Module):
    """Linear-tanh with a buffer added to the output (read by captured programs and the probes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("gain", torch.ones(2))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x)) * self.gain


@pytest.mark.parametrize("name", list(CASES))
def test_a_buffer_replaced_by_a_new_tensor_is_read_on_a_hit(name: str) -> None:
    """A buffer's identity is not in the key (only its name, dtype, shape, device): a new tensor
    assigned to it must still be the one the hit differentiates."""
    torch.manual_seed(1)
    f, x = Shifted().double(), torch.randn(4, 3, dtype=torch.float64)
    jm.clear_cache()
    _check(name, f, x)
    _check(name, f, x)
    f.gain = torch.tensor([3.0, -0.5], dtype=torch.float64)
    _check(name, f, x)
    f.gain = f.gain.float()  # a new dtype: a new signature (the output is promoted as before)
    _check(name, f, x)


def test_a_buffer_changed_in_place_is_read_on_a_hit() -> None:
    torch.manual_seed(1)
    f, x = Shifted().double(), torch.randn(4, 3, dtype=torch.float64)
    jm.clear_cache()
    for name in CASES:
        _check(name, f, x)
    with torch.no_grad():
        f.gain.mul_(4.0)
    for name in CASES:
        _check(name, f, x)


def test_grad_mode_has_a_profile_of_its_own_and_create_graph_hits_stay_differentiable() -> None:
    f, x = _model()
    jm.clear_cache()
    # mode="forward", the route auto took when this was written (auto now takes the probes, whose
    # result under no_grad carries a graph, as torch.autograd.grad(create_graph=True) does there)
    with torch.no_grad():
        J0 = jm.jacobian(f, x, wrt="params", create_graph=True, mode="forward")
        J0 = jm.jacobian(f, x, wrt="params", create_graph=True, mode="forward")
    assert not J0.requires_grad
    for _ in range(2):
        J = jm.jacobian(f, x, wrt="params", create_graph=True, mode="forward")
        assert J.requires_grad
        g = torch.autograd.grad(J.sum(), f.fc1.weight)[0]
        params = {n: p for n, p in f.named_parameters()}

        def total(w: Tensor) -> Tensor:
            ps = {**{n: p.detach() for n, p in params.items()}, "fc1.weight": w}

            def one(q: dict[str, Tensor], xb: Tensor) -> Tensor:
                return functional_call(f, q, (xb.unsqueeze(0),))[0]

            jac = vmap(jacrev(one), in_dims=(None, 0))(ps, x)
            return sum(j.sum() for j in jac.values())

        want = torch.func.grad(total)(f.fc1.weight.detach())
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(J0, J.detach(), rtol=0, atol=0)


def test_remembered_options_still_refuse_bad_types_and_follow_transforms() -> None:
    """``check_options`` remembers Options by value and type: batched=1 equals True as a dict key,
    and must still raise; inside a torch.func transform create_graph is forced on."""
    common = dict(wrt="inputs", mode="auto", structure="auto", chunk_size=None, flatten=True)
    opts = _checks.check_options(batched=True, create_graph=False, **common)
    assert _checks.check_options(batched=True, create_graph=False, **common) is opts
    with pytest.raises(TypeError, match="batched: expected True or False"):
        _checks.check_options(batched=1, create_graph=False, **common)
    with pytest.raises(TypeError, match="create_graph: expected True or False"):
        _checks.check_options(batched=True, create_graph=0, **common)
    inside = vmap(lambda xb: torch.tensor(_checks.check_options(batched=True, create_graph=False,
                                                                **common).create_graph) + xb * 0)(torch.zeros(2))
    assert inside.tolist() == [1.0, 1.0] and not opts.create_graph
    f, x = _model()
    jm.jacobian(f, x, batched=True)
    with pytest.raises(TypeError, match="batched: expected True or False"):
        jm.jacobian(f, x, batched=1)
    with pytest.raises(TypeError, match="chunk_size: expected a positive int"):
        jm.jacobian(f, x, chunk_size=True)


def test_the_eager_transform_is_found_by_value_and_type() -> None:
    """jacobian(f, x) finds its transform by the options' values and types: chunk_size=1.0 (a
    float equal to 1) is not chunk_size=1, and wrt given as a list is found without hashing it."""
    f, x = _model()
    jm.jacobian(f, x, chunk_size=1)
    with pytest.raises(TypeError, match="chunk_size"):
        jm.jacobian(f, x, chunk_size=1.0)
    names = ["fc2.weight", "fc2.bias"]
    for _ in range(2):
        got = jm.jacobian(f, x, wrt=names)
        torch.testing.assert_close(got, _jac_params(f, x)[..., -(2 * 5 + 2):], rtol=1e-9, atol=1e-10)


class Odd(nn.Module):
    """A parameter without a rule of the probe engine (used through a plain multiply): the generic
    engine differentiates it, from the flat copy z of the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.fc(x)) * self.scale)


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_the_flat_parameters_made_on_demand_are_this_calls_values(mode: str) -> None:
    """z is made when an engine first reads it: after an optimizer step it must hold the new values."""
    torch.manual_seed(2)
    f, x = Odd().double(), torch.randn(5, 3, dtype=torch.float64)
    jm.clear_cache()
    for step in range(3):
        for _ in range(2):
            got = jm.jacobian(f, x, wrt="params", mode=mode)
            torch.testing.assert_close(got, _jac_params(f, x), rtol=1e-9, atol=1e-10)
        with torch.no_grad():
            for p in f.parameters():
                p.add_(0.1 * (step + 1))


class Mixed(nn.Module):
    """A float32 layer, then a float64 one: z (the parameters concatenated) would be float64."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)).double())


def test_mixed_parameter_dtypes_give_the_promoted_dtype_without_z() -> None:
    from jacmode._problem import _LazyParams

    torch.manual_seed(2)
    f, x = Mixed(), torch.randn(5, 3)
    p = _LazyParams(kind="params", batched=True, structure="independent", fn=f, z=None, x=x,  # type: ignore[arg-type]
                    batch=5, n_in=26, n_out=2, in_shape=(26,), out_shape=(2,), tensors=list(f.parameters()))
    assert (p.dtype, p.device) == (torch.float64, x.device) and "_z" in p.__dict__ and p.__dict__["_z"] is None
    assert p.z.dtype == torch.float64 and p.z.shape == (26,)
    torch.testing.assert_close(p.z, torch.cat([t.detach().reshape(-1) for t in f.parameters()]), rtol=0, atol=0)


class Flipping(nn.Module):
    """A forward that changes its own model: training flags, requires_grad, a parameter's .grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        self.fc.training = not self.fc.training
        self.fc.bias.requires_grad_(False)
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("name", ["jacobian params", "jacobian inputs", "per_sample_grads", "laplacian"])
def test_a_hit_leaves_the_model_as_found(name: str) -> None:
    """The guard of a repeated call records from the key's walk (``Survey``): what it restores must
    be the state of this call, also after the model changed between calls and when a call raises."""
    torch.manual_seed(3)
    f, x = Flipping().double(), torch.randn(4, 3, dtype=torch.float64)
    call = CASES[name][0]
    for step in range(3):
        f.fc.bias.requires_grad_(True)
        f.fc.weight.grad = torch.full_like(f.fc.weight, float(step))
        grad, flags = f.fc.weight.grad, [m.training for m in f.modules()]
        try:
            call(f, x)
        except Exception:  # noqa: BLE001 -- a raising call must leave the model as found too
            pass
        assert f.fc.weight.grad is grad and f.fc.bias.requires_grad
        assert [m.training for m in f.modules()] == flags
        f.eval() if step == 0 else f.train()


def test_a_guard_entered_with_a_survey_restores_grad_mode() -> None:
    f, _ = _model()
    mods = modules_of(f)
    for mode in (False, True):
        with torch.set_grad_enabled(not mode):
            key, survey = _profile.walked(0, (torch.zeros(1, 3),), {}, mods)
            with preserved_state(f, mods, survey, grad=mode):
                assert torch.is_grad_enabled() is mode
                f.fc1.weight.requires_grad_(False)
            assert torch.is_grad_enabled() is (not mode)
            assert f.fc1.weight.requires_grad
    with pytest.raises(RuntimeError, match="boom"):
        with preserved_state(f, mods, None, grad=False):
            raise RuntimeError("boom")
    assert torch.is_grad_enabled()


def test_a_parameter_on_another_device_is_named_on_a_first_call() -> None:
    shared = nn.Linear(3, 3)
    f = nn.Sequential(nn.Sequential(nn.Tanh(), shared), shared, nn.Linear(3, 2))
    with torch.device("meta"):
        f[2] = nn.Linear(3, 2)
    jm.clear_cache()
    torch.testing.assert_close(_checks._first_parameter(f), f[0][1].weight, rtol=0, atol=0)
    g = nn.Sequential(nn.Tanh(), f[2], shared)
    with pytest.raises(ValueError, match="x: is on cpu but parameter '1.weight' of the model is on meta"):
        jm.jacobian(g, torch.randn(2, 3))


@pytest.mark.parametrize("wrt", ["inputs", "params"])
def test_the_eager_call_and_its_transform_share_one_profile(wrt: str) -> None:
    """The eager call passes every option, jm.transform only those given: with the defaults filled
    in they name the same profile (one first call, not two), and give the same bits."""
    f, x = _model()
    jm.clear_cache()
    first = jm.jacobian(f, x, wrt=wrt)
    assert torch.equal(jm.transform(jm.jacobian, f, wrt=wrt)(x), first)
    assert torch.equal(jm.jacfn(f, wrt=wrt, mode="auto")(x), first)
    assert _profile.count(f) == 1
    jm.jacobian(f, x, wrt=wrt, mode="reverse")  # other options: a profile of their own
    assert _profile.count(f) == 2
