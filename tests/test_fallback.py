"""Fallbacks: operations without forward-AD formulas, without vmap support, old-style Functions."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import jacmode as jm
from jacmode import JacmodeWarning, _cache, _guard
from jacmode._autodiff.fallback import classify
from conftest import ref_input_jacobian, ref_param_jacobian


class NoJvpExp(torch.autograd.Function):
    """exp with a backward formula only: no jvp, no vmap rule."""

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class OldStyleExp(torch.autograd.Function):
    """exp written the old way (forward(ctx, x)): no torch.func transform can run it."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class Wide(nn.Module):
    """D = 1 input, Y = 300 outputs: forward mode is the natural choice."""

    def __init__(self, act) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 300).double()
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x) * 0.1)


class Branchy(nn.Module):
    """Python control flow on values (.item()): vmap over samples cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3000, 3).double()

    def forward(self, x):
        h = self.lin(x)  # each sample takes its own branch, so samples stay independent
        return torch.stack([torch.tanh(r) if r.sum().item() > 0 else torch.sin(r) for r in h])


def _no_warnings(call):
    """call(), asserting that jacmode warns nothing (torch's own warnings, e.g. those of the guard's
    TorchDynamo trace, are not jacmode's to silence, and as errors they would fail the trace)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    given = [str(w.message) for w in caught if issubclass(w.category, JacmodeWarning)]
    assert not given, given
    return out


def _falls_back_once(f, x, match, ref, **kw):
    """auto warns on the first call (match) and is right (ref); the second call (the first that
    remembers the fallback: _guard.py) and later ones stay quiet, and so does plan(), whether or not
    f can be guarded; clear_cache forgets the warning with everything else. Returns the plan and
    why f's calls reuse nothing (_guard.why_not; empty when f is guarded)."""
    jm.clear_cache()
    with pytest.warns(JacmodeWarning, match=match):
        J = jm.jacobian(f, x, **kw)
    torch.testing.assert_close(J, ref)
    for _ in range(3):  # the second call, the third (the first to reuse), a later one
        torch.testing.assert_close(_no_warnings(lambda: jm.jacobian(f, x, **kw)), J)
    plan = _no_warnings(lambda: jm.plan(f, x, **kw))
    unguarded = _guard.why_not(f)
    jm.clear_cache()
    with pytest.warns(JacmodeWarning, match=match):
        torch.testing.assert_close(jm.jacobian(f, x, **kw), J)
    return plan, unguarded


def test_no_jvp_function_auto_falls_back_to_reverse_and_warns_once():
    model, x = Wide(NoJvpExp.apply), torch.randn(8, 1, dtype=torch.float64)
    plan, unguarded = _falls_back_once(model, x, r"no forward-AD formula for custom autograd.Function NoJvpExp",
                                       ref_input_jacobian(model, x))
    assert not unguarded  # the guarded path: the fallback is cached from the second call
    assert plan.mode == "reverse" and "NoJvpExp" in plan.reason


def test_no_jvp_function_explicit_forward_raises():
    jm.clear_cache()
    model, x = Wide(NoJvpExp.apply), torch.randn(8, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"mode: 'forward' .* NoJvpExp .*has none\. Use mode='reverse'"):
        jm.jacobian(model, x, mode="forward")
    with pytest.raises(ValueError, match=r"NoJvpExp"):
        jm.plan(model, x, mode="forward")
    torch.testing.assert_close(jm.jacobian(model, x, mode="reverse"), ref_input_jacobian(model, x))


def test_aten_operation_without_forward_ad_is_named():
    anchors = torch.randn(300, 1, dtype=torch.float64)
    f = lambda x: torch.cdist(x, anchors)  # noqa: E731  (B, 1) -> (B, 300)
    x = torch.randn(256, 1, dtype=torch.float64)
    exact = torch.sign(x - anchors.T).unsqueeze(-1)  # d|x - a| / dx, (B, 300, 1)
    _falls_back_once(f, x, r"aten::(_cdist_forward|_euclidean_dist) \(called at test_fallback.py", exact)
    with pytest.raises(ValueError, match=r"aten::(_cdist_forward|_euclidean_dist).*mode='reverse'"):
        jm.jacobian(f, x, mode="forward")


def test_item_control_flow_auto_loops_over_samples_and_warns_once():
    """Branchy cannot be guarded (TorchDynamo cannot trace .item() whole), so every call is a first
    call (_guard.py); the warning is still given once (_cache.warn_once)."""
    model = Branchy()
    x = torch.randn(4, 3000, dtype=torch.float64)
    plan, unguarded = _falls_back_once(model, x, r"\.item\(\) or Python control flow", ref_param_jacobian(model, x),
                                       wrt="params")
    assert plan.loop == "samples"
    assert "cannot trace it whole" in unguarded  # the path that caches nothing, not the cached one


def test_untraceable_function_warns_once():
    """A plain function Dynamo cannot trace (print) that falls back: one warning, from its first call."""
    anchors = torch.randn(300, 1, dtype=torch.float64)

    def f(x):
        print(end="")
        return torch.cdist(x, anchors)

    x = torch.randn(8, 1, dtype=torch.float64)
    exact = torch.sign(x - anchors.T).unsqueeze(-1)
    _, unguarded = _falls_back_once(f, x, r"no forward-AD formula for aten::", exact)
    assert "cannot trace it whole" in unguarded


def test_function_of_several_arguments_warns_once():
    """The flat function jacmode makes of a call of several arguments is new at every call; the
    warning belongs to the user's function behind it, so it is given once."""
    anchors = torch.randn(300, 1, dtype=torch.float64)
    f = lambda x, s: torch.cdist(x, anchors) * s  # noqa: E731
    x = torch.randn(8, 1, dtype=torch.float64)
    s = torch.tensor(2.0, dtype=torch.float64)
    exact = 2.0 * torch.sign(x - anchors.T).unsqueeze(-1)
    jm.clear_cache()
    with pytest.warns(JacmodeWarning, match=r"no forward-AD formula for aten::"):
        J = jm.jacobian(f, x, s, argnums=0, in_dims=(0, None))
    torch.testing.assert_close(J, exact)
    for _ in range(3):
        torch.testing.assert_close(_no_warnings(lambda: jm.jacobian(f, x, s, argnums=0, in_dims=(0, None))), exact)


def test_warn_once_per_function_and_message():
    """Per function and message; a function that cannot be weakly referenced is warned every time."""

    class Slotted:
        __slots__ = ()

        def __call__(self, x):
            return x

    def f(x):
        return x

    def given(g, message, n=3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(n):
                _cache.warn_once(g, message)
        return [str(w.message) for w in caught if issubclass(w.category, JacmodeWarning)]

    jm.clear_cache()
    assert given(f, "jacmode: one") == ["jacmode: one"]
    assert given(f, "jacmode: two") == ["jacmode: two"]
    assert given(f, "jacmode: one") == []
    assert given(lambda x: x, "jacmode: one") == ["jacmode: one"]  # another function
    assert given(Slotted(), "jacmode: three") == ["jacmode: three"] * 3
    jm.clear_cache()
    assert given(f, "jacmode: one") == ["jacmode: one"]


def test_item_control_flow_explicit_reverse_raises():
    jm.clear_cache()
    model, x = Branchy(), torch.randn(4, 3000, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"mode: 'reverse' vectorises over samples .*\.item\(\).*mode='auto'"):
        jm.jacobian(model, x, wrt="params", mode="reverse")
    # forward mode never vmaps over samples, so it works
    torch.testing.assert_close(jm.jacobian(model, x, wrt="params", mode="forward"), ref_param_jacobian(model, x))


def test_old_style_function_uses_autograd_loops():
    model, x = Wide(OldStyleExp.apply), torch.randn(3, 1, dtype=torch.float64)
    plan, _ = _falls_back_once(model, x, r"torch.autograd.grad loops.*OldStyleExp", ref_input_jacobian(model, x))
    assert plan.loop == "autograd"
    for mode in ("forward", "reverse"):
        with pytest.raises(ValueError, match=r"setup_context"):
            jm.jacobian(model, x, mode=mode)


def test_old_style_function_params_and_unbatched():
    jm.clear_cache()
    model, x = Wide(OldStyleExp.apply), torch.randn(3, 1, dtype=torch.float64)
    with pytest.warns(JacmodeWarning, match="OldStyleExp"):
        Jp = jm.jacobian(model, x, wrt="params")
    torch.testing.assert_close(Jp, ref_param_jacobian(model, x))
    Ju = _no_warnings(lambda: jm.jacobian(model, x[0], batched=False))  # the same gap of the same f: said once
    torch.testing.assert_close(Ju, ref_input_jacobian(model, x[0], batched=False))


def test_vmap_performance_warning_is_translated():
    jm.clear_cache()
    f = lambda x: torch.cummax(x, dim=1).values * 2.0  # noqa: E731  cummax backward has no batching rule
    x = torch.randn(3, 4, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = jm.jacobian(f, x, mode="reverse")
    messages = [str(w.message) for w in caught]
    assert not any("performance drop" in m for m in messages)
    assert any("no vmap batching rule for aten::cummaxmin_backward" in m for m in messages)
    torch.testing.assert_close(J, ref_input_jacobian(f, x))


def test_classify_leaves_other_errors_alone():
    assert classify(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    kind, what = classify(RuntimeError("Batching rule not implemented for aten::foo.bar; ..."))
    assert kind == "vmap" and "aten::foo" in what


@pytest.fixture
def blind_probe(monkeypatch):
    """A capability probe that foresees nothing: gaps are found by the engines while running."""
    from jacmode._planning import decide as _decide
    from jacmode._autodiff import fallback as _fallback

    monkeypatch.setattr(_decide._fallback, "capabilities", lambda f, key, p: _fallback.Caps())
    jm.clear_cache()


def test_gaps_found_while_running_are_handled(blind_probe):
    model, x = Wide(NoJvpExp.apply), torch.randn(8, 1, dtype=torch.float64)
    with pytest.warns(JacmodeWarning, match="NoJvpExp"):
        J = jm.jacobian(model, x)
    torch.testing.assert_close(J, ref_input_jacobian(model, x))
    with pytest.raises(ValueError, match=r"mode: 'forward' .*NoJvpExp.*mode='reverse'"):
        jm.jacobian(model, x, mode="forward")
    branchy, xb = Branchy(), torch.randn(4, 3000, dtype=torch.float64)
    # the probe engine needs no vmap: with a rule for the layer, nothing falls back
    torch.testing.assert_close(jm.jacobian(branchy, xb, wrt="params"), ref_param_jacobian(branchy, xb))
    branchy._jacmode_no_probes = True  # the generic vmap engine
    jm.clear_cache()
    with pytest.warns(JacmodeWarning, match=r"loops over samples"):
        Jp = jm.jacobian(branchy, xb, wrt="params")
    torch.testing.assert_close(Jp, ref_param_jacobian(branchy, xb))
    with pytest.raises(ValueError, match=r"vectorises over samples"):
        jm.jacobian(branchy, xb, wrt="params", mode="reverse")


class _StorageReader(nn.Module):
    """Raises as cuDNN's LSTM and GRU kernels do on a GPU when a torch.func transform wraps their
    inputs (they read the inputs' memory directly); plain autograd runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        if wrapped(x) or wrapped(self.lin.weight):
            raise RuntimeError("Cannot access data pointer of Tensor that doesn't have storage")
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("wrt", ["inputs", "params"])
def test_an_operation_that_reads_memory_directly_falls_back_to_autograd_loops(wrt: str) -> None:
    torch.manual_seed(0)
    m, x = _StorageReader().double(), torch.randn(4, 3, dtype=torch.float64)
    want = ref_input_jacobian(m, x) if wrt == "inputs" else ref_param_jacobian(m, x)
    with pytest.warns(jm.JacmodeWarning, match="reads its inputs' memory directly"):
        got = [jm.jacobian(m, x, wrt=wrt) for _ in range(3)]
    for g in got:
        torch.testing.assert_close(g, want)
    with pytest.raises(ValueError, match="mode: 'forward' runs f under torch.func transforms, which cannot run an "
                                         "operation that reads its inputs' memory directly"):
        jm.jacobian(m, x, wrt=wrt, mode="forward")


class _JvpFails(torch.autograd.Function):
    """tanh whose forward-mode formula fails with an error torch gives no name to (as torch's jvp of
    CUDA layer norm in float16 does: a float32 tangent meets a float16 weight)."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Tensor) -> None:
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)

    @staticmethod
    def jvp(ctx: Any, t: Tensor) -> Tensor:
        raise RuntimeError("expected mat1 and mat2 to have the same dtype, but got: float != c10::Half")

    @staticmethod
    def vmap(info: Any, in_dims: Any, x: Tensor) -> Any:
        return _JvpFails.apply(x), in_dims[0]


def test_a_forward_mode_that_fails_where_reverse_runs_is_a_gap_of_forward_mode() -> None:
    """auto takes reverse mode, and its plan names the error; mode='forward' says why it cannot run."""
    torch.manual_seed(0)
    lin = nn.Linear(1, 8).double()  # one input, eight outputs: auto would take forward mode
    f = lambda x: _JvpFails.apply(lin(x))  # noqa: E731
    x = torch.randn(4, 1, dtype=torch.float64)
    plan = jm.plan(f, x)
    assert plan.mode == "reverse" and "forward mode fails here (RuntimeError: expected mat1 and mat2" in plan.reason
    for g in [jm.jacobian(f, x) for _ in range(3)]:
        torch.testing.assert_close(g, ref_input_jacobian(f, x))
    with pytest.raises(ValueError, match="mode: 'forward' needs a forward-AD .* forward mode fails here"):
        jm.jacobian(f, x, mode="forward")
