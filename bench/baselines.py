"""The two problems of the benchmarks, and the idioms jacmode replaces, written once.

Shared by ``python -m bench.bench`` and the asv suites in ``asv_benchmarks/``. Every method maps
(model, x) to the per-sample result, so the suites and the command time the same code:

* ``"params"`` (problem 1): the class ``MLP(784, 20, 10)`` of problems.md (fc1 -> ReLU -> fc2),
  P = 15,910; every method returns the (B, Y, P) = (B, 10, 15910) parameter Jacobian.
* ``"dydt"`` (problem 2): the class ``NetX`` (1-20-20-4, ``torch.tanh`` in ``forward``); every
  method returns dy_i/dt at each time step, (B, 4) (``jacmode.jacobian``: (B, 4, 1)).

Timings are of the problems' own classes, as users write them; the ``nn.Sequential`` twins
(``mnist_mlp_sequential``, ``time_mlp_sequential``) are a second row at most.

Example:
    >>> import torch
    >>> from bench.baselines import METHODS, PROBLEMS
    >>> model, x = PROBLEMS["dydt"].make(8, "cpu")
    >>> a = METHODS["dydt"]["jvp with ones"](model, x)
    >>> b = METHODS["dydt"]["users' loop"](model, x)
    >>> a.shape, bool(torch.allclose(a, b, atol=1e-5))
    (torch.Size([8, 4]), True)
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, cast

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vmap

import jacmode as jm

Method = Callable[[nn.Module, Tensor], Tensor]


class MLP(nn.Module):
    """Problem 1's model, the class exactly as its users wrote it (../shared/problems.md)."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, output_size)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        return self.fc2(self.relu(h))


class NetX(nn.Module):
    """Problem 2's model, as its users wrote it: functional ``torch.tanh`` in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1, 20)
        self.fc2 = nn.Linear(20, 20)
        self.out = nn.Linear(20, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.out(x)


class PinnNet(nn.Module):
    """A PINN as such code is usually written: Linear layers and ``torch.tanh`` in ``forward``.

    ``PinnNet(2, 64, 2)`` is the 2-64-64-1 network of the PINN benchmarks (inputs (t, x)).
    """

    def __init__(self, d_in: int = 2, width: int = 64, hidden: int = 2, d_out: int = 1) -> None:
        super().__init__()
        sizes = [d_in] + [width] * hidden
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.out = nn.Linear(sizes[-1], d_out)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def pinn_sequential(d_in: int = 2, width: int = 64, hidden: int = 2, d_out: int = 1) -> nn.Module:
    """The ``nn.Sequential`` twin of ``PinnNet`` (same layers, ``nn.Tanh``): a second row in benchmarks."""
    sizes = [d_in] + [width] * hidden
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], d_out))


class Opaque(nn.Module):
    """``net`` behind a Python branch on the input's rank, which torch.fx cannot trace: jacmode
    captures no graph and runs its generic engines (nested forward mode, vmap(jvp)) on it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 0:
            raise ValueError("expected a batch")
        return self.net(x)


class CumsumNet(PinnNet):
    """``PinnNet`` with one operation that has no rule (a cumulative sum over the hidden units)."""

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x.cumsum(-1))


class CNN(nn.Module):
    """The CNN class of bench/targets.py section 11 (and bench/psg_floor.py): two unpadded 3 x 3
    convolutions and a Linear on 28 x 28 images."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8 * 24 * 24, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.c1(x))
        x = torch.relu(self.c2(x))
        return self.fc(x.flatten(1))


def mnist_mlp() -> nn.Module:
    """Problem 1's model as users write it: ``MLP(784, 20, 10)``, P = 15,910."""
    return MLP(28 * 28, 20, 10)


def mnist_mlp_sequential() -> nn.Module:
    """The ``nn.Sequential`` twin of problem 1's model (same layers): a second row in benchmarks."""
    return nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10))


def time_mlp() -> nn.Module:
    """Problem 2's model as users write it: ``NetX()``, 1-20-20-4 with functional tanh."""
    return NetX()


def time_mlp_sequential() -> nn.Module:
    """The ``nn.Sequential`` twin of problem 2's model: a second row in benchmarks."""
    return nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 4))


@dataclass(frozen=True)
class BenchProblem:
    """A model, its input of B samples, and the batch sizes worth timing.

    Attributes:
        title: what is computed, for tables and plots.
        model: builds the model.
        features: per-sample input shape.
        sizes: the batch sizes B of the full benchmark.
        small: the largest B at which the quadratic or per-entry idioms are still timed.
    """

    title: str
    model: Callable[[], nn.Module]
    features: tuple[int, ...]
    sizes: tuple[int, ...]
    small: int

    def make(self, batch: int, device: str, seed: int = 0) -> tuple[nn.Module, Tensor]:
        """The model and a batch of B inputs on ``device``, the same for every method."""
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.model().to(device)
        x = torch.rand(batch, *self.features, generator=gen).to(device)
        return model, x


PROBLEMS = {
    "params": BenchProblem("(B, 10, 15910) parameter Jacobian of the MNIST MLP", mnist_mlp,
                           features=(784,), sizes=(2, 64, 512), small=64),
    "dydt": BenchProblem("(B, 4) dy/dt of the 1-20-20-4 tanh MLP", time_mlp,
                         features=(1,), sizes=(100, 1000, 100_000), small=1000),
}


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def _concat(blocks: "list[Tensor] | tuple[Tensor, ...]") -> Tensor:
    """Per-parameter (B, Y, *shape) blocks -> (B, Y, P) in ``named_parameters()`` order."""
    return torch.cat([j.flatten(2) for j in blocks], dim=2)


# -- problem 1: per-sample parameter Jacobians ------------------------------------------------------


def params_loop(model: nn.Module, x: Tensor) -> Tensor:
    """The users' loop as they wrote it: per sample and output, a forward pass of that sample and
    ``autograd.grad`` of that output; B*Y forward and backward passes."""
    params = list(model.parameters())
    n_out = model(x[:1]).shape[1]
    rows = []
    for b in range(x.shape[0]):
        for y in range(n_out):
            grads = torch.autograd.grad(model(x[b : b + 1])[0, y], params)
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows).reshape(x.shape[0], n_out, -1)


def params_vmap_jacrev(model: nn.Module, x: Tensor) -> Tensor:
    """The reply: ``vmap`` over samples of ``jacrev`` of ``functional_call``, then concatenated."""

    def one(p: dict[str, Tensor], xb: Tensor) -> Tensor:
        return functional_call(model, p, (xb.unsqueeze(0),)).squeeze(0)

    return _concat(list(vmap(jacrev(one), in_dims=(None, 0))(_params(model), x).values()))


def params_autograd_jacobian(model: nn.Module, x: Tensor) -> Tensor:
    """``torch.autograd.functional.jacobian(vectorize=True)`` of the batch output in the parameters."""
    params = _params(model)
    names = list(params)

    def batch_out(*values: Tensor) -> Tensor:
        return functional_call(model, dict(zip(names, values)), (x,))

    return _concat(torch.autograd.functional.jacobian(batch_out, tuple(params.values()), vectorize=True))


def params_hand_rule(model: nn.Module, x: Tensor) -> Tensor:
    """The floor: problem 1's Jacobian derived by hand for exactly this model (fc1 -> ReLU -> fc2).

    out = W2 relu(W1 x + b1) + b2, so per sample b and output y: d/dW2[o, i] = [o = y] r[b, i],
    d/db2 = e_y, d/db1 = W2[y] * relu'(h[b]) =: g[b, y], d/dW1 = g[b, y] (x) x[b]; written into one
    preallocated (B, Y, P) tensor.
    """
    fc1, fc2 = cast(nn.Linear, model.fc1), cast(nn.Linear, model.fc2)
    with torch.no_grad():
        h = fc1(x)
        r = torch.relu(h)
        B, H, D, Y = x.shape[0], h.shape[1], x.shape[1], int(fc2.out_features)
        J = x.new_empty(B, Y, H * D + H + Y * H + Y)
        g = fc2.weight * (h > 0).to(x.dtype).unsqueeze(1)  # (B, Y, H)
        torch.mul(g.unsqueeze(-1), x[:, None, None, :], out=J[..., : H * D].view(B, Y, H, D))
        J[..., H * D : H * D + H] = g
        w2 = J[..., H * D + H : H * D + H + Y * H].view(B, Y, Y, H)
        w2.zero_()
        w2.diagonal(dim1=1, dim2=2).copy_(r.unsqueeze(-1).expand(B, H, Y))
        b2 = J[..., H * D + H + Y * H :]
        b2.zero_()
        b2.diagonal(dim1=1, dim2=2).fill_(1)
    return J


def allocate_fill(model: nn.Module, x: Tensor) -> Tensor:
    """The memory floor of any method: allocate a tensor of the (B, Y, P) result and fill it."""
    n_out = model(x[:1]).numel()
    n_params = sum(p.numel() for p in model.parameters())
    return x.new_empty(x.shape[0], n_out, n_params).fill_(1.0)


_TWINS: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def _jacmode_sequential_twin(model: nn.Module, x: Tensor) -> Tensor:
    """jacmode on the ``nn.Sequential`` twin of problem 1's class (the same layers and parameters)."""
    twin = _TWINS.get(model)
    if twin is None:
        twin = _TWINS[model] = nn.Sequential(*(cast(nn.Module, getattr(model, n)) for n in ("fc1", "relu", "fc2")))
    return cast(Tensor, jm.jacobian(twin, x, wrt="params"))


def _jacmode_params(mode: str) -> Method:
    def method(model: nn.Module, x: Tensor) -> Tensor:
        return cast(Tensor, jm.jacobian(model, x, wrt="params", mode=mode))

    return method


# -- problem 2: dy/dt at every time step ------------------------------------------------------------


def dydt_loop(net: nn.Module, t: Tensor) -> Tensor:
    """The users' loop, like the parameter loop: per time step and output, a forward pass of that
    step and ``autograd.grad`` of that output; B*4 forward and backward passes."""
    n_out = net(t[:1]).shape[1]
    out = torch.empty(t.shape[0], n_out, dtype=t.dtype, device=t.device)
    for b in range(t.shape[0]):
        for i in range(n_out):
            tb = t[b : b + 1].detach().requires_grad_(True)
            out[b, i] = torch.autograd.grad(net(tb)[0, i], tb)[0][0, 0]
    return out


def dydt_full_diagonal(net: nn.Module, t: Tensor) -> Tensor:
    """The reply: the whole-batch Jacobian (B, 4, B, 1), O(B^2), then its diagonal blocks."""
    full = torch.autograd.functional.jacobian(net, t)
    i = torch.arange(t.shape[0], device=t.device)
    return full[i, :, i, 0]


def dydt_grad_ones(net: nn.Module, t: Tensor) -> Tensor:
    """``autograd.grad`` of each output column with a cotangent of ones: 4 backward passes."""
    t = t.detach().requires_grad_(True)
    out = net(t)
    ones = torch.ones(out.shape[0], dtype=out.dtype, device=out.device)
    cols = [torch.autograd.grad(out[:, j], t, ones, retain_graph=True)[0] for j in range(out.shape[1])]
    return torch.cat(cols, dim=1)


def dydt_jvp_ones(net: nn.Module, t: Tensor) -> Tensor:
    """``torch.func.jvp`` with a tangent of ones: one forward-mode pass."""
    return jvp(net, (t,), (torch.ones_like(t),))[1]


METHODS: dict[str, dict[str, Method]] = {
    "params": {
        "users' loop": params_loop,
        "vmap(jacrev)": params_vmap_jacrev,
        "autograd.functional.jacobian": params_autograd_jacobian,
        "jacmode": _jacmode_params("auto"),
        "jacmode forward": _jacmode_params("forward"),
        "jacmode reverse": _jacmode_params("reverse"),
        "jacmode, Sequential twin": _jacmode_sequential_twin,
        "hand-derived rule (floor)": params_hand_rule,
        "allocate+fill (floor)": allocate_fill,
    },
    "dydt": {
        "users' loop": dydt_loop,
        "full Jacobian + diagonal": dydt_full_diagonal,
        "autograd.grad with ones": dydt_grad_ones,
        "jvp with ones": dydt_jvp_ones,
        "jacmode": lambda net, t: jm.derivative(net, t),
        "jacmode.jacobian": lambda net, t: cast(Tensor, jm.jacobian(net, t)),
    },
}
# The idioms whose cost grows faster than the batch: timed only up to BenchProblem.small.
QUADRATIC = {"users' loop", "full Jacobian + diagonal"}


def preload() -> None:
    """Import what torch.func loads lazily on first use (about 1 s and 80 MB), before measuring.

    Every method then starts from the same process state, so neither a time nor a peak memory
    includes these one-time imports.
    """
    for name in ("torch._dynamo", "torch._decomp.decompositions_for_jvp"):
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - other torch versions
            pass


def runs_at(problem: str, method: str, batch: int, limit: Optional[int] = None) -> bool:
    """Whether ``method`` is timed at this B (the loops and the O(B^2) idiom at small B only)."""
    small = PROBLEMS[problem].small if limit is None else limit
    return method not in QUADRATIC or batch <= small
