"""plan(): what jacobian will do, for every strategy, and jacobian doing exactly that."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import jacmode as jm
from jacmode._planning import decide as _decide
from conftest import Opaque, mlp_1_4, mnist_mlp, ref_input_jacobian, ref_param_jacobian


@pytest.fixture
def used(monkeypatch):
    """The plans jacobian actually runs."""
    seen = []
    real = _decide.run

    def spy(p, plan, out=None):
        seen.append(plan)
        return real(p, plan, out)

    monkeypatch.setattr(_decide, "run", spy)
    return seen


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()


CASES = {
    "broadcast-forward": (lambda: nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 300)).double(), (8, 1), {},
                          ("forward", "broadcast")),
    "broadcast-reverse": (lambda: nn.Sequential(nn.Linear(300, 64), nn.Tanh(), nn.Linear(64, 2)).double(), (128, 300), {},
                          ("reverse", "broadcast")),
    "per-sample": (lambda: mlp_1_4().double(), (5, 1), {"wrt": "params"}, ("reverse", "per-sample")),
    "params-forward": (lambda: nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 400)).double(), (64, 2),
                       {"wrt": ["0.bias"]}, ("forward", "whole-batch")),
    "coupled": (_bn_net, (5, 3), {"structure": "coupled"}, (None, "whole-batch")),
    "full": (lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh()).double(), (2, 4), {"batched": False}, (None, "full")),
    "diagonal": (lambda: nn.Tanh(), (7, 3), {"structure": "diagonal"}, (None, "diagonal")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_is_what_jacobian_does(name, used):
    make, shape, kw, (mode, strategy) = CASES[name]
    model = make()
    x = torch.randn(*shape, dtype=torch.float64)
    plan = jm.plan(model, x, **kw)
    assert plan.strategy == strategy
    if mode is not None:
        assert plan.mode == mode
    J = jm.jacobian(model, x, **kw)
    assert len(used) == 1
    ran = used[0]
    assert (ran.mode, ran.strategy, ran.directions, ran.chunk_size, ran.sample_chunk) == (
        plan.mode, plan.strategy, plan.directions, plan.chunk_size, plan.sample_chunk)
    # and the answer is right
    if kw.get("wrt") == "params":
        torch.testing.assert_close(J, ref_param_jacobian(model, x))
    elif kw.get("structure") == "diagonal":
        torch.testing.assert_close(J, 1 - torch.tanh(x) ** 2)
    elif kw.get("batched") is False:
        torch.testing.assert_close(J, ref_input_jacobian(model, x, batched=False))
    elif "wrt" not in kw and "structure" not in kw:
        torch.testing.assert_close(J, ref_input_jacobian(model, x))


@pytest.mark.parametrize("mode", ["forward", "reverse"])
def test_explicit_mode_is_obeyed_and_said(mode, used):
    net, x = mlp_1_4(), torch.randn(10, 1)
    plan = jm.plan(net, x, wrt="params", mode=mode)
    assert plan.mode == mode and "requested" in plan.reason
    jm.jacobian(net, x, wrt="params", mode=mode)
    assert used[0].mode == mode


def test_the_two_problems_choose_the_known_winners():
    # problem 1: P = 15,910 parameters, Y = 10 outputs -> reverse, vmapped over samples
    p1 = jm.plan(mnist_mlp(), torch.randn(2, 784), wrt="params")
    assert (p1.mode, p1.strategy) == ("reverse", "per-sample")
    assert p1.costs["forward"] > 10 * p1.costs["reverse"]
    # problem 2: dy/dt, D = 1 input, Y = 4 outputs: one shared seed either way (1 tangent or 4
    # cotangents); on the calibration machine forward mode (generated Taylor code) measured 2.5x
    # faster at B = 1,000 (0.35 vs 0.89 ms) and 3.6x at B = 100,000 (28 vs 103 ms)
    p2 = jm.plan(mlp_1_4(), torch.randn(1000, 1))
    assert (p2.mode, p2.strategy, p2.directions) == ("forward", "broadcast", 1)
    assert 0.2 < p2.costs["forward"] / p2.costs["reverse"] < 0.8


def test_repr_gives_costs_memory_and_reason():
    text = repr(jm.plan(mlp_1_4(), torch.randn(100, 1), wrt="params"))
    assert text.startswith("Plan(mode='reverse'")
    for part in ("forward=", "reverse=", " ms", "result", "workspace", "budget", "why: parameters P=544"):
        assert part in text
    p = jm.plan(mlp_1_4(), torch.randn(100, 1), wrt="params")
    assert p.peak_bytes == p.result_bytes + p.workspace_bytes
    assert p.result_bytes == 100 * 4 * 544 * 4


def test_costs_grow_with_the_directions_of_each_mode():
    """With the generic engines (vmap over jvp / vjp; a callable jacmode does not capture) the
    number of directions decides: measured, D = 400 -> Y = 10 reverse 1.9 vs forward 123 ms and
    D = 10 -> Y = 400 forward 4.8 vs reverse 142 ms at B = 256. Through a captured Linear, forward
    mode copies the weight's columns and wins both (0.17 vs 0.83 ms and 0.27 vs 1.5 ms)."""
    small = jm.plan(Opaque(nn.Linear(10, 10)), torch.randn(256, 10))
    wide_in = jm.plan(Opaque(nn.Linear(400, 10)), torch.randn(256, 400))
    wide_out = jm.plan(Opaque(nn.Linear(10, 400)), torch.randn(256, 10))
    assert wide_in.costs["forward"] > small.costs["forward"]
    assert wide_out.costs["reverse"] > small.costs["reverse"]
    assert wide_in.mode == "reverse" and wide_out.mode == "forward"
    captured = jm.plan(nn.Linear(400, 10), torch.randn(256, 400))
    assert (captured.mode, captured.engine) == ("forward", "forward-layerwise")


@settings(max_examples=15, deadline=None)
@given(d=st.integers(1, 12), y=st.integers(1, 12), b=st.integers(1, 5))
def test_auto_agrees_with_both_modes(d, y, b):
    torch.manual_seed(d * 100 + y)
    net = nn.Sequential(nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, y)).double()
    x = torch.randn(b, d, dtype=torch.float64)
    auto = jm.jacobian(net, x)
    for mode in ("forward", "reverse"):
        torch.testing.assert_close(jm.jacobian(net, x, mode=mode), auto)
    torch.testing.assert_close(auto, ref_input_jacobian(net, x))


class _ClassMLP(nn.Module):
    def __init__(self, i: int, h: int, o: int) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(i, h), nn.Linear(h, h), nn.Linear(h, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def test_the_planner_prices_the_probe_engine_where_it_runs(used):
    # the last layer's bias: the probe engine's reverse pass crosses nothing (the output is its probe)
    torch.manual_seed(0)
    g, x = _ClassMLP(8, 32, 64), torch.randn(128, 8)
    plan = jm.plan(g, x, wrt=["l3.bias"])
    assert (plan.mode, plan.strategy, plan.engine) == ("reverse", "per-sample", "reverse-probes")
    assert plan.costs["forward"] > 2 * plan.costs["reverse"]
    assert "reverse-probes (probe engine)" in plan.reason
    jm.jacobian(g, x, wrt=["l3.bias"])
    assert used[0].engine == "reverse-probes"
    # the first layer's bias: the reverse pass crosses the whole net, and costs more
    deep = jm.plan(g, x, wrt=["l1.bias"])
    assert deep.costs["reverse"] > plan.costs["reverse"]


def test_plan_lists_every_engine_with_its_price_or_why_not():
    torch.manual_seed(0)
    g, x = _ClassMLP(8, 32, 64), torch.randn(128, 8)
    plan = jm.plan(g, x, wrt=["l3.bias"])
    by = {c.engine: c for c in plan.candidates}
    assert set(by) == {"forward", "forward-layerwise", "reverse", "reverse-probes"}
    assert by["reverse-probes"].chosen and by["reverse-probes"].seconds == plan.costs["reverse"]
    assert by["forward"].feasible and not by["forward"].chosen and "x the chosen engine's time" in by["forward"].why
    assert by["forward"].workspace_bytes > 0
    assert not by["forward-layerwise"].feasible and "parameter tangents" in by["forward-layerwise"].why
    assert not by["reverse"].feasible and "fallback" in by["reverse"].why
    assert sum(c.chosen for c in plan.candidates) == 1
    text = repr(plan)
    assert "\n  - reverse-probes (probe engine)" in text and "chosen" in text
    # inputs of a captured MLP: Taylor mode serves forward, the probe engine cannot serve
    plan = jm.plan(nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 30)), torch.randn(16, 2))
    by = {c.engine: c for c in plan.candidates}
    assert by["forward-layerwise"].feasible and "not inputs" in by["reverse-probes"].why
    assert plan.engine == "forward-layerwise"


def test_an_engine_that_does_not_fit_the_budget_says_so():
    # forward over P = 15,910 parameter tangents needs a workspace far over 200 KB; reverse fits in chunks
    plan = jm.plan(mnist_mlp(), torch.randn(4, 784), wrt="params", max_memory="200KB")
    by = {c.engine: c for c in plan.candidates}
    assert by["reverse-probes"].chosen
    with pytest.raises(ValueError, match="even one direction per pass needs"):
        jm.plan(mnist_mlp(), torch.randn(4, 784), wrt="params", mode="forward", max_memory="1KB")


def test_the_cost_terms_of_narrow_convolutions_transcendental_maps_and_fresh_results() -> None:
    """A convolution's positions (spatial entries, whatever its channels) are counted per sample
    (their own term: narrow ones run far below their flop rate), so are the entries of
    transcendental maps, and a result of FRESH_BYTES or more is priced for its pages, a smaller one not."""
    from jacmode._planning import footprint as _footprint
    from jacmode._planning.calibrated import FRESH_BYTES
    from jacmode._planning.engines import fresh_pages

    conv = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 5 * 7, 3))
    fp = _footprint.measure(conv, torch.randn(4, 1, 5, 7), 4, hooked=[conv[3]])
    assert fp.conv_out == 5 * 7 and fp.tail is not None and fp.tail.conv_out == 0.0
    wide = nn.Sequential(nn.Conv1d(3, 16, 3), nn.Flatten())  # (B, 16, 9): 9 positions, not 144 entries
    assert _footprint.measure(wide, torch.randn(2, 3, 11), 2).conv_out == 9
    mlp = nn.Sequential(nn.Linear(3, 4))
    assert _footprint.measure(mlp, torch.randn(2, 3), 2).conv_out == 0.0
    # entries of transcendental maps: 8 of the GELU and 2 of the tanh per sample, not the ReLU's
    acts = nn.Sequential(nn.Linear(3, 8), nn.GELU(), nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2), nn.Tanh())
    fp = _footprint.measure(acts, torch.randn(2, 3), 2, hooked=[acts[2]])
    assert fp.special == 10 and fp.tail is not None and fp.tail.special == 2

    assert fresh_pages(FRESH_BYTES // 4 - 1, 4) == 0.0
    assert fresh_pages(2 * (FRESH_BYTES // 8), 8) == 2.0 * FRESH_BYTES
