"""Generated code for the Taylor engine (``_capture/codegen.py``) against the interpreter and float64
torch.func oracles: the same numbers, parameters and closure tensors followed between calls, and
create_graph through the generated code."""

from __future__ import annotations

import contextlib
import shutil
import warnings

import pytest
import torch
from torch import nn
from torch.func import jvp

import jacmode as jm
from jacmode import _guard
from jacmode._capture import capture, codegen
from jacmode._capture.compiled import compiled


class Pinn(nn.Module):
    def __init__(self, d: int = 2, h: int = 10) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        x = torch.tanh(self.fc1(x))
        x = torch.sigmoid(self.fc2(x)) * x
        return self.out(x)


interpreter = codegen.disabled


def _generated(f, x) -> list:
    """The generated code of f's captured program, read in the scope of a call f(x) as an entry point
    enters it (the program is cached under the generation of f's state: ``_guard.py``)."""
    program = _guard.scoped_call(f, (x,), {}, lambda: capture.program_for(f))
    return [v for v in getattr(program, "_codegen", {}).values() if callable(v)]


def _oracle_partial(f, x, dims):
    g = f
    for d in dims:
        e = torch.zeros_like(x)
        e[:, d] = 1
        g = (lambda h, e: lambda z: jvp(h, (z,), (e,))[1])(g, e)
    return g(x)


@pytest.mark.parametrize("create_graph", [False, True])
def test_generated_code_equals_interpreter_and_oracle(create_graph):
    torch.manual_seed(0)
    net = Pinn(3).double()
    x = torch.rand(7, 3, dtype=torch.float64)
    targets = [(0,), (1, 1), (0, 2, 2)]
    for _ in range(codegen.AFTER_CALLS + 1):
        got = jm.partials(net, x, targets, create_graph=create_graph)
        lap = jm.laplacian(net, x, create_graph=create_graph)
        d3 = jm.derivative(Pinn(1).double(), x[:, :1], order=3)
    assert len(_generated(net, x)) == 2
    with interpreter():
        want = jm.partials(net, x, targets, create_graph=create_graph)
        lap_want = jm.laplacian(net, x, create_graph=create_graph)
    for g, w, dims in zip(got, want, targets):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, _oracle_partial(net, x, dims).detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lap, lap_want, rtol=1e-12, atol=1e-12)
    assert d3.shape == (7, 1)


def test_input_jacobians_run_generated_code_and_follow_the_parameters():
    """jacobian wrt inputs over a captured program (forward mode, layer by layer) runs generated code
    from its third call, equal to the interpreter and to float64 torch.func, also after a step."""
    torch.manual_seed(8)
    net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 40)).double()
    x = torch.rand(9, 3, dtype=torch.float64)
    for step in range(2):
        for _ in range(codegen.AFTER_CALLS + 1):
            got = jm.jacobian(net, x)
        assert jm.plan(net, x).engine == "forward-layerwise"
        assert len(_generated(net, x)) == 1
        with interpreter():
            torch.testing.assert_close(got, jm.jacobian(net, x), rtol=1e-12, atol=1e-12)
        want = torch.vmap(torch.func.jacrev(net))(x)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            net[2].weight.mul_(1.5)  # the code reads the parameters on every call


def test_compiled_input_jacobian_transform(monkeypatch):
    """``jm.transform(jm.jacobian, f, compile=backend)`` compiles the input Jacobian's generated code."""
    from jacmode._capture import compiled as _compiled

    made = []
    real = _compiled.compiled
    monkeypatch.setattr(_compiled, "compiled", lambda gm, *a, **k: made.append(gm) or real(gm, *a, **k))
    torch.manual_seed(9)
    net = nn.Sequential(nn.Linear(2, 12), nn.Tanh(), nn.Linear(12, 30)).double()
    x = torch.rand(5, 2, dtype=torch.float64)
    jac = jm.transform(jm.jacobian, net, compile="aot_eager")
    for _ in range(3):
        got = jac(x)
    assert made, "no code was compiled"
    torch.testing.assert_close(got, torch.vmap(torch.func.jacrev(net))(x), rtol=1e-10, atol=1e-12)


def test_create_graph_gradients_through_generated_code_and_an_optimizer_step():
    torch.manual_seed(1)
    net = Pinn().double()
    x = torch.rand(9, 2, dtype=torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def loss():
        u_t, u_xx = jm.partials(net, x, [(0,), (1, 1)], create_graph=True)
        return (u_t - 0.1 * u_xx).square().mean()

    # steps 3.. run generated code (the first call caches nothing: _guard.py); each follows the optimizer's update
    for step in range(5):
        opt.zero_grad()
        value = loss()
        value.backward()
        grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        with interpreter():
            opt.zero_grad()
            want = loss()
            want.backward()
            grads_want = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-14)
        for a, b in zip(grads, grads_want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
        opt.step()
    assert _generated(net, x)


def test_closure_tensor_and_functional_call_are_inputs_not_constants():
    torch.manual_seed(2)
    net = Pinn().double()
    W = torch.rand(2, 2, dtype=torch.float64)
    f = lambda x: net(x @ W) * torch.tanh(x[:, :1])  # noqa: E731
    x = torch.rand(5, 2, dtype=torch.float64)
    for _ in range(codegen.AFTER_CALLS + 1):  # code on call AFTER_CALLS + 1 (_guard.py)
        jm.laplacian(f, x)
    assert _generated(f, x)
    W = W + 0.5  # rebinding the closure's tensor: the generated code reads the new one
    with interpreter():
        want = jm.laplacian(f, x)
    torch.testing.assert_close(jm.laplacian(f, x), want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        net.fc1.weight.mul_(2.0)  # an in-place update of a leaf module's parameter
    with interpreter():
        want2 = jm.laplacian(f, x)
    assert not torch.allclose(want, want2)
    torch.testing.assert_close(jm.laplacian(f, x), want2, rtol=1e-12, atol=1e-12)
    params = {k: v * 1.5 for k, v in net.named_parameters()}
    g = lambda x: torch.func.functional_call(net, params, (x,))  # noqa: E731
    for _ in range(codegen.AFTER_CALLS + 1):  # code on call AFTER_CALLS + 1 (_guard.py)
        got = jm.laplacian(g, x)
    with interpreter():
        torch.testing.assert_close(got, jm.laplacian(g, x), rtol=1e-12, atol=1e-12)


def test_generated_code_inside_generated_block_and_shapes():
    torch.manual_seed(3)
    net = Pinn().double()
    xs = {b: torch.rand(b, 2, dtype=torch.float64) for b in (4, 6)}
    jm.partial(net, xs[4], (1, 1))  # the first call of a function caches nothing (_guard.py): then code from the next
    with codegen.generated():
        for b in (4, 6, 4):  # a new shape is a new signature, never code made for another
            x = xs[b]
            got = jm.partial(net, x, (1, 1))
            with interpreter():
                torch.testing.assert_close(got, jm.partial(net, x, (1, 1)), rtol=1e-12, atol=1e-12)
    # a shape is also a new state of f (Dynamo's guards specialise on it): one program and one code per shape
    assert [len(_generated(net, xs[b])) for b in (4, 6)] == [1, 1]


def test_fuse_keeps_results():
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b, c: (a + b * c).tanh() * 2.0,
                                                    tracing_mode="fake")(*torch.rand(3, 4).unbind(0))
    codegen.fuse(gm, in_place=True)
    names = [str(n.target) for n in gm.graph.nodes]
    assert any("addcmul" in n for n in names) and any("tanh_" in n or "mul_" in n for n in names)
    a, b, c = torch.rand(3, 4).unbind(0)
    torch.testing.assert_close(gm(a, b, c), (a + b * c).tanh() * 2.0)


def test_compiled_falls_back_with_a_warning():
    fn = lambda a: a * 2  # noqa: E731
    with pytest.warns(jm.JacmodeWarning, match="failed"):
        run = compiled(fn, backend="no-such-backend")
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))

    def broken(gm, inputs):
        raise RuntimeError("the backend broke")

    run = compiled(fn, backend=broken)
    with pytest.warns(jm.JacmodeWarning, match="the backend broke"):
        assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run(torch.ones(3)), torch.full((3,), 2.0))  # once: later calls run fn quietly


def test_compiled_generated_code_recompiles_on_new_shapes():
    torch.manual_seed(4)
    net = Pinn().double()
    with codegen.generated("aot_eager"):
        for dtype, b in ((torch.float64, 3), (torch.float64, 5), (torch.float32, 3)):
            n = net.to(dtype)
            x = torch.rand(b, 2, dtype=dtype)
            got = jm.partials(n, x, [(0,), (1, 1)], create_graph=True)
            with interpreter():
                want = jm.partials(n, x, [(0,), (1, 1)], create_graph=True)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
            (gw,) = torch.autograd.grad(got[1].sum(), [n.fc1.weight])
            (ww,) = torch.autograd.grad(want[1].sum(), [n.fc1.weight])
            torch.testing.assert_close(gw, ww)


def test_leaf_module_settings_are_followed():
    torch.manual_seed(5)
    act = nn.LeakyReLU(0.1)
    net = nn.Sequential(nn.Linear(2, 6), nn.Softplus(beta=2.0), nn.Linear(6, 6), act, nn.Linear(6, 1)).double()
    x = torch.rand(5, 2, dtype=torch.float64) - 0.5
    for _ in range(codegen.AFTER_CALLS + 1):  # code on call AFTER_CALLS + 1 (_guard.py)
        jm.partial(net, x, (0, 1))
    assert _generated(net, x)
    net[1].beta = 3.0
    act.negative_slope = 0.3
    got = jm.partial(net, x, (0, 1))
    with interpreter():
        torch.testing.assert_close(got, jm.partial(net, x, (0, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.compile
def test_generated_code_compiled_with_inductor():
    if shutil.which("g++") is None and shutil.which("c++") is None and shutil.which("clang++") is None:
        pytest.skip("no C++ compiler for inductor")
    torch.manual_seed(6)
    net = Pinn(2, 6)
    x = torch.rand(16, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jm.JacmodeWarning)  # compiled, not fallen back
        with codegen.generated("inductor"):
            got = jm.laplacian(net, x)
    with interpreter():
        torch.testing.assert_close(got, jm.laplacian(net, x), rtol=1e-4, atol=1e-5)


class _Scaled(nn.Module):
    """A module called on a constant (not on the input): its parameters are inputs of the code too."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Linear(1, 4), nn.Linear(2, 4)

    def forward(self, x):
        c = self.emb(torch.ones(1, 1, dtype=x.dtype))
        return (torch.tanh(self.fc(x)) * c).sum(1, keepdim=True)


def test_module_called_on_a_constant_follows_its_parameters():
    torch.manual_seed(7)
    net = _Scaled().double()
    x = torch.rand(4, 2, dtype=torch.float64)
    for _ in range(codegen.AFTER_CALLS + 1):  # code on call AFTER_CALLS + 1 (_guard.py)
        jm.partial(net, x, (1, 1))
    assert _generated(net, x)
    with torch.no_grad():
        net.emb.bias.add_(1.0)
    got = jm.partial(net, x, (1, 1))
    with interpreter():
        torch.testing.assert_close(got, jm.partial(net, x, (1, 1)), rtol=1e-12, atol=1e-12)


class _Offset(nn.Module):
    """A model whose forward makes a tensor without naming its device: it follows the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(2, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)) + torch.ones(8, dtype=x.dtype))


@pytest.mark.parametrize("context", ["block", "default"])
def test_generated_code_runs_under_a_default_device_context(monkeypatch, context):
    """Inside ``with torch.device(...)`` or after ``torch.set_default_device``, repeated calls run the
    generated code (not the interpreter), equal to float64 torch.func; the context's devices are in
    the code's key, so code made inside one is never taken outside it, and the reverse."""
    from jacmode._capture import taylor
    from jacmode._probes import layerwise

    runs = {"taylor": 0, "probes": 0}
    taylor_run, fill = taylor._run, layerwise.fill

    def counted_run(*a, **k):
        runs["taylor"] += 1
        return taylor_run(*a, **k)

    def counted_fill(*a, **k):
        runs["probes"] += 1
        return fill(*a, **k)

    monkeypatch.setattr(taylor, "_run", counted_run)
    monkeypatch.setattr(layerwise, "fill", counted_fill)
    torch.manual_seed(3)
    net = _Offset().double()
    x = torch.rand(6, 2, dtype=torch.float64)
    lap_want = torch.stack([torch.func.hessian(lambda z: net(z)[k])(x[b]).diagonal(dim1=-2, dim2=-1).sum(-1)
                            for b in range(6) for k in range(2)]).reshape(6, 2)
    jac_want = torch.vmap(torch.func.jacrev(net))(x)
    params = dict(net.named_parameters())

    def per_sample(p, xb):
        return torch.func.functional_call(net, p, (xb.unsqueeze(0),)).squeeze(0)

    rows = torch.vmap(torch.func.jacrev(per_sample), in_dims=(None, 0))(params, x)
    par_want = torch.cat([rows[n].reshape(6, 2, -1) for n in params], dim=2)
    outside = jm.laplacian(net, x)
    ctx = torch.device("cpu") if context == "block" else contextlib.nullcontext()
    if context == "default":
        torch.set_default_device("cpu")
    try:
        with ctx:
            assert codegen.modes() == (torch.device("cpu"),)
            for _ in range(codegen.AFTER_CALLS + 2):
                lap, jac = jm.laplacian(net, x), jm.jacobian(net, x)
                par = jm.jacobian(net, x, wrt="params")
            before = dict(runs)
            lap, jac, par = jm.laplacian(net, x), jm.jacobian(net, x), jm.jacobian(net, x, wrt="params")
            assert runs == before  # all three from generated code
            made = _guard.scoped_call(net, (x,), {}, lambda: capture.program_for(net))
            keys = [k for k, v in made._codegen.items() if callable(v)]
            assert keys and all(k[-1] == (torch.device("cpu"),) for k in keys)
    finally:
        if context == "default":
            torch.set_default_device(None)  # no default-device context, as before
    assert codegen.modes() is None
    for got, want in ((lap, lap_want), (jac, jac_want), (par, par_want), (jm.laplacian(net, x), outside)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_code_made_outside_a_device_context_is_not_taken_inside_it():
    """A forward that makes a tensor without naming its device follows the default device: inside
    ``with torch.device("meta")`` it fails as the eager model does, on every call, though code made
    outside exists; outside again the results are as before."""
    torch.manual_seed(4)
    net, x = _Offset().double(), torch.rand(5, 2, dtype=torch.float64)
    calls = (lambda: jm.laplacian(net, x), lambda: jm.jacobian(net, x), lambda: jm.jacobian(net, x, wrt="params"))
    for _ in range(codegen.AFTER_CALLS + 2):
        before = [call() for call in calls]
    with torch.device("meta"):
        with pytest.raises(RuntimeError, match="meta") as eager:
            net(x)
        for _ in range(3):
            for call in calls:
                with pytest.raises(RuntimeError, match="meta") as got:
                    call()
                assert str(got.value) == str(eager.value)
    for call, want in zip(calls, before):
        torch.testing.assert_close(call(), want, rtol=1e-12, atol=1e-12)
