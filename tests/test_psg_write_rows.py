"""per_sample_grads' write of the blocks without the K dim (``layerwise.write_rows``, the rules'
``write_rows``): a Linear with 2-D inputs by one broadcast product, anything else (leading dims,
convolutions, normalisations, the module-local vmap rule, a module's second call, a module never
called) through the K = 1 ``write``. Oracle: torch.func's vmap(grad) in float64; and the same
numbers as ``layerwise.write`` with K = 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import jacmode as jm
from jacmode import _guard
from jacmode._probes import layerio, layerwise, probes
from jacmode._rules.local import LOCAL
from tests.test_psg_probe_pass import ce, vmap_psg




class Scale(nn.Module):
    """No rule: the module-local vmap rule, which reads the keyword arguments of the call."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(n))

    def forward(self, h: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
        return h * self.s + shift


class Mixed(nn.Module):
    """Every kind of block: a Linear on 2-D and on 3-D inputs, a Linear called twice, one never
    called, one without bias, a convolution, a LayerNorm and a module without a rule."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.seq = nn.Linear(6, 4)  # on (B, 3, 6): leading dims
        self.norm = nn.LayerNorm(12)
        self.twice = nn.Linear(12, 12)
        self.spare = nn.Linear(12, 5)  # never called: zero columns
        self.scale = Scale(12)
        self.nobias = nn.Linear(12, 7, bias=False)
        self.head = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.view(-1, 2, 8)))  # (B, 3, 6)
        h = self.norm(self.seq(h).flatten(1))  # (B, 12)
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        h = self.scale(h, shift=0.5)
        return self.head(torch.relu(self.nobias(h)))


def test_every_kind_of_block_matches_vmap_grad_repeatedly() -> None:
    torch.manual_seed(0)
    model = Mixed().double()
    x, y = torch.randn(6, 16, dtype=torch.float64), torch.randint(0, 4, (6,))
    want = vmap_psg(model, x, ce, y)
    names = [n for n, _ in model.named_parameters()]
    lo = sum(p.numel() for n, p in model.named_parameters() if names.index(n) < names.index("spare.weight"))
    for _ in range(3):  # the first call profiles, the later ones are hits
        got = jm.per_sample_grads(model, x, ce, y=y)
        torch.testing.assert_close(got, want)
        assert got[:, lo:lo + 12 * 5 + 5].abs().max() == 0  # spare.weight, spare.bias


def test_write_rows_gives_the_numbers_of_write_with_one_direction() -> None:
    """Bit for bit, into a result full of garbage (every covered column is written)."""
    torch.manual_seed(0)
    model = Mixed().double()
    x, y = torch.randn(5, 16, dtype=torch.float64), torch.randint(0, 4, (5,))
    named = list(model.named_parameters())
    cov = probes.coverage(model, named)  # with the module-local rule (per_sample_grads leaves it to vmap)
    assert not cov.uncovered and cov.rules[model.scale] is LOCAL
    with torch.enable_grad():
        rec = probes.record(model, x, cov)
        zs = [c.probe for c in rec.calls]
        gs = torch.autograd.grad(ce(rec.output, y).sum(), zs)
    P = sum(p.numel() for p in model.parameters())
    rows, old = torch.full((5, P), float("nan"), dtype=torch.float64), torch.full((5, P), 7.0, dtype=torch.float64)
    padded = torch.full((5, P + 7), float("nan"), dtype=torch.float64)
    inner = padded[:, 3:P + 3]  # rows longer than P, a storage offset: the views are placed by both
    for _ in range(2):  # the second time from the selection's plan
        layerwise.write_rows(rec, list(gs), cov, named, rows)
        layerwise.write_rows(rec, list(gs), cov, named, inner)
        layerwise.write(rec, [g.unsqueeze(0) for g in gs], cov, named, old.unsqueeze(1))
        assert torch.equal(rows, old) and torch.equal(inner, old)
    assert padded[:, :3].isnan().all() and padded[:, P + 3:].isnan().all()
    torch.testing.assert_close(rows, vmap_psg(model, x, ce, y))


@pytest.mark.parametrize("wrt", [["fc2.weight", "fc1.bias"], ["fc1.weight"], ["fc2.bias"]])
def test_a_subset_writes_its_own_columns(wrt: list) -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.fc1, model.act, model.fc2 = nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)
    model = model.double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    full = vmap_psg(model, x, ce, y)
    cols = layerwise.columns(list(model.named_parameters()))
    want = torch.cat([full[:, cols[n][0]:cols[n][0] + cols[n][1]] for n, _ in model.named_parameters() if n in wrt], 1)
    for _ in range(2):
        torch.testing.assert_close(jm.per_sample_grads(model, x, ce, y=y, wrt=wrt), want)


def test_float32_problem_class_against_a_float64_oracle() -> None:
    """The benchmarked path (a Linear on 2-D inputs, one broadcast product per weight)."""
    from bench.baselines import MLP

    torch.manual_seed(0)
    model = MLP(30, 8, 5)
    x, y = torch.randn(9, 30), torch.randint(0, 5, (9,))
    want = vmap_psg(model.double(), x.double(), ce, y)
    model.float()
    for _ in range(3):
        got = jm.per_sample_grads(model, x, ce, y=y)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


class Rewrites(nn.Module):
    """Each layer's output is modified in place after the call: its own cotangent is not the layer's."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(5, 6), nn.Linear(6, 3), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.how == "relu_":
            h = torch.relu_(h)
        elif self.how == "view":
            h[:, 0] = 0.0  # through a view of the output
        else:
            h.mul_(2.0)
        out = self.fc2(torch.tanh(h))
        return out


@pytest.mark.parametrize("how", ["relu_", "view", "mul_"])
def test_outputs_modified_in_place_after_the_call_give_exact_rows(how: str) -> None:
    """The first call that keeps the coverage (the second: the first caches nothing, ``_guard.py``)
    finds the rewritten output (the generic engine serves it), later ones take probes."""
    torch.manual_seed(0)
    model = Rewrites(how).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    want = vmap_psg(model, x, ce, y)
    for _ in range(3):
        torch.testing.assert_close(jm.per_sample_grads(model, x, ce, y=y), want)
    # the cached coverage, read in the scope of a call model(x) as an entry point enters it (the
    # coverage is cached under the generation of the model's state: _guard.py)
    cached = _guard.scoped_call(model, (x,), {}, lambda: layerio.usable(model, x, list(model.named_parameters())))
    assert cached.found == {"rewritten": True}
    cov = probes.coverage(model, list(model.named_parameters()), local=False)
    rec = probes.record(model, x, cov, outputs=True)
    assert [c.rewritten for c in rec.calls] == [True, False]


def test_outputs_stand_for_the_probes_where_they_require_grad() -> None:
    """The module's output itself is the probe of a call whose output requires grad; a frozen layer
    on an input without grad keeps a probe. Same cotangents as the probes', bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    model[0].requires_grad_(False)
    named = list(model.named_parameters())
    cov = probes.coverage(model, named)
    with torch.enable_grad():
        got = probes.record(model, x, cov, outputs=True)
        assert got.calls[0].output_version is None and got.calls[0].probe.is_leaf  # a probe
        assert [c.probe.grad_fn is not None and c.output_version is not None for c in got.calls[1:]] == [True, True]
        a = torch.autograd.grad(ce(got.output, y).sum(), [c.probe for c in got.calls])
        ref = probes.record(model, x, cov)
        b = torch.autograd.grad(ce(ref.output, y).sum(), [c.probe for c in ref.calls])
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not any(c.rewritten for c in got.calls)
