"""Generated code for the probe engine (``_probes/generated.py``) against the interpreted engine and
float64 torch.func oracles: the same numbers on many models, parameters, buffers and Python values
followed between calls, and the cases it must refuse (closure tensors, value branches, dropout)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

import jacmode as jm
from jacmode import _guard
from jacmode._capture import capture, codegen
from jacmode._probes import generated
from conftest import ref_param_jacobian

# the first call caches nothing (_guard.py), call AFTER_CALLS + 1 generates the code (its answer is the
# interpreted engine's): the last call runs generated code
CALLS = codegen.AFTER_CALLS + 2


def _codes(model, x) -> list:
    """The generated probe code of model's program, read in the scope of a call model(x) as an entry
    point enters it (the program is cached under the generation of the model's state: ``_guard.py``)."""
    program = _guard.scoped_call(model, (x,), {}, lambda: capture.program_for(model))
    if isinstance(program, str):
        return []
    return [v for v in program.__dict__.get("_probe_codegen", {}).values() if callable(v)]


def _oracle(model, x, names=None):
    """(B, Y, P) per-sample Jacobian of model wrt its parameters (or ``names``), float64 torch.func."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v for k, v in model.named_buffers()}
    names = list(params) if names is None else names

    def one(sel, xb):
        out = functional_call(model, ({**params, **sel}, buffers), (xb.unsqueeze(0),))
        return out.reshape(-1)

    jac = vmap(jacrev(one), in_dims=(None, 0))({n: params[n] for n in names}, x)
    return torch.cat([jac[n].reshape(x.shape[0], jac[n].shape[1], -1) for n in names], -1)


def _interpreted(model, x, **kw):
    with generated.disabled():
        return jm.jacobian(model, x, wrt="params", mode="reverse", **kw)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act(self.fc(x))
        h = self.norm(h + x)
        return self.head(torch.tanh(h)) + self.head(h)  # head called twice: its blocks add up


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(3 * 2 * 2, 4)

    def forward(self, x):
        return self.fc(self.pool(torch.nn.functional.leaky_relu(self.bn(self.conv(x)), 0.1)).flatten(1))


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), (4, 5)),
    "residual": (Residual, (3, 6)),
    "conv": (lambda: Conv().eval(), (2, 2, 4, 4)),
    "leaky": (lambda: nn.Sequential(nn.Linear(3, 16), nn.LeakyReLU(0.3), nn.Linear(16, 2)), (5, 3)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generated_equals_interpreted_and_oracle(name):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    for _ in range(CALLS):
        got = jm.jacobian(model, x, wrt="params", mode="reverse")
    assert _codes(model, x), "the repeated call runs generated code"
    torch.testing.assert_close(got, _interpreted(model, x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)


def test_parameter_updates_buffers_and_python_values_are_followed():
    torch.manual_seed(1)
    model = MODELS["leaky"][0]().double()
    x = torch.randn(5, 3, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(CALLS + 1):
        got = jm.jacobian(model, x, wrt="params", mode="reverse")
        torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()  # in place: the generated code reads the new values
    assert _codes(model, x)
    model[1].negative_slope = 0.05  # a leaf module's Python value, frozen in the code: generated anew
    torch.testing.assert_close(jm.jacobian(model, x, wrt="params", mode="reverse"), _oracle(model, x), rtol=1e-10, atol=1e-12)
    conv = MODELS["conv"][0]().double()
    xc = torch.randn(2, 2, 4, 4, dtype=torch.float64)
    for _ in range(CALLS):
        jm.jacobian(conv, xc, wrt="params", mode="reverse")
    with torch.no_grad():
        conv.bn.running_var.mul_(3.0)  # a buffer changed in place
    torch.testing.assert_close(jm.jacobian(conv, xc, wrt="params", mode="reverse"), _oracle(conv, xc), rtol=1e-10, atol=1e-12)


def test_out_subsets_dtypes_and_shapes():
    torch.manual_seed(2)
    model = MODELS["mlp"][0]()
    x = torch.randn(4, 5)
    out = torch.full((4, 3, 7 * 5 + 7 + 3 * 7 + 3), float("nan"))
    for _ in range(CALLS):
        got = jm.jacobian(model, x, wrt="params", mode="reverse", out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, _interpreted(model, x), rtol=1e-6, atol=1e-6)
    for _ in range(CALLS):  # a selection of parameters
        sub = jm.jacobian(model, x, wrt=["2.weight", "0.bias"], mode="reverse")
    want = _oracle(model.double(), x.double(), ["0.bias", "2.weight"])
    assert sub.shape == (4, 3, 7 + 21)
    torch.testing.assert_close(sub.double(), want, rtol=1e-5, atol=1e-6)
    for shape in ((7, 5), (1, 5)):  # another batch, another signature; B = 1 too
        xs = torch.randn(*shape, dtype=torch.float64)
        for _ in range(CALLS):
            got = jm.jacobian(model, xs, wrt="params", mode="reverse")
        torch.testing.assert_close(got, _oracle(model, xs), rtol=1e-10, atol=1e-12)


def test_the_model_is_left_as_found():
    torch.manual_seed(3)
    model = MODELS["residual"][0]()
    x = torch.randn(3, 6)
    model.fc.weight.requires_grad_(False)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(CALLS):
        jm.jacobian(model, x, wrt=["head.weight", "norm.bias"], mode="reverse")
    assert _codes(model, x)
    assert model.training and not model.fc.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert not model._forward_hooks and not model.fc._forward_hooks
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


_SCALE = torch.tensor(2.0, dtype=torch.float64)


class _Global(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x) * _SCALE  # a global tensor: it would be frozen in a graph


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        return h if bool((h > -1e9).all()) else -h  # a branch on values: no straight-line code


def test_what_cannot_be_generated_is_interpreted_and_exact():
    global _SCALE
    torch.manual_seed(4)
    x = torch.randn(4, 3, dtype=torch.float64)
    branch = _Branch().double()
    for model in (_Global().double(), branch):
        for _ in range(CALLS):
            got = jm.jacobian(model, x, wrt="params", mode="reverse" if model is not branch else "auto")
        assert not _codes(model, x)
        torch.testing.assert_close(got, ref_param_jacobian(model, x), rtol=1e-10, atol=1e-12)
    dropout = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double()
    for _ in range(CALLS):  # random layers: every call draws its masks through the interpreted engine
        jm.jacobian(dropout, x, wrt="params", mode="reverse")
    assert not _codes(dropout, x)
    model = _Global().double()
    for _ in range(CALLS):
        jm.jacobian(model, x, wrt="params", mode="reverse")
    _SCALE = torch.tensor(-3.0, dtype=torch.float64)
    try:
        torch.testing.assert_close(jm.jacobian(model, x, wrt="params", mode="reverse"), _oracle(model, x), rtol=1e-10, atol=1e-12)
    finally:
        _SCALE = torch.tensor(2.0, dtype=torch.float64)


def test_transform_form_runs_the_same_code():
    torch.manual_seed(5)
    model = MODELS["mlp"][0]().double()
    jac = jm.jacfn(model, wrt="params", mode="reverse")
    x = torch.randn(4, 5, dtype=torch.float64)
    for _ in range(CALLS):
        got = jac(x)
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)


@pytest.mark.compile
def test_compiled_probe_code():
    if shutil.which("g++") is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        pytest.skip("no C++ compiler for inductor")
    torch.manual_seed(6)
    model = MODELS["mlp"][0]()
    x = torch.randn(4, 5)
    jac = jm.transform(jm.jacobian, model, wrt="params", mode="reverse", compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jm.JacmodeWarning)  # compiled, not fallen back
        for _ in range(2):
            got = jac(x)
    torch.testing.assert_close(got, _interpreted(model, x), rtol=1e-5, atol=1e-6)


def test_model_with_generated_code_can_be_garbage_collected():
    import gc
    import weakref

    model = MODELS["mlp"][0]()
    x = torch.randn(4, 5)
    for _ in range(CALLS):
        jm.jacobian(model, x, wrt="params", mode="reverse")
    assert _codes(model, x)
    refs = [weakref.ref(model), weakref.ref(x)]
    del model, x
    gc.collect()
    assert all(r() is None for r in refs)


SCALE = {"value": 2.0}


class _Scaled(nn.Module):
    """Reads a module-level Python value (a guard of the captured program) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 2)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x) * SCALE["value"] + self.shift))


def test_the_profiles_memo_checks_what_its_key_does_not_hold():
    """Repeated calls run the generated code from the profile's runs ([Generated code on the
    profile]); what the profile's key does not hold must still reach the code or refuse it."""
    torch.manual_seed(4)
    model = _Scaled().double()
    x = torch.randn(3, 4, dtype=torch.float64)

    def check(xx=x):
        for _ in range(CALLS):
            got = jm.jacobian(model, xx, wrt="params", mode="reverse")
            torch.testing.assert_close(got, _oracle(model, xx), rtol=1e-10, atol=1e-12)

    check()
    assert _codes(model, x)
    with torch.no_grad():  # the same parameter object, the same shape, other strides
        model.fc1.weight.data = model.fc1.weight.data.t().contiguous().t().mul_(1.5)
    check()
    model.shift = torch.randn(6, dtype=torch.float64)  # a new buffer tensor (the key holds its shape only)
    check()
    SCALE["value"] = -0.5  # a Python value the program read
    try:
        check()
    finally:
        SCALE["value"] = 2.0
    xs = torch.randn(3, 8, dtype=torch.float64)[:, ::2]  # the input's strides
    check(xs)
    out = torch.empty(3, 2, 6 * 4 + 6 + 2 * 6 + 2, dtype=torch.float64)
    for _ in range(CALLS):  # out= changes the signature of the code, not the profile's facts
        got = jm.jacobian(model, x, wrt="params", mode="reverse", out=out)
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)
    check()


def test_large_results_are_not_generated_and_stay_exact(monkeypatch):
    """Above MAX_RESULT_BYTES the interpreted engine keeps serving (generating would cost seconds for
    a step whose Python is a small part of it; the cap is on uncompiled code)."""
    torch.manual_seed(4)
    model = Residual().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    monkeypatch.setattr(generated, "MAX_RESULT_BYTES", 8 * 3 * 8 * 5)  # below the (8, 3, P) result's bytes
    for _ in range(CALLS):
        got = jm.jacobian(model, x, wrt="params", mode="reverse")
    assert not _codes(model, x)
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)


def test_the_generating_check_compares_every_sample():
    """``_close`` compares a few samples at a time: a difference in any of them, the last included, is found."""
    want = torch.randn(300, 10, 1000, dtype=torch.float64)
    assert generated._close(want.clone(), want, 1e-12)
    for b in (0, 150, 299):
        got = want.clone()
        got[b, 9, 999] += 1e-6
        assert not generated._close(got, want, 1e-12)
    assert not generated._close(want[:-1], want, 1e-12)
    assert generated._close(torch.tensor(1.0), torch.tensor(1.0), 1e-12)
