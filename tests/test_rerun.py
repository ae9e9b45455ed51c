"""A repeated parameter Jacobian served by the profile's generated code alone (``_jacobian._direct``).

From the fifth call of a signature whose engine is the generated probe code (the first call of a
function caches nothing and the second makes the guard of its state, ``_guard.py``; the code is
generated on the ``codegen.AFTER_CALLS``-th call after that, the fourth), the call looks up
its profile and runs that code, without the guard of the model's state or a problem of its own
([Generated code on the profile] in ``_probes/generated.py``). Each test changes one thing the
shortcut could miss and checks the answer against a float64 torch.func oracle, and that the
shortcut served where it should.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import jacmode as jm
from jacmode._capture import codegen
from jacmode._probes import generated

CALLS = codegen.AFTER_CALLS + 3  # generated on the fourth call, served by the shortcut from the fifth


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 3)

    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(h * 2.0 if self.training else h)


def _oracle(model, x):
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def one(p, xb):
        return functional_call(model, (p, buffers), (xb.unsqueeze(0),)).reshape(-1)

    jac = vmap(jacrev(one), in_dims=(None, 0))(params, x)
    return torch.cat([jac[n].reshape(x.shape[0], jac[n].shape[1], -1) for n in params], -1)


@pytest.fixture
def served(monkeypatch):
    """How many calls the shortcut served."""
    count = {"n": 0}
    real = generated.rerun

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        count["n"] += got is not None
        return got

    monkeypatch.setattr(generated, "rerun", spy)
    return count


def _calls(model, x, **kw):
    for _ in range(CALLS):
        got = jm.jacobian(model, x, wrt="params", mode="reverse", **kw)
    return got


def _setup():
    torch.manual_seed(0)
    return Net().double(), torch.randn(5, 4, dtype=torch.float64)


def test_the_shortcut_serves_repeated_calls_exactly(served):
    model, x = _setup()
    torch.testing.assert_close(_calls(model, x), _oracle(model, x), rtol=1e-10, atol=1e-12)
    assert served["n"] >= 1
    t = jm.transform(jm.jacobian, model, wrt="params", mode="reverse")
    for _ in range(2):
        torch.testing.assert_close(t(x), _oracle(model, x), rtol=1e-10, atol=1e-12)
    assert served["n"] >= 3


def test_optimizer_steps_parameters_replaced_and_grads_left_alone(served):
    model, x = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for _ in range(CALLS):
        torch.testing.assert_close(jm.jacobian(model, x, wrt="params", mode="reverse"), _oracle(model, x),
                                   rtol=1e-10, atol=1e-12)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    assert served["n"] >= 1
    grads = {n: p.grad for n, p in model.named_parameters()}
    saved = {n: g.clone() for n, g in grads.items()}
    _calls(model, x)
    assert all(p.grad is grads[n] and torch.equal(p.grad, saved[n]) for n, p in model.named_parameters())
    model.fc2.weight = nn.Parameter(torch.randn(3, 8, dtype=torch.float64))  # a new parameter object
    torch.testing.assert_close(_calls(model, x), _oracle(model, x), rtol=1e-10, atol=1e-12)


def test_hooks_flags_and_modes_added_later(served):
    model, x = _setup()
    _calls(model, x)
    handle = model.fc1.register_forward_hook(lambda m, a, out: out * 3.0)
    try:
        torch.testing.assert_close(_calls(model, x), _oracle(model, x), rtol=1e-10, atol=1e-12)
    finally:
        handle.remove()
    model.eval()  # forward reads self.training
    torch.testing.assert_close(_calls(model, x), _oracle(model, x), rtol=1e-10, atol=1e-12)
    model.train()
    model.act.negative_slope = 0.5  # a leaf module's scalar, frozen in the code
    torch.testing.assert_close(_calls(model, x), _oracle(model, x), rtol=1e-10, atol=1e-12)
    assert served["n"] >= 3
    with torch.no_grad():  # the caller's grad mode: its own profile, and restored after
        got = _calls(model, x)
    assert torch.is_grad_enabled()
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)
    with torch.inference_mode():
        got = _calls(model, x)
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)


def test_a_callers_dispatch_mode_sees_the_engine_not_the_shortcut(served):
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    model, x = _setup()
    _calls(model, x)
    before = served["n"]
    with Count():
        got = jm.jacobian(model, x, wrt="params", mode="reverse")
    assert Count.n > 0 and served["n"] == before
    torch.testing.assert_close(got, _oracle(model, x), rtol=1e-10, atol=1e-12)


def test_out_and_flatten_false_are_served_too(served):
    model, x = _setup()
    want = _oracle(model, x)
    out = torch.full_like(want, float("nan"))
    got = _calls(model, x, out=out)
    assert got is out and served["n"] >= 1
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    blocks = _calls(model, x, flatten=False)
    assert served["n"] >= 2
    start = 0
    for name, p in model.named_parameters():
        n = p.numel()
        torch.testing.assert_close(blocks[name], want[..., start:start + n].reshape(5, 3, *p.shape), rtol=1e-10, atol=1e-12)
        start += n
    xs = torch.randn(7, 4, dtype=torch.float32)  # another batch and dtype: another profile
    torch.testing.assert_close(_calls(model.float(), xs).double(), _oracle(model.double(), xs.double()),
                               rtol=1e-5, atol=1e-6)


def test_inside_a_torch_func_transform_the_shortcut_stays_out(served):
    model, x = _setup()
    _calls(model, x)
    before = served["n"]
    got = torch.func.vmap(lambda xx: jm.jacobian(model, xx, wrt="params", mode="reverse"))(x.unsqueeze(1))
    assert served["n"] == before
    torch.testing.assert_close(got.squeeze(1), _oracle(model, x), rtol=1e-10, atol=1e-12)
