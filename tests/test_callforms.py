"""Several arguments, pytrees, keyword arguments and has_aux for every inputs-side entry point,
against float64 torch.func oracles: jacrev / jacfwd / hessian with ``argnums`` and
``has_aux``, ``vmap`` with ``in_dims``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev, vmap
from torch.utils.data import DataLoader, TensorDataset

import jacmode as jm
from jacmode import _args
from jacmode._capture import capture as _capture
from jacmode._errors import CoupledBatchError

DT = torch.float64
CLOSE = dict(rtol=1e-9, atol=1e-10)


def _net(d_in: int = 3, d_out: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out)).to(DT)


NET = _net()


def u(x: Tensor, t: Tensor) -> Tensor:
    """u(x, t): x (B, 2), t (B, 1) -> (B, 2), captured (a closure over NET)."""
    return NET(torch.cat([x, t], 1))


def per_sample(f: Any, in_dims: Any = 0) -> Any:
    """f of one sample from f of a batch: batched arguments get a sample dim of one."""
    def one(*args: Any, **kw: Any) -> Any:
        dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        lifted = [torch.utils._pytree.tree_map(lambda v: v[None], a) if d == 0 else a for a, d in zip(args, dims)]
        out = f(*lifted, **kw)
        return torch.utils._pytree.tree_map(lambda v: v[0] if isinstance(v, Tensor) else v, out)
    return one


def assert_tree_close(got: Any, ref: Any) -> None:
    g, gs = torch.utils._pytree.tree_flatten(got)
    r, rs = torch.utils._pytree.tree_flatten(ref)
    assert gs == rs, (gs, rs)
    for a, b in zip(g, r):
        torch.testing.assert_close(a, b, **CLOSE)


def data(b: int = 7, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, generator=gen, dtype=DT), torch.rand(b, 1, generator=gen, dtype=DT)


# ---- jacobian over call forms --------------------------------------------------------------------

def masked(x: Tensor, mask: Tensor, *, scale: float = 1.0) -> dict[str, Tensor]:
    return {"y": torch.tanh(x) * mask * scale, "s": (x ** 2).sum(1) * mask.sum(1)}


@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0)])
@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_jacobian_argnums_match_torch_func(argnums: Any, mode: str) -> None:
    x, t = data(40)
    got = jm.jacobian(u, x, t, argnums=argnums, mode=mode)
    ref = vmap(jacrev(per_sample(u), argnums=argnums))(x, t)
    assert_tree_close(got, ref)


def test_jacobian_riders_kwargs_pytree_output_and_aux() -> None:
    x = torch.randn(9, 3, dtype=DT)
    mask = (torch.rand(9, 3) > 0.4).to(DT)
    got = jm.jacobian(masked, x, mask, kwargs={"scale": 2.0})
    ref = vmap(jacrev(per_sample(lambda a, m: masked(a, m, scale=2.0))))(x, mask)
    assert_tree_close(got, ref)
    # broadcast rider (in_dims=None) and has_aux
    row = torch.rand(3, dtype=DT)
    f = lambda a, w: (torch.sin(a) * w, {"norm": a.norm()})  # noqa: E731
    got, aux = jm.jacobian(f, x, row, in_dims=(0, None), has_aux=True)
    ref = vmap(jacrev(lambda a, w: torch.sin(a) * w), in_dims=(0, None))(x, row)
    torch.testing.assert_close(got, ref, **CLOSE)
    torch.testing.assert_close(aux["norm"], x.norm())


def test_jacobian_pytree_inputs() -> None:
    x, t = data(6)
    f = lambda p, c: p["x"] * p["t"] + c["k"] * p["t"] ** 2  # noqa: E731
    c = {"k": torch.rand(6, 1, dtype=DT)}
    got = jm.jacobian(f, {"x": x, "t": t}, c)
    ref = vmap(jacrev(per_sample(f)))({"x": x, "t": t}, c)
    assert_tree_close(got, ref)
    got = jm.jacobian(f, {"x": x, "t": t}, c, argnums=(0, 1))
    ref = vmap(jacrev(per_sample(f), argnums=(0, 1)))({"x": x, "t": t}, c)
    assert_tree_close(got, ref)


def test_unbatched_several_arguments() -> None:
    a, b = torch.randn(3, dtype=DT), torch.randn(2, dtype=DT)
    f = lambda a, b: torch.outer(a, b).sin()  # noqa: E731
    got = jm.jacobian(f, a, b, argnums=(0, 1), batched=False)
    assert_tree_close(got, jacrev(f, argnums=(0, 1))(a, b))


FORMS = st.fixed_dictionaries({
    "argnums": st.sampled_from([0, 1, (0, 1), (1, 0), (1,)]),
    "rider": st.sampled_from(["batched", "broadcast", "kwarg"]),
    "out": st.sampled_from(["tensor", "tuple", "dict"]),
    "aux": st.booleans(),
    "b": st.integers(1, 40),
    "chunk": st.sampled_from([None, 1, 3]),
})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(FORMS)
def test_drawn_call_forms_match_torch_func(form: dict[str, Any]) -> None:
    b = form["b"]
    x, t = data(b, seed=b)
    c = torch.rand(b, 2, dtype=DT) if form["rider"] != "broadcast" else torch.rand(2, dtype=DT)

    def core(x: Tensor, t: Tensor, c: Tensor) -> Any:
        y = NET(torch.cat([x * c, t], 1))
        if form["out"] == "tuple":
            return y, (t * x).sin()
        if form["out"] == "dict":
            return {"y": y, "z": t.exp() * x[:, :1]}
        return y

    if form["rider"] == "kwarg":
        f = lambda x, t, c=None: core(x, t, c)  # noqa: E731
        call_args, kwargs, in_dims = (x, t), {"c": c}, 0
        ref_f = lambda x, t, c: core(x, t, c)  # noqa: E731
        ref_in = (0, 0, 0)
    else:
        f, call_args, kwargs = core, (x, t, c), None
        in_dims = 0 if form["rider"] == "batched" else (0, 0, None)
        ref_f, ref_in = core, (0, 0, 0) if form["rider"] == "batched" else (0, 0, None)
    g = (lambda *a, **k: (f(*a, **k), "aux")) if form["aux"] else f
    got = jm.jacobian(g, *call_args, argnums=form["argnums"], in_dims=in_dims, kwargs=kwargs,
                      has_aux=form["aux"], chunk_size=form["chunk"])
    if form["aux"]:
        got, aux = got
        assert aux == "aux"
    ref = vmap(jacrev(per_sample(ref_f, ref_in), argnums=form["argnums"]), in_dims=ref_in)(x, t, c)
    assert_tree_close(got, ref)


# ---- derivative operators ------------------------------------------------------------------------

def heat(x: Tensor, t: Tensor) -> Tensor:
    return NET1(torch.cat([x, t], 1))


NET1 = _net(2, 1, seed=3)


def test_partials_by_name_equal_the_concatenated_input() -> None:
    x, t = data(50)
    x = x[:, :1]
    xt = torch.cat([x, t], 1)
    u_t, u_xx = jm.partials(heat, x, t, dims=[("t",), ("x", "x")])
    r_t, r_xx = jm.partials(NET1, xt, [(1,), (0, 0)])
    torch.testing.assert_close(u_t, r_t, **CLOSE)
    torch.testing.assert_close(u_xx, r_xx, **CLOSE)
    # by position pairs, by plain ints with explicit argnums, and the mixed partial
    torch.testing.assert_close(jm.partial(heat, x, t, dims=((0, 0), (1, 0))), jm.partial(NET1, xt, (0, 1)), **CLOSE)
    torch.testing.assert_close(jm.partial(heat, x, t, dims=(1,), argnums=(0, 1)), r_t, **CLOSE)
    # the captured program serves the call (the fast engine fires)
    program = _capture.program_for(_args.describe_call(heat, (x, t), argnums=(0, 1)).fn)
    assert not isinstance(program, str) and program.riders_step is not None
    # torch.cat([x, t], 1) of the flat input's own columns is the flat input: no slicing and joining
    assert "torch.cat" not in program.ops and "operator.getitem" not in program.ops
    swapped = _capture.program_for(_args.describe_call(heat, (x, t), argnums=(1, 0)).fn)
    assert not isinstance(swapped, str) and "torch.cat" in swapped.ops
    r_t, r_x = jm.partials(heat, x, t, dims=[(0,), (1,)], argnums=(1, 0))  # z = (t, x): columns swapped
    torch.testing.assert_close(r_t, jm.partial(NET1, xt, (1,)), **CLOSE)
    torch.testing.assert_close(r_x, jm.partial(NET1, xt, (0,)), **CLOSE)


def test_laplacian_in_x_only_with_t_a_rider() -> None:
    x, t = data(30)
    got = jm.laplacian(u, x, t, argnums=0)
    h = vmap(hessian(per_sample(u), argnums=0))(x, t)  # (B, 2, 2, 2)
    torch.testing.assert_close(got, h.diagonal(dim1=-2, dim2=-1).sum(-1), **CLOSE)
    est = jm.laplacian(u, x, t, argnums=0, samples=4, generator=torch.Generator().manual_seed(0))
    assert est.shape == got.shape
    w = torch.eye(2, dtype=DT)[:, :1]
    torch.testing.assert_close(jm.laplacian(u, x, t, weight=w), h[..., 0, 0], **CLOSE)


@pytest.mark.parametrize("argnums", [0, 1, (0, 1), (1, 0)])
def test_hessian_layout_is_torch_funcs(argnums: Any) -> None:
    x, t = data(8)
    f = lambda x, t: {"a": torch.sin(x * t), "b": (x ** 3).sum(1) * t[:, 0]}  # noqa: E731
    assert_tree_close(jm.hessian(f, x, t, argnums=argnums), vmap(hessian(per_sample(f), argnums=argnums))(x, t))


def test_derivative_divergence_operator_biharmonic() -> None:
    x, t = data(12)
    f = lambda x, t: torch.sin(x.sum(1, keepdim=True) * t) * t  # noqa: E731
    d2 = jm.derivative(f, x, t, argnums=1, order=2)
    ref = vmap(jacrev(jacrev(per_sample(f), argnums=1), argnums=1))(x, t)
    torch.testing.assert_close(d2, ref.reshape(12, 1), **CLOSE)
    v = lambda x, t: x ** 2 * t  # noqa: E731  -- a vector field in x, t a rider
    torch.testing.assert_close(jm.divergence(v, x, t), (2 * x * t).sum(1), **CLOSE)
    terms = [(1.0, ("t",)), (-0.5, (("x", 0), ("x", 0))), (2.0, ())]
    got = jm.operator(f, x, t, terms=terms)
    g1 = vmap(jacrev(per_sample(f), argnums=1))(x, t).reshape(12, 1)
    h = vmap(hessian(per_sample(f), argnums=0))(x, t).reshape(12, 2, 2)
    torch.testing.assert_close(got, g1 - 0.5 * h[:, :1, 0] + 2 * f(x, t), **CLOSE)
    p = jm.operator_plan(u, x, t, terms=[(1.0, (("x", 0), ("x", 0)))])
    assert p.engine == "collapsed Taylor mode"
    bi = jm.biharmonic(lambda x, t: (x ** 4).sum(1) * t[:, 0], x, t)
    torch.testing.assert_close(bi, 48 * t[:, 0], **CLOSE)


def test_outputs_keep_fs_pytree_and_aux() -> None:
    x, t = data(10)
    f = lambda x, t: ({"u": u(x, t)[:, :1], "v": (x * t).sum(1)}, "meta")  # noqa: E731
    (u_t, u_xx), aux = jm.partials(f, x, t, dims=[("t",), (("x", 1), ("x", 1))], has_aux=True)
    assert aux == "meta" and set(u_t) == {"u", "v"} and u_t["v"].shape == (10,)
    torch.testing.assert_close(u_t["v"], x.sum(1), **CLOSE)
    torch.testing.assert_close(u_xx["v"], torch.zeros(10, dtype=DT), **CLOSE)
    lap, aux = jm.laplacian(f, x, t, has_aux=True)
    assert set(lap) == {"u", "v"} and aux == "meta"


def test_one_argument_calls_keep_working() -> None:
    x = torch.randn(5, 2, dtype=DT)
    tt = torch.linspace(0, 1, 5, dtype=DT)
    torch.testing.assert_close(jm.derivative(lambda s: s ** 3, tt, 2), 6 * tt, **CLOSE)
    f = lambda x: x[:, :1] ** 2 * x[:, 1:] ** 3  # noqa: E731
    torch.testing.assert_close(jm.partial(f, x, (0, 1)), 6 * x[:, :1] * x[:, 1:] ** 2, **CLOSE)
    a, b = jm.partials(f, x, [(0,), (1, 1)])
    torch.testing.assert_close(b, 6 * x[:, :1] ** 2 * x[:, 1:], **CLOSE)
    torch.testing.assert_close(jm.operator(f, x, [(1.0, (0, 0))]), 2 * x[:, 1:] ** 3, **CLOSE)
    assert jm.jacobian(f, x).shape == (5, 1, 2)


# ---- riders are inputs of the captured program, and follow the samples ----------------------------

def test_riders_are_read_on_every_call_of_the_captured_program() -> None:
    x, t = data(20)
    first = jm.partials(u, x, t, dims=[(("x", 0),), (("x", 0), ("x", 0))], argnums=0)
    t2 = t + 1.0  # same shapes, new values
    second = jm.partials(u, x, t2, dims=[(("x", 0),), (("x", 0), ("x", 0))], argnums=0)
    ref = jm.partials(NET, torch.cat([x, t2], 1), [(0,), (0, 0)])
    for a, b in zip(second, ref):
        torch.testing.assert_close(a, b, **CLOSE)
    assert not torch.allclose(first[1], second[1])
    mask = torch.rand(20, 2, dtype=DT)
    g = lambda x, m: NET(torch.cat([x * m, x[:, :1]], 1))  # noqa: E731
    for m in (mask, 1 - mask):
        h = vmap(hessian(per_sample(g), argnums=0))(x, m)
        torch.testing.assert_close(jm.laplacian(g, x, m), h.diagonal(dim1=-2, dim2=-1).sum(-1), **CLOSE)


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_chunks_of_samples_take_their_riders(chunk_size: Any) -> None:
    x, t = data(64)
    for structure in ("auto", "coupled"):
        got = jm.partials(u, x, t, dims=[(("x", 0),), (("x", 1), ("x", 1))], argnums=0, chunk_size=chunk_size,
                          structure=structure)
        ref = jm.partials(NET, torch.cat([x, t], 1), [(0,), (1, 1)], structure=structure)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **CLOSE)
    j = jm.jacobian(u, x, t, argnums=0, chunk_size=chunk_size, max_memory="30KB")
    torch.testing.assert_close(j, jm.jacobian(NET, torch.cat([x, t], 1))[..., :2], **CLOSE)
    ops = jm.operator(u, x, t, terms=[(1.0, ((0, 0),)), (t[:, 0], ((0, 1),))], chunk_size=chunk_size)
    ref = jm.operator(NET, torch.cat([x, t], 1), [(1.0, (0,)), (t[:, 0], (1,))])
    torch.testing.assert_close(ops, ref, **CLOSE)


def test_generic_engine_with_riders_on_many_samples() -> None:
    x, t = data(70)
    f = lambda x, t: torch.special.erf(x * t) + x.sin()  # noqa: E731  -- erf: no Taylor rule
    got = jm.laplacian(f, x, t)
    h = vmap(hessian(per_sample(f), argnums=0))(x, t)
    torch.testing.assert_close(got, h.diagonal(dim1=-2, dim2=-1).sum(-1), **CLOSE)
    torch.testing.assert_close(jm.hessian(f, x, t, chunk_size=2), h, **CLOSE)


def test_coupled_samples_are_detected_through_riders() -> None:
    x = torch.randn(40, 3, dtype=DT)
    mask = (torch.rand(40, 3) > 0.5).to(DT)
    mixing = lambda x, m: x * (m * x).mean(0)  # noqa: E731  -- the batch mixes through x
    with pytest.raises(CoupledBatchError, match="samples of the batch are coupled"):
        jm.jacobian(mixing, x, mask)
    through_mask = lambda x, m: x * m.mean(0)  # noqa: E731  -- only through the per-sample mask
    with pytest.raises(CoupledBatchError, match="samples of the batch are coupled"):
        jm.laplacian(through_mask, x, mask)
    got = jm.jacobian(mixing, x, mask, structure="coupled")  # the diagonal blocks of the whole batch
    whole = jacrev(lambda z: mixing(z, mask))(x)  # (B, 3, B, 3)
    k = torch.arange(40)
    torch.testing.assert_close(got, whole[k, :, k, :], **CLOSE)


def test_create_graph_through_several_arguments() -> None:
    x, t = data(16)
    x = x[:, :1]
    x.requires_grad_(True)
    u_t, u_xx = jm.partials(heat, x, t, dims=[("t",), ("x", "x")], create_graph=True)
    loss = ((u_t - 0.1 * u_xx) ** 2).mean()
    grads = torch.autograd.grad(loss, [*NET1.parameters(), x], allow_unused=True)
    xt = torch.cat([x, t], 1)
    r_t, r_xx = jm.partials(NET1, xt, [(1,), (0, 0)], create_graph=True)
    ref = torch.autograd.grad(((r_t - 0.1 * r_xx) ** 2).mean(), [*NET1.parameters(), x], allow_unused=True)
    for a, b in zip(grads, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **CLOSE)


# ---- parameters of a model of several arguments ---------------------------------------------------

class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
        return self.out(torch.tanh(self.fc(x * mask))) * scale


def snapshot(m: nn.Module) -> Any:
    return ([p.detach().clone() for p in m.parameters()], [p.grad for p in m.parameters()],
            [x.training for x in m.modules()], type(m), dict(m._forward_hooks))


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_params_of_a_model_of_several_arguments(mode: str) -> None:
    torch.manual_seed(0)
    model = Masked().to(DT)
    x = torch.randn(30, 3, dtype=DT)
    mask = (torch.rand(30, 3) > 0.4).to(DT)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(jacrev(lambda p, a, m: functional_call(model, p, (a[None], m[None]), {"scale": 2.0})[0]),
               in_dims=(None, 0, 0))(params, x, mask)
    before = snapshot(model)
    got = jm.jacobian(model, x, mask, kwargs={"scale": 2.0}, wrt="params", flatten=False, mode=mode)
    assert_tree_close(got, ref)
    flat = jm.jacobian(model, x, mask, kwargs={"scale": 2.0}, wrt="params", mode=mode, chunk_size=5)
    torch.testing.assert_close(flat, torch.cat([ref[k].reshape(30, 2, -1) for k in ref], -1), **CLOSE)
    after = snapshot(model)
    assert type(model) is Masked and after[2:] == before[2:]
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    assert jm.plan(model, x, mask, wrt="params").strategy == "per-sample"
    assert jm.jacobian(model, x, mask, wrt=["out.bias"]).shape == (30, 2, 2)


def test_jacobians_of_batches_of_several_arguments() -> None:
    torch.manual_seed(0)
    model = Masked().to(DT)
    x, mask, y = torch.randn(10, 3, dtype=DT), torch.rand(10, 3, dtype=DT), torch.randn(10, 2, dtype=DT)
    loader = DataLoader(TensorDataset(x, mask, y), batch_size=4)
    whole = jm.jacobian(model, x, mask, wrt="params")
    torch.testing.assert_close(torch.cat(list(jm.jacobians(model, loader, n_args=2))), whole, **CLOSE)
    out = jm.jacobians(model, loader, n_args=2, out=torch.empty(10, 2, 26, dtype=DT))
    torch.testing.assert_close(out, whole, **CLOSE)
    ins = list(jm.jacobians(model, loader, n_args=2, wrt="inputs", argnums=(0, 1)))
    assert len(ins) == 3 and isinstance(ins[0], tuple) and ins[0][1].shape == (4, 2, 3)
    with pytest.raises(TypeError, match=r"batches: got a tuple of 2 entries holding tensors.*n_args=2"):
        jm.jacobians(model, (x, mask), n_args=2)
    with pytest.raises(jm.BatchError, match=r"batches: batch 0 is Tensor, but n_args=2 needs a tuple"):
        list(jm.jacobians(model, iter([x]), n_args=2))
    with pytest.raises(ValueError, match="n_args: argnums, in_dims and kwargs apply to batches of several"):
        jm.jacobians(model, loader, kwargs={"scale": 2.0})


# ---- errors ---------------------------------------------------------------------------------------

def test_errors_name_the_argument() -> None:
    x, t = data(5)
    with pytest.raises(TypeError, match=r"argnums: expected an int or a non-empty tuple of ints"):
        jm.jacobian(u, x, t, argnums=[0, 1])
    with pytest.raises(ValueError, match=r"argnums: 2 is out of range for a call with 2 positional"):
        jm.jacobian(u, x, t, argnums=2)
    with pytest.raises(ValueError, match=r"argnums: each argument may be named once"):
        jm.hessian(u, x, t, argnums=(0, 0))
    with pytest.raises(ValueError, match=r"in_dims: argument 1 is batched along dim 0.*B = 5.*in_dims=\(0, None\)"):
        jm.jacobian(u, x, torch.rand(3, 1, dtype=DT))
    with pytest.raises(ValueError, match=r"in_dims: expected one entry .* per positional argument \(2\)"):
        jm.laplacian(u, x, t, in_dims=(0,))
    with pytest.raises(TypeError, match=r"argument 1: differentiating needs a real floating dtype, got torch.int64"):
        jm.jacobian(u, x, torch.ones(5, 1, dtype=torch.long), argnums=(0, 1))
    with pytest.raises(TypeError, match=r"f: has_aux=True expects f to return a pair \(output, aux\)"):
        jm.jacobian(u, x, t, has_aux=True)
    with pytest.raises(ValueError, match=r"argument 1: every differentiated tensor needs the same number of samples"):
        jm.jacobian(u, x, t[:3], argnums=(0, 1))
    with pytest.raises(ValueError, match=r"dims: 'y' is not the name of a positional argument of f.*\['x', 't'\]"):
        jm.partials(u, x, t, dims=[("y",)])
    with pytest.raises(ValueError, match=r"dims: argument 'x' has 2 coordinates per sample; name one of them"):
        jm.partial(u, x, t, dims=("x",))
    with pytest.raises(ValueError, match=r"dims: mixes argument names with plain int coordinates"):
        jm.partial(u, x, t, dims=("t", 0))
    with pytest.raises(ValueError, match=r"dims: coordinate \('x', 0\) names argument 0, which is not differentiated"):
        jm.partial(u, x, t, dims=(("x", 0),), argnums=1)
    with pytest.raises(TypeError, match=r"order: ambiguous call: f takes several positional arguments.*order=2"):
        jm.derivative(lambda a, n: a * n, t, 2)
    with pytest.raises(TypeError, match=r"dims: ambiguous call"):
        jm.partial(lambda a, d: a, x, (0, 1))
    with pytest.raises(ValueError, match=r"argnums: derivative differentiates along one scalar per sample.*hold 2"):
        jm.derivative(u, x, t, order=2)
    with pytest.raises(TypeError, match=r"kwargs: expected a dict of f's keyword arguments"):
        jm.jacobian(u, x, kwargs=[t])
    with pytest.raises(TypeError, match=r"has_aux: expected True or False"):
        jm.jacobian(u, x, t, has_aux="yes")
    with pytest.raises(TypeError, match=r"x: missing: pass the input\(s\) of f"):
        jm.jacobian(u)
    with pytest.raises(TypeError, match=r"dims: missing"):
        jm.partial(u, x, t)
    with pytest.raises(ValueError, match=r"structure: 'sparse' takes one tensor argument"):
        jm.jacobian(u, x, t, structure="sparse")
    with pytest.raises(ValueError, match=r"out: not supported for a call of several arguments"):
        jm.jacobian(u, x, t, out=torch.empty(5, 2, 2, dtype=DT))
    with pytest.raises(TypeError, match=r"f: wrt='params' differentiates the parameters of an nn.Module"):
        jm.jacobian(u, x, t, wrt="params")
    with pytest.raises(ValueError, match=r"f: returned a different output structure"):
        flip = iter(range(100))
        jm.jacobian(lambda x, t: (x,) if next(flip) % 2 else (x, t), x, t)


def test_sparse_entry_points_take_one_tensor() -> None:
    a = torch.ones(4, dtype=DT)
    with pytest.raises(TypeError, match=r"x: sparse_jacobian takes f and one tensor x, got 2 positional"):
        jm.sparse_jacobian(lambda p, q: p * q, a, a)
    with pytest.raises(TypeError, match=r"x: sparse_hessian takes f and one tensor x, got 2 positional"):
        jm.sparse_hessian(lambda p, q: (p * q).sum(), a, a)
    with pytest.raises(ValueError, match=r"structure: 'sparse' takes one tensor argument"):
        jm.hessian(lambda p, q: (p * q).sum(1), a[None], a[None], structure="sparse")


def test_in_dims_by_name_and_a_raising_call_leaves_the_model_as_found() -> None:
    x = torch.randn(6, 3, dtype=DT)
    w = torch.rand(3, dtype=DT)
    f = lambda x, w: torch.tanh(x * w)  # noqa: E731
    ref = vmap(jacrev(f), in_dims=(0, None))(x, w)
    torch.testing.assert_close(jm.jacobian(f, x, w, in_dims={"w": None}), ref, **CLOSE)
    torch.testing.assert_close(jm.jacobian(f, x, w, in_dims={1: None}), ref, **CLOSE)
    torch.manual_seed(0)
    model = Masked().to(DT)
    model.eval()
    before = snapshot(model)
    with pytest.raises(RuntimeError):
        jm.jacobian(model, x, torch.ones(6, 5, dtype=DT), wrt="params")  # f's own shape error, on the whole batch
    after = snapshot(model)
    assert type(model) is Masked and after[2:] == before[2:] and not model.training
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
