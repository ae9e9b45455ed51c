"""Rewrites of generated code (``_capture/rewrites.py``): the directions shared by all samples folded
into the next weight, the blocked sum of squares of a Laplacian's last hidden layer, and dead code,
against the interpreter and float64 torch.func oracles (codegen, laplacian, create_graph)."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import jacmode as jm
from jacmode import _guard
from jacmode._capture import capture, codegen, rewrites

_aten = torch.ops.aten


interpreter = codegen.disabled


def _net(d: int, h: int, act: type, hidden: int = 2) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip([d] + [h] * (hidden - 1), [h] * hidden):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers, nn.Linear(h, 1)).double()


class _TorchTanh(nn.Module):  # the PINN spelling: torch.tanh in forward
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _warm(f, x) -> None:
    """The first call of a function caches nothing (``_guard.py``): from the next, the program is kept
    and, inside ``codegen.generated``, its code generated on its first call."""
    jm.laplacian(f, x)


def _graphs(f, x) -> list[torch.fx.GraphModule]:
    """The generated graphs of f's program, read in the scope of a call f(x) as an entry point enters
    it (the program is cached under the generation of f's state: ``_guard.py``)."""
    program = _guard.scoped_call(f, (x,), {}, lambda: capture.program_for(f))
    out = []
    for v in getattr(program, "_codegen", {}).values():
        gm = getattr(v, "__wrapped__", getattr(v, "__self__", v))  # compiled, or a bound forward
        if isinstance(gm, torch.fx.GraphModule):
            out.append(getattr(gm, "aten_graph", gm))  # the rewritten aten graph, before bindings.fast
    return out


def _folded(gm: torch.fx.GraphModule, d: int, j: int) -> int:
    """How many matrix products take the folded weight (H, D J) of the rewrite."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _aten.mm.default:
            b = node.args[1].meta.get("val")
            if b is not None and b.dim() == 2 and b.shape[1] == d * j:
                n += 1
    return n


def _oracle_laplacian(f, x):
    hess = torch.func.vmap(torch.func.hessian(lambda z: f(z[None])[0, 0]))(x)
    return hess.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)


@pytest.mark.parametrize("act", [nn.Tanh, nn.Sigmoid, nn.SiLU])
def test_laplacian_blocked_square_sum_equals_interpreter_and_oracle(act, monkeypatch):
    monkeypatch.setattr(rewrites, "CHUNK_BYTES", 1024)  # several blocks at a small batch
    torch.manual_seed(0)
    net = _net(5, 12, act)
    x = torch.rand(40, 5, dtype=torch.float64)
    _warm(net, x)
    with codegen.generated():
        got = jm.laplacian(net, x)
    (gm,) = _graphs(net, x)
    assert _folded(gm, 5, 12) > 1  # folded and blocked
    with interpreter():
        want = jm.laplacian(net, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, _oracle_laplacian(net, x), rtol=1e-10, atol=1e-12)


def test_laplacian_rewrite_with_create_graph_gradients():
    torch.manual_seed(1)
    net = _TorchTanh(4, 16).double()
    x = torch.rand(64, 4, dtype=torch.float64)
    _warm(net, x)
    with codegen.generated():
        got = jm.laplacian(net, x, create_graph=True)
    assert any(_folded(gm, 4, 16) for gm in _graphs(net, x))
    grads = torch.autograd.grad(got.square().sum(), list(net.parameters()), allow_unused=True)
    with interpreter():
        want = jm.laplacian(net, x, create_graph=True)
    grads_want = torch.autograd.grad(want.square().sum(), list(net.parameters()), allow_unused=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert grads[-1] is None and grads_want[-1] is None  # the output bias has no curvature
    for a, b in zip(grads[:-1], grads_want[:-1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("hidden", [2, 3])
def test_permuted_result_for_compiled_code(hidden):
    """Compiled code folds the directions also where the result feeds more than a sum of
    squares (a deeper network, the Hessian, first derivatives): a permuted (D, B, J) result whose
    later views are reshapes. aot_eager runs the rewritten graph with torch's own kernels."""
    torch.manual_seed(2)
    net = _net(3, 8, nn.Tanh, hidden)
    x = torch.rand(32, 3, dtype=torch.float64)
    _warm(net, x)
    with codegen.generated("aot_eager"):
        lap = jm.laplacian(net, x)
        hess = jm.hessian(net, x)
        jac = jm.jacobian(net, x)
    assert sum(_folded(gm, 3, 8) > 0 for gm in _graphs(net, x)) >= 2  # the Laplacian's and the Hessian's
    with interpreter():
        torch.testing.assert_close(lap, jm.laplacian(net, x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hess, jm.hessian(net, x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(jac, jm.jacobian(net, x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lap, _oracle_laplacian(net, x), rtol=1e-10, atol=1e-12)


def test_not_rewritten_where_it_does_not_pay():
    """Per-sample rows (more output features than samples) and the disabled switch keep the
    traced graph; the results are the interpreter's either way."""
    torch.manual_seed(3)
    net = _net(3, 8, nn.Tanh)
    x = torch.rand(4, 3, dtype=torch.float64)  # B = 4 < J = 8
    _warm(net, x)
    with codegen.generated():
        got = jm.laplacian(net, x)
    assert not any(_folded(gm, 3, 8) for gm in _graphs(net, x))
    net2 = _net(3, 8, nn.Tanh)
    x2 = torch.rand(32, 3, dtype=torch.float64)
    _warm(net2, x2)
    rewrites.ENABLED = False
    try:
        with codegen.generated():
            got2 = jm.laplacian(net2, x2)
    finally:
        rewrites.ENABLED = True
    assert not any(_folded(gm, 3, 8) for gm in _graphs(net2, x2))
    with interpreter():
        torch.testing.assert_close(got, jm.laplacian(net, x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got2, jm.laplacian(net2, x2), rtol=1e-12, atol=1e-12)


def test_dead_code_keeps_mutations():
    def f(a):
        z = a.new_zeros(3)
        z[0] = 1.0  # index_put_ reads nothing afterwards, but is not dead
        unused = a.sin()  # noqa: F841 -- dead
        return a * z.sum()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.rand(3))
    rewrites.dead_code(gm.graph)
    gm.recompile()
    names = [str(n.target) for n in gm.graph.nodes]
    assert not any("sin" in n for n in names)
    a = torch.rand(3)
    torch.testing.assert_close(gm(a), f(a))


def test_rows_of_blocks():
    rows = rewrites._rows(4096, 2560)
    assert 4096 % rows == 0 and 4096 // rows <= rewrites.MAX_CHUNKS  # one block size where possible
    # by the rule itself: 4096 * 2560 bytes = 10 blocks of CHUNK_BYTES (1 MiB), capped at MAX_CHUNKS (8),
    # and 8 divides 4096: 512 rows a block
    assert (rewrites.CHUNK_BYTES, rewrites.MAX_CHUNKS) == (1 << 20, 8) and rows == 512
    assert rewrites._rows(1000, 64) == 1000  # small enough for one block
    assert rewrites._rows(7, 2560) == 7
    assert -(-100_000 // rewrites._rows(100_000, 2560)) <= rewrites.MAX_CHUNKS


def test_constants_fold_the_seeds_and_keep_results():
    torch.manual_seed(4)
    net = _net(3, 8, nn.Tanh)
    x = torch.rand(16, 3, dtype=torch.float64)
    _warm(net, x)
    with codegen.generated():
        got = jm.hessian(net, x)
    (gm,) = _graphs(net, x)
    targets = {str(n.target) for n in gm.graph.nodes}
    assert not any("index_put" in t or "new_zeros" in t for t in targets)  # the seeds are constants
    assert any(n.op == "get_attr" and str(n.target).startswith("_jacmode_constant") for n in gm.graph.nodes)
    with interpreter():
        torch.testing.assert_close(got, jm.hessian(net, x), rtol=1e-12, atol=1e-12)


def test_constants_refuse_an_input_written_into_a_constant_and_a_read_before_a_write():
    def written(a):
        z = a.new_zeros(3)
        z.add_(a)  # the input goes into the constant's storage
        return z * 2

    def read_early(a):
        z = a.new_zeros(3)
        y = a * z  # reads z before the write below
        z[0] = 1.0
        return y + a * z

    for f in (written, read_early):
        gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.rand(3))
        assert not rewrites.constants(gm)
        a = torch.rand(3)
        torch.testing.assert_close(gm(a), f(a))

    def folded(a):
        z = a.new_zeros(3)
        z[1] = 2.0
        return a * z

    gm = torch.fx.experimental.proxy_tensor.make_fx(folded, tracing_mode="fake")(torch.rand(3))
    assert rewrites.constants(gm)
    a = torch.rand(3)
    torch.testing.assert_close(gm(a), folded(a))


def test_constants_leave_a_folded_tuple_alone():
    def f(a):
        parts = a.new_ones(4).split(2)  # a tuple of constants, read through getitem
        return a[:2] * parts[0] + a[2:] * parts[1]

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.rand(4))
    rewrites.constants(gm)
    a = torch.rand(4)
    torch.testing.assert_close(gm(a), f(a))


# [Tanh in compiled code]: Cody and Waite's tanh in elementwise operations


def _ulps(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|got - exact| in units in the last place of ``exact`` rounded to ``dtype`` (exact in float64)."""
    near = exact.to(dtype).abs()
    ulp = (torch.nextafter(near, torch.full_like(near, float("inf"))) - near).double()
    return (got.double() - exact.double()).abs() / ulp


@pytest.mark.parametrize("dtype,tiny,limit", [(torch.float32, -45, 2.0), (torch.float64, -323, 2.0)])
def test_tanh_spelled_within_two_ulps_over_the_whole_range(dtype, tiny, limit):
    """A dense sweep of [-30, 30] and a logarithmic one down to the smallest subnormals: float32
    against float64's tanh, float64 against torch's own (itself within 1 ulp)."""
    sweep = torch.logspace(tiny, 1.6, 200_001, dtype=dtype)
    x = torch.cat([torch.linspace(-30, 30, 1_000_001, dtype=dtype), sweep, -sweep])
    exact = torch.tanh(x.double())
    err = _ulps(rewrites.tanh_spelled(x), exact, dtype)[exact != 0]
    assert err.max() <= limit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tanh_spelled_special_values(dtype):
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 0.5493061443340549,
                      -9.1, 19.1], dtype=dtype)
    got, want = rewrites.tanh_spelled(x), torch.tanh(x)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=2 * torch.finfo(dtype).eps)
    assert torch.equal(torch.signbit(got[:2]), torch.tensor([False, True]))  # signed zeros kept


@settings(max_examples=300, deadline=None)
@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_tanh_spelled_any_float32(v):
    x = torch.tensor([v], dtype=torch.float32)
    got, exact = rewrites.tanh_spelled(x), torch.tanh(x.double())
    if exact.isnan().any():
        assert got.isnan().all()
    elif exact.item() == 0:
        assert got.item() == 0 and torch.signbit(got).item() == torch.signbit(x).item()
    else:
        assert _ulps(got, exact, torch.float32).item() <= 2.0


def test_fast_tanh_rewrites_every_cpu_float_tanh_and_leaves_half_alone():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, h):
        return torch.tanh(2 * x) * x, torch.tanh(h)

    x, h = torch.randn(64, dtype=torch.float64), torch.randn(8, dtype=torch.float16)
    gm = make_fx(f)(x, h)
    assert rewrites.fast_tanh(gm)
    tanhs = [n for n in gm.graph.nodes if n.target is _aten.tanh.default]
    assert len(tanhs) == 1 and tanhs[0].meta["val"].dtype == torch.float16  # float16 keeps torch's tanh
    got, want = gm(x, h), f(x, h)
    torch.testing.assert_close(got[0], want[0], rtol=4e-16, atol=4e-16)
    assert torch.equal(got[1], want[1])
    assert not rewrites.fast_tanh(gm)  # nothing left to replace


def _has_compiler() -> bool:
    from tests.test_compile import _has_compiler as has

    return has()


@pytest.mark.compile
@pytest.mark.skipif(not _has_compiler(), reason="no C++ compiler for inductor")
def test_compiled_laplacian_and_derivatives_with_the_spelled_tanh():
    """Compiled code without grad takes the spelled-out tanh: results as the interpreter's (float32
    tolerance), and with create_graph (autograd through the code) torch's own tanh."""
    torch.manual_seed(5)
    net = _TorchTanh(3, 16)
    x = torch.rand(64, 3)
    _warm(net, x)
    with codegen.generated("inductor"):
        lap = jm.laplacian(net, x)
        d2 = jm.partials(net, x, [(0,), (1, 1)])
    graphs = _graphs(net, x)
    assert graphs and not any(n.target is _aten.tanh.default for gm in graphs for n in gm.graph.nodes)
    with interpreter():
        torch.testing.assert_close(lap, jm.laplacian(net, x), rtol=1e-4, atol=1e-5)
        for a, b in zip(d2, jm.partials(net, x, [(0,), (1, 1)])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lap.double(), _oracle_laplacian(net.double(), x.double()), rtol=1e-4, atol=1e-5)
