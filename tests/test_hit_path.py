"""The shortcuts of a repeated input-Jacobian call (a profile hit): z shared with x where the engine
never runs f, the attention flags left alone where no attention runs, against float64 references."""

from __future__ import annotations

import copy

import torch
from torch import nn

import jacmode as jm
from jacmode import _profile, _state
from jacmode._checks import check_options
from jacmode._jacobian import _attention
from jacmode._problem import again, own_input
from conftest import ref_input_jacobian


def _facts(f: nn.Module) -> tuple:
    [prof] = _profile._PROFILES._data.get(f, {}).values()
    return prof.facts


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
        for _ in range(4):
            torch.testing.assert_close(jm.jacobian(f, x, mode="forward"), want)
            assert torch.equal(x, kept)


def test_a_shared_problem_copies_x_before_f_runs() -> None:
    f = nn.Sequential(nn.Linear(70, 9), nn.Tanh(), nn.Linear(9, 4))
    x = torch.randn(3, 70)
    jm.jacobian(f, x, mode="forward")
    problem, _ = _facts(f)
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
    jm.jacobian(f, torch.randn(3, 70), mode="forward")
    assert _attention(_facts(f)) is False  # Taylor mode over a program of linear layers and tanh
    g = nn.Sequential(nn.Linear(3, 9), nn.Tanh(), nn.Linear(9, 4))
    jm.jacobian(g, torch.randn(3, 3), mode="reverse")
    assert _attention(_facts(g)) is True  # another engine: the flags are set as on every call


def test_attention_model_repeated_matches_reference() -> None:
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    want = ref_input_jacobian(layer, x)
    fast = torch.backends.mha.get_fastpath_enabled()
    for _ in range(3):
        torch.testing.assert_close(jm.jacobian(layer, x), want)
        assert torch.backends.mha.get_fastpath_enabled() == fast
    assert _state._KERNELS["users"] == 0


def test_guard_given_a_survey_restores_the_model() -> None:
    """preserved_state with the key's survey (no ModelView) still puts flags and grads back."""
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
    assert f.training and f[1].training and f[2].weight.requires_grad and f[0].weight.grad is grad
