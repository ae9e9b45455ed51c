"""Functional parameters: ``wrt=params_dict``, ``fn(params, x)`` with broadcast params, ensembles.

Every result is compared with a float64 torch.func oracle that evaluates the same
``functional_call`` sample by sample (``vmap(jacrev(...), in_dims=(None, 0))``, ``vmap(grad(...))``)
or with a loop over the models of an ensemble; the module must be left as found (parameters,
buffers, flags, hooks, the parameter objects themselves), also when the call raises.
"""

from __future__ import annotations

import copy
import gc
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call, grad, jacfwd, jacrev, stack_module_state, vmap
from torch.utils._pytree import tree_leaves

import jacmode as jm
from jacmode import _problem, _profile
from jacmode._jacobian import JacobianEntry
from jacmode._probes import layerio
from _zoo_models import one_intra_op_thread  # noqa: F401 -- tiny tensors: one thread
from conftest import assert_unchanged, snapshot

DT = torch.float64
Params = dict[str, Tensor]


def mlp(d_in: int = 3, d_out: int = 2, width: int = 5, depth: int = 1, bias: bool = True,
        act: Callable[[], nn.Module] = nn.Tanh) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, width, bias=bias), act()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width, bias=bias), act()]
    return nn.Sequential(*layers, nn.Linear(width, d_out, bias=bias)).to(DT)


def other(net: nn.Module, shift: float = 0.5) -> Params:
    """Values other than the module's own, as a functional optimiser holds them."""
    return {k: v.detach() + shift * torch.randn_like(v) for k, v in net.named_parameters()}


def oracle(net: nn.Module, params: Params, x: Tensor) -> Params:
    """{name: (B, *out, *shape)}: torch.func's per-sample Jacobian of functional_call(net, params, x_b)."""
    return vmap(jacrev(lambda p, xb: functional_call(net, p, (xb[None],))[0]), in_dims=(None, 0))(params, x)


def flat(blocks: Params, batch: int, n_out: int) -> Tensor:
    return torch.cat([t.reshape(batch, n_out, -1) for t in blocks.values()], dim=-1)


def close(a: Any, b: Any, tol: float = 1e-10) -> None:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        assert u.shape == v.shape
        torch.testing.assert_close(u, v, rtol=tol, atol=tol)


def probed(call: Callable[[], Any]) -> tuple[Any, list[tuple[str, bool]]]:
    """``call()`` and, for each parameter problem it built, (the module's class, whether probes cover it)."""
    seen: list[tuple[str, bool]] = []
    orig = _problem._params_problem

    def spy(*a: Any, **k: Any) -> Any:
        p = orig(*a, **k)
        seen.append((type(p.model).__name__, p.probes is not None))
        return p

    _problem._params_problem = spy  # type: ignore[assignment]
    try:
        return call(), seen
    finally:
        _problem._params_problem = orig  # type: ignore[assignment]


def objects(net: nn.Module) -> list[tuple[int, int]]:
    """The identity of every parameter and buffer slot: a bound dict must be swapped out again."""
    return [(id(m), id(t)) for m in net.modules() for t in (*m._parameters.values(), *m._buffers.values())]


# ---- wrt=params_dict -------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(depth=st.integers(1, 2), width=st.integers(1, 5), bias=st.booleans(), batch=st.integers(1, 5),
       mode=st.sampled_from(["auto", "forward", "reverse"]), data=st.data())
def test_dict_matches_functional_call_oracle(depth: int, width: int, bias: bool, batch: int, mode: str,
                                              data: st.DataObject) -> None:
    net = mlp(width=width, depth=depth, bias=bias, act=nn.Tanh if depth == 1 else nn.Softplus)
    names = list(dict(net.named_parameters()))
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    params = {n: v for n, v in other(net).items() if n in chosen}
    params = dict(reversed(list(params.items()))) if data.draw(st.booleans()) else params  # any order
    x = torch.randn(batch, 3, dtype=DT)
    before, slots = snapshot(net), objects(net)
    want = oracle(net, params, x)
    got = jm.jacobian(net, x, wrt=params, mode=mode, flatten=False)
    assert list(got) == list(params)  # the dict's order
    close(got, want)
    close(jm.jacobian(net, x, wrt=params, mode=mode), flat(want, batch, 2))
    assert_unchanged(net, before)
    assert objects(net) == slots


def test_probes_fire_and_read_the_dicts_tensors() -> None:
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).to(DT)
    x = torch.randn(7, 6, dtype=DT)
    params = other(net)
    got, seen = probed(lambda: jm.jacobian(net, x, wrt=params))
    assert seen == [("Sequential", True)]
    close(got, flat(oracle(net, params, x), 7, 3))
    big = nn.Sequential(nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 3)).to(DT)
    xb = torch.randn(16, 64, dtype=DT)
    ours, own = jm.plan(big, xb, wrt=other(big)), jm.plan(big, xb, wrt="params")
    assert "layer-wise probes" in repr(ours) and (ours.mode, ours.strategy) == (own.mode, own.strategy)
    # a new dict of new tensors each step (a functional optimiser): right values, and caches that do not grow
    sizes = []
    for _ in range(4):
        params = other(net)
        close(jm.jacobian(net, x, wrt=params), flat(oracle(net, params, x), 7, 3))
        gc.collect()  # the cache is weakly keyed: count its live entries, not garbage from earlier tests
        sizes.append(sum(1 for _ in _problem._COVERAGE.items()))
    assert len(set(sizes)) == 1


class _Seen(nn.Module):
    """An MLP whose forward records (in the class) the module it runs as and the first layer's weight there."""

    log: list[tuple[nn.Module, Tensor]] = []

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(3, 5), nn.Linear(5, 2)
        self.act: Callable[[Tensor], Tensor] = torch.tanh

    def forward(self, x: Tensor) -> Tensor:
        _Seen.log.append((self, self.lin.weight))
        return self.out(self.act(self.lin(x)))


def test_calls_at_a_dict_run_on_a_kept_copy_of_the_model() -> None:
    """The user's model never holds the dict's tensors (its forward runs as a copy's); one copy serves
    every step of a functional optimiser, and follows the model's changes between steps (an
    attribute, a layer replaced by one of another shape, train/eval)."""
    net = _Seen().to(DT)
    x = torch.randn(6, 3, dtype=DT)
    log = _Seen.log
    log.clear()
    for step in range(6):
        if step == 3:
            net.act = torch.sin  # the copy reads the model as it is now
        if step == 4:
            net.out = nn.Linear(5, 4).to(DT)  # a layer of another shape: a new copy
        params, ref = other(net), copy.deepcopy(net)  # (the oracles run on a deep copy: logged as it)
        close(jm.jacobian(net, x, wrt=params, flatten=False), oracle(ref, params, x))
        close(jm.per_sample_grads(net, x, lambda o: (o ** 2).sum(1), wrt=params, flatten=False),
              vmap(grad(lambda p, xb: (functional_call(ref, p, (xb[None],)) ** 2).sum()), in_dims=(None, 0))(params, x))
    assert log and all(module is not net for module, _ in log)
    assert all(net.lin.weight is not w for _, w in log)
    log.clear()
    copies = jm._guard.peek(net).copies  # one thread: one copy, kept (remade once, for the new shape)
    assert len(copies) == 1


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
def test_create_graph_gives_gradients_to_the_dict(mode: str) -> None:
    net = mlp()
    x = torch.randn(6, 3, dtype=DT)
    params = {n: v.requires_grad_() for n, v in other(net).items()}
    w = torch.randn(6, 2, 32, dtype=DT)
    J = jm.jacobian(net, x, wrt=params, create_graph=True, mode=mode)
    got = torch.autograd.grad((J * w).sum(), list(params.values()), allow_unused=True, materialize_grads=True)
    O = flat(oracle(net, params, x), 6, 2)
    want = torch.autograd.grad((O * w).sum(), list(params.values()), allow_unused=True, materialize_grads=True)
    close(got, want)
    assert all(p.grad is None for p in net.parameters())


def test_buffers_tied_weights_and_shared_tensors() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.out = nn.Linear(3, 3)
            self.out.weight = self.lin.weight  # tied
            self.register_buffer("scale", torch.ones(3))

        def forward(self, x: Tensor) -> Tensor:
            return self.out(torch.tanh(self.lin(x) * self.scale))

    net = Scaled().to(DT)
    x = torch.randn(4, 3, dtype=DT)
    # a floating buffer, and one of two tied names (the other follows it, as functional_call's tie_weights)
    params = {"scale": torch.rand(3, dtype=DT) + 0.5, "lin.weight": torch.randn(3, 3, dtype=DT)}
    close(jm.jacobian(net, x, wrt=params, flatten=False), oracle(net, params, x))
    # one tensor object for two untied names: each name gets its own columns, as jacrev over the dict
    plain = mlp(d_in=3, d_out=3, width=3)
    t = torch.randn(3, 3, dtype=DT)
    shared = {"0.weight": t, "2.weight": t}
    close(jm.jacobian(plain, x, wrt=shared, flatten=False), oracle(plain, shared, x))


def test_module_left_as_found_when_the_call_raises() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.armed = False

        def forward(self, x: Tensor) -> Tensor:
            if self.armed and self.lin.weight.grad_fn is None and not isinstance(self.lin.weight, nn.Parameter):
                raise RuntimeError("boom")
            return self.lin(x)

    net = Fails().to(DT)
    net.lin.weight.grad = torch.ones_like(net.lin.weight)
    net.eval()
    before, slots = snapshot(net), objects(net)
    net.armed = True
    with pytest.raises(RuntimeError, match="boom"):
        jm.jacobian(net, torch.randn(4, 3, dtype=DT), wrt={"lin.weight": torch.randn(2, 3, dtype=DT)})
    net.armed = False
    assert_unchanged(net, before)
    assert objects(net) == slots and isinstance(net.lin.weight, nn.Parameter)


def test_products_take_a_dict() -> None:
    net = mlp(width=4)
    x, y = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT)
    params = {k: v for k, v in other(net).items() if k != "0.bias"}
    before = snapshot(net)

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    g = vmap(grad(lambda p, xb, yb: loss(functional_call(net, p, (xb[None],)), yb[None]).sum()),
             in_dims=(None, 0, 0))(params, x, y)
    close(jm.per_sample_grads(net, x, loss, y=y, wrt=params, flatten=False), g)
    close(jm.per_sample_grads(net, x, loss, y=y, wrt=params), torch.cat([t.reshape(5, -1) for t in g.values()], 1))
    J = flat(oracle(net, params, x), 5, 2)  # (B, Y, P)
    close(jm.ggn(net, x, "mse", wrt=params), torch.einsum("byp,byq->pq", J, J))
    close(jm.ggn(net, x, "mse", wrt=params, diagonal=True), (J ** 2).sum((0, 1)))
    x2 = torch.randn(3, 3, dtype=DT)
    J2 = flat(oracle(net, params, x2), 3, 2)
    close(jm.ntk(net, x, x2, wrt=params), torch.einsum("byp,czp->bcyz", J, J2))
    assert jm.ntk_plan(net, x, x2, wrt=params).method in ("structured", "contraction", "products")
    assert_unchanged(net, before)


# ---- errors -------------------------------------------------------------------------------------------

def test_dict_errors() -> None:
    net = mlp()
    x = torch.randn(4, 3, dtype=DT)
    good = other(net)
    with pytest.raises(ValueError, match=r"wrt: '0\.wieght' is not a parameter of Sequential\. Did you mean '0\.weight'"):
        jm.jacobian(net, x, wrt={"0.wieght": good["0.weight"]})
    with pytest.raises(ValueError, match=r"wrt: the value of '0\.weight' has shape \(3, 5\), but the module's"):
        jm.jacobian(net, x, wrt={"0.weight": good["0.weight"].T})
    with pytest.raises(TypeError, match=r"wrt: the value of '0\.weight' has dtype torch\.int64; .*floating"):
        jm.jacobian(net, x, wrt={"0.weight": torch.ones(5, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match=r"wrt: the value of '0\.bias' must be a tensor .*got list"):
        jm.per_sample_grads(net, x, lambda o: o.sum(1), wrt={"0.bias": [0.0] * 5})
    with pytest.raises(TypeError, match=r"wrt: a dict of parameter tensors needs f to be an nn\.Module.*argnums=0"):
        jm.jacobian(lambda v: net(v), x, wrt=good)
    with pytest.raises(ValueError, match=r"wrt: got an empty dict"):
        jm.ggn(net, x, wrt={})
    with pytest.raises(TypeError, match=r"wrt: the dict's tensors must share one dtype and device"):
        jm.ntk(net, x, wrt={"0.weight": good["0.weight"], "0.bias": good["0.bias"].float()})
    with pytest.raises(TypeError, match=r"wrt: dict keys must be parameter names \(str\)"):
        jm.jacobian(net, x, wrt={0: good["0.weight"]})
    with pytest.raises(TypeError, match=r"wrt: a dict of parameter tensors is not taken by this function"):
        next(iter(jm.jacobians(net, iter([x]), wrt=good)))
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)).to(DT)
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match=r"wrt: \['0\.weight', '1\.weight'\] are tied in the module"):
        jm.jacobian(tied, x, wrt={"0.weight": torch.randn(3, 3, dtype=DT), "1.weight": torch.randn(3, 3, dtype=DT)})


def test_functional_style_errors() -> None:
    net = mlp()
    x, params = torch.randn(4, 3, dtype=DT), other(net)

    def fn(p: Params, v: Tensor) -> Tensor:
        return functional_call(net, p, (v,))

    with pytest.raises(ValueError, match=r"in_dims: every argument is broadcast"):
        jm.jacobian(fn, params, x, argnums=0, in_dims=None)
    with pytest.raises(ValueError, match=r"in_dims: the differentiated arguments \(0, 1\) are broadcast for some"):
        jm.jacobian(lambda p, v: fn(p, v), params, x, argnums=(0, 1), in_dims=(None, 0))
    with pytest.raises(ValueError, match=r"flatten: not taken with broadcast differentiated arguments"):
        jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0), flatten=True)
    with pytest.raises(ValueError, match=r"batched: not taken with broadcast differentiated arguments"):
        jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0), batched=False)
    with pytest.raises(TypeError, match=r"argument 0: differentiating needs a floating dtype"):
        jm.jacobian(fn, {"0.weight": torch.ones(5, 3, dtype=torch.long)}, x, argnums=0, in_dims=(None, 0))
    with pytest.raises(TypeError, match=r"argument 0: expected a tensor to differentiate, got str"):
        jm.jacobian(fn, "weights", x, argnums=0, in_dims=(None, 0))
    with pytest.raises(ValueError, match=r"in_dims: the batched arguments must share dim 0"):
        jm.jacobian(lambda w, a, b: a @ w + b, torch.randn(3, 2, dtype=DT), x, torch.randn(5, 2, dtype=DT),
                    argnums=0, in_dims=(None, 0, 0))


# ---- functional style: fn(params, x) -----------------------------------------------------------------

NET = mlp()

FNS: dict[str, tuple[Callable[..., Any], bool]] = {  # fn(params, x), and whether the probes serve it
    "functional_call": (lambda p, x: functional_call(NET, p, (x,)), True),
    "functional_call, kwargs dict": (lambda p, x: functional_call(NET, p, args=(), kwargs={"input": x}), False),
    "after the model": (lambda p, x: torch.sin(functional_call(NET, p, (x,))), False),
    "input depends on params": (lambda p, x: functional_call(NET, p, (x * p["0.bias"].sum(),)), False),
    "modified params": (lambda p, x: functional_call(NET, {k: 2 * v for k, v in p.items()}, (x,)), False),
    "tuple output": (lambda p, x: (functional_call(NET, p, (x,)), functional_call(NET, p, (x,)).sum(1)), False),
    "by hand": (lambda p, x: torch.tanh(x @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"], False),
}


@pytest.mark.parametrize("name", list(FNS))
def test_functional_style_matches_torch_func(name: str) -> None:
    fn, fast = FNS[name]
    x, params = torch.randn(5, 3, dtype=DT), other(NET)
    before = snapshot(NET)
    got, seen = probed(lambda: jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0)))

    def one(p: Params, xb: Tensor) -> Any:
        return torch.utils._pytree.tree_map(lambda t: t[0], fn(p, xb[None]))

    close(got, vmap(jacrev(one), in_dims=(None, 0))(params, x))
    assert (seen == [("Sequential", True)]) == fast
    assert_unchanged(NET, before)


def test_functional_style_several_arguments() -> None:
    x, m = torch.randn(6, 3, dtype=DT), torch.rand(6, 4, dtype=DT)
    w, b = torch.randn(4, 3, dtype=DT), torch.randn(4, dtype=DT)

    def f2(w: Tensor, b: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(x @ w.T + b)

    got = jm.jacobian(f2, w, b, x, argnums=(0, 1), in_dims=(None, None, 0))
    close(got, vmap(jacrev(f2, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x))

    def f3(w: Tensor, x: Tensor, m: Tensor) -> Tensor:  # two batched arguments
        return torch.tanh(x @ w.T) * m

    close(jm.jacobian(f3, w, x, m, argnums=0, in_dims=(None, 0, 0)), vmap(jacrev(f3), in_dims=(None, 0, 0))(w, x, m))
    assert jm.plan(f2, w, b, x, argnums=(0, 1), in_dims=(None, None, 0)).directions > 0


def test_functional_style_create_graph() -> None:
    x = torch.randn(5, 3, dtype=DT)
    params = {n: v.requires_grad_() for n, v in other(NET).items()}
    fn = FNS["functional_call"][0]
    J = jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0), create_graph=True)
    O = oracle(NET, params, x)
    got = torch.autograd.grad(sum(t.sin().sum() for t in J.values()), list(params.values()), allow_unused=True,
                              materialize_grads=True)
    want = torch.autograd.grad(sum(t.sin().sum() for t in O.values()), list(params.values()), allow_unused=True,
                               materialize_grads=True)
    close(got, want)


# ---- ensembles: vmap over torch.func.stack_module_state ------------------------------------------------

def _ensemble(n: int = 3) -> tuple[list[nn.Module], Params, nn.Module]:
    models = [nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 2)).to(DT) for _ in range(n)]
    stacked, _ = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    return models, stacked, base


ENSEMBLE: dict[str, Callable[[nn.Module, Callable[..., Tensor], Params, Tensor], Any]] = {
    "jacobian inputs": lambda m, fm, p, x: jm.jacobian(lambda v: fm(p, v), x),
    "jacobian inputs, reverse": lambda m, fm, p, x: jm.jacobian(lambda v: fm(p, v), x, mode="reverse"),
    "hessian": lambda m, fm, p, x: jm.hessian(lambda v: fm(p, v)[:, 0], x),
    "laplacian": lambda m, fm, p, x: jm.laplacian(lambda v: fm(p, v), x),
    "jacobian wrt dict": lambda m, fm, p, x: jm.jacobian(m, x, wrt=p),
    "jacobian wrt dict, forward": lambda m, fm, p, x: jm.jacobian(m, x, wrt=p, mode="forward", flatten=False),
    "functional style": lambda m, fm, p, x: jm.jacobian(fm, p, x, argnums=0, in_dims=(None, 0)),
    "per_sample_grads": lambda m, fm, p, x: jm.per_sample_grads(m, x, lambda o: (o ** 2).sum(1), wrt=p),
    "per_sample_grads, torch loss": lambda m, fm, p, x: jm.per_sample_grads(
        m, x, nn.MSELoss(), y=torch.ones(x.shape[0], 2, dtype=DT), wrt=p, flatten=False),
}


@pytest.mark.parametrize("name", list(ENSEMBLE))
def test_vmap_over_stacked_parameters_matches_a_loop(name: str) -> None:
    models, stacked, base = _ensemble()
    x = torch.randn(5, 3, dtype=DT)

    def fm(p: Params, v: Tensor) -> Tensor:
        return functional_call(base, p, (v,))

    call = ENSEMBLE[name]
    got = vmap(lambda p: call(base, fm, p, x))(stacked)
    for i, model in enumerate(models):
        mine = {n: t[i] for n, t in stacked.items()}
        want = call(model, lambda p, v: functional_call(model, p, (v,)), mine, x)
        close(torch.utils._pytree.tree_map(lambda t: t[i], got), want)


def test_per_sample_grads_inside_grad_and_jacfwd() -> None:
    net = mlp()
    x, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    def ours(v: Tensor) -> Tensor:
        return jm.per_sample_grads(net, v, loss, y=y)

    params = {n: p.detach() for n, p in net.named_parameters()}

    def theirs(v: Tensor) -> Tensor:
        g = vmap(grad(lambda p, xb, yb: loss(functional_call(net, p, (xb[None],)), yb[None]).sum()),
                 in_dims=(None, 0, 0))(params, v, y)
        return torch.cat([t.reshape(v.shape[0], -1) for t in g.values()], 1)

    close(grad(lambda v: ours(v).pow(2).sum())(x), grad(lambda v: theirs(v).pow(2).sum())(x))
    close(jacfwd(ours)(x), jacfwd(theirs)(x))
    # meta-learning: the gradient of a loss of per-sample gradients with respect to the parameters
    def one(q: Params, xb: Tensor, yb: Tensor) -> Tensor:
        return loss(functional_call(net, q, (xb[None],)), yb[None]).sum()

    meta = grad(lambda p: jm.per_sample_grads(net, x, loss, y=y, wrt=p).pow(2).sum())(params)
    ref = grad(lambda p: sum(t.pow(2).sum() for t in vmap(grad(one), in_dims=(None, 0, 0))(p, x, y).values()))(params)
    close(meta, ref)


def test_cache_entries_do_not_grow_with_new_dicts() -> None:
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).to(DT)
    x, y = torch.randn(8, 4, dtype=DT), torch.randn(8, 2, dtype=DT)
    counts = []
    for _ in range(4):  # net's first call (the first jacobian) caches nothing (_guard.py): counted from the second round
        p = other(net)
        jm.jacobian(net, x, wrt=p)
        jm.per_sample_grads(net, x, lambda o, t: ((o - t) ** 2).sum(1), y=y, wrt=p)
        counts.append((sum(1 for _ in _problem._COVERAGE.items()), sum(1 for _ in layerio._COVERAGE.items()),
                       sum(1 for _ in _profile._PROFILES.items())))
    assert counts[1] == counts[-1]
    # a repeated call with a new dict reuses the problem's facts (no describe), reading the new tensors
    described: list[int] = []
    orig = _problem.describe

    def spy(*a: Any, **k: Any) -> Any:
        described.append(1)
        return orig(*a, **k)

    import jacmode._jacobian as _jac
    _jac.describe = spy  # type: ignore[assignment]
    try:
        p = other(net)
        close(jm.jacobian(net, x, wrt=p), flat(oracle(net, p, x), 8, 2))
    finally:
        _jac.describe = orig  # type: ignore[assignment]
    assert described == []
    held = [t for _, _, prof in _profile._PROFILES.items() if isinstance(prof.facts, JacobianEntry)
            for t in (*prof.facts.problem.tensors, *prof.holds)]
    assert not any(t is q for t in held for q in p.values())  # the cache keeps no dict's tensors


@pytest.mark.parametrize("name", ["functional_call", "by hand"])
def test_functional_per_sample_grads(name: str) -> None:
    fn = FNS[name][0]
    x, y, params = torch.randn(5, 3, dtype=DT), torch.randn(5, 2, dtype=DT), other(NET)

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    got = jm.per_sample_grads(fn, (params, x), loss, y=y, argnums=0, in_dims=(None, 0))
    want = vmap(grad(lambda p, xb, yb: loss(fn(p, xb[None]), yb[None]).sum()), in_dims=(None, 0, 0))(params, x, y)
    close(got, want)
    w, b = torch.randn(2, 3, dtype=DT), torch.randn(2, dtype=DT)
    got2 = jm.per_sample_grads(lambda w, b, v: v @ w.T + b, (w, b, x), loss, y=y, argnums=(0, 1), in_dims=(None, None, 0))
    want2 = vmap(grad(lambda w, b, xb, yb: loss((xb @ w.T + b)[None], yb[None]).sum(), argnums=(0, 1)),
                 in_dims=(None, None, 0, 0))(w, b, x, y)
    close(got2, want2)
    with pytest.raises(TypeError, match=r"f: per_sample_grads needs f to return one tensor"):
        jm.per_sample_grads(lambda p, v: (fn(p, v), 0), (params, x), loss, y=y, argnums=0, in_dims=(None, 0))


def _leaf_jacobian(fn: Callable[..., Any], params: Params, x: Tensor) -> Tensor:
    """(B, Y, P) of torch.func's ``vmap(jacrev(fn1), in_dims=(None, 0))`` for fn's one-sample spelling,
    the parameters flattened in the dict's order."""
    blocks = vmap(jacrev(lambda p, xb: fn(p, xb[None])[0]), in_dims=(None, 0))(params, x)
    return torch.cat([blocks[n].reshape(x.shape[0], -1, params[n].numel()) for n in params], -1)


@pytest.mark.parametrize("name", ["functional_call", "after the model", "by hand"])
def test_functional_ntk_and_ggn(name: str) -> None:
    """torch.func's NTK tutorial's spelling, fn(params, x) with params shared, for ntk, ntk_plan and ggn."""
    fn, fast = FNS[name]
    x1, x2, params = torch.randn(4, 3, dtype=DT), torch.randn(6, 3, dtype=DT), other(NET)
    before = snapshot(NET)
    j1, j2 = _leaf_jacobian(fn, params, x1), _leaf_jacobian(fn, params, x2)
    style = {"argnums": 0, "in_dims": (None, 0)}
    for _ in range(3):  # repeated calls, as a training loop makes them
        close(jm.ntk(fn, (params, x1), (params, x2), **style), torch.einsum("byp,czp->bcyz", j1, j2))
        close(jm.ntk(fn, (params, x1), x2=(params, x2), trace=True, **style), torch.einsum("byp,cyp->bc", j1, j2))
        close(jm.ntk(fn, (params, x1), **style), torch.einsum("byp,czp->bcyz", j1, j1))
        close(jm.ggn(fn, (params, x1), "mse", **style), torch.einsum("byp,byq->pq", j1, j1))
        close(jm.ggn(fn, (params, x1), "mse", diagonal=True, **style), torch.einsum("byp,byp->p", j1, j1))
        v = torch.randn(j1.shape[-1], dtype=DT)
        close(jm.ggn(fn, (params, x1), "mse", v=v, **style), torch.einsum("byp,byq,q->p", j1, j1, v))
    plan = jm.ntk_plan(fn, (params, x1), (params, x2), **style)  # per-layer rules: fn is the model in disguise
    assert ("structured needs a per-layer rule" not in repr(plan)) == fast
    assert_unchanged(NET, before)
    w, b = torch.randn(2, 3, dtype=DT), torch.randn(2, dtype=DT)
    k = jm.ntk(lambda w, b, v: torch.tanh(v @ w.T + b), (w, b, x1), (w, b, x2), argnums=(0, 1), in_dims=(None, None, 0))
    jw = vmap(jacrev(lambda w, b, v: torch.tanh(v @ w.T + b), argnums=(0, 1)), in_dims=(None, None, 0))
    f1, f2 = (torch.cat([t.reshape(t.shape[0], 2, -1) for t in jw(w, b, xs)], -1) for xs in (x1, x2))
    close(k, torch.einsum("byp,czp->bcyz", f1, f2))


def test_functional_products_errors() -> None:
    fn = FNS["functional_call"][0]
    x1, x2, params = torch.randn(4, 3, dtype=DT), torch.randn(6, 3, dtype=DT), other(NET)
    style = {"argnums": 0, "in_dims": (None, 0)}
    with pytest.raises(TypeError, match=r"x2: give x1 and x2 in the same form, both a tuple of fn's arguments"):
        jm.ntk(fn, (params, x1), x2, **style)
    with pytest.raises(ValueError, match=r"x2: broadcast argument leaf 0 \(in_dims=None\) must be the same"):
        jm.ntk(fn, (params, x1), ({k: v + 1 for k, v in params.items()}, x2), **style)
    with pytest.raises(ValueError, match=r"x2: argument leaf 4 must be a tensor of per-sample shape \(3,\)"):
        jm.ntk(fn, (params, x1), (params, x2[:, :2]), **style)
    with pytest.raises(ValueError, match=r"wrt: not taken with broadcast differentiated arguments"):
        jm.ggn(fn, (params, x1), wrt="params", **style)
    with pytest.raises(TypeError, match=r"f: ntk needs f to return one tensor \(the model's output\), got tuple"):
        jm.ntk(lambda p, v: (fn(p, v), 1), (params, x1), **style)
    for call in (lambda: jm.jacobian(lambda p, v, s=1.0: fn(p, v) * s, params, x1, kwargs={"s": 2.0}, **style),
                 lambda: jm.per_sample_grads(fn, (params, x1), lambda o: o.sum(1), kwargs={"s": 2.0}, **style),
                 lambda: jm.ntk(fn, (params, x1), kwargs={"s": 2.0}, **style)):
        with pytest.raises(ValueError, match=r"kwargs: not taken with broadcast differentiated arguments .* "
                                             r"functools\.partial"):
            call()


def test_functional_style_under_inference_mode_and_no_grad() -> None:
    x, params = torch.randn(4, 3, dtype=DT), other(NET)
    want = oracle(NET, params, x)
    for name in ("functional_call", "input depends on params"):
        fn = FNS[name][0]
        ref = vmap(jacrev(lambda p, xb: fn(p, xb[None])[0]), in_dims=(None, 0))(params, x)
        with torch.no_grad():
            close(jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0)), ref)
        with torch.inference_mode():
            close(jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0)), ref)
    with torch.inference_mode():
        close(jm.jacobian(NET, x, wrt=params, flatten=False), want)


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 4), width=st.integers(1, 4), data=st.data())
def test_per_sample_grads_and_ggn_with_dict_subsets(batch: int, width: int, data: st.DataObject) -> None:
    net = mlp(width=width, act=nn.Softplus)
    names = list(dict(net.named_parameters()))
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    params = {n: v for n, v in other(net).items() if n in chosen}
    x, y = torch.randn(batch, 3, dtype=DT), torch.randn(batch, 2, dtype=DT)
    before, slots = snapshot(net), objects(net)

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    g = vmap(grad(lambda p, xb, yb: loss(functional_call(net, p, (xb[None],)), yb[None]).sum()),
             in_dims=(None, 0, 0))(params, x, y)
    close(jm.per_sample_grads(net, x, loss, y=y, wrt=params, flatten=False), g)
    J = flat(oracle(net, params, x), batch, 2)
    close(jm.ggn(net, x, "mse", wrt=params, diagonal=True), (J ** 2).sum((0, 1)))
    assert_unchanged(net, before)
    assert objects(net) == slots


def test_a_layer_replaced_between_bound_calls() -> None:
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 2)).to(DT)
    x = torch.randn(9, 5, dtype=DT)
    p = other(net)
    close(jm.jacobian(net, x, wrt=p), flat(oracle(net, p, x), 9, 2))
    net[0] = nn.Linear(5, 6).to(DT)  # same names and shapes, another module
    p = other(net)
    close(jm.jacobian(net, x, wrt=p), flat(oracle(net, p, x), 9, 2))
    close(jm.per_sample_grads(net, x, lambda o: o.sum(1), wrt=p),
          torch.cat([t.reshape(9, -1) for t in vmap(grad(lambda q, xb: functional_call(net, q, (xb[None],)).sum()),
                                                   in_dims=(None, 0))(p, x).values()], 1))


def test_meta_base_model_errors() -> None:
    models, stacked, base = _ensemble()
    x = torch.randn(4, 3, dtype=DT)
    partial = {n: t for n, t in stacked.items() if n != "3.bias"}
    with pytest.raises(ValueError, match=r"wrt: the module's '3\.bias' is on the meta device"):
        vmap(lambda p: jm.jacobian(base, x, wrt=p))(partial)
    with pytest.raises(ValueError, match=r"x: is on cpu but parameter '0\.weight' of the model is on meta"):
        vmap(lambda p: jm.per_sample_grads(base, x, lambda o: o.sum(1)))(stacked)


def test_functional_style_keeps_no_arguments_alive() -> None:
    import gc
    import weakref

    from jacmode._args import params as rows

    def by_hand(p: Params, v: Tensor) -> Tensor:
        return torch.tanh(v @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"]

    x, params = torch.randn(4, 3, dtype=DT), other(NET)
    for _ in range(2):  # the second call reuses the first call's module of sample rows
        close(jm.jacobian(by_hand, params, x, argnums=0, in_dims=(None, 0)),
              vmap(jacrev(lambda p, xb: by_hand(p, xb[None])[0]), in_dims=(None, 0))(params, x))
    assert len(rows._HANDLES[by_hand]) == 1
    refs = [weakref.ref(x), *(weakref.ref(t) for t in params.values()), weakref.ref(by_hand)]
    del x, params, by_hand
    gc.collect()
    assert all(r() is None for r in refs)


def test_vmap_over_parameters_and_data() -> None:
    models, stacked, base = _ensemble(3)
    xs, ys = torch.randn(3, 5, 3, dtype=DT), torch.randn(3, 5, 2, dtype=DT)

    def loss(out: Tensor, t: Tensor) -> Tensor:
        return ((out - t) ** 2).sum(1)

    got = vmap(lambda p, xb, yb: jm.per_sample_grads(base, xb, loss, y=yb, wrt=p))(stacked, xs, ys)
    jac = vmap(lambda p, xb: jm.jacobian(base, xb, wrt=p, flatten=False))(stacked, xs)
    fn = vmap(lambda p, xb: jm.jacobian(lambda q, v: functional_call(base, q, (v,)), p, xb, argnums=0,
                                        in_dims=(None, 0)))(stacked, xs)
    for i, model in enumerate(models):
        close(got[i], jm.per_sample_grads(model, xs[i], loss, y=ys[i]))
        own = {n: t[i] for n, t in stacked.items()}
        want = oracle(model, own, xs[i])
        close({n: t[i] for n, t in jac.items()}, want)
        close({n: t[i] for n, t in fn.items()}, want)


def test_in_dims_by_name() -> None:
    x, params = torch.randn(4, 3, dtype=DT), other(NET)

    def fn(params: Params, x: Tensor) -> Tensor:
        return functional_call(NET, params, (x,))

    close(jm.jacobian(fn, params, x, argnums=0, in_dims={"params": None}), oracle(NET, params, x))


@pytest.mark.parametrize("how", ["grad", "jacfwd"])
def test_transforms_over_the_dict(how: str) -> None:
    net = mlp()
    x, params = torch.randn(4, 3, dtype=DT), other(net)
    if how == "grad":
        def T(f: Callable[[Params], Tensor]) -> Callable[[Params], Any]:
            return grad(lambda p: f(p).pow(2).sum())
    else:
        def T(f: Callable[[Params], Tensor]) -> Callable[[Params], Any]:
            return jacfwd(lambda p: f(p).sum((0, 1)))
    want = T(lambda p: flat(oracle(net, p, x), 4, 2))(params)
    close(T(lambda p: jm.jacobian(net, x, wrt=p))(params), want)
    close(T(lambda p: flat(jm.jacobian(lambda q, v: functional_call(net, q, (v,)), p, x, argnums=0,
                                       in_dims=(None, 0)), 4, 2))(params), want)
