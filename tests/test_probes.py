"""Probe engine and per-module rules against float64 autograd references, one sample at a time."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
import torch
from torch import nn

from jacmode._probes.probes import coverage, record
from jacmode._rules.base import has
from jacmode._rules.modules import rule_for

torch.manual_seed(0)


def reference(model: nn.Module, x: torch.Tensor, V: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: (B, K, *shape)} by autograd.grad of <V[k, b], model(x[b])>, sample by sample."""
    params = dict(model.named_parameters())
    out: dict[str, list] = {n: [] for n in names}
    for b in range(x.shape[0]):
        rows = {n: [] for n in names}
        for k in range(V.shape[0]):
            y = model(x[b : b + 1])
            gs = torch.autograd.grad((y * V[k, b : b + 1]).sum(), [params[n] for n in names], allow_unused=True)
            for n, g in zip(names, gs):
                rows[n].append(torch.zeros_like(params[n]) if g is None else g)
        for n in names:
            out[n].append(torch.stack(rows[n]))
    return {n: torch.stack(v) for n, v in out.items()}


def probe_blocks(model: nn.Module, x: torch.Tensor, V: torch.Tensor, use_write: bool, batched: bool = True):
    named = list(model.named_parameters())
    cov = coverage(model, named)
    rec = record(model, x, cov)
    Gs = rec.pullback(V, batched=batched)
    K, B = V.shape[:2]
    params = dict(named)
    blocks = {n: torch.zeros(B, K, *params[n].shape, dtype=V.dtype) for n in cov.covered}
    seen: set[int] = set()
    for call, G in zip(rec.calls, Gs):
        targets = {a: blocks[n] for a, n in cov.modules[call.module].items()}
        if use_write:
            with torch.no_grad():
                call.rule.write(call.module, call.inputs, G, targets, accumulate=id(call.module) in seen)
        else:
            for a, blk in call.rule.per_sample(call.module, call.inputs, G).items():
                if a in targets:
                    targets[a] += blk
        seen.add(id(call.module))
    return blocks, cov


def case(model: nn.Module, shape: tuple, index: bool = False, vocab: int = 7):
    model = model.double().eval()
    x = torch.randint(0, vocab, shape) if index else torch.randn(*shape, dtype=torch.float64)
    return model, x


CASES = {
    "linear": lambda: case(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), (3, 5)),
    "linear-seq": lambda: case(nn.Sequential(nn.Linear(5, 4), nn.GELU(), nn.Linear(4, 3, bias=False)), (2, 6, 5)),
    "linear-4d": lambda: case(nn.Linear(3, 2), (2, 2, 3, 3)),
    "conv1d": lambda: case(nn.Sequential(nn.Conv1d(2, 4, 3, stride=2, padding=1, groups=2), nn.Tanh()), (2, 2, 9)),
    "conv2d": lambda: case(nn.Sequential(nn.Conv2d(2, 3, (2, 3), stride=(1, 2), padding=1, dilation=(2, 1)),
                                         nn.ReLU(inplace=True), nn.Conv2d(3, 3, 3, padding="same",
                                                                          padding_mode="reflect", groups=3)), (2, 2, 6, 7)),
    "conv3d": lambda: case(nn.Conv3d(2, 2, 2, stride=(1, 2, 1), padding=(1, 0, 1), bias=False), (2, 2, 3, 4, 3)),
    "layernorm": lambda: case(nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.LayerNorm((6,), bias=False)), (3, 4)),
    "layernorm-2d": lambda: case(nn.LayerNorm((3, 4)), (2, 5, 3, 4)),
    "groupnorm": lambda: case(nn.Sequential(nn.Conv2d(2, 4, 2), nn.GroupNorm(2, 4), nn.Tanh()), (2, 2, 4, 4)),
    "batchnorm": lambda: case(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)), (3, 3)),
    "embedding": lambda: case(nn.Sequential(nn.Embedding(7, 3, padding_idx=1), nn.Flatten(), nn.Linear(12, 2)),
                              (3, 4), index=True),
}
if hasattr(nn, "RMSNorm"):
    CASES["rmsnorm"] = lambda: case(nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5), nn.Tanh()), (3, 4))


def _randomise(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)


@pytest.mark.parametrize("use_write", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rules_match_autograd(name: str, use_write: bool) -> None:
    model, x = CASES[name]()
    _randomise(model)
    with torch.no_grad():
        out_shape = model(x).shape
    V = torch.randn(3, *out_shape, dtype=torch.float64)
    blocks, cov = probe_blocks(model, x, V, use_write)
    assert not cov.uncovered and blocks
    ref = reference(model, x, V, list(blocks))
    for n in blocks:
        torch.testing.assert_close(blocks[n], ref[n], msg=f"{name}: {n}")


class Twice(nn.Module):
    """A module called twice, a residual, an in-place ReLU after a layer and a functional activation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.fc1(x))
        h = h + torch.tanh(self.fc2(h))
        h = self.relu(self.fc2(h))
        return self.head(h)


@pytest.mark.parametrize("batched", [False, True])
def test_module_called_twice_residual_inplace(batched: bool) -> None:
    model = Twice().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    V = torch.randn(2, 3, 2, dtype=torch.float64)
    blocks, _ = probe_blocks(model, x, V, use_write=True, batched=batched)
    ref = reference(model, x, V, list(blocks))
    for n in blocks:
        torch.testing.assert_close(blocks[n], ref[n])


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3, max_norm=1.0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.b.weight = self.a.weight
        self.prelu = nn.PReLU()
        self.wn = nn.utils.parametrizations.weight_norm(nn.Linear(3, 2))
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wn(self.bn(self.prelu(self.b(self.a(self.emb(x))))))


def test_coverage_names_each_reason() -> None:
    model = Odd().train()
    cov = coverage(model, list(model.named_parameters()), local=False)
    why = cov.uncovered
    assert "max_norm" in why["emb.weight"]
    assert "tied" in why["a.weight"]
    assert "PReLU" in why["prelu.weight"]
    assert "parametrized" in why["wn.parametrizations.weight.original0"]
    assert "training" in why["bn.weight"]
    assert set(cov.covered) == {"a.bias", "b.bias"} and "parametrized" in why["wn.bias"]
    model.eval()
    assert "bn.weight" in coverage(model, list(model.named_parameters()), local=False).covered
    assert "prelu.weight" in coverage(model, list(model.named_parameters())).covered  # module-local vmap


def test_hooks_removed_when_model_raises() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise RuntimeError("boom")

    model = Boom()
    cov = coverage(model, list(model.named_parameters()))
    with pytest.raises(RuntimeError, match="boom"):
        record(model, torch.randn(2, 2), cov)
    assert not model.fc._forward_hooks


def test_stale_input_detected_and_rules_leave_room() -> None:
    class Mut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x)
            y = self.fc(h)
            return y * h.mul_(2).sum()

    model = Mut()
    rec = record(model, torch.randn(2, 2), coverage(model, list(model.named_parameters())))
    assert rec.calls[0].stale
    assert has(rec.calls[0].rule, "gram")  # Linear defines the NTK product; convolutions do not
    assert not has(rule_for(nn.Conv2d(1, 1, 1)), "gram")


@settings(max_examples=25, deadline=None)
@given(
    dims=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    mode=st.sampled_from(["zeros", "reflect", "circular"]),
    bias=st.booleans(),
)
def test_conv_rule_any_setting(dims, groups, kernel, stride, padding, dilation, mode, bias) -> None:
    """Conv1d/2d/3d blocks against autograd over strides, paddings and their modes, dilations, groups."""
    side = 5 if dims < 3 else 4
    assume(dilation * (kernel - 1) + 1 <= side + 2 * padding and (mode == "zeros" or padding < side))
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](
        2, 4, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups, bias=bias, padding_mode=mode
    ).double()
    x = torch.randn(2, 2, *[side] * dims, dtype=torch.float64)
    V = torch.randn(2, *conv(x).shape, dtype=torch.float64)
    blocks, _ = probe_blocks(conv, x, V, use_write=True)
    ref = reference(conv, x, V, list(blocks))
    for n in blocks:
        torch.testing.assert_close(blocks[n], ref[n])


@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU, nn.SiLU])
def test_the_pull_back_of_many_directions_is_one_batched_pass(act):
    """The Y output directions are pulled back by one batched pass: the backward ops run about as
    often for 90 directions as for 30 (the paths differ: 60 rows take one plain reverse pass of
    repeated rows, 180 the batched pass), not once per direction (torch's older vmap behind
    ``is_grads_batched`` loops over the directions for tanh_backward, gelu_backward,
    silu_backward), with the same blocks as the oracle."""
    import jacmode as jm
    from conftest import ref_param_jacobian
    from torch.profiler import profile

    def backward_calls(y: int) -> dict[str, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 8), act(), nn.Linear(8, 8), act(), nn.Linear(8, y)).double()
        x = torch.randn(2, 3, dtype=torch.float64)
        jm.clear_cache()
        with profile() as prof:
            J = jm.jacobian(model, x, wrt="params", mode="reverse")
        assert jm.plan(model, x, wrt="params").engine == "reverse-probes"
        torch.testing.assert_close(J, ref_param_jacobian(model, x))
        return {e.key: e.count for e in prof.key_averages() if e.key.endswith("_backward")}

    few, many = backward_calls(30), backward_calls(90)
    assert few and few.keys() == many.keys() and all(many[k] <= 2 * few[k] for k in few), (few, many)
