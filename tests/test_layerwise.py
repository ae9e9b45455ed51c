"""jm.jacobian(wrt="params") on the layer-wise probe engine: real model classes, mixed coverage,
fallbacks, and every option that held on the generic engine, against the users' loop in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_unchanged, ref_param_jacobian, snapshot
from torch import nn

import jacmode as jm
from bench.baselines import MLP


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 4, 3, stride=2, groups=1)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x), inplace=True)
        return self.fc(torch.tanh(self.c2(h)).flatten(1))


class ResMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.mid, self.out = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + F.gelu(self.mid(self.norm(h)))
        return self.out(h)


class Mixed(nn.Module):
    """A PReLU (no rule) between covered layers, and a raw parameter of the root module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(3, 4), nn.PReLU(4), nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.fc2(self.act(self.fc1(x)))


class OutsideUse(nn.Module):
    """An embedding weight also used outside its module (a tied output head): the check fails."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(6, 4), nn.Linear(4, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(idx))).mean(1)
        return h @ self.emb.weight.T


class SeqFirst(nn.Module):
    """A Linear that sees the samples in its second dim (sequence first): the check catches it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x.transpose(0, 1))).transpose(0, 1).flatten(1)


def models() -> dict:
    torch.manual_seed(0)
    return {
        "mlp-class": (MLP(5, 4, 3), torch.randn(3, 5)),
        "cnn": (CNN(), torch.randn(2, 1, 6, 6)),
        "resmlp": (ResMLP(), torch.randn(3, 4)),
        "mixed": (Mixed(), torch.randn(3, 3)),
        "outside": (OutsideUse(), torch.randint(0, 6, (3, 5))),
        "seq-first": (SeqFirst(), torch.randn(3, 3, 3)),
        "convtranspose": (nn.Sequential(nn.ConvTranspose2d(1, 2, 3, stride=2), nn.Tanh(), nn.Flatten(),
                                        nn.Linear(98, 2)), torch.randn(2, 1, 3, 3)),
        "transformer": (nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
                                      nn.Flatten(), nn.Linear(12, 2)).eval(), torch.randn(2, 3, 4)),
    }


def engines(model: nn.Module, x: torch.Tensor) -> tuple[bool, set]:
    """(whether the probe engine runs, the parameters it leaves to vmap), from plan()'s reason."""
    reason = jm.plan(model, x, wrt="params", mode="reverse").reason
    if "layer-wise probes" not in reason:
        return False, set()
    rest = reason.split("vmap over samples for ")[1].split("; ") if "vmap over samples for" in reason else []
    return True, {r.split(":")[0] for r in rest}


@pytest.mark.parametrize("name", sorted(models()))
def test_matches_users_loop_and_leaves_model_as_found(name: str) -> None:
    jm.clear_cache()
    model, x = models()[name]
    model, x = model.double(), x.double() if x.is_floating_point() else x
    before = snapshot(model)
    J = jm.jacobian(model, x, wrt="params", mode="reverse")  # tiny models: auto may pick forward mode
    assert_unchanged(model, before)
    torch.testing.assert_close(J, ref_param_jacobian(model, x))
    covered, uncovered = engines(model, x)
    if name in ("mlp-class", "cnn", "resmlp"):
        assert covered and not uncovered
    if name == "mixed":
        # the model's own parameter: vmap; PReLU: module-local vmap, or vmap when torch cannot nest it
        assert covered and "scale" in uncovered and uncovered <= {"scale", "act.weight"}
        assert "scale: no per-sample rule for Mixed" in jm.plan(model, x, wrt="params", mode="reverse").reason
    if name in ("transformer", "convtranspose"):  # MultiheadAttention, ConvTranspose2d: module-local vmap
        assert covered and not uncovered
        assert "module-local vmap" in jm.plan(model, x, wrt="params", mode="reverse").reason
    if name in ("outside", "seq-first"):  # the completeness check sends the whole call to the generic engine
        assert not covered


def test_options_subsets_frozen_flatten_out_chunks_create_graph() -> None:
    torch.manual_seed(0)
    model, x = ResMLP().double(), torch.randn(5, 4, dtype=torch.float64)
    names = ["inp.weight", "norm.weight", "out.bias"]
    ref = ref_param_jacobian(model, x, names)
    model.inp.weight.requires_grad_(False)  # frozen but selected: still differentiated
    torch.testing.assert_close(jm.jacobian(model, x, wrt=names, mode="reverse"), ref)
    d = jm.jacobian(model, x, wrt=names, flatten=False, mode="reverse")
    assert d["norm.weight"].shape == (5, 3, 6)
    buf = torch.full_like(ref, float("nan"))
    assert jm.jacobian(model, x, wrt=names, out=buf, mode="reverse") is buf
    torch.testing.assert_close(buf, ref)
    plan = jm.plan(model, x, wrt=names, max_memory=2_000, mode="reverse")
    assert plan.sample_chunk is not None and plan.sample_chunk < 5
    torch.testing.assert_close(jm.jacobian(model, x, wrt=names, max_memory=2_000, mode="reverse"), ref)
    J = jm.jacobian(model, x, wrt=names[1:], create_graph=True, mode="reverse")
    torch.testing.assert_close(J.detach(), ref[..., 24:])
    g = torch.autograd.grad(J.square().sum(), model.mid.weight)[0]
    params = dict(model.named_parameters())

    def loop_sq() -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for b in range(5):
            out = model(x[b : b + 1])[0]
            for y in range(3):
                gs = torch.autograd.grad(out[y], [params[n] for n in names[1:]], create_graph=True)
                total = total + sum(t.square().sum() for t in gs)
        return total

    want = torch.autograd.grad(loop_sq(), model.mid.weight)[0]
    torch.testing.assert_close(g, want)


def test_dropout_one_mask_per_sample_shared_by_its_outputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)).double().train()
    x = torch.randn(4, 4, dtype=torch.float64)
    J = jm.jacobian(model, x, wrt="params", mode="reverse")
    mask_cols = J[:, :, : 8 * 4].reshape(4, 3, 8, 4).abs().sum((1, 3)) != 0  # units kept, per sample
    assert mask_cols.any() and not mask_cols.all()
    for b in range(4):  # every output direction of a sample saw the same mask: one forward pass
        for y in range(3):
            assert torch.equal(J[b, y, : 32].reshape(8, 4).abs().sum(1) != 0, mask_cols[b]) or J[b, y].abs().sum() == 0


def test_coupled_batch_still_detected() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    with pytest.raises(jm.CoupledBatchError):
        jm.jacobian(model, torch.randn(5, 3), wrt="params")


def test_hooks_removed_when_model_raises_midway() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            if self.armed and torch.is_grad_enabled():
                raise RuntimeError("halfway")
            return h

    model = Fails()
    x = torch.randn(3, 2)
    jm.jacobian(model, x, wrt="params", mode="reverse")
    model.armed = True
    with pytest.raises(RuntimeError, match="halfway"):
        jm.jacobian(model, x, wrt="params", mode="reverse")
    assert not model.fc._forward_hooks


def test_module_local_rule_not_used_with_create_graph_or_dropout() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose1d(2, 2, 2), nn.Tanh(), nn.Flatten(), nn.Linear(8, 2)).double()
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    assert "module-local" in jm.plan(model, x, wrt="params", mode="reverse").reason
    names = ["0.weight", "3.bias"]
    J = jm.jacobian(model, x, wrt=names, mode="reverse", create_graph=True)
    torch.testing.assert_close(J.detach(), ref_param_jacobian(model, x, names))
    assert "module-local" not in jm.plan(model, x, wrt="params", mode="reverse", create_graph=True).reason
    model = nn.Sequential(nn.ConvTranspose1d(2, 2, 2), nn.Dropout(0.3), nn.Flatten(), nn.Linear(8, 2)).double().train()
    assert "module-local" not in jm.plan(model, x, wrt="params", mode="reverse").reason
