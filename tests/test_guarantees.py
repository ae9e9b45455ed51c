"""What a call must never do: change the model, change x, leak memory, or trip over another thread.

The model is checked with conftest.snapshot / assert_unchanged (parameter values, requires_grad
flags, .grad, buffers and running statistics, train/eval flags, hooks), also when the user's
forward raises halfway, and the process-wide settings jacmode touches (attention kernels, forward
AD levels) are checked to be restored.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref

import psutil
import pytest
import torch
from conftest import assert_unchanged, mlp_1_4, ref_input_jacobian, ref_param_jacobian, snapshot
from torch import Tensor, nn

import jacmode as jm
from _zoo_models import one_intra_op_thread  # noqa: F401 -- autouse fixture

WRT_MODES = list(itertools.product(["inputs", "params"], ["forward", "reverse", "auto"]))


class Counter(nn.Module):
    """Counts its calls in a buffer in training mode (a custom stateful layer). It rebinds the
    buffer: torch.func refuses in-place updates of it inside a transform (see the test below)."""

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        if self.training and self.in_place:
            self.calls += 1
        elif self.training:
            self.calls = self.calls + 1
        return x


class Boom(nn.Module):
    """Raises on its ``at``-th call (1 = the first call jacmode makes, its probe)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        # counted in a list: jacmode runs some passes on a structural clone of the module, which
        # shares its list (an int attribute would count in the clone's own attributes)
        self.at, self.count = at, [0]

    @property
    def seen(self) -> int:
        return self.count[0]

    def forward(self, x: Tensor) -> Tensor:
        self.count[0] += 1
        if self.seen == self.at:
            raise RuntimeError("boom: the user's forward failed")
        return x


def _stateful_model(tail: nn.Module | None = None) -> nn.Module:
    """BatchNorm in training mode (running statistics), a stateful buffer, a frozen parameter,
    populated .grad, hooks and a sub-module in eval mode: everything a call could disturb."""
    torch.manual_seed(0)
    layers = [nn.Linear(3, 4), nn.BatchNorm1d(4), Counter(), nn.Tanh(), nn.Dropout(0.3), nn.Linear(4, 2)]
    model = nn.Sequential(*layers).double()
    model[5].bias.requires_grad_(False)
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()  # populate .grad and stats
    if tail is not None:
        model.append(tail)
    model[4].eval()
    model[0].register_forward_hook(lambda m, i, o: None)
    model[3].register_forward_pre_hook(lambda m, i: None)
    return model


def _bn_identity(model: nn.Module) -> list[int]:
    bn = model[1]
    return [id(bn.running_mean), id(bn.running_var), id(bn.num_batches_tracked), int(bn.track_running_stats)]


@pytest.mark.parametrize(("wrt", "mode"), WRT_MODES)
@pytest.mark.parametrize("batched", [True, False])
def test_model_is_left_exactly_as_found(wrt: str, mode: str, batched: bool) -> None:
    model = _stateful_model()
    x = torch.randn(3, 3, dtype=torch.float64)
    before, ids, params = snapshot(model), _bn_identity(model), list(model.parameters())
    kwargs = dict(structure="coupled") if batched else dict(batched=False)
    jm.jacobian(model, x, wrt=wrt, mode=mode, **kwargs)
    assert_unchanged(model, before)
    assert _bn_identity(model) == ids and list(model.parameters()) == params
    assert model[2].calls.item() == 1  # the one counted call of the set-up forward pass


@pytest.mark.parametrize(("at", "chunk_size"), [(1, None), (2, None), (3, 1)])
@pytest.mark.parametrize(("wrt", "mode"), WRT_MODES)
def test_model_is_restored_when_the_forward_raises_halfway(
    at: int, chunk_size: int | None, wrt: str, mode: str
) -> None:
    """Call 1 is the probe, call 2 the first differentiated pass; with one direction per pass,
    forward mode makes a third call (the second chunk), reverse mode does not (its tape is shared)."""
    model = _stateful_model(Boom(at))
    x = torch.randn(3, 3, dtype=torch.float64)
    before, ids = snapshot(model), _bn_identity(model)
    kwargs = dict(wrt=wrt, mode=mode, structure="coupled", chunk_size=chunk_size)
    counting = _stateful_model(Boom(0))  # the planner's probes (footprint, engine checks) call f too
    jm.jacobian(counting, x, **kwargs)
    if at > counting[-1].seen:
        jm.jacobian(model, x, **kwargs)  # fewer calls than `at`
    else:
        with pytest.raises(RuntimeError, match="boom"):
            jm.jacobian(model, x, **kwargs)
    assert_unchanged(model, before)
    assert _bn_identity(model) == ids
    _assert_process_state_restored()


@pytest.mark.parametrize(("wrt", "mode"), WRT_MODES)
def test_a_buffer_updated_in_place_is_restored(wrt: str, mode: str) -> None:
    """The probe runs the forward plainly (the buffer is updated), then torch.func refuses the
    in-place update of a captured tensor inside the transform: the model must be as found."""
    model = nn.Sequential(nn.Linear(3, 3), Counter(in_place=True), nn.Linear(3, 2)).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    before = snapshot(model)
    J = None
    if wrt == "params" and mode == "reverse":  # the probe engine runs no torch.func transform
        J = jm.jacobian(model, x, wrt=wrt, mode=mode)
    elif wrt == "params" and mode == "auto":  # either engine, by the cost model
        try:
            J = jm.jacobian(model, x, wrt=wrt, mode=mode)
        except RuntimeError as err:
            assert "in-place operation" in str(err) and "captured Tensor" in str(err)
    else:
        with pytest.raises(RuntimeError, match="in-place operation.*captured Tensor"):
            jm.jacobian(model, x, wrt=wrt, mode=mode)
    assert_unchanged(model, before)
    assert model[1].calls.item() == 0
    if J is not None:
        torch.testing.assert_close(J, ref_param_jacobian(model, x))


class NoVmap(nn.Module):
    """Independent samples, a stateful buffer, and Python control flow that vmap cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.count = nn.Linear(3, 2), Counter()

    def forward(self, x: Tensor) -> Tensor:
        h = self.count(self.lin(x))
        return h * 2 if h.sum().item() > -1e9 else h


def test_model_is_restored_when_the_forward_raises_under_vmap() -> None:
    """The per-sample parameter Jacobian vmaps the forward over samples; .item() fails there.

    (Once a fallback for this lands, the call succeeds instead: the state must be kept either way.)
    """
    model = NoVmap().double()
    x = torch.randn(3, 3, dtype=torch.float64)
    before = snapshot(model)
    try:
        jm.jacobian(model, x, wrt="params", mode="reverse")
    except (RuntimeError, ValueError) as err:  # torch's error, or jacmode's for explicit modes
        assert "item" in str(err)
    assert_unchanged(model, before)
    _assert_process_state_restored()


def _assert_process_state_restored() -> None:
    """Attention kernel flags are back, no forward-AD level is left open, jacobian still works."""
    assert torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.autograd.forward_ad._current_level == -1
    net, t = mlp_1_4().double(), torch.rand(5, 1, dtype=torch.float64)
    torch.testing.assert_close(jm.jacobian(net, t, mode="forward"), ref_input_jacobian(net, t))


def test_attention_settings_are_restored_and_a_users_choice_is_kept() -> None:
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True).double().eval()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    jm.jacobian(layer, x, mode="forward")
    _assert_process_state_restored()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        jm.jacobian(layer, x, mode="forward")
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


# -------------------------------------------------------------------------------------------
# x


def _inputs() -> dict[str, Tensor]:
    base = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    return {
        "plain": torch.randn(4, 3, dtype=torch.float64),
        "leaf requiring grad": torch.randn(4, 3, dtype=torch.float64, requires_grad=True),
        "non-leaf": base * 2,
        "non-contiguous": torch.randn(3, 4, dtype=torch.float64).t(),
    }


@pytest.mark.parametrize("kind", list(_inputs()))
@pytest.mark.parametrize(("wrt", "mode"), [wm for wm in WRT_MODES if wm[1] != "auto"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_x_is_never_mutated(kind: str, wrt: str, mode: str, create_graph: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = _inputs()[kind]
    values, flag, leaf, version = x.detach().clone(), x.requires_grad, x.is_leaf, x._version
    out = jm.jacobian(model, x, wrt=wrt, mode=mode, create_graph=create_graph)
    assert torch.equal(x.detach(), values) and x._version == version
    assert x.requires_grad == flag and x.is_leaf == leaf and (not leaf or x.grad is None)
    assert all(p.grad is None for p in model.parameters())
    want = ref_input_jacobian(model, x.detach()) if wrt == "inputs" else ref_param_jacobian(model, x.detach())
    torch.testing.assert_close(out.detach(), want)


@pytest.mark.parametrize(("wrt", "mode"), WRT_MODES)
@pytest.mark.parametrize("batched", [True, False])
def test_x_is_kept_when_the_model_modifies_its_input_in_place(wrt: str, mode: str, batched: bool) -> None:
    """ReLU(inplace=True) applied to the input itself: forward mode over inputs is correct;
    the other calls may be refused by torch (in-place on a leaf / on a captured tensor), but x
    is never touched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 2)).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    values = x.clone()
    try:
        out = jm.jacobian(model, x, wrt=wrt, mode=mode, batched=batched)
    except RuntimeError as err:
        assert (wrt, mode) != ("inputs", "forward")
        assert "in-place" in str(err)
    else:
        if wrt == "inputs":  # the reference loop itself cannot run ReLU(inplace=True) on a leaf
            plain = nn.Sequential(nn.ReLU(), model[1])
            torch.testing.assert_close(out, ref_input_jacobian(plain, x, batched=batched))
    assert torch.equal(x, values)


# -------------------------------------------------------------------------------------------
# memory


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_repeated_calls_do_not_leak_memory() -> None:
    """Resident memory is flat over 200 calls (every wrt x mode, fresh lambdas too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(64, 8)

    def calls(n: int) -> None:
        for i in range(n):
            wrt, mode = WRT_MODES[i % len(WRT_MODES)]
            fresh = wrt == "inputs" and i % 2  # a new function each time: its cache entry must go
            jm.jacobian((lambda x: model(x)) if fresh else model, x, wrt=wrt, mode=mode)

    calls(40)  # warm-up: allocator pools, vmap and autograd caches
    start = _rss()
    calls(200)
    grown = _rss() - start
    # Measured: < 0.2 MB. A parameter Jacobian is 64 * 4 * 420 floats (430 KB): keeping one per
    # call would grow by ~40 MB, keeping a tape or a vmap level far more.
    assert grown < 8 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MB over 200 calls"


@pytest.mark.parametrize(("wrt", "mode"), WRT_MODES)
def test_models_and_inputs_can_be_garbage_collected_after_a_call(wrt: str, mode: str) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 3)
    jm.jacobian(model, x, wrt=wrt, mode=mode)
    jm.jacobian(lambda t: model(t), x, mode=mode)  # noqa: PLW0108 -- a plain function, cached by identity
    refs = [weakref.ref(model), weakref.ref(x)]
    del model, x
    gc.collect()
    assert all(r() is None for r in refs)


# -------------------------------------------------------------------------------------------
# threads


def test_two_threads_on_two_models_give_correct_results() -> None:
    """Forward mode (single tangent and vmap), reverse, inputs and parameters, a transformer
    (attention kernel flags), all interleaved across two threads, each on its own model."""
    torch.manual_seed(0)
    pinn, t = mlp_1_4().double(), torch.rand(64, 1, dtype=torch.float64)
    attn = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True).double().eval()
    seq = torch.randn(2, 3, 4, dtype=torch.float64)
    jobs = {
        "pinn": [(pinn, t, dict(mode="forward")), (pinn, t, dict(wrt="params", mode="reverse"))],
        "attn": [(attn, seq, dict(mode="forward")), (attn, seq, dict(mode="reverse", wrt="params"))],
    }
    want = {name: [jm.jacobian(m, x, **kw) for m, x, kw in work] for name, work in jobs.items()}
    torch.testing.assert_close(want["pinn"][0], ref_input_jacobian(pinn, t))
    torch.testing.assert_close(want["attn"][0], ref_input_jacobian(attn, seq))
    barrier, failures = threading.Barrier(2), []

    def worker(name: str) -> None:
        barrier.wait()
        try:
            for _ in range(15):
                for (m, x, kw), expected in zip(jobs[name], want[name]):
                    torch.testing.assert_close(jm.jacobian(m, x, **kw), expected, rtol=0, atol=1e-12)
        except Exception as err:  # noqa: BLE001 -- reported below, with its thread
            failures.append(f"{name}: {err!r}")

    threads = [threading.Thread(target=worker, args=(name,)) for name in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures
    _assert_process_state_restored()
