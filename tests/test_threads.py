"""Several threads on one model: jacmode calls in parallel, and a plain training step beside them.

The cases run in one child process (one after the other) with a timeout, so that a crash or a hang
fails the tests instead of taking pytest down. Every round starts from ``jm.clear_cache()`` behind
a barrier, so that the threads capture, trace and generate code at the same time; a fifth thread runs
``net(x).sum().backward()`` throughout, without jacmode. The child checks every result against a
torch.func oracle computed before the threads start, and the model afterwards (the same Parameter
objects, the same values, no fake or wrapped tensor left in it), and prints a JSON summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

_SRC = str(Path(__file__).resolve().parents[1] / "src")
_TIMEOUT = 120  # seconds: a hang fails the test (a passing case takes a few seconds)

_PRELUDE = """
import json, sys, threading, traceback
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev, vmap
import jacmode as jm

torch.set_num_threads(1)
torch.manual_seed(0)
ROUNDS, CALLS, WORKERS = {rounds}, {calls}, 4
errors, mismatches, plain_errors = [], [], []
stop = threading.Event()


def plain(net, x):
    # a training step without jacmode, on the same model, for as long as the workers run
    while not stop.is_set():
        try:
            net.zero_grad(set_to_none=True)
            net(x).sum().backward()
        except Exception as err:  # noqa: BLE001
            plain_errors.append(f"{{type(err).__name__}}: {{str(err)[:200]}}")


def run(net, x, cases):
    barrier = threading.Barrier(WORKERS)

    def worker(k):
        for _ in range(ROUNDS):
            try:
                if barrier.wait() == 0:
                    jm.clear_cache()
                barrier.wait()
            except threading.BrokenBarrierError:
                return
            for call in range(CALLS):
                name, fn, want = cases[(k + call) % len(cases)]
                try:
                    got = fn()
                except Exception as err:  # noqa: BLE001
                    errors.append(f"{{name}}: {{type(err).__name__}}: {{str(err)[:300]}}")
                    traceback.print_exc()
                    continue
                gots = got if isinstance(got, tuple) else (got,)
                wants = want if isinstance(want, tuple) else (want,)
                for g, w in zip(gots, wants):
                    if type(g) is not torch.Tensor or g.shape != w.shape or not torch.allclose(
                            g.double(), w.double(), rtol=1e-4, atol=1e-5):
                        diff = (g.double() - w.double()).abs().max().item() if g.shape == w.shape else None
                        mismatches.append(f"{{name}}: {{type(g).__name__}} max diff {{diff}}")

    side = threading.Thread(target=plain, args=(net, x))
    side.start()
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(WORKERS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    side.join()


def model_report(net, before):
    bad = []
    for name, p in net.named_parameters():
        if p is not before[name][0]:
            bad.append(f"{{name}} is another object")
        if type(p) is not nn.Parameter or type(p.data) is not torch.Tensor:
            bad.append(f"{{name}} is a {{type(p).__name__}} / {{type(p.data).__name__}}")
        elif not torch.equal(p.detach(), before[name][1]):
            bad.append(f"{{name}} changed value")
    for m in net.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            bad.append(f"{{type(m).__name__}} keeps hooks")
    return bad


def finish(net, before):
    print("RESULT " + json.dumps({{"errors": errors, "mismatches": mismatches, "plain_errors": plain_errors,
                                  "model": model_report(net, before)}}))
"""

_TAYLOR = """
net = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
x = torch.randn(6, 3)
before = {n: (p, p.detach().clone()) for n, p in net.named_parameters()}
net64 = nn.Sequential(*[m for m in __import__("copy").deepcopy(net)]).double()
x64 = x.double()
one = lambda xb: net64(xb[None])[0]
hess = vmap(hessian(one))(x64)                       # (B, Y, D, D)
jac = vmap(jacrev(one))(x64)                         # (B, Y, D)
lap = hess.diagonal(dim1=-2, dim2=-1).sum(-1)        # (B, Y)
parts = (jac[..., 0], hess[..., 0, 0], hess[..., 1, 2])
def in_cpu_block(fn):
    def call():
        with torch.device("cpu"):  # a default-device context: its own code, keyed by its devices
            return fn()
    return call


cases = [
    ("laplacian", lambda: jm.laplacian(net, x), lap),
    ("jacobian", lambda: jm.jacobian(net, x), jac),
    ("partials", lambda: tuple(jm.partials(net, x, dims=[(0,), (0, 0), (1, 2)])), parts),
    ("laplacian in a torch.device block", in_cpu_block(lambda: jm.laplacian(net, x)), lap),
    ("jacobian in a torch.device block", in_cpu_block(lambda: jm.jacobian(net, x)), jac),
]
run(net, x, cases)
finish(net, before)
"""

_PARAMS = """
class MLP(nn.Module):
    def __init__(self, d_in=12, hidden=8, d_out=4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


net = MLP()
x, y = torch.randn(5, 12), torch.randint(0, 4, (5,))
before = {n: (p, p.detach().clone()) for n, p in net.named_parameters()}
params = {n: p.detach().clone() for n, p in net.named_parameters()}
one = lambda p, xb: functional_call(net, p, (xb[None],))[0]
loss = lambda out, yy: nn.functional.cross_entropy(out, yy, reduction="none")
one_loss = lambda p, xb, yb: loss(functional_call(net, p, (xb[None],)), yb[None])[0]
jac = vmap(jacrev(one), in_dims=(None, 0))(params, x)
jac = torch.cat([jac[n].reshape(x.shape[0], 4, -1) for n in params], 2)            # (B, Y, P)
psg = vmap(torch.func.grad(one_loss), in_dims=(None, 0, 0))(params, x, y)
psg = torch.cat([psg[n].reshape(x.shape[0], -1) for n in params], 1)                # (B, P)
cases = [
    ("jacobian wrt params", lambda: jm.jacobian(net, x, wrt="params"), jac),
    ("per_sample_grads", lambda: jm.per_sample_grads(net, x, loss, y=y), psg),
]
run(net, x, cases)
finish(net, before)
"""


_ROWS = """
class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.out = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x, m=None):
        return self.out(torch.tanh(self.lin(x if m is None else x * m)))


net = Two().double()
x = torch.randn(5, 3, dtype=torch.float64)
before = {n: (p, p.detach().clone()) for n, p in net.named_parameters()}
params = {n: p.detach().clone() for n, p in net.named_parameters()}
w = torch.randn(4, 3, dtype=torch.float64)
g = lambda w, v: torch.sin(torch.tanh(v @ w.T))
loss = lambda out: (out ** 2).sum(1)
cases = []
for i in range(3):  # other inputs in every case: a thread reading another's call would be seen
    xi, mi = torch.randn(5, 3, dtype=torch.float64), torch.rand(5, 3, dtype=torch.float64)
    one = lambda p, xb, mb: functional_call(net, p, (xb[None], mb[None]))[0]
    jac = vmap(jacrev(one), in_dims=(None, 0, 0))(params, xi, mi)
    jac = torch.cat([jac[n].reshape(5, 2, -1) for n in params], 2)
    psg = vmap(torch.func.grad(lambda p, xb, mb: loss(one(p, xb, mb)[None])[0]), in_dims=(None, 0, 0))(params, xi, mi)
    psg = torch.cat([psg[n].reshape(5, -1) for n in params], 1)
    fun = vmap(jacrev(lambda w, v: g(w, v[None])[0]), in_dims=(None, 0))(w, xi)
    cases += [
        (f"jacobian of two arguments wrt params {i}", lambda xi=xi, mi=mi: jm.jacobian(net, xi, mi, wrt="params"), jac),
        (f"per_sample_grads of two arguments {i}", lambda xi=xi, mi=mi: jm.per_sample_grads(net, (xi, mi), loss), psg),
        (f"jacobian of fn(w, x) wrt w {i}", lambda xi=xi: jm.jacobian(g, w, xi, argnums=0, in_dims=(None, 0)), fun),
    ]
run(net, x, cases)
finish(net, before)
"""


# A model, dicts of other values than its own, and torch.func's per-sample Jacobian at a dict (the
# oracles are computed before any thread runs)
_AT_DICTS = """
net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
x = torch.randn(5, 3, dtype=torch.float64)
before = {n: (p, p.detach().clone()) for n, p in net.named_parameters()}
own = {n: p.detach().clone() for n, p in net.named_parameters()}
dicts = [{n: p + 0.3 * (k + 1) for n, p in own.items()} for k in range(2)]  # other values than the model's
one = lambda p, xb: functional_call(net, p, (xb[None],))[0]
flat = lambda blocks: torch.cat([blocks[n].reshape(5, 2, -1) for n in own], 2)
"""


_BINDS = _AT_DICTS + """
fn = lambda p, v: torch.sin(functional_call(net, p, (v,)))   # torch.func's style: fn swaps p into net
cases = [
    ("jacobian wrt params", lambda: jm.jacobian(net, x, wrt="params"), flat(vmap(jacrev(one), in_dims=(None, 0))(own, x))),
    ("jacobian wrt inputs", lambda: jm.jacobian(net, x), vmap(jacrev(lambda xb: one(own, xb)))(x)),
    ("laplacian of a lambda", lambda: jm.laplacian(lambda z: net(z), x),
     vmap(hessian(lambda xb: one(own, xb)))(x).diagonal(dim1=-2, dim2=-1).sum(-1)),
]
for k, d in enumerate(dicts):
    cases.append((f"jacobian at a dict {k}", lambda d=d: jm.jacobian(net, x, wrt=d),
                  flat(vmap(jacrev(one), in_dims=(None, 0))(d, x))))
    cases.append((f"functional style {k}", lambda d=d: flat(jm.jacobian(fn, d, x, argnums=0, in_dims=(None, 0))),
                  flat(vmap(jacrev(lambda p, xb: fn(p, xb[None])[0]), in_dims=(None, 0))(d, x))))
side = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))  # the plain training step: another model
run(side, torch.randn(5, 3), cases)
finish(net, before)
"""


_DICTS = _AT_DICTS + """
loss = lambda out: (out ** 2).sum(1)
grads = lambda p: torch.cat([g.reshape(5, -1) for g in vmap(
    torch.func.grad(lambda p, xb: loss(functional_call(net, p, (xb[None],)))[0]), in_dims=(None, 0))(p, x).values()], 1)
cases = []
for k, d in enumerate(dicts):
    cases.append((f"jacobian at a dict {k}", lambda d=d: jm.jacobian(net, x, wrt=d),
                  flat(vmap(jacrev(one), in_dims=(None, 0))(d, x))))
    cases.append((f"per_sample_grads at a dict {k}", lambda d=d: jm.per_sample_grads(net, x, loss, wrt=d), grads(d)))
with torch.no_grad():
    y_own = net(x).clone()


def forward_only():  # the model's own output, whatever the calls at a dict do meanwhile
    while not stop.is_set():
        with torch.no_grad():
            y = net(x)
        if not torch.equal(y, y_own):
            plain_errors.append("a plain forward of the model computed with other tensors")


watcher = threading.Thread(target=forward_only)
watcher.start()
run(net, x, cases)
watcher.join()
finish(net, before)
"""


# Between two cases of one child: the lists and the stop event of the prelude start empty again.
_RESET = """
errors.clear(); mismatches.clear(); plain_errors.clear(); stop.clear()
"""


def _child(bodies: list[str], rounds: int, calls: int) -> list[dict]:
    """The RESULT of each body, run one after the other in one child process (one import of torch
    and jacmode for all: seconds on a busy machine)."""
    script = textwrap.dedent(_PRELUDE.format(rounds=rounds, calls=calls)) + _RESET.join(
        textwrap.dedent(b) for b in bodies)
    env = {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    timeout = _TIMEOUT * len(bodies)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the threads did not finish within {timeout} s (a hang)")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or len(lines) != len(bodies):
        pytest.fail(f"the child process died (exit code {done.returncode}) after {len(lines)} of {len(bodies)} "
                    f"cases:\n{done.stderr[-3000:]}")
    return [json.loads(ln[len("RESULT "):]) for ln in lines]


@pytest.fixture(scope="module")
def found() -> dict[str, dict]:
    """Both cases in one child (see _child): the Taylor operators first, then the parameter Jacobians."""
    taylor, params = _child([_TAYLOR, _PARAMS], rounds=3, calls=5)
    return {"taylor": taylor, "params": params}


def _check(found: dict) -> None:
    counts = {k: len(v) for k, v in found.items()}
    assert counts == {"errors": 0, "mismatches": 0, "plain_errors": 0, "model": 0}, json.dumps(
        {k: v[:5] for k, v in found.items()}, indent=1)


def test_taylor_operators_and_plain_backward_in_threads(found: dict[str, dict]) -> None:
    """laplacian, jacobian and partials from four threads at once, some inside a default-device
    context (``with torch.device``) and some not, traces and generated code made concurrently,
    beside a plain forward/backward: right results, the model untouched."""
    _check(found["taylor"])


def test_modules_of_sample_rows_in_threads() -> None:
    """Calls of several arguments (``jacobian(model, x, m, wrt="params")``, ``per_sample_grads(model,
    (x, m), ...)``) and of the functional style (``jacobian(fn, w, x, argnums=0, in_dims=(None, 0))``)
    from four threads at once, each with its own inputs, beside a plain forward/backward: each
    thread's module of sample rows reads its own call (results of torch.func), the model untouched."""
    [rows] = _child([_ROWS], rounds=3, calls=30)
    _check(rows)


def test_calls_beside_dicts_bound_into_the_model() -> None:
    """jacobian at a dict of tensors (``wrt=params``, run on a copy of the model) and in torch.func's
    functional style (fn calls ``functional_call(net, p, x)``, which puts other tensors into the
    model's slots while it runs), from four threads at once with calls on the model's own parameters and inputs: each result is
    the one it would be alone (a call that another thread's bind disturbed runs again), and the model
    is left with its own parameters."""
    [binds] = _child([_BINDS], rounds=3, calls=30)
    _check(binds)


def test_a_plain_forward_beside_calls_at_a_dict() -> None:
    """jacobian and per_sample_grads at dicts of tensors (``wrt=params``) from four threads at once,
    beside a plain forward and a plain forward/backward of the same model: the calls run on copies
    of the model, so the plain passes compute with the model's own parameters all along, and every
    result is torch.func's at its dict."""
    [dicts] = _child([_DICTS], rounds=3, calls=30)
    _check(dicts)


def test_parameter_jacobians_and_plain_backward_in_threads(found: dict[str, dict]) -> None:
    """jacobian(wrt="params") and per_sample_grads from four threads at once, beside a plain
    forward/backward: the results of torch.func, the model untouched."""
    _check(found["params"])


def _bind_in_a_thread(model: Any) -> None:
    """Another thread binds ``model`` (as a dict call or functional_call would) and finishes."""
    import threading

    from jacmode import _threads

    def bind() -> None:
        with _threads.touching([model]):
            pass

    t = threading.Thread(target=bind)
    t.start()
    t.join()


def test_which_binds_disturb_a_call() -> None:
    """A call is disturbed by another thread's bind of a model it reads, in flight when it began or
    begun since; not by its own thread's binds (however many: more than the list of recent binds
    keeps), nor by binds of other models."""
    import threading

    from torch import nn

    from jacmode import _threads

    net, other = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1)), nn.Linear(2, 2)
    used = {id(m) for m in net.modules()}
    stamp = _threads.bind_stamp()
    for _ in range(600):
        with _threads.touching([net]):
            pass
    assert not _threads.disturbed(stamp, lambda: used)
    _bind_in_a_thread(other)
    assert not _threads.disturbed(stamp, lambda: used)
    _bind_in_a_thread(net[1])  # a submodule of net
    assert _threads.disturbed(stamp, lambda: used)
    ready, done = threading.Event(), threading.Event()

    def hold() -> None:
        with _threads.touching([net]):
            ready.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    ready.wait(30)
    in_flight = _threads.bind_stamp()  # taken while another thread binds net
    done.set()
    t.join()
    assert _threads.disturbed(in_flight, lambda: used)
    assert not _threads.disturbed(_threads.bind_stamp(), lambda: used)


def test_a_disturbed_call_over_an_iterator_of_batches_is_refused() -> None:
    """A call that another thread's bind disturbed runs again, which a data set given as an iterator
    cannot: a clear error instead of a result from fewer batches."""
    import torch
    from torch import nn

    import jacmode as jm

    class Busy(nn.Module):
        """A model whose forward lets another thread bind it (once) while the call runs."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.done = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.done:
                self.done = True
                _bind_in_a_thread(self)
            return self.lin(x)

    net = Busy()
    batches = [torch.randn(4, 3) for _ in range(3)]
    with pytest.raises(RuntimeError, match=r"Busy: another thread bound a dict of tensors into a model this call "
                                           r"reads .* over an iterator of batches"):
        jm.per_sample_grads(net, iter(batches), lambda o: (o ** 2).sum(1), progress=False)
    net.done = False  # a list can be iterated again: the call runs again and is exact
    got = jm.per_sample_grads(net, [(b,) for b in batches], lambda o: (o ** 2).sum(1), progress=False)
    want = torch.cat([jm.per_sample_grads(net, b, lambda o: (o ** 2).sum(1)) for b in batches])
    assert torch.allclose(got, want)
