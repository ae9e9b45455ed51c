"""Bugs found by outside testing, each against a float64 oracle: torch.func (jacfwd, hessian,
jacrev) or plain ``torch.autograd.grad`` loops over single samples."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import hessian, jacfwd, vmap

import jacmode as jm

DT = torch.float64


# ---- biharmonic's randomised estimator without return_std -------------------------------------


class U(nn.Module):
    """A tanh network of the kind PINN users write (captured: the collapsed Taylor path)."""

    def __init__(self, d: int = 3, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Soft(U):
    """The same network through softsign, which has no Taylor rule: the generic nested forward path."""

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.softsign(self.fc1(x)))


def _biharmonic_oracle(u: nn.Module, x: Tensor) -> Tensor:
    """sum_(i,j) d^4 u / dx_i^2 dx_j^2 per sample (B, Y): the Laplacian of the Laplacian, torch.func."""
    def lap(v: Tensor) -> Tensor:
        return torch.diagonal(hessian(lambda w: u(w[None])[0])(v), dim1=-2, dim2=-1).sum(-1)

    return torch.stack([torch.diagonal(jacfwd(jacfwd(lap))(x[b]), dim1=-2, dim2=-1).sum(-1)
                        for b in range(x.shape[0])])


def test_biharmonic_estimate_of_the_reported_network_has_the_batch_shape() -> None:
    torch.manual_seed(0)
    u = U().double()
    x = torch.randn(9, 3, dtype=DT)
    before = {k: v.clone() for k, v in u.state_dict().items()}
    est = jm.biharmonic(u, x, samples=4)
    assert est.shape == (9, 1) and est.dtype == DT and bool(torch.isfinite(est).all())
    assert all(torch.equal(before[k], v) for k, v in u.state_dict().items())  # the model is left as it was


@pytest.mark.parametrize("cls", [U, Soft], ids=["captured", "generic"])
def test_biharmonic_estimate_is_unbiased_against_torch_func(cls: type) -> None:
    torch.manual_seed(1)
    u = cls().double()
    x = torch.randn(9, 3, dtype=DT)
    exact = _biharmonic_oracle(u, x)
    torch.testing.assert_close(jm.biharmonic(u, x), exact, rtol=1e-9, atol=1e-9)  # the exact mode
    k = 4000 if cls is U else 1000
    est = jm.biharmonic(u, x, samples=k, generator=torch.Generator().manual_seed(3))
    same, err = jm.biharmonic(u, x, samples=k, generator=torch.Generator().manual_seed(3), return_std=True)
    torch.testing.assert_close(est, same, rtol=1e-12, atol=1e-12)  # the same draws, with or without the error
    assert ((est - exact) / err).abs().max() < 4.5  # 9 estimates, each within 4.5 standard errors


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 7), d=st.integers(1, 4), k=st.integers(1, 6), chunk=st.sampled_from([None, 1, 3]),
       generic=st.booleans())
def test_biharmonic_estimate_shapes_and_draws_over_batches_and_dimensions(
    b: int, d: int, k: int, chunk: Optional[int], generic: bool
) -> None:
    torch.manual_seed(b * 100 + d * 10 + k)
    u = (Soft if generic else U)(d, 6).double()
    x = torch.randn(b, d, dtype=DT)
    est = jm.biharmonic(u, x, samples=k, chunk_size=chunk, generator=torch.Generator().manual_seed(5))
    assert est.shape == (b, 1)
    # the estimate is the mean over the K draws of D^4 u[v]^4 / 3: rebuilt from the same directions
    v = torch.randn((k, b, d), generator=torch.Generator().manual_seed(5), dtype=DT)
    def h(t: Tensor, w: Tensor, xi: Tensor) -> Tensor:
        return u(xi[None] + t * w)[0, 0]  # u along one direction w of one sample xi

    d4 = jacfwd(jacfwd(jacfwd(jacfwd(h))))  # every draw of every sample in one vmapped call (the same numbers)
    draws = vmap(vmap(d4, in_dims=(None, 0, None)), in_dims=(None, 1, 0))(torch.zeros((), dtype=DT), v, x)  # (b, k)
    want = (draws / 3.0).mean(1)[:, None]
    torch.testing.assert_close(est, want, rtol=1e-8, atol=1e-8)


# ---- the independence check on a model that casts float token ids ------------------------------


class Tok(nn.Module):
    """Float token ids cast inside forward: noise on the ids would move them off the table."""

    def __init__(self, couple: str = "") -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 3)
        self.couple = couple

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x.long()).mean(1)
        if self.couple == "mean":  # the ids of every sample reach every output, through values only
            h = h - h.mean(0)
        elif self.couple == "cumsum":
            h = h.cumsum(0)
        elif self.couple == "flip":
            h = h.flip(0)
        return self.fc(h)


def _tok(couple: str = "", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Tok(couple).double()


def _ids(b: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 10, (b, 6), generator=torch.Generator().manual_seed(seed)).double()


def _state(m: nn.Module) -> dict[str, Any]:
    return {k: v.clone() for k, v in m.state_dict().items()} | {"training": m.training}


def _same_state(m: nn.Module, before: dict[str, Any]) -> bool:
    return m.training == before["training"] and all(torch.equal(before[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("b", [5, 20])  # every sample probed; 8 of 20 probed
def test_per_sample_grads_of_float_ids_cast_in_forward(b: int) -> None:
    m, x = _tok(), _ids(b)
    y = torch.randint(0, 3, (b,), generator=torch.Generator().manual_seed(1))
    before = _state(m)
    per_sample = jm.per_sample_grads(m, x, lambda out, t: F.cross_entropy(out, t, reduction="none"), y=y,
                                     flatten=False)
    batch_mean = jm.per_sample_grads(m, x, nn.CrossEntropyLoss(), y=y)  # rows of torch's mean loss: 1/B each
    names = [n for n, _ in m.named_parameters()]
    for i in range(b):  # the oracle: one sample at a time, plain autograd
        g = torch.autograd.grad(F.cross_entropy(m(x[i : i + 1]), y[i : i + 1]), list(m.parameters()))
        for n, r in zip(names, g):
            torch.testing.assert_close(per_sample[n][i], r, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(batch_mean[i], torch.cat([r.reshape(-1) for r in g]) / b, rtol=1e-10, atol=1e-12)
    assert _same_state(m, before)


@pytest.mark.parametrize("b", [5, 20])
def test_parameter_jacobian_of_float_ids_cast_in_forward(b: int) -> None:
    m, x = _tok(seed=2), _ids(b, seed=3)
    before = _state(m)
    J = jm.jacobian(m, x, wrt="params")
    params = list(m.parameters())
    want = torch.stack([
        torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
                     for o in m(x[i : i + 1])[0]])
        for i in range(b)
    ])
    torch.testing.assert_close(J, want, rtol=1e-10, atol=1e-12)
    assert _same_state(m, before)


@pytest.mark.parametrize("couple", ["mean", "cumsum", "flip"])
@pytest.mark.parametrize("b", [5, 20])
def test_coupled_float_ids_are_still_refused(couple: str, b: int) -> None:
    m, x = _tok(couple), _ids(b)
    y = torch.randint(0, 3, (b,), generator=torch.Generator().manual_seed(1))
    with pytest.raises(jm.CoupledBatchError, match="other samples of the batch changed the output"):
        jm.per_sample_grads(m, x, nn.CrossEntropyLoss(), y=y)
    jm.clear_cache()
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        jm.jacobian(m, x, wrt="params")


def test_float_ids_as_a_second_argument_follow_their_samples() -> None:
    class Scaled(nn.Module):
        def __init__(self, couple: bool) -> None:
            super().__init__()
            self.emb, self.fc, self.couple = nn.Embedding(10, 4), nn.Linear(4, 3), couple

        def forward(self, w: Tensor, ids: Tensor) -> Tensor:
            h = self.emb(ids.long()).mean(1) * w
            return self.fc(h - h.mean(0) if self.couple else h)

    torch.manual_seed(0)
    m = Scaled(False).double()
    w, ids = torch.randn(12, 1, dtype=DT), _ids(12)
    J = jm.jacobian(m, w, ids)  # d out / d w, the ids ride along with their samples
    want = torch.stack([jacfwd(lambda v, i=i: m(v[None], ids[i : i + 1])[0])(w[i]) for i in range(12)])
    torch.testing.assert_close(J, want, rtol=1e-10, atol=1e-12)
    m.couple = True
    jm.clear_cache()
    with pytest.raises(jm.CoupledBatchError, match="coupled"):
        jm.jacobian(m, w, ids)


def test_float_ids_the_check_cannot_tell_or_that_need_distinct_samples() -> None:
    m = _tok()
    with pytest.raises(ValueError, match="too few distinct samples.*cannot tell whether the samples are independent"):
        jm.jacobian(m, torch.full((4, 6), 3.0, dtype=DT), wrt="params")  # every sample the same

    class Distinct(Tok):
        def forward(self, x: Tensor) -> Tensor:
            if torch.unique(x, dim=0).shape[0] < x.shape[0]:
                raise RuntimeError("repeated sample")
            return super().forward(x)

    torch.manual_seed(0)
    with pytest.raises(ValueError, match="RuntimeError: repeated sample.*not a function of each sample alone"):
        jm.jacobian(Distinct().double(), _ids(5), wrt="params")


# ---- jacobian(f, x) of an f that returns a tuple, list or dict ----------------------------------


def _pytree_f(x: Tensor) -> Any:
    return (torch.sin(x) * x[:, :1], {"sq": x**2, "sum": [x.sum(1, keepdim=True).tanh()]})


def _per_sample(f: Any) -> Any:
    """f of one sample (no batch dimension), for ``vmap(jacrev(...))``."""
    return lambda v: torch.utils._pytree.tree_map(lambda t: t[0], f(v[None]))


def _assert_tree_close(got: Any, want: Any) -> None:
    g, g_spec = torch.utils._pytree.tree_flatten(got)
    w, w_spec = torch.utils._pytree.tree_flatten(want)
    assert g_spec == w_spec, (g_spec, w_spec)
    for a, b in zip(g, w):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["auto", "forward", "reverse"])
@pytest.mark.parametrize("batched", [True, False])
def test_one_argument_jacobian_of_a_pytree_output_is_torch_funcs(mode: str, batched: bool) -> None:
    x = torch.randn(4, 3, dtype=DT)
    want = torch.func.vmap(torch.func.jacrev(_per_sample(_pytree_f)))(x) if batched else \
        torch.func.jacrev(_pytree_f)(x)
    _assert_tree_close(jm.jacobian(_pytree_f, x, mode=mode, batched=batched), want)
    _assert_tree_close(jm.jacobian(_pytree_f, x, argnums=0, mode=mode, batched=batched), want)
    _assert_tree_close(jm.jacobian(_pytree_f, x, mode=mode, batched=batched), want)  # the second call
    _assert_tree_close(jm.jacfn(_pytree_f, mode=mode, batched=batched)(x), want)
    as_tuple = torch.utils._pytree.tree_map(lambda t: (t,), want)  # a tuple argnums: one Jacobian per argnum
    _assert_tree_close(jm.jacobian(_pytree_f, x, argnums=(0,), mode=mode, batched=batched), as_tuple)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(1, 5), d=st.integers(1, 4), kind=st.sampled_from(["tuple", "list", "dict"]),
       mode=st.sampled_from(["auto", "forward", "reverse"]))
def test_pytree_outputs_over_batches_dimensions_and_containers(b: int, d: int, kind: str, mode: str) -> None:
    torch.manual_seed(b * 10 + d)
    net = nn.Sequential(nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, 2)).double()

    def f(x: Tensor) -> Any:
        y = net(x)
        leaves = [y, torch.exp(x) * y[:, :1]]
        return tuple(leaves) if kind == "tuple" else leaves if kind == "list" else dict(zip("ab", leaves))

    x = torch.randn(b, d, dtype=DT)
    _assert_tree_close(jm.jacobian(f, x, mode=mode), torch.func.vmap(torch.func.jacrev(_per_sample(f)))(x))


def test_pytree_output_with_has_aux() -> None:
    x = torch.randn(5, 3, dtype=DT)

    def f(x: Tensor) -> Any:
        return _pytree_f(x), {"norm": x.norm(dim=1)}

    J, aux = jm.jacobian(f, x, has_aux=True)
    want, want_aux = torch.func.vmap(torch.func.jacrev(_per_sample(lambda v: f(v)[0])))(x), f(x)[1]
    _assert_tree_close(J, want)
    _assert_tree_close(aux, want_aux)


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        y = self.lin(x)
        return {"logits": y, "energy": (y**2).sum(1)}


def test_pytree_output_of_a_module_for_inputs_and_parameters() -> None:
    torch.manual_seed(0)
    m, x = DictNet().double(), torch.randn(4, 3, dtype=DT)
    before = _state(m)
    params = dict(m.named_parameters())
    per_sample = torch.func.vmap(torch.func.jacrev(lambda v: torch.utils._pytree.tree_map(
        lambda t: t[0], torch.func.functional_call(m, params, (v[None],)))))(x)
    _assert_tree_close(jm.jacobian(m, x), per_sample)
    # parameters: (B, Y, P) with Y running over the output leaves in pytree order, as with argnums=(0,)
    J = jm.jacobian(m, x, wrt="params")
    rows = []
    for i in range(4):
        out = m(x[i : i + 1])
        ys = torch.cat([t[0].reshape(-1) for t in torch.utils._pytree.tree_leaves(out)])
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(y, list(m.parameters()),
                                                                                        retain_graph=True)])
                                 for y in ys]))
    torch.testing.assert_close(J, torch.stack(rows), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(J, jm.jacobian(m, x, wrt="params", argnums=(0,)), rtol=0, atol=0)
    blocks = jm.jacobian(m, x, wrt="params", flatten=False)
    assert set(blocks) == {"logits", "energy"} and blocks["energy"]["lin.weight"].shape == (4, 2, 3)
    assert jm.plan(m, x).mode in ("forward", "reverse")
    assert _same_state(m, before)


def test_pytree_output_errors() -> None:
    x = torch.randn(4, 3, dtype=DT)
    with pytest.raises(ValueError, match="out: not supported .* an f that returns a tuple, list or dict.*drop out="):
        jm.jacobian(_pytree_f, x, out=torch.empty(4, 3, 3, dtype=DT))
    with pytest.raises(ValueError, match=r"structure: 'diagonal' needs .* got 1 differentiated tensor\(s\) and 3 "
                                         r"output tensor\(s\)\. Use structure='auto'"):
        jm.jacobian(_pytree_f, x, structure="diagonal")
    lstm = nn.LSTM(3, 4, batch_first=True).double()  # (output, (h, c)): h and c hold the batch in dim 1
    with pytest.raises(ValueError, match=r"every output must have the batch dimension 2 first.*got an output of "
                                         r"shape \(1, 2, 4\).*lambda x: model\(x\)\[0\].*batched=False"):
        jm.jacobian(lstm, torch.randn(2, 5, 3, dtype=DT))
    with pytest.raises(TypeError, match=r"f: expected f\(x\) to return one torch.Tensor, got tuple.*select one"):
        jm.laplacian(_pytree_f, x)  # the operators take one output


# ---- generated probe code: a constant computed from a node that a mutating operation writes -------

class _SliceCat(nn.Module):
    """forward slices the first layer's output and concatenates it with a function of the rest: the
    generated probe step writes into a zeros tensor that a later node reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(1, 5), nn.Linear(5, 3)
        self.k = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.cat([h[:, : self.k], torch.sin(h[:, self.k:])], 1))


def test_generated_probe_code_folds_no_constant_computed_from_a_written_node() -> None:
    torch.manual_seed(0)
    m, x = _SliceCat().double(), torch.randn(3, 1, dtype=torch.float64)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def one(xb: torch.Tensor) -> torch.Tensor:
        j = torch.func.jacrev(lambda p: torch.func.functional_call(m, p, (xb[None],))[0])(params)
        return torch.cat([v.reshape(v.shape[0], -1) for v in j.values()], 1)

    want = torch.func.vmap(one)(x)
    for _ in range(6):  # generated code from the fourth call on
        torch.testing.assert_close(jm.jacobian(m, x, wrt="params"), want, rtol=1e-10, atol=1e-12)


def test_a_model_of_several_arguments_with_hooks_of_its_own_gets_its_hooks_on_its_arguments() -> None:
    """``jacobian(model, x, m, wrt="params")`` runs the model's own forward hooks and pre-hooks on the
    model's arguments (they used to receive the engines' sample indices: a raw IndexError), three calls in
    a row, and per_sample_grads agrees with torch.func."""
    from torch.func import functional_call, grad, jacrev, vmap

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * m

    torch.manual_seed(0)
    net = Masked().double()
    net.register_forward_hook(lambda mod, inp, out: out * 2)
    net.register_forward_pre_hook(lambda mod, inp: (inp[0] + 1, inp[1]))
    x, m = torch.randn(4, 3, dtype=torch.float64), torch.rand(4, 2, dtype=torch.float64)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def one(p: dict, xb: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xb[None], mb[None]))[0]

    want = vmap(jacrev(one), in_dims=(None, 0, 0))(params, x, m)
    want = torch.cat([want[k].reshape(4, 2, -1) for k in params], -1)
    for _ in range(3):
        torch.testing.assert_close(jm.jacobian(net, x, m, wrt="params"), want)
    grads = vmap(grad(lambda p, xb, mb: one(p, xb, mb).sum()), in_dims=(None, 0, 0))(params, x, m)
    torch.testing.assert_close(jm.per_sample_grads(net, (x, m), lambda out: out.sum(1)),
                               torch.cat([grads[k].reshape(4, -1) for k in params], -1))


@pytest.mark.parametrize("couple", ["", "mean", "cumsum", "flip"])
def test_on_an_accelerator_the_check_changes_samples_to_other_samples(couple: str, monkeypatch: Any) -> None:
    """On a GPU an id moved off the embedding table is a device-side assert that kills the process's
    CUDA context, so there the independence check changes samples to other samples of the batch from
    the start (simulated here on the CPU): f never sees an id the user did not pass, independent
    samples give the users' loop, coupled ones are refused."""
    from jacmode import _coupling

    monkeypatch.setattr(_coupling, "_noise_is_safe", lambda x: False)
    m, x = _tok(couple, seed=2), _ids(12, seed=3)
    seen: list[Tensor] = []
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # (the engines' vmapped passes: the user's x)
    m.register_forward_pre_hook(lambda mod, args: None if wrapped(args[0]) else seen.append(args[0].detach().clone()))
    if couple:
        with pytest.raises(jm.CoupledBatchError, match="other samples of the batch changed the output"):
            jm.jacobian(m, x, wrt="params")
    else:
        J = jm.jacobian(m, x, wrt="params")
        params = list(m.parameters())
        want = torch.stack([
            torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params, retain_graph=True)])
                         for o in m(x[i : i + 1])[0]])
            for i in range(12)
        ])
        torch.testing.assert_close(J, want, rtol=1e-10, atol=1e-12)
    given = {tuple(r.tolist()) for r in x}
    assert seen and all(tuple(r.tolist()) in given for s in seen for r in s.reshape(-1, 6))
