"""The shortcuts of a repeated input-Jacobian call (a profile hit): z shared with x where the engine
never runs f, the attention flags left alone where no attention runs, no state guard around Taylor
mode over a pure program, against float64 references."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import jacmode as jm
from jacmode import _profile, _state
from jacmode._checks import check_options
from jacmode._jacobian import JacobianEntry, _attention
from jacmode._problem import again, own_input
from conftest import ref_input_jacobian


def _facts_profile(f: nn.Module) -> _profile.Profile[JacobianEntry]:
    [prof] = _profile._PROFILES.get(f, {}).values()
    return prof


def _facts(f: nn.Module) -> JacobianEntry:
    return _facts_profile(f).facts


class InPlaceFirst(nn.Module):
    """relu(inplace=True) right on the input: the captured program's rule computes it out of place."""

    def __init__(self) -> None:
        super().__init__()
        self.act, self.fc = nn.ReLU(inplace=True), nn.Linear(70, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(x))


def test_repeated_calls_leave_x_alone() -> None:
    torch.manual_seed(0)
    for f in (nn.Sequential(nn.Linear(70, 9), nn.Tanh(), nn.Linear(9, 4)).double(), InPlaceFirst().double()):
        x = torch.randn(3, 70, dtype=torch.float64)
        kept = x.clone()
        ref = copy.deepcopy(f)
        if isinstance(ref, InPlaceFirst):
            ref.act.inplace = False  # the reference's autograd refuses a leaf modified in place
        want = ref_input_jacobian(ref, x.clone())
        for _ in range(5):  # the first call caches nothing, the second profiles (_guard.py), three hits
            torch.testing.assert_close(jm.jacobian(f, x, mode="forward"), want)
            assert torch.equal(x, kept)


def test_a_shared_problem_copies_x_before_f_runs() -> None:
    f = nn.Sequential(nn.Linear(70, 9), nn.Tanh(), nn.Linear(9, 4))
    x = torch.randn(3, 70)
    jm.jacobian(f, x, mode="forward")  # the first call caches nothing (_guard.py)
    jm.jacobian(f, x, mode="forward")  # the second makes the profile
    problem = _facts(f).problem
    opts = check_options(wrt="inputs", mode="forward", batched=True, structure="auto", chunk_size=None,
                         create_graph=False, flatten=True)
    p = again(problem, f, x, opts, shared=True)
    assert p.z.data_ptr() == x.data_ptr()
    own_input(p)
    assert p.z.data_ptr() != x.data_ptr() and torch.equal(p.z, x)
    own_input(p)  # once only
    q = again(problem, f, x, opts)
    assert q.z.data_ptr() != x.data_ptr()


def test_attention_flags_are_kept_where_attention_may_run() -> None:
    f = nn.Sequential(nn.Linear(70, 9), nn.Tanh(), nn.Linear(9, 4))
    x = torch.randn(3, 70)
    for _ in range(2):  # the profile is made by the second call (_guard.py)
        jm.jacobian(f, x, mode="forward")
    assert _attention(_facts(f)) is False  # Taylor mode over a program of linear layers and tanh
    g = nn.Sequential(nn.Linear(3, 9), nn.Tanh(), nn.Linear(9, 4))
    x = torch.randn(3, 3)
    for _ in range(2):
        jm.jacobian(g, x, mode="reverse")
    assert _attention(_facts(g)) is True  # another engine: the flags are set as on every call


def test_attention_model_repeated_matches_reference() -> None:
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    want = ref_input_jacobian(layer, x)
    fast = torch.backends.mha.get_fastpath_enabled()
    for _ in range(4):  # profiled by the second call (_guard.py), hits from the third
        torch.testing.assert_close(jm.jacobian(layer, x), want)
        assert torch.backends.mha.get_fastpath_enabled() == fast
    assert _state._KERNELS["users"] == 0


def test_guard_given_a_survey_restores_the_model() -> None:
    """preserved_state with the key's survey (no ModelView) still puts flags back; a .grad written
    meanwhile (another thread's backward: jacmode writes none) stays."""
    f = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    modules = _state.modules_of(f)
    grad = torch.ones_like(f[0].weight)
    f[0].weight.grad = grad
    _, survey = _profile.walked(0, (torch.randn(2, 3),), {}, modules)  # taken right before the guard
    with _state.preserved_state(f, modules, survey, grad=False, kernels=False) as view:
        assert view is None and not torch.is_grad_enabled()
        f.eval()
        f[2].weight.requires_grad_(False)
        f[0].weight.grad = None
    assert f.training and f[1].training and f[2].weight.requires_grad and f[0].weight.grad is None


# ---- a repeated call of Taylor mode over a pure program runs without the guard (_columns_rerun) ----


def _mlp(d: int = 70) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(d, 9), nn.Tanh(), nn.Linear(9, 4)).double()


def test_pure_program_hits_are_guard_free_and_exact() -> None:
    from jacmode._jacobian import _pure

    f = _mlp()
    x = torch.randn(3, 70, dtype=torch.float64)
    for _ in range(4):  # profiled by the second call (_guard.py), hits from the third
        torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))
    assert _pure(_facts(f)) is True
    t = jm.transform(jm.jacobian, f)
    t(x)
    t(x)
    assert t.__dict__.get("_direct") is True  # the last call took the guard-free path


def test_a_change_after_guard_free_hits_gives_the_new_answer() -> None:
    f = _mlp()
    x = torch.randn(3, 70, dtype=torch.float64)
    for _ in range(4):  # profiled by the second call (_guard.py), hits from the third
        jm.jacobian(f, x)
    with torch.no_grad():
        f[0].weight.mul_(-2.0)  # in place: the same key, the program reads the new values
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))
    f[2].weight = nn.Parameter(torch.randn(4, 9, dtype=torch.float64))  # reassigned: a new key
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))
    f[1] = nn.Sigmoid()  # another layer
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))
    handle = f[1].register_forward_hook(lambda m, a, out: out * 3.0)
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))
    handle.remove()
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))


def test_guard_free_hits_keep_grad_mode_and_the_model() -> None:
    f = _mlp()
    x = torch.randn(3, 70, dtype=torch.float64, requires_grad=True)
    for _ in range(4):  # profiled by the second call (_guard.py), hits from the third
        jm.jacobian(f, x)
    grads = [p.grad for p in f.parameters()]
    for mode in (True, False):
        with torch.set_grad_enabled(mode):
            got = jm.jacobian(f, x)
            assert torch.is_grad_enabled() is mode
        assert not got.requires_grad  # create_graph=False
    assert [p.grad for p in f.parameters()] == grads and f.training
    assert x.grad is None


@pytest.mark.parametrize("code", ["interpreted", "generated"])
def test_a_rule_failing_on_a_guard_free_hit_falls_back_exactly(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Interpreted: the engine's Taylor mode raises; generated: the code the profile keeps ready
    (from the call that generates it) raises. Either way the guarded path answers exactly."""
    import jacmode._structure as structure
    from jacmode._capture import codegen
    from jacmode._rules.base import Unsupported

    f = _mlp()
    x = torch.randn(3, 70, dtype=torch.float64)
    for _ in range(5):  # profiled by the second call (_guard.py), hits from the third, code ready from the fourth
        jm.jacobian(f, x)
    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise Unsupported("a rule's assumption broke")

    if code == "interpreted":
        monkeypatch.setattr(codegen, "ENABLED", False)
        monkeypatch.setattr(structure, "layerwise_columns", broken)
    else:
        assert isinstance(_facts_profile(f).runs.get("columns_code"), codegen.Ready)
        monkeypatch.setattr(codegen.Ready, "__call__", broken)
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))  # the generic engine, guarded
    assert calls and f.training
    monkeypatch.undo()
    torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))


def test_a_module_called_plainly_is_not_pure() -> None:
    from jacmode._jacobian import _pure

    class Offset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(70, 4).double()
            self.shift = nn.Linear(1, 4).double()
            self.register_buffer("one", torch.ones(1, 1, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + self.shift(self.one)  # a module's own forward on a constant

    f = Offset()
    x = torch.randn(3, 70, dtype=torch.float64)
    for _ in range(4):  # profiled by the second call (_guard.py), hits from the third
        torch.testing.assert_close(jm.jacobian(f, x), ref_input_jacobian(f, x))
    found = _facts(f)
    assert found.problem.program is not None and _pure(found) is False  # the guarded path, every call
