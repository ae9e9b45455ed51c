"""mode="autotune": timed, cached per function and shapes, inspectable, clearable.

A function's first call caches nothing (``_guard.py``): it times the candidates and keeps no
winner; the second call times them again and caches the winner, which later calls reuse."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import jacmode as jm
from jacmode._planning import autotune as _autotune
from conftest import mlp_1_4, ref_input_jacobian, ref_param_jacobian


@pytest.fixture
def timings(monkeypatch):
    """Count the candidates autotune times."""
    calls = []
    real = _autotune._time

    def spy(p, plan):
        calls.append(plan.mode)
        return real(p, plan)

    monkeypatch.setattr(_autotune, "_time", spy)
    jm.clear_cache()
    yield calls
    jm.clear_cache()


def test_autotune_times_once_then_reuses(timings):
    net = mlp_1_4().double()
    x = torch.randn(20, 1, dtype=torch.float64)
    J = jm.jacobian(net, x, mode="autotune")
    torch.testing.assert_close(J, ref_input_jacobian(net, x))
    assert sorted(timings) == ["forward", "reverse"]
    assert jm.autotune_cache() == []  # the first call caches nothing (_guard.py)
    torch.testing.assert_close(jm.jacobian(net, x, mode="autotune"), ref_input_jacobian(net, x))
    assert sorted(timings) == ["forward", "forward", "reverse", "reverse"]  # timed again, and cached
    (entry,) = jm.autotune_cache()
    assert entry["function"] == "Sequential" and entry["shape"] == (20, 1)
    assert entry["dtype"] == torch.float64 and entry["device"] == "cpu" and entry["wrt"] == "inputs"
    assert entry["mode"] == min(entry["seconds"], key=entry["seconds"].get)
    assert set(entry["seconds"]) == {"forward", "reverse"} and entry["how"] == "whole runs"
    jm.jacobian(net, x, mode="autotune")
    assert len(timings) == 4  # reused, not timed again
    plan = jm.plan(net, x, mode="autotune")
    assert plan.mode == entry["mode"] and plan.reason.startswith("autotuned on these inputs")
    assert plan.costs == entry["seconds"]


def test_autotune_key_separates_shapes_dtypes_and_wrt(timings):
    net = mlp_1_4()
    jm.jacobian(net, torch.randn(8, 1), mode="autotune")  # the first call caches nothing (_guard.py)
    jm.jacobian(net, torch.randn(8, 1), mode="autotune")
    jm.jacobian(net, torch.randn(16, 1), mode="autotune")
    jm.jacobian(net, torch.randn(16, 1), mode="autotune", wrt="params")
    jm.jacobian(net.double(), torch.randn(16, 1, dtype=torch.float64), mode="autotune")
    keys = {(e["shape"], e["dtype"], e["wrt"]) for e in jm.autotune_cache()}
    assert keys == {((8, 1), torch.float32, "inputs"), ((16, 1), torch.float32, "inputs"),
                    ((16, 1), torch.float32, "params"), ((16, 1), torch.float64, "inputs")}


def test_clear_cache_forgets_autotuned_modes(timings):
    net = mlp_1_4()
    for _ in range(2):  # the first call times but caches nothing; the second caches (_guard.py)
        jm.jacobian(net, torch.randn(4, 1), mode="autotune")
    assert len(jm.autotune_cache()) == 1
    jm.clear_cache()
    assert jm.autotune_cache() == []
    assert "not timed yet" in jm.plan(net, torch.randn(4, 1), mode="autotune").reason
    jm.jacobian(net, torch.randn(4, 1), mode="autotune")
    assert len(timings) == 6  # two calls before the clear, one after (each times both candidates)


def test_cache_is_weak_in_the_function(timings):
    net = mlp_1_4()
    for _ in range(2):  # cached by the second call (_guard.py)
        jm.jacobian(net, torch.randn(4, 1), mode="autotune")
    assert len(jm.autotune_cache()) == 1
    del net
    gc.collect()
    assert jm.autotune_cache() == []


@pytest.mark.parametrize("wrt", ["inputs", "params"])
def test_long_candidates_are_extrapolated_from_short_passes(monkeypatch, timings, wrt):
    monkeypatch.setattr(_autotune, "WHOLE_S", 0.0)  # every candidate counts as long
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    x = torch.randn(12, 6, dtype=torch.float64)
    J = jm.jacobian(net, x, wrt=wrt, mode="autotune")
    ref = ref_input_jacobian(net, x) if wrt == "inputs" else ref_param_jacobian(net, x)
    torch.testing.assert_close(J, ref)
    torch.testing.assert_close(jm.jacobian(net, x, wrt=wrt, mode="autotune"), ref)  # cached by the second call
    (entry,) = jm.autotune_cache()
    assert "extrapolated" in entry["how"]
    assert all(s > 0 for s in entry["seconds"].values())
