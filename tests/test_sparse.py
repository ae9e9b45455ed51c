"""Sparse Jacobians and Hessians (jm.sparsity, jm.coloring, jm.sparse_jacobian, jm.sparse_hessian,
structure="sparse"): every result against a dense float64 torch.func oracle, colourings checked for
structural orthogonality, error paths by message."""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import jacmode as jm
from jacmode._sparse.coloring import ORDERS, color
from jacmode._sparse.evaluate import sources
from jacmode._sparse.pattern import SparsityPattern

D = torch.float64


def brusselator(n: int, a: float = 3.4, b: float = 1.0, alpha: float = 0.02):
    """Residual of the 2-D Brusselator on an n x n periodic grid, x = (u, v) flattened: N = 2 n^2."""
    h2 = (1.0 / n) ** 2

    def lap(w):
        return (torch.roll(w, 1, 0) + torch.roll(w, -1, 0) + torch.roll(w, 1, 1) + torch.roll(w, -1, 1) - 4 * w) / h2

    def f(x):
        u, v = x.reshape(2, n, n)
        fu = b + u * u * v - (a + 1) * u + alpha * lap(u)
        fv = a * u - u * u * v + alpha * lap(v)
        return torch.stack([fu, fv]).reshape(-1)

    return f


def dense_of(J: torch.Tensor) -> torch.Tensor:
    return J.to_dense() if J.layout != torch.strided else J


def check_exact(f, x, **kw):
    ref = torch.func.jacfwd(f)(x)
    ref2 = ref.reshape(-1, x.numel())
    p = jm.sparsity(f, x)
    # the pattern holds every nonzero of the true Jacobian (it may hold more)
    missing = ref2.ne(0) & ~p.to_dense()
    assert not missing.any(), f"pattern misses {int(missing.sum())} nonzeros"
    for mode in ("forward", "reverse", "auto"):
        J = jm.sparse_jacobian(f, x, mode=mode, **kw)
        assert J.layout == torch.sparse_csr
        torch.testing.assert_close(J.to_dense(), ref2, rtol=1e-12, atol=1e-12)
    dense = jm.sparse_jacobian(f, x, layout="dense")
    assert dense.shape == ref.shape
    torch.testing.assert_close(dense, ref, rtol=1e-12, atol=1e-12)
    return p


# --- the pattern of drawn banded / stencil / local functions ---

UNARY = [torch.sin, torch.tanh, torch.exp, lambda z: z * z, torch.sigmoid, F.softplus, torch.relu]


def _op(draw):
    """Draw one banded / stencil / local operation on a 2-D z, returned as a function of z."""
    kind = draw(st.sampled_from(["roll", "shift", "unary", "product", "pad", "sum", "softmax", "t", "flip",
                                 "conv", "where", "cat", "setitem", "matmul", "cumsum"]))
    k, dim = draw(st.integers(-2, 2)), draw(st.integers(0, 1))
    unary = draw(st.sampled_from(UNARY))
    mode = draw(st.sampled_from(["constant", "circular", "reflect", "replicate"]))

    def pad(z):
        return F.pad(z[None], (1, 1), mode=mode)[0][:, 1:-1] * 2 + F.pad(z[None], (2, 0), mode=mode)[0][:, :-2]

    def setitem(z):
        out = z.clone()
        out[0] = z[-1] * z[0]
        return out

    w = torch.linspace(-1, 1, 3, dtype=D).reshape(1, 1, 3)
    return {
        "roll": lambda z: torch.roll(z, k, dims=dim),
        "shift": lambda z: torch.cat([z[1:] - z[:-1], z[:1]], dim=0),
        "unary": unary,
        "product": lambda z: z * torch.roll(z, 1, 1) + z[:, :1],
        "pad": pad,
        "sum": lambda z: z + z.sum(dim=dim, keepdim=True),
        "softmax": lambda z: torch.softmax(z, dim=dim),
        "t": lambda z: z.t().reshape(z.shape),
        "flip": lambda z: z.flip(0) * z,
        "conv": lambda z: F.conv1d(z.unsqueeze(1), w, padding=1).squeeze(1),
        "where": lambda z: torch.where(z > 0.5, z * 3, torch.cos(z)),
        "cat": lambda z: torch.stack([z[:, 0] * z[:, -1]] + [z[:, j] for j in range(1, z.shape[1])], dim=1),
        "setitem": setitem,
        "matmul": lambda z: z @ torch.linspace(0, 1, z.shape[1] ** 2, dtype=D).reshape(z.shape[1], z.shape[1]),
        "cumsum": lambda z: torch.cumsum(z, dim=dim),
    }[kind]


@st.composite
def local_functions(draw):
    a, b = draw(st.integers(2, 5)), draw(st.integers(3, 5))
    steps = [_op(draw) for _ in range(draw(st.integers(1, 3)))]
    seed = draw(st.integers(0, 10_000))

    def f(x):
        z = x.reshape(a, b)
        for step in steps:
            z = step(z)
        return z.reshape(-1)

    x = torch.rand(a * b, dtype=D, generator=torch.Generator().manual_seed(seed)) + 0.1
    return f, x


@settings(max_examples=40, deadline=None)
@given(local_functions())
def test_drawn_local_functions_equal_the_dense_jacobian(case):
    f, x = case
    check_exact(f, x)


def test_brusselator_exact_and_coloured_with_8():
    n = 8
    f = brusselator(n)
    x = torch.rand(2 * n * n, dtype=D, generator=torch.Generator().manual_seed(0))
    p = check_exact(f, x)
    assert p.scope == "global" and p.nnz == 6 * 2 * n * n
    c = jm.coloring(p, "column")
    assert c.lower_bound == 6 and c.n_colors <= 8
    r = jm.coloring(p, "row")
    assert r.n_colors <= 8
    pl = jm.plan(f, x, batched=False, structure="sparse")
    assert pl.strategy == "sparse" and pl.directions == pl.coloring.n_colors <= 8
    assert "colours" in repr(pl) and "lower bound 6" in repr(pl)


def test_modules_conv_and_linear():
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular").double()
    lin = nn.Linear(5, 4).double()
    x = torch.rand(1, 2, 5, 5, dtype=D)
    check_exact(lambda z: torch.tanh(conv(z)), x)
    check_exact(lambda z: lin(torch.sin(z)).sum(-1), torch.rand(6, 5, dtype=D))
    conv1 = nn.Conv1d(2, 4, 3, stride=2, dilation=1, groups=2).double()
    check_exact(conv1, torch.rand(2, 9, dtype=D))
    was = conv.training
    jm.sparse_jacobian(conv, x)
    assert conv.training == was and all(p.grad is None for p in conv.parameters())


def test_create_graph_is_differentiable():
    f = brusselator(4)
    x = torch.rand(32, dtype=D, requires_grad=True)
    J = jm.jacobian(f, x, batched=False, structure="sparse", create_graph=True)
    g = torch.autograd.grad(J.values().pow(2).sum(), x)[0]
    ref = torch.autograd.grad(torch.func.jacfwd(f)(x).pow(2).sum(), x)[0]
    torch.testing.assert_close(g, ref)


# --- scopes: global, local, dense fallback ---


def test_value_dependent_branch_gives_a_local_pattern():
    def f(x):
        if x.sum() > 0:
            return x[1:] * x[:-1]
        return torch.sin(x[1:])

    x = torch.rand(7, dtype=D)
    p = check_exact(f, x)
    assert p.scope == "local" and "bool" in p.reason


def test_index_from_the_input_is_local_and_exact():
    f = lambda x: x[torch.argsort(x)] * x
    p = check_exact(f, torch.rand(6, dtype=D))
    assert p.scope == "local"


def test_op_without_rule_reads_its_own_jacobian():
    f = lambda x: torch.diff(torch.sin(x)) * 2
    p = check_exact(f, torch.rand(9, dtype=D))
    assert p.scope == "local" and "diff" in p.reason and p.nnz == 16


def test_in_place_on_a_view_falls_back_to_the_dense_jacobian_with_a_warning():
    def f(x):
        y = x * 2
        y[1:].mul_(x[:-1])
        return y

    x = torch.rand(6, dtype=D)
    jm.clear_cache()
    with pytest.warns(jm.JacmodeWarning, match="no sparsity pattern could be detected"):
        p = jm.sparsity(f, x)
    assert p.scope == "dense"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jm.JacmodeWarning)
        torch.testing.assert_close(jm.sparse_jacobian(f, x, layout="dense"), torch.func.jacfwd(f)(x))


def test_global_pattern_is_cached_and_reused():
    f = brusselator(4)
    x = torch.rand(32, dtype=D)
    jm.sparsity(f, x)  # the first call of f caches nothing (_guard.py): the second caches the pattern
    assert jm.sparsity(f, x) is jm.sparsity(f, torch.rand(32, dtype=D))
    p = jm.sparsity(f, x)
    c = jm.coloring(p)
    J1 = jm.sparse_jacobian(f, x, pattern=p, coloring=c)
    x2 = torch.rand(32, dtype=D)
    J2 = jm.sparse_jacobian(f, x2, coloring=c, layout="coo")
    torch.testing.assert_close(J1.to_dense(), torch.func.jacfwd(f)(x))
    torch.testing.assert_close(J2.to_dense(), torch.func.jacfwd(f)(x2))


# --- colourings ---


def _random_pattern(rng, y, n, density):
    dense = rng.random((y, n)) < density
    crow = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int64)
    col = np.nonzero(dense)[1].astype(np.int64)
    return SparsityPattern((y, n), crow, col, (n,), (y,)), dense


@pytest.mark.parametrize("seed", range(6))
def test_column_and_row_colourings_are_structurally_orthogonal(seed):
    rng = np.random.default_rng(seed)
    p, dense = _random_pattern(rng, int(rng.integers(1, 40)), int(rng.integers(1, 40)), rng.uniform(0.02, 0.4))
    for order in ORDERS:
        c = color(p, "column", order)
        for r in range(dense.shape[0]):
            cols = np.nonzero(dense[r])[0]
            assert len(set(c.colors[cols].tolist())) == len(cols)
        assert c.lower_bound <= c.n_colors or p.nnz == 0
        rc = color(p, "row", order)
        for j in range(dense.shape[1]):
            rows = np.nonzero(dense[:, j])[0]
            assert len(set(rc.colors[rows].tolist())) == len(rows)


@pytest.mark.parametrize("seed", range(6))
def test_star_colouring_recovers_every_entry(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 40))
    a = rng.random((n, n)) < rng.uniform(0.03, 0.3)
    sym = a | a.T | np.eye(n, dtype=bool)
    crow = np.concatenate([[0], np.cumsum(sym.sum(1))]).astype(np.int64)
    p = SparsityPattern((n, n), crow, np.nonzero(sym)[1].astype(np.int64), (n,), (), symmetric=True)
    for order in ORDERS:
        c = color(p, "star", order)
        sources(c)  # raises if some entry can be read neither in its row nor in its column
        # distance-1: neighbours differ
        i, j = np.nonzero(sym & ~np.eye(n, dtype=bool))
        assert np.all(c.colors[i] != c.colors[j])
        # exact decompression with a random symmetric matrix of this pattern
        m = np.where(sym, rng.standard_normal((n, n)), 0.0)
        m = m + m.T
        hv = np.stack([m @ (c.colors == k).astype(float) for k in range(c.n_colors)])
        got = hv.reshape(-1)[sources(c)]
        np.testing.assert_allclose(got, m[np.nonzero(sym)], rtol=1e-12, atol=1e-12)


def test_sparse_hessian_of_a_sum_of_local_terms_is_exact():
    def energy(x):
        u = x.reshape(6, 6)
        grad2 = (torch.roll(u, 1, 0) - u) ** 2 + (torch.roll(u, 1, 1) - u) ** 2
        return grad2.sum() + (u ** 4).sum() + torch.sin(u[:, 1:] * u[:, :-1]).sum()

    x = torch.rand(36, dtype=D)
    ref = torch.func.hessian(energy)(x)
    H = jm.hessian(energy, x, structure="sparse")
    assert H.layout == torch.sparse_csr
    torch.testing.assert_close(H.to_dense(), ref, rtol=1e-12, atol=1e-12)
    p = jm.sparsity(energy, x, hessian=True)
    assert not (ref.ne(0) & ~p.to_dense()).any()
    star = jm.coloring(p)
    assert star.partition == "star"
    assert star.n_colors <= color(p, "column").n_colors
    Hd = jm.sparse_hessian(energy, x, layout="dense", chunk_size=2)
    torch.testing.assert_close(Hd, ref, rtol=1e-12, atol=1e-12)


def test_auto_mode_follows_the_colour_counts():
    x = torch.rand(60, dtype=D)
    dense_row = lambda z: torch.cat([torch.sin(z), z.sum().reshape(1)])
    dense_col = lambda z: torch.sin(z) * z[0]
    p1 = jm.plan(dense_row, x, batched=False, structure="sparse")
    p2 = jm.plan(dense_col, x, batched=False, structure="sparse")
    assert (p1.mode, p1.directions) == ("reverse", 2)
    assert (p2.mode, p2.directions) == ("forward", 2)
    check_exact(dense_row, x)
    check_exact(dense_col, x)


def test_structure_auto_uses_sparsity_for_a_large_point_only():
    n = 4096
    f = lambda z: z[1:] * z[:-1]
    x = torch.rand(n, dtype=torch.float32)
    assert jm.plan(f, x, batched=False).strategy == "sparse"
    J = jm.jacobian(f, x, batched=False)
    assert J.layout == torch.strided and J.shape == (n - 1, n)
    i = torch.arange(n - 1)
    assert torch.equal(J[i, i], x[1:]) and torch.equal(J[i, i + 1], x[:-1])
    assert int(J.ne(0).sum()) <= 2 * (n - 1)
    assert jm.plan(f, x[:100], batched=False).strategy != "sparse"  # small: today's path


# --- errors ---


def test_errors_name_the_argument_and_the_fix():
    f = brusselator(2)
    x = torch.rand(8, dtype=D)
    with pytest.raises(ValueError, match="structure: .sparse. is for the Jacobian of one point"):
        jm.jacobian(f, x, structure="sparse")
    with pytest.raises(ValueError, match="layout: expected one of"):
        jm.sparse_jacobian(f, x, layout="bsr")
    with pytest.raises(ValueError, match="mode: expected one of"):
        jm.sparse_jacobian(f, x, mode="autotune")
    with pytest.raises(TypeError, match="pattern: expected a SparsityPattern"):
        jm.coloring("not a pattern")
    with pytest.raises(TypeError, match="pattern: expected a SparsityPattern"):
        jm.sparse_jacobian(f, x, pattern=np.zeros(3))
    with pytest.raises(ValueError, match="order: expected one of"):
        jm.coloring(jm.sparsity(f, x), order="random")
    with pytest.raises(ValueError, match="partition: 'star' colours symmetric"):
        jm.coloring(jm.sparsity(f, x), "star")
    with pytest.raises(ValueError, match="pattern: it is a Jacobian pattern for inputs of shape"):
        jm.sparse_jacobian(f, torch.rand(4, 2, dtype=D), pattern=jm.sparsity(f, x))
    with pytest.raises(ValueError, match="mode: 'forward' needs a column colouring"):
        jm.sparse_jacobian(f, x, mode="forward", coloring=jm.coloring(jm.sparsity(f, x), "row"))
    with pytest.raises(ValueError, match="f: a Hessian needs a scalar function"):
        jm.hessian(f, x, structure="sparse")
    with pytest.raises(ValueError, match="max_memory: one direction needs"):
        jm.sparse_jacobian(f, x, max_memory=8)
    with pytest.raises(TypeError, match="hessian: expected True or False"):
        jm.sparsity(f, x, hessian="yes")
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        jm.sparsity(f, [1.0, 2.0])


def test_a_python_number_read_from_a_differentiated_value_falls_back():
    f = lambda z: z * z.sum().item()
    x = torch.rand(5, dtype=D)
    jm.clear_cache()
    with pytest.warns(jm.JacmodeWarning, match=r"item\(\) of a value computed from x"):
        p = jm.sparsity(f, x)
    assert p.scope == "dense"
    with warnings.catch_warnings():  # the fallback runs on every call, the warning is given once per f
        warnings.simplefilter("error", jm.JacmodeWarning)
        for _ in range(3):
            assert jm.sparsity(f, x).scope == "dense"
    jm.clear_cache()
    with pytest.warns(jm.JacmodeWarning, match=r"item\(\) of a value computed from x"):
        jm.sparsity(f, x)


def test_data_dependent_shapes_are_local_and_exact():
    f = lambda z: torch.masked_select(z, z > 0.3) * 2 + z[z > 0.3] ** 2
    x = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.7], dtype=D)
    p = check_exact(f, x)
    assert p.scope == "local" and p.shape == (3, 5)


def test_random_operations_are_noted_and_keep_structure_auto_dense():
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).double()
    x = torch.rand(512, 8, dtype=D)
    assert jm.sparsity(net, x).random
    net.eval()
    assert not jm.sparsity(net, x).random


def test_hessian_of_a_module_is_exact_and_leaves_it_as_found():
    net = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    e = lambda z: (net(z.reshape(4, 6)) ** 2).sum()
    x = torch.rand(24, dtype=D)
    H = jm.sparse_hessian(e, x)
    assert not H.values().requires_grad and all(p.grad is None for p in net.parameters())
    torch.testing.assert_close(H.to_dense(), torch.func.hessian(e)(x))
    with pytest.raises(ValueError, match="out: not supported with structure='sparse'"):
        jm.jacobian(lambda z: z * 2, x, batched=False, structure="sparse", out=torch.empty(24, 24))


@pytest.mark.parametrize("chunk_size", [1, 3])
def test_chunks_and_create_graph_of_the_sparse_hessian(chunk_size):
    e = lambda z: ((z[1:] - z[:-1]) ** 2).sum() + (z ** 4).sum() + torch.sin(z[2:] * z[:-2]).sum()
    x = torch.rand(40, dtype=D, requires_grad=True)
    H = jm.sparse_hessian(e, x, chunk_size=chunk_size, create_graph=True)
    torch.testing.assert_close(H.to_dense(), torch.func.hessian(e)(x.detach()))
    g = torch.autograd.grad(H.values().sum(), x)[0]
    torch.testing.assert_close(g, torch.autograd.grad(torch.func.hessian(e)(x).sum(), x)[0])
    for mode in ("forward", "reverse"):
        J = jm.sparse_jacobian(lambda z: torch.sin(z[1:] * z[:-1]), x.detach(), mode=mode, chunk_size=chunk_size)
        torch.testing.assert_close(J.to_dense(), torch.func.jacfwd(lambda z: torch.sin(z[1:] * z[:-1]))(x.detach()))


def test_structure_auto_gives_up_early_on_a_dense_function():
    net = nn.Sequential(nn.Linear(4096, 64), nn.Tanh(), nn.Linear(64, 8)).double().eval()
    x = torch.rand(4096, dtype=D)
    assert jm.plan(net, x, batched=False).strategy != "sparse"
    from jacmode._sparse import detect
    assert detect._trace(net, x, False, max_average=512).startswith("dense")  # abandoned at the first layer
    torch.testing.assert_close(jm.jacobian(net, x, batched=False), torch.func.jacrev(net)(x))


# --- bidirectional colouring ---


def arrowhead(z):
    """A dense first row (the sum), a dense first column (z[0] scales every output) and a band."""
    band = torch.sin(z[1:] * z[:-1]) + z[1:] ** 2
    return torch.cat([z.sum().reshape(1), band + z[0] * z[1:]])


def test_bidirectional_beats_both_sides_on_the_arrowhead():
    x = torch.rand(200, dtype=D)
    p = jm.sparsity(arrowhead, x)
    col, row, both = (jm.coloring(p, part) for part in ("column", "row", "bidirectional"))
    assert (col.n_colors, row.n_colors) == (200, 200)  # the dense row and column: one colour each
    assert both.n_colors == both.n_column_colors + both.n_row_colors <= 5 < min(col.n_colors, row.n_colors)
    assert both.n_row_colors == 1 and jm.coloring(p).partition == "bidirectional"
    pl = jm.plan(arrowhead, x, batched=False, structure="sparse")
    assert (pl.mode, pl.directions, pl.coloring.partition) == ("bidirectional", both.n_colors, "bidirectional")
    assert f"{both.n_column_colors} jvps on column colours + 1 vjps" in pl.reason
    assert pl.costs["bidirectional"] < min(pl.costs["forward"], pl.costs["reverse"])
    ref = torch.func.jacfwd(arrowhead)(x)
    for chunk in (None, 1):
        J = jm.jacobian(arrowhead, x, batched=False, structure="sparse", chunk_size=chunk)
        torch.testing.assert_close(J.to_dense(), ref, rtol=1e-12, atol=1e-12)


def test_bidirectional_mirror_image_dense_columns_from_jvps():
    # block sums (wide rows, cheap by rows) scaled by z[0] (a dense column) next to the total (a dense row)
    f = lambda z: torch.cat([z.sum().reshape(1), (z.reshape(-1, 4) ** 2).sum(1) * z[0]])
    x = torch.rand(400, dtype=D)
    c = jm.coloring(jm.sparsity(f, x))
    assert c.partition == "bidirectional" and (c.n_column_colors, c.n_row_colors) == (1, 2)
    assert c.colors[0] == 0 and (c.colors[1:] == -1).all()  # only the dense column is pushed
    torch.testing.assert_close(jm.sparse_jacobian(f, x).to_dense(), torch.func.jacfwd(f)(x), rtol=1e-12,
                               atol=1e-12)


def test_bidirectional_is_differentiable_and_a_fallback_keeps_it():
    x = torch.rand(30, dtype=D, requires_grad=True)
    c = jm.coloring(jm.sparsity(arrowhead, x.detach()), "bidirectional")
    J = jm.sparse_jacobian(arrowhead, x, coloring=c, create_graph=True)
    g = torch.autograd.grad((J.values() ** 2).sum(), x)[0]
    ref = torch.autograd.grad((torch.func.jacrev(arrowhead)(x) ** 2).sum(), x)[0]
    torch.testing.assert_close(g, ref)
    assert jm.sparse_jacobian(arrowhead, x.detach(), coloring=c, layout="dense").shape == (30, 30)


@st.composite
def arrow_patterns(draw):
    """A band of drawn width, up to three dense rows and columns, sometimes random entries on top."""
    y, n = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    width = draw(st.integers(0, 3))
    i, j = np.meshgrid(np.arange(y), np.arange(n), indexing="ij")
    dense = np.abs(i - j * y // max(n, 1)) <= width
    for r in draw(st.lists(st.integers(0, y - 1), max_size=3)):
        dense[r] = True
    for k in draw(st.lists(st.integers(0, n - 1), max_size=3)):
        dense[:, k] = True
    noise = np.asarray(draw(st.lists(st.booleans(), min_size=y * n, max_size=y * n))).reshape(y, n)
    dense |= noise & draw(st.booleans())  # sometimes a random sprinkle on top
    return dense


@settings(max_examples=60, deadline=None)
@given(arrow_patterns())
def test_bidirectional_decompression_is_exact_on_drawn_patterns(dense):
    y, n = dense.shape
    crow = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int64)
    p = SparsityPattern((y, n), crow, np.nonzero(dense)[1].astype(np.int64), (n,), (y,))
    for order in ("natural", "best"):
        c = color(p, "bidirectional", order)
        # every entry read from its side: exact with a random matrix of this pattern
        m = np.where(dense, np.random.default_rng(0).standard_normal((y, n)), 0.0)
        jv = [m @ (c.colors == k) for k in range(c.n_column_colors)]
        uj = [(c.row_colors == k) @ m for k in range(c.n_row_colors)]
        got = np.concatenate([np.zeros(0), *jv, *uj])[sources(c)]
        np.testing.assert_allclose(got, m[np.nonzero(dense)], rtol=1e-12, atol=1e-12)
        assert c.n_colors == c.n_column_colors + c.n_row_colors
        assert c.n_colors <= max(color(p, "column", order).n_colors, color(p, "row", order).n_colors)
    auto = jm.coloring(p)
    from jacmode._sparse.coloring import cost
    assert cost(auto) <= min(cost(color(p, "column")), cost(color(p, "row")))


@settings(max_examples=15, deadline=None)
@given(st.integers(3, 40), st.lists(st.integers(0, 39), min_size=1, max_size=3),
       st.lists(st.integers(0, 39), min_size=1, max_size=3), st.integers(1, 2))
def test_bidirectional_jacobians_equal_the_dense_jacobian(n, rows, cols, width):
    rows, cols = sorted({r % n for r in rows}), sorted({k % n for k in cols})

    def f(z):
        band = sum(torch.roll(z, s) * (1 + s) for s in range(-width, width + 1))
        y = torch.tanh(band) + z[cols].prod() * z   # dense columns: every output sees z[cols]
        return torch.cat([y, torch.stack([torch.sin(z * (r + 1)).sum() for r in rows])])   # dense rows

    x = torch.rand(n, dtype=D)
    ref = torch.func.jacfwd(f)(x)
    c = jm.coloring(jm.sparsity(f, x), "bidirectional")
    for chunk in (None, 2):
        J = jm.sparse_jacobian(f, x, coloring=c, chunk_size=chunk)
        torch.testing.assert_close(J.to_dense(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(jm.sparse_jacobian(f, x), jm.sparse_jacobian(f, x, coloring=c), rtol=1e-12,
                               atol=1e-12)


def test_bidirectional_errors():
    x = torch.rand(20, dtype=D)
    c = jm.coloring(jm.sparsity(arrowhead, x), "bidirectional")
    for mode, want in (("forward", "column"), ("reverse", "row")):
        with pytest.raises(ValueError, match=f"mode: '{mode}' needs a {want} colouring, got coloring= with a "
                                             "bidirectional partition"):
            jm.sparse_jacobian(arrowhead, x, mode=mode, coloring=c)
    energy = lambda z: (z[1:] * z[:-1]).sum()
    with pytest.raises(ValueError, match="partition: a Hessian pattern is coloured with 'star'"):
        jm.coloring(jm.sparsity(energy, x, hessian=True), "bidirectional")
    with pytest.raises(ValueError, match="pattern: it is a Jacobian pattern .* and a Hessian is asked for"):
        jm.sparse_hessian(energy, x, coloring=c)
    with pytest.raises(ValueError, match=r"partition: expected one of \(.*'bidirectional'\)"):
        jm.coloring(jm.sparsity(arrowhead, x), "bicolour")


@pytest.mark.parametrize("f", [
    lambda v: torch.roll(v, 1) * v + torch.nn.functional.pad(v, (1, 0))[:6] + v.reshape(2, 3).sum(0).repeat(2),
    lambda v: torch.cumsum(v, 0),  # no rule: read off the op's own Jacobian
], ids=["rules", "own jacobian"])
def test_patterns_and_results_do_not_follow_the_default_device(f: Callable[[Tensor], Tensor]) -> None:
    """Index sets live on the CPU whatever torch's default device is (``torch.set_default_device``,
    ``with torch.device(...)``): a context naming another device changes neither the pattern nor
    the sparse Jacobian."""
    x = torch.randn(6, dtype=torch.float64)
    want = jm.sparsity(f, x).to_dense()
    with torch.device("meta"):
        got = jm.sparsity(f, x).to_dense()
        jac = jm.sparse_jacobian(f, x)
    assert torch.equal(got, want)
    torch.testing.assert_close(jac.to_dense(), torch.func.jacrev(f)(x))
