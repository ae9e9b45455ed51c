"""Generated code through torch's Python bindings (``_capture/bindings.py``): the same numbers, or the aten graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import jacmode as jm
from jacmode import _guard
from jacmode._capture import bindings, capture

_aten = torch.ops.aten


def _f(x, w, out):
    h = torch.tanh(x @ w.t())
    out.narrow(1, 0, h.shape[1]).copy_(h)
    torch.mul(h, x[:, :1], out=out.narrow(1, h.shape[1], h.shape[1]))
    return out, h.sum(0).view(1, -1)


def _inputs(b=3, d=4, k=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, d, generator=g, dtype=dtype), torch.randn(k, d, generator=g, dtype=dtype),
            torch.empty(b, 2 * k, dtype=dtype)]


def test_targets_become_bindings_with_bitwise_equal_results():
    inputs = _inputs()
    gm = make_fx(_f)(*inputs)
    fast = bindings.fast(gm, inputs)
    assert fast is not gm and fast.aten_graph is gm
    targets = [n.target for n in fast.graph.nodes if n.op == "call_function"]
    left = [t for t in targets if isinstance(t, torch._ops.OpOverload)]
    assert left == [_aten.slice.Tensor] * len(left) and len(left) < len(targets) / 2, targets  # no torch.slice
    assert torch.Tensor.copy_ in targets and torch.mul in targets
    for w, g in zip(gm(*inputs), fast(*_inputs())):
        assert torch.equal(w, g)


def test_a_binding_that_disagrees_keeps_the_aten_graph(monkeypatch):
    inputs = _inputs()
    gm = make_fx(_f)(*inputs)
    monkeypatch.setattr(bindings, "binding", lambda t: torch.cos if t is _aten.tanh.default else None)
    assert bindings.fast(gm, inputs) is gm


def test_a_binding_that_raises_keeps_the_aten_graph(monkeypatch):
    inputs = _inputs()
    gm = make_fx(_f)(*inputs)
    monkeypatch.setattr(bindings, "binding", lambda t: torch.stack if t is _aten.tanh.default else None)
    assert bindings.fast(gm, inputs) is gm


def test_tensor_subclass_inputs_keep_the_aten_graph():
    class Tagged(torch.Tensor):
        pass

    inputs = _inputs()
    gm = make_fx(_f)(*inputs)
    assert bindings.fast(gm, [inputs[0].as_subclass(Tagged), *inputs[1:]]) is gm


def test_no_binding_for_ops_torch_only_wraps_in_python_or_lacks():
    assert bindings.binding(_aten.threshold_backward.default) is None  # no Python binding
    assert bindings.binding(_aten.split.Tensor) is torch._C.TensorBase.split  # not torch.functional's torch.split
    assert bindings.binding(_aten.copy_.default) is torch.Tensor.copy_
    assert bindings.binding(_aten.mul.out) is torch.mul  # out= is kwarg-only: the function takes it
    assert bindings.binding(_aten.add_.Tensor) is torch.Tensor.add_
    assert bindings.binding(len) is None


def _program(f, x):
    """f's captured program, read in the scope of a call f(x) as an entry point enters it (the program
    is cached under the generation of f's state: ``_guard.py``)."""
    return _guard.scoped_call(f, (x,), {}, lambda: capture.program_for(f))


class _MLP(nn.Module):
    def __init__(self, d, h, y, act):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, h), act(), nn.Linear(h, y)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 4), d=st.integers(1, 5), h=st.integers(1, 6), y=st.integers(1, 3),
       act=st.sampled_from([nn.ReLU, nn.Tanh, nn.SiLU]))
def test_generated_probe_code_through_bindings_matches_the_loop_oracle(b, d, h, y, act):
    torch.manual_seed(b * 100 + d * 10 + h)
    net = _MLP(d, h, y, act).double()
    x = torch.randn(b, d, dtype=torch.float64)
    # the first call caches nothing (_guard.py): generated on the fourth call, run from the fifth
    for _ in range(5):
        got = jm.jacobian(net, x, wrt="params", mode="reverse")  # the probe engine
    program = _program(net, x)
    codes = [v for v in program.__dict__.get("_probe_codegen", {}).values() if callable(v)]
    assert any(hasattr(getattr(c, "__self__", None), "aten_graph") for c in codes)
    params = dict(net.named_parameters())
    rows = []
    for i in range(b):
        jac = torch.func.jacrev(lambda p: torch.func.functional_call(net, p, (x[i:i + 1],)).reshape(-1))(params)
        rows.append(torch.cat([jac[n].reshape(y, -1) for n in params], 1))
    torch.testing.assert_close(got, torch.stack(rows), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["laplacian", "partials"])
def test_generated_operator_code_through_bindings_matches_the_interpreter(op):
    from jacmode._capture import codegen

    torch.manual_seed(0)
    net = _MLP(3, 8, 1, nn.Tanh).double()
    x = torch.rand(16, 3, dtype=torch.float64)
    call = (lambda: jm.laplacian(net, x)) if op == "laplacian" else (lambda: jm.partials(net, x, [(0, 0), (1,)]))
    for _ in range(4):  # the first call caches nothing (_guard.py): generated and run on the fourth
        got = call()
    program = _program(net, x)
    assert any(hasattr(getattr(c, "__self__", None), "aten_graph") for c in program.__dict__["_codegen"].values())
    with codegen.disabled():
        want = call()
    for g, w in zip(got if isinstance(got, (tuple, list)) else [got], want if isinstance(want, (tuple, list)) else [want]):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
