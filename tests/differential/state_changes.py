"""State changes between repeated calls: the grammar and the runner.

jacmode remembers what a first call found (the captured program, the profile, the generated code of
the third call, the verdict that samples are independent, the output size) and reuses it. This
harness changes what ``forward`` reads between calls, as users do in a training loop or a notebook,
and checks every call against a float64 oracle recomputed on the state *at that moment*.

A case (``Case``, plain data) is

- a change (``CHANGES``): a small model class written as users write them whose forward reads
  the changed state (a function held as an attribute, a dict / list entry, a config object's
  attribute, a numpy scalar, a float or int attribute, a class attribute, a global function or
  tensor rebound, a closure cell, a lambda closing over a changed variable, a child module's
  attribute, a flag that switches a branch, coupling switched on or off, the output narrowed or
  made a tuple, BatchNorm's running statistics set to None, an optimizer step, a parameter
  replaced, a module swapped, a hook added, train/eval, dtype, batch size, requires_grad, a buffer
  replaced or set to None, a functional parameters dict changed);
- an entry point with its options (``ENTRIES``) and a calling convention (eager with the module,
  a lambda held across calls or made anew each call, ``jm.transform`` made once, or for parameter
  Jacobians torch.func's functional style, ``fn(params, x)`` with the parameters shared);
- the number of calls (1-6), the call index before which the change is applied, and possibly one
  before which it is undone.

``run_case`` makes the calls. Before each one it records the model's state, recomputes the
float64 oracle on a deep copy of the model as it is then (torch.func / autograd loops of
``oracles.py``), and after it checks the model was left as found. Error outcomes are judged
against a second reference, what a *fresh* call gives on the same state: after the sequence,
``jm.clear_cache()`` and the world rebuilt and replayed up to that call (``fresh_outcome``).
Every call is classified as

- ``match``: jacmode's result equals the oracle to ``runner.TOL`` of its dtype and order;
- ``clear_error``: one of jacmode's own clear errors (``runner.clear_error``) where an error is
  owed (a fresh call raises one too, or the samples are coupled); ``stale_error`` when a
  fresh call on the same state gives a result instead (e.g. a coupling verdict kept after the
  coupling was undone): counted and listed in its own column, not a failure (a refusal with a
  clear message, not a wrong number);
- ``silently_wrong``: a result that differs from the oracle, or a result where an error is owed;
- ``raw_error``: any other exception;
- ``state``: the call left the model changed (parameters, .grad, buffers, flags, hooks).

``settle`` recomputes a disagreement by float64 central differences, a third method independent
of both, to say which side is wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import traceback
import warnings
from typing import Any, Callable, Optional

import numpy as np
import oracles as O
import runner as R
import torch
import vectors as V
from torch import Tensor, nn
from torch.func import functional_call

import jacmode as jm

H = 5  # hidden width of every model

# ---------------------------------------------------------------------------------------------
# Global state that models read (reset by every build).

ACT: Callable[[Tensor], Tensor] = torch.tanh  # a global function rebound (GlobalAct)
SHIFT: Tensor = torch.zeros(H)  # a global tensor rebound or changed in place (GlobalShift)


def _reset_globals() -> None:
    global ACT, SHIFT
    ACT = torch.tanh
    SHIFT = torch.linspace(-0.5, 0.5, H)
    ClassAttr.scale = 1.0


class Base(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(d_in, H)
        self.l2 = nn.Linear(H, d_out)


class Plain(Base):
    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)))


class ActAttr(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.act = torch.tanh

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.act(self.l1(x)))


class DictAttr(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.opts = {"act": torch.tanh, "scale": 1.0}

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.opts["act"](self.l1(x)) * self.opts["scale"])


class ListAttr(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.scales = [1.0, 0.5]

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)) * self.scales[0]) * self.scales[1]


class Config:
    def __init__(self) -> None:
        self.scale = 1.0
        self.act = "tanh"


class ConfigAttr(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.cfg = Config()

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x) * self.cfg.scale
        h = torch.tanh(h) if self.cfg.act == "tanh" else torch.sigmoid(h)
        return self.l2(h)


class NumpyScalar(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.scale = np.float32(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x) * self.scale))


class NumpyFloat64(Base):
    """np.float64 is a subclass of Python's float (np.float32 is not)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.scale = np.float64(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)) * self.scale)


class IntSlice(Base):
    """An int attribute that splits the hidden features between two activations."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.k = H

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.l1(x))
        return self.l2(torch.cat([h[:, : self.k], torch.sin(h[:, self.k :])], 1))


class FloatAttr(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.scale * self.l1(x)))


class IntPower(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.power = 1

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)) ** self.power)


class IntDepth(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.mid = nn.Linear(H, H)
        self.depth = 1

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.l1(x))
        for _ in range(self.depth):
            h = torch.tanh(self.mid(h))
        return self.l2(h)


class ClassAttr(Base):
    scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)) * self.scale)


class GlobalAct(Base):
    def forward(self, x: Tensor) -> Tensor:
        return self.l2(ACT(self.l1(x)))


class GlobalShift(Base):
    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x) + SHIFT.to(x.dtype)))


def closure_model(d_in: int, d_out: int) -> tuple[nn.Module, Callable[[float], None]]:
    """A model whose forward reads a closure cell, and the setter of that cell."""
    scale = 1.0

    class ClosureNet(Base):
        def forward(self, x: Tensor) -> Tensor:
            return self.l2(torch.tanh(self.l1(x) * scale))

    def set_scale(v: float) -> None:
        nonlocal scale
        scale = v

    return ClosureNet(d_in, d_out), set_scale


class SoftplusChild(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.act = nn.Softplus(beta=1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.act(self.l1(x)))


class Scale(nn.Module):
    def __init__(self, s: float) -> None:
        super().__init__()
        self.s = s

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s


class CustomChild(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.scale = Scale(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.scale(self.l1(x))))


class FlagBranch(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.extra = False

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.l1(x))
        if self.extra:
            h = h + torch.sin(2 * h)
        return self.l2(h)


class Centred(Base):
    """Coupling switched by a flag: h - h.mean(0) couples the samples."""

    def __init__(self, d_in: int, d_out: int, centre: bool = False) -> None:
        super().__init__(d_in, d_out)
        self.centre = centre

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.l1(x))
        if self.centre:
            h = h - h.mean(0)
        return self.l2(h)


class Centre(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x - x.mean(0, keepdim=True)


class NormSlot(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.norm: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.norm(torch.tanh(self.l1(x))))


class BNNet(Base):
    """BatchNorm1d in eval mode with non-trivial running statistics."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.bn = nn.BatchNorm1d(H)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, H))
            self.bn.running_var.copy_(torch.linspace(0.5, 1.5, H))
            self.bn.weight.copy_(torch.linspace(0.8, 1.2, H))
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.bn(torch.tanh(self.l1(x))))


class Narrow(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.n_out = d_out

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)))[:, : self.n_out]


class MaybeTuple(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.as_tuple = False

    def forward(self, x: Tensor) -> Any:
        out = self.l2(torch.tanh(self.l1(x)))
        return (out,) if self.as_tuple else out


class ModuleAct(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.act: nn.Module = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.act(self.l1(x)))


class TrainBranch(Base):
    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.l1(x))
        if self.training:
            h = 0.5 * h + torch.sin(h)
        return self.l2(h)


class BufferShift(Base):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, H))

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        if self.shift is not None:
            h = h + self.shift
        return self.l2(torch.tanh(h))


# ---------------------------------------------------------------------------------------------
# Worlds: a model, the user's f, the state a change touches, and how to change it.


@dataclasses.dataclass
class World:
    net: nn.Module
    f: Callable[..., Any]  # what the input entry points are given (the module or a user lambda)
    oracle_f: Callable[[nn.Module], Callable[[Tensor], Any]]  # net64 (the current model, float64) -> f64
    target: Callable[[], nn.Module]  # the module f calls now (a lambda may rebind it)
    d_in: int
    d_out: int
    batch: int
    dtype: torch.dtype
    coupled: bool = False  # forward couples the samples now (owes an error at B > 1)
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)  # the change's own handles


@dataclasses.dataclass(frozen=True)
class Change:
    name: str
    klass: str  # "1 python value", "2 independence", "3 output size", "other"
    make: Callable[[int, int], Any]  # (d_in, d_out) -> a model, or (model, extra)
    apply: Callable[[World, torch.Generator], None]
    revert: Callable[[World], None]
    lambda_f: Optional[Callable[[World], None]] = None  # sets world.f / oracle_f / target (f is a lambda)
    coupled_before: bool = False
    coupled_after: bool = False
    d_out: Optional[int] = None  # forces the model's output width
    min_batch: int = 1

    @property
    def input_only(self) -> bool:
        """f is a lambda: the entry points that need the module itself do not apply."""
        return self.lambda_f is not None


def _set(attr: str, value: Any, on: Callable[[World], Any] = lambda w: w.net) -> tuple[Callable, Callable]:
    """apply / revert of ``setattr(on(world), attr, value)``."""

    def apply(w: World, gen: torch.Generator) -> None:
        obj = on(w)
        w.notes.setdefault(("old", attr), getattr(obj, attr))
        setattr(obj, attr, value)

    def revert(w: World) -> None:
        setattr(on(w), attr, w.notes[("old", attr)])

    return apply, revert


def _item(key: Any, value: Any, on: Callable[[World], Any]) -> tuple[Callable, Callable]:
    """apply / revert of ``on(world)[key] = value`` (a dict or list attribute changed in place)."""

    def apply(w: World, gen: torch.Generator) -> None:
        obj = on(w)
        w.notes.setdefault(("old", key), obj[key])
        obj[key] = value

    def revert(w: World) -> None:
        on(w)[key] = w.notes[("old", key)]

    return apply, revert


def _global(name: str, value: Callable[[], Any]) -> tuple[Callable, Callable]:
    def apply(w: World, gen: torch.Generator) -> None:
        w.notes.setdefault(("old", name), globals()[name])
        globals()[name] = value()

    def revert(w: World) -> None:
        globals()[name] = w.notes[("old", name)]

    return apply, revert


def _closure_apply(w: World, gen: torch.Generator) -> None:
    w.notes["set_scale"](2.5)


def _closure_revert(w: World) -> None:
    w.notes["set_scale"](1.0)


def _make_closure(d_in: int, d_out: int) -> tuple[nn.Module, dict[str, Any]]:
    net, setter = closure_model(d_in, d_out)
    return net, {"set_scale": setter}


def _lambda_closure(w: World) -> None:
    """f = lambda z: net(z) * c, c a closure cell that the user changes."""
    c = 1.0

    def set_c(v: float) -> None:
        nonlocal c
        c = v

    net = w.net
    w.f = lambda z: net(z) * c
    w.oracle_f = lambda net64: (lambda z: net64(z) * c)
    w.notes["set_c"] = set_c


def _lambda_rebind(w: World) -> None:
    """f = lambda z: model(z), ``model`` rebound to another instance of the same class."""
    model = w.net
    other = copy.deepcopy(w.net)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-1.3).add_(0.1)

    def rebind(to_other: bool) -> None:
        nonlocal model
        model = other if to_other else w.net

    w.f = lambda z: model(z)
    w.target = lambda: model
    w.oracle_f = lambda net64: net64
    w.notes["rebind"] = rebind


def _fparams(w: World) -> None:
    """f = lambda z: functional_call(net, params, (z,)) over a dict the user changes."""
    net = w.net
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    w.f = lambda z: functional_call(net, params, (z,))
    w.oracle_f = lambda net64: (lambda z: functional_call(net64, {k: v.double() for k, v in params.items()}, (z,)))
    w.notes["params"] = params


def _fparams_apply(w: World, gen: torch.Generator) -> None:
    p = w.notes["params"]
    w.notes.setdefault("old_w", p["l1.weight"])
    p["l1.weight"] = p["l1.weight"] * -1.5 + 0.2


def _opt_step(w: World, gen: torch.Generator) -> None:
    net = w.net
    w.notes.setdefault("saved", [p.detach().clone() for p in net.parameters()])
    grads = [p.grad for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x = torch.randn(4, w.d_in, generator=gen).to(next(net.parameters()).dtype)
    opt.zero_grad(set_to_none=True)
    (net(x) ** 2).sum().backward()
    opt.step()
    for p, g in zip(net.parameters(), grads):  # the user's loop: the .grad we set stays as it was
        p.grad = g


def _opt_revert(w: World) -> None:
    with torch.no_grad():
        for p, v in zip(w.net.parameters(), w.notes["saved"]):
            p.copy_(v.to(p.dtype))


def _param_replaced(w: World, gen: torch.Generator) -> None:
    old = w.net.l1.weight
    w.notes.setdefault("old_param", old)
    w.net.l1.weight = nn.Parameter(torch.randn(old.shape, generator=gen).to(old.dtype))


def _param_revert(w: World) -> None:
    w.net.l1.weight = w.notes["old_param"]


def _hook(pre: bool) -> tuple[Callable, Callable]:
    def apply(w: World, gen: torch.Generator) -> None:
        if pre:
            w.notes["hook"] = w.net.l2.register_forward_pre_hook(lambda m, args: (args[0] * 1.7 - 0.2,))
        else:
            w.notes["hook"] = w.net.l1.register_forward_hook(lambda m, args, out: out * 1.5 + 0.1)

    def revert(w: World) -> None:
        w.notes.pop("hook").remove()

    return apply, revert


def _dtype(w: World, gen: torch.Generator) -> None:
    w.net.double()
    w.dtype = torch.float64


def _dtype_revert(w: World) -> None:
    w.net.float()
    w.dtype = torch.float32


def _batch(w: World, gen: torch.Generator) -> None:
    w.notes.setdefault("old_batch", w.batch)
    w.batch = {1: 3, 2: 5, 3: 2, 5: 3}[w.batch]


def _batch_revert(w: World) -> None:
    w.batch = w.notes["old_batch"]


def _requires_grad(w: World, gen: torch.Generator) -> None:
    w.net.l1.bias.requires_grad_(False)


def _requires_grad_revert(w: World) -> None:
    w.net.l1.bias.requires_grad_(True)


def _buffer_replaced(w: World, gen: torch.Generator) -> None:
    w.notes.setdefault("old_buffer", w.net.shift)
    w.net.shift = torch.randn(H, generator=gen).to(w.net.l1.weight.dtype)  # still a buffer


def _buffer_inplace(w: World, gen: torch.Generator) -> None:
    w.notes.setdefault("old_buffer_value", w.net.shift.clone())
    with torch.no_grad():
        w.net.shift.mul_(-2.0).add_(0.3)


def _buffer_none(w: World, gen: torch.Generator) -> None:
    w.notes.setdefault("old_buffer", w.net.shift)
    w.net.shift = None


def _buffer_revert(w: World) -> None:
    if "old_buffer_value" in w.notes:
        with torch.no_grad():
            w.net.shift.copy_(w.notes["old_buffer_value"])
    else:
        w.net.shift = w.notes["old_buffer"]


def _bn_none(w: World, gen: torch.Generator) -> None:
    bn = w.net.bn
    w.notes.setdefault("stats", (bn.running_mean, bn.running_var))
    bn.running_mean = None
    bn.running_var = None


def _bn_none_revert(w: World) -> None:
    w.net.bn.running_mean, w.net.bn.running_var = w.notes["stats"]


def _swap(attr: str, new: Callable[[World], nn.Module]) -> tuple[Callable, Callable]:
    def apply(w: World, gen: torch.Generator) -> None:
        w.notes.setdefault(("old", attr), getattr(w.net, attr))
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
        setattr(w.net, attr, new(w).to(w.net.l1.weight.dtype))

    def revert(w: World) -> None:
        setattr(w.net, attr, w.notes[("old", attr)])

    return apply, revert


def _train(w: World, gen: torch.Generator) -> None:
    w.net.train()


def _eval(w: World, gen: Any = None) -> None:
    w.net.eval()


def _global_shift_inplace(w: World, gen: torch.Generator) -> None:
    w.notes.setdefault("old_shift", SHIFT.clone())
    SHIFT.mul_(-3.0).add_(0.4)


def _global_shift_inplace_revert(w: World) -> None:
    SHIFT.copy_(w.notes["old_shift"])


def _changes() -> dict[str, Change]:
    c: list[Change] = []

    def add(name: str, klass: str, make: Callable, ar: tuple[Callable, Callable], **kw: Any) -> None:
        c.append(Change(name, klass, make, ar[0], ar[1], **kw))

    one, two, three, other = "1 python value", "2 independence", "3 output size", "other"
    add("act_attr", one, ActAttr, _set("act", torch.sin))
    add("dict_act", one, DictAttr, _item("act", torch.sigmoid, lambda w: w.net.opts))
    add("dict_scale", one, DictAttr, _item("scale", 2.5, lambda w: w.net.opts))
    add("list_entry", one, ListAttr, _item(1, -1.5, lambda w: w.net.scales))
    add("config_scale", one, ConfigAttr, _set("scale", -0.7, lambda w: w.net.cfg))
    add("config_str", one, ConfigAttr, _set("act", "sigmoid", lambda w: w.net.cfg))
    add("numpy_scalar", one, NumpyScalar, _set("scale", np.float32(2.0)))
    add("numpy_float64", one, NumpyFloat64, _set("scale", np.float64(2.5)))
    add("float_attr", one, FloatAttr, _set("scale", 3.0))
    add("int_slice", one, IntSlice, _set("k", 2))
    add("int_power", one, IntPower, _set("power", 3))
    add("int_depth", one, IntDepth, _set("depth", 2))
    add("class_attr", one, ClassAttr, (lambda w, g: setattr(ClassAttr, "scale", 2.0),
                                       lambda w: setattr(ClassAttr, "scale", 1.0)))
    add("global_fn", one, GlobalAct, _global("ACT", lambda: torch.sin))
    add("closure_cell", one, _make_closure, (_closure_apply, _closure_revert))
    add("lambda_closure", one, Plain, (lambda w, g: w.notes["set_c"](-2.0), lambda w: w.notes["set_c"](1.0)),
        lambda_f=_lambda_closure)
    add("lambda_rebind", one, Plain, (lambda w, g: w.notes["rebind"](True), lambda w: w.notes["rebind"](False)),
        lambda_f=_lambda_rebind)
    add("child_softplus_beta", one, SoftplusChild, _set("beta", 3.0, lambda w: w.net.act))
    add("child_custom_attr", one, CustomChild, _set("s", -1.7, lambda w: w.net.scale))
    add("flag_branch", one, FlagBranch, _set("extra", True))
    add("centre_on", two, Centred, _set("centre", True), coupled_after=True)
    add("centre_off", two, lambda d, o: Centred(d, o, centre=True), _set("centre", False), coupled_before=True)
    add("identity_to_centre", two, NormSlot, _swap("norm", lambda w: Centre()), coupled_after=True)
    add("bn_train", two, BNNet, (_train, _eval), coupled_after=True, min_batch=2)
    add("narrow_out", three, Narrow, _set("n_out", 2), d_out=4)
    add("head_swap_narrow", three, Plain, _swap("l2", lambda w: nn.Linear(H, 2)), d_out=4)
    add("tuple_out", three, MaybeTuple, _set("as_tuple", True))
    add("bn_stats_none", three, BNNet, (_bn_none, _bn_none_revert), coupled_after=True, min_batch=2)
    add("global_tensor_rebound", other, GlobalShift, _global("SHIFT", lambda: torch.linspace(1.0, -2.0, H)))
    add("global_tensor_inplace", other, GlobalShift, (_global_shift_inplace, _global_shift_inplace_revert))
    add("fparams_dict", other, Plain, (_fparams_apply, lambda w: w.notes["params"].update({"l1.weight": w.notes["old_w"]})),
        lambda_f=_fparams)
    add("optimizer_step", other, Plain, (_opt_step, _opt_revert))
    add("param_replaced", other, Plain, (_param_replaced, _param_revert))
    add("module_swap", other, ModuleAct, _swap("act", lambda w: nn.Sigmoid()))
    add("head_swap", other, Plain, _swap("l2", lambda w: nn.Linear(H, w.d_out)))
    add("forward_hook", other, Plain, _hook(pre=False))
    add("forward_pre_hook", other, Plain, _hook(pre=True))
    add("train_to_eval", other, TrainBranch, (_eval, lambda w: w.net.train()))
    add("eval_to_train", other, lambda d, o: TrainBranch(d, o).eval(), (_train, _eval))
    add("dtype_float64", other, Plain, (_dtype, _dtype_revert))
    add("batch_size", other, Plain, (_batch, _batch_revert))
    add("requires_grad_off", other, Plain, (_requires_grad, _requires_grad_revert))
    add("buffer_replaced", other, BufferShift, (_buffer_replaced, _buffer_revert))
    add("buffer_inplace", other, BufferShift, (_buffer_inplace, _buffer_revert))
    add("buffer_none", other, BufferShift, (_buffer_none, _buffer_revert))
    return {ch.name: ch for ch in c}


CHANGES = _changes()


# ---------------------------------------------------------------------------------------------
# Entry points: the jacmode call, its float64 oracle, and its finite-difference recomputation.


def LOSS(out: Tensor) -> Tensor:
    """The per-sample loss of per_sample_grads."""
    return (out**2).sum(1)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    op: Callable[..., Any]
    opts: Callable[[int], dict[str, Any]]  # d_in -> keyword options
    kind: str  # "input" (f may be a lambda) or "module"
    order: int = 1
    fits: Callable[[int, int], bool] = lambda d_in, d_out: True


def _dims(d: int) -> list[tuple[int, ...]]:
    return [(0,), (0, 0)] if d == 1 else [(1,), (0, 1)]


ENTRIES: dict[str, Entry] = {e.name: e for e in [
    Entry("jacobian", jm.jacobian, lambda d: {}, "input"),
    Entry("jacobian_forward", jm.jacobian, lambda d: {"mode": "forward"}, "input"),
    Entry("jacobian_reverse", jm.jacobian, lambda d: {"mode": "reverse"}, "input"),
    Entry("hessian", jm.hessian, lambda d: {}, "input", 2),
    Entry("laplacian", jm.laplacian, lambda d: {}, "input", 2),
    Entry("partials", jm.partials, lambda d: {"dims": _dims(d)}, "input", 2),
    Entry("derivative", jm.derivative, lambda d: {"order": 1}, "input", 1, lambda d, o: d == 1),
    Entry("derivative2", jm.derivative, lambda d: {"order": 2}, "input", 2, lambda d, o: d == 1),
    Entry("divergence", jm.divergence, lambda d: {}, "input", 1, lambda d, o: d == o),
    Entry("jacobian_params", jm.jacobian, lambda d: {"wrt": "params"}, "module"),
    Entry("jacobian_subset", jm.jacobian, lambda d: {"wrt": ["l2.weight", "l1.bias"]}, "module"),
    Entry("per_sample_grads", jm.per_sample_grads, lambda d: {"loss": LOSS}, "module"),
    Entry("ntk", jm.ntk, lambda d: {}, "module"),
    Entry("ntk_trace", jm.ntk, lambda d: {"trace": True}, "module"),
    Entry("ggn", jm.ggn, lambda d: {"loss": "mse"}, "module"),
    Entry("ggn_diagonal", jm.ggn, lambda d: {"loss": "mse", "diagonal": True}, "module"),
]}

CONVENTIONS = ("eager", "transform", "lambda", "lambda_fresh")  # the last two: input entries on a module
# torch.func's functional style, fn(params, x) with the parameters a shared argument
# (jm.jacobian(fn, params, x, argnums=0, in_dims=(None, 0))): parameter Jacobians and the products
FUNCTIONAL = "functional"
FUNCTIONAL_ENTRIES = ("jacobian_params", "per_sample_grads", "ntk", "ntk_trace", "ggn", "ggn_diagonal")
# the same entry points at a dict of the model's trainable parameters as they are now (wrt=dict: the
# call runs on a copy of the model holding new tensors of the same values, as a functional optimiser
# passes them at every step)
DICT = "dict"


def _trainable(net: nn.Module, names: Optional[list[str]]) -> list[tuple[str, Tensor]]:
    """The parameters differentiated: the trainable ones, or the named subset, in named_parameters()
    order (jacobian's docstring: "concatenated in named_parameters() order")."""
    named = dict(net.named_parameters())
    if names is None:
        return [(n, p) for n, p in named.items() if p.requires_grad]
    return [(n, p) for n, p in named.items() if n in names]


def _param_rows(net64: nn.Module, x: Tensor, names: Optional[list[str]]) -> Tensor:
    """(B, Y, P) parameter Jacobian of each sample evaluated alone (autograd loops)."""
    rows = []
    for b in range(x.shape[0]):
        out = net64(x[b : b + 1])
        if not isinstance(out, Tensor):
            raise TypeError("oracle: the model returns a tuple")
        rows.append(O._rows(out[0], [p for _, p in _trainable(net64, names)]).detach())
    return torch.stack(rows)


def oracle(entry: Entry, f64: Callable[[Tensor], Any], net64: nn.Module, x: Tensor) -> Any:
    """The float64 oracle of ``entry`` at x (float64) on the current state."""
    n, d = entry.name, x.shape[1]
    probe = f64(x)
    if isinstance(probe, tuple):  # each component's derivative, a tuple (jacmode owes a clear TypeError)
        return tuple(oracle(entry, lambda z, k=k: f64(z)[k], net64, x) for k in range(len(probe)))
    if n.startswith("jacobian") and entry.kind == "input":
        return O.input_jacobian(f64, x, True)
    if n == "hessian":
        return O.hessian(f64, x)
    if n == "laplacian":
        return O.laplacian(f64, x)
    if n == "partials":
        return tuple(O.partial(f64, x, dims) for dims in _dims(d))
    if n.startswith("derivative"):
        return O.derivative(f64, x, entry.order)
    if n == "divergence":
        if probe.shape[1:] != x.shape[1:]:
            raise ValueError(f"oracle: divergence of an output {tuple(probe.shape)} of an input {tuple(x.shape)}")
        return O.divergence(f64, x)
    names = ["l2.weight", "l1.bias"] if n == "jacobian_subset" else None
    if n.startswith("jacobian"):
        return _param_rows(net64, x, names)
    if n == "per_sample_grads":
        return O.per_sample_grads(net64, x, LOSS, None).detach()
    j = _param_rows(net64, x, None)
    if n == "ntk":
        return torch.einsum("byp,czp->bcyz", j, j)
    if n == "ntk_trace":
        return torch.einsum("byp,cyp->bc", j, j)
    g = torch.einsum("byp,byq->pq", j, j)
    return g.diagonal() if n == "ggn_diagonal" else g


def finite_differences(entry: Entry, f64: Callable[[Tensor], Tensor], net64: nn.Module, x: Tensor) -> Any:
    """The same quantity as ``oracle`` by float64 central differences (no autograd at all)."""
    n, b_ = entry.name, x.shape[0]
    with torch.no_grad():
        if entry.kind == "input":
            return _fd_input(entry, f64, x)
        names = ["l2.weight", "l1.bias"] if n == "jacobian_subset" else None
        params = _trainable(net64, names)
        flat0 = torch.cat([p.detach().reshape(-1) for _, p in params])
        base = {k: v.detach() for k, v in net64.named_parameters()}

        def at(theta: Tensor, xb: Tensor) -> Tensor:
            ps, i = dict(base), 0
            for name, p in params:
                ps[name] = theta[i : i + p.numel()].reshape(p.shape)
                i += p.numel()
            return functional_call(net64, ps, (xb,))

        h = 1e-6
        rows = []
        for b in range(b_):
            xb = x[b : b + 1]
            fn = (lambda th: LOSS(at(th, xb))[0]) if n == "per_sample_grads" else (lambda th: at(th, xb)[0])
            cols = []
            for i in range(flat0.numel()):
                e = torch.zeros_like(flat0)
                e[i] = h
                cols.append((fn(flat0 + e) - fn(flat0 - e)) / (2 * h))
            rows.append(torch.stack(cols, -1))
        j = torch.stack(rows)  # (B, Y, P) or (B, P) for per_sample_grads
        if n.startswith("jacobian") or n == "per_sample_grads":
            return j
        if n == "ntk":
            return torch.einsum("byp,czp->bcyz", j, j)
        if n == "ntk_trace":
            return torch.einsum("byp,cyp->bc", j, j)
        g = torch.einsum("byp,byq->pq", j, j)
        return g.diagonal() if n == "ggn_diagonal" else g


def _fd_input(entry: Entry, f64: Callable[[Tensor], Tensor], x: Tensor) -> Any:
    d = x.shape[1]

    def e(i: int, h: float) -> Tensor:
        v = torch.zeros_like(x)
        v[:, i] = h  # every sample moved at once: fine for independent samples (what is compared)
        return v

    if entry.order == 1:
        h = 1e-6
        j = torch.stack([(f64(x + e(i, h)) - f64(x - e(i, h))) / (2 * h) for i in range(d)], -1)  # (B, O, D)
        if entry.name == "divergence":
            return j.diagonal(dim1=-2, dim2=-1).sum(-1)
        if entry.name == "derivative":
            return j[..., 0]
        return j
    h = 1e-4
    hess = torch.zeros(*f64(x).shape, d, d, dtype=x.dtype)
    for i in range(d):
        for k in range(d):
            hess[..., i, k] = (f64(x + e(i, h) + e(k, h)) - f64(x + e(i, h) - e(k, h)) - f64(x - e(i, h) + e(k, h))
                               + f64(x - e(i, h) - e(k, h))) / (4 * h * h)
    if entry.name == "hessian":
        return hess
    if entry.name == "laplacian":
        return hess.diagonal(dim1=-2, dim2=-1).sum(-1)
    if entry.name == "derivative2":
        return hess[..., 0, 0]
    return tuple(hess[..., dims[0], dims[1]] if len(dims) == 2 else _fd_input(
        dataclasses.replace(entry, name="jacobian", order=1), f64, x)[..., dims[0]] for dims in _dims(d))


# ---------------------------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    change: str
    entry: str
    convention: str
    calls: int  # 1..6
    at: int  # the change is applied before this call (0-based)
    back: Optional[int]  # undone before this call, or None
    batch: int
    d_in: int
    d_out: int
    dtype: torch.dtype = torch.float32
    mix: Optional[str] = None  # a second entry point, made on the odd calls (a verdict carried across entries)

    def describe(self) -> str:
        back = f", back before {self.back}" if self.back is not None else ""
        mix = f" alternating with {self.mix}" if self.mix else ""
        return (f"{self.change} x {self.entry}{mix} ({self.convention}), {self.calls} calls, change before call "
                f"{self.at}{back}; B={self.batch}, in={self.d_in}, out={self.d_out}, {str(self.dtype)[6:]}, "
                f"seed {self.seed}")


def entry_at(case: Case, i: int) -> Entry:
    """The entry point of call i."""
    return ENTRIES[case.mix if case.mix is not None and i % 2 == 1 else case.entry]


MIXES = {"input": ("jacobian_params", "per_sample_grads", "ntk_trace", "ggn"),
         "module": ("jacobian", "jacobian_reverse", "hessian", "laplacian")}


def valid(case: Case) -> bool:
    ch, en = CHANGES[case.change], ENTRIES[case.entry]
    if en.kind == "module" and (ch.input_only or case.convention in ("lambda", "lambda_fresh")):
        return False
    if case.convention == FUNCTIONAL and (en.name not in FUNCTIONAL_ENTRIES or case.mix is not None
                                          or case.change == "tuple_out"):  # (blocks per output: torch.func's pytree)
        return False
    if case.convention == DICT and (en.name not in FUNCTIONAL_ENTRIES or case.mix is not None):
        return False
    if ch.input_only and case.convention in ("lambda", "lambda_fresh"):
        return False  # f is already the user's lambda
    if case.batch < ch.min_batch:
        return False
    if case.mix is not None and (ch.input_only or case.convention not in ("eager", "transform")
                                 or not ENTRIES[case.mix].fits(case.d_in, case.d_out)):
        return False
    return en.fits(case.d_in, case.d_out)


def draw(rng: random.Random, seed: int, change: Optional[str] = None, entry: Optional[str] = None) -> Case:
    """One random valid case (the given change / entry if named)."""
    while True:
        ch = CHANGES[change or rng.choice(sorted(CHANGES))]
        en = ENTRIES[entry or rng.choice(sorted(ENTRIES))]
        d_in = 1 if en.name.startswith("derivative") else rng.choice([1, 2, 3])
        d_out = ch.d_out or (d_in if en.name == "divergence" else rng.choice([2, 3]))
        if en.name == "divergence" and d_out != d_in:
            d_in = d_out
        convention = rng.choice(CONVENTIONS if en.kind == "input" and not ch.input_only else
                                (*CONVENTIONS[:2], FUNCTIONAL, DICT) if en.name in FUNCTIONAL_ENTRIES
                                else CONVENTIONS[:2])
        calls = rng.choice([2, 3, 4, 4, 5, 5, 6, 6, 6]) if rng.random() > 0.03 else 1
        at = rng.choice(range(1, calls)) if calls > 1 and rng.random() > 0.1 else 0
        back = rng.choice(range(at + 1, calls)) if at + 1 < calls and rng.random() < 0.3 else None
        batch = rng.choice([1, 2, 3, 3]) if ch.min_batch == 1 else rng.choice([2, 3])
        dtype = torch.float64 if rng.random() < 0.15 and ch.name != "dtype_float64" else torch.float32
        mix = rng.choice(MIXES[en.kind]) if rng.random() < 0.2 else None
        case = Case(seed, ch.name, en.name, convention, calls, at, back, batch, d_in, d_out, dtype, mix)
        if valid(case):
            return case
        change_fixed, entry_fixed = change is not None, entry is not None
        if change_fixed and entry_fixed and not valid(dataclasses.replace(case, convention="eager", mix=None)):
            raise ValueError(f"no valid case of {change} x {entry}")


def fixed_cases(n: int, seed: int = 20240) -> list[Case]:
    """CI's fixed set: the changes in turn, each meeting the entry points in a walk that shifts by
    one per round (so n >= len(CHANGES) * k covers every change k times with k different entries)."""
    rng = random.Random(seed)
    out: list[Case] = []
    changes, entries = sorted(CHANGES), sorted(ENTRIES)
    k = 0
    while len(out) < n:
        ch = changes[k % len(changes)]
        start = k // len(changes) * 5 + k % len(changes)  # 5 is prime to the 16 entry points
        for j in range(len(entries)):
            try:
                out.append(draw(rng, 1000 + k, ch, entries[(start + j) % len(entries)]))
                break
            except ValueError:
                continue
        k += 1
    return out


def covering_cases(pool: int = 700, prefix: int = 180, seed: int = 20240) -> list[Case]:
    """CI's default set: a subset of ``fixed_cases(pool)`` (the same cases, seeds and order) that
    meets every combination the whole walk meets at under half its calls. The walk's first
    ``prefix`` cases (every change 4 times, each time with another entry point), then each later
    case of the walk that meets a (change class, entry point, convention) or a (change,
    convention) that no case kept before it meets: so every change class x entry point, every
    change class x entry point x convention and every change x convention of the whole walk stays
    covered; change x entry pairs go from the walk's 681 to 299)."""
    full = fixed_cases(pool, seed)
    out = full[:prefix]

    def met(c: Case) -> set[tuple[str, ...]]:
        return {(CHANGES[c.change].klass, c.entry, c.convention), (c.change, c.convention)}

    seen = set().union(*(met(c) for c in out))
    for c in full[prefix:]:
        if not met(c) <= seen:
            out.append(c)
            seen |= met(c)
    return out


# ---------------------------------------------------------------------------------------------
# Running a case.


def build(case: Case) -> World:
    """The world before the first call: globals reset, the model from the case's seed."""
    _reset_globals()
    ch = CHANGES[case.change]
    torch.manual_seed(case.seed)
    made = ch.make(case.d_in, case.d_out)
    net, notes = made if isinstance(made, tuple) else (made, {})
    net = net.to(case.dtype)
    w = World(net=net, f=net, oracle_f=lambda net64: net64, target=lambda: net, d_in=case.d_in, d_out=case.d_out,
              batch=case.batch, dtype=case.dtype, coupled=ch.coupled_before, notes=dict(notes))
    if ch.lambda_f is not None:
        ch.lambda_f(w)
    first = next(net.parameters())
    first.grad = torch.full_like(first, 0.25)  # a .grad the calls must leave alone
    if case.convention == "transform":
        for en in {entry_at(case, 0).name: entry_at(case, 0), entry_at(case, 1).name: entry_at(case, 1)}.values():
            f = w.net if en.kind == "module" else w.f
            try:
                w.notes[("transform", en.name)] = jm.transform(en.op, f, **en.opts(case.d_in))
            except Exception as err:  # noqa: BLE001 -- every call then raises it, and is judged
                w.notes[("transform", en.name)] = err
    elif case.convention == "lambda":
        held = w.f
        w.notes["held"] = lambda z: held(z)
    elif case.convention == FUNCTIONAL:  # one fn for every call, reading the model as it is then
        w.notes["functional"] = lambda p, xb: functional_call(w.net, p, (xb,))
    return w


def events_before(case: Case, i: int) -> list[str]:
    ev = []
    if i == case.at:
        ev.append("apply")
    if case.back is not None and i == case.back:
        ev.append("revert")
    return ev


def advance(case: Case, w: World, i: int) -> None:
    """Apply the events due before call i."""
    ch = CHANGES[case.change]
    gen = torch.Generator().manual_seed(case.seed * 31 + 7)
    for ev in events_before(case, i):
        if ev == "apply":
            ch.apply(w, gen)
            w.coupled = ch.coupled_after if (ch.coupled_after or ch.coupled_before) else w.coupled
        else:
            ch.revert(w)
            w.coupled = ch.coupled_before


def make_x(case: Case, w: World, i: int) -> Tensor:
    gen = torch.Generator().manual_seed(case.seed * 101 + i)
    return torch.randn(w.batch, w.d_in, generator=gen, dtype=torch.float64).to(w.dtype)


def call(case: Case, w: World, x: Tensor, i: int) -> Any:
    """Call i of the case's entry point (or of its mix) under the case's convention."""
    en = entry_at(case, i)
    if case.convention == "transform":
        t = w.notes[("transform", en.name)]
        if isinstance(t, Exception):
            raise t
        return t(x)
    f = w.net if en.kind == "module" else w.f
    if case.convention == FUNCTIONAL:
        return _functional_call(en, w.notes["functional"], w.net, x)
    if case.convention == DICT:
        values = {n: p.detach().clone() for n, p in _trainable(w.net, None)}
        return en.op(w.net, x, **{**en.opts(case.d_in), "wrt": values})
    if case.convention == "lambda":
        f = w.notes["held"]
    elif case.convention == "lambda_fresh":
        held = w.f
        f = lambda z: held(z)  # noqa: E731 -- a new lambda of the same code each call
    return en.op(f, x, **en.opts(case.d_in))


def _functional_call(en: Entry, fn: Callable[..., Tensor], net: nn.Module, x: Tensor) -> Tensor:
    """The parameter Jacobian (B, Y, P), the per-sample gradients (B, P), the NTK or the GGN in
    torch.func's functional style, ``fn(params, x)`` (the trainable parameters of the model as it is
    now, in named_parameters() order)."""
    params = dict(_trainable(net, None))
    style: dict[str, Any] = {"argnums": 0, "in_dims": (None, 0)}
    if en.name == "per_sample_grads":
        grads = jm.per_sample_grads(fn, (params, x), LOSS, **style)
        return torch.cat([grads[n].reshape(x.shape[0], params[n].numel()) for n in params], -1)
    if en.name.startswith(("ntk", "ggn")):
        return en.op(fn, (params, x), **en.opts(x.shape[1]), **style)
    blocks = jm.jacobian(fn, params, x, **style)
    return torch.cat([blocks[n].reshape(x.shape[0], -1, params[n].numel()) for n in params], -1)


def coupled_now(w: World) -> bool:
    return w.coupled and w.batch > 1


@dataclasses.dataclass
class CallRecord:
    index: int
    entry: Entry
    status: str = ""  # match, clear_error, stale_error, silently_wrong, raw_error, state
    detail: str = ""
    err: float = float("nan")  # max |jacmode - oracle| where both are numbers
    got: Any = None
    want: Any = None
    error: Optional[BaseException] = None
    oracle_error: Optional[BaseException] = None
    changed: Optional[str] = None
    fd: Optional[str] = None  # the finite-difference verdict on a disagreement


def _detach(v: Any) -> Any:
    if isinstance(v, tuple):
        return tuple(_detach(t) for t in v)
    return v.detach().clone() if isinstance(v, Tensor) else v


def run_case(case: Case) -> list[CallRecord]:
    """Make the case's calls, judge each, and return the records."""
    jm.clear_cache()
    records: list[CallRecord] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w = build(case)
            for i in range(case.calls):
                advance(case, w, i)
                rec = CallRecord(i, entry_at(case, i))
                x = make_x(case, w, i)
                if not coupled_now(w):
                    try:
                        net64 = copy.deepcopy(w.target()).double()
                        rec.want = oracle(rec.entry, w.oracle_f(net64), net64, x.double())
                    except Exception as err:  # noqa: BLE001 -- the fresh call decides
                        rec.oracle_error = err
                before, target = V.state_of(w.net), w.target()
                try:
                    rec.got = _detach(call(case, w, x, i))
                except Exception as err:  # noqa: BLE001 -- judged below
                    rec.error = err
                rec.changed = V.state_changed(before, w.net)
                if rec.changed is None and w.target() is not target:
                    rec.changed = "the module f calls was rebound"
                records.append(rec)
        for rec in records:
            judge(case, w, rec)
    finally:
        _reset_globals()
        jm.clear_cache()
    return records


def fresh_outcome(case: Case, i: int) -> tuple[str, Any]:
    """What a fresh call gives at call i: ("value", result) or ("error", exception)."""
    jm.clear_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = build(case)
        for j in range(i + 1):
            advance(case, w, j)
        x = make_x(case, w, i)
        try:
            return "value", _detach(call(case, w, x, i))
        except Exception as err:  # noqa: BLE001
            return "error", err
        finally:
            _reset_globals()
            jm.clear_cache()


def compare(got: Any, want: Any, dtype: torch.dtype, order: int) -> tuple[Optional[str], float]:
    """(None, err) when got matches want to runner.TOL, else (why, err)."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return f"expected a tuple of {len(want)}, got {type(got).__name__}", float("inf")
        worst: tuple[Optional[str], float] = (None, 0.0)
        for g, wv in zip(got, want):
            bad, err = compare(g, wv, dtype, order)
            if bad or err > worst[1]:
                worst = (bad or worst[0], max(err, worst[1]))
        return worst
    if not isinstance(got, Tensor):
        return f"expected a tensor, got {type(got).__name__}", float("inf")
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}", float("inf")
    if got.dtype != dtype:
        return f"dtype {got.dtype}, expected {dtype}", float("nan")
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    tol = R.TOL[dtype][order] * (scale + R.FLOOR)
    if not err <= tol:
        return f"max |jacmode - oracle| = {err:.3g} > {tol:.3g} (max |oracle| = {scale:.3g})", err
    return None, err


def _short(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)[-3:]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames))


def judge(case: Case, w: World, rec: CallRecord) -> None:
    """Classify one call (see the module's note)."""
    en = rec.entry
    if rec.changed:
        rec.status, rec.detail = "state", rec.changed
        return
    fresh: Optional[tuple[str, Any]] = None
    need_fresh = rec.error is not None or rec.oracle_error is not None or rec.want is None
    if need_fresh:
        fresh = fresh_outcome(case, rec.index)
    owed = rec.want is None and rec.oracle_error is None  # coupled samples at B > 1
    fresh_error = fresh is not None and fresh[0] == "error" and R.clear_error(fresh[1]) is None
    if rec.error is not None:
        why = R.clear_error(rec.error)
        if why is not None:
            rec.status = "raw_error"
            rec.detail = f"{_short(rec.error)} [{why}] at {_where(rec.error)}"
            if fresh is not None:
                rec.detail += f"; a fresh call gives {_short(fresh[1]) if fresh[0] == 'error' else 'a result'}"
            return
        if owed or fresh_error:
            rec.status, rec.detail = "clear_error", _short(rec.error)
        else:
            rec.status = "stale_error"
            rec.detail = f"{_short(rec.error)}; a fresh call gives a result"
        return
    # jacmode returned a result
    if owed:
        rec.status = "silently_wrong"
        rec.detail = ("a result where the samples are coupled; a fresh call raises "
                      + (_short(fresh[1]) if fresh and fresh[0] == "error" else "nothing (a first-call bug too)"))
        return
    if fresh_error:
        rec.status = "silently_wrong"
        rec.detail = f"a result where a fresh call raises {_short(fresh[1])}"
        return
    want = rec.want
    if rec.oracle_error is not None:  # the oracle cannot: a fresh call's result is the reference
        if fresh is None or fresh[0] != "value":
            rec.status, rec.detail = "raw_error", f"oracle: {_short(rec.oracle_error)}; fresh: {fresh}"
            return
        want = fresh[1]
    bad, err = compare(rec.got, want, _result_dtype(case, rec), en.order)
    rec.err = err
    if bad:
        rec.status, rec.detail = "silently_wrong", bad
    else:
        rec.status = "match"


def _result_dtype(case: Case, rec: CallRecord) -> torch.dtype:
    """The dtype of the differentiated tensors at that call (dtype changes apply before rec.index)."""
    if case.change == "dtype_float64" and case.at <= rec.index and not (case.back is not None and case.back <= rec.index):
        return torch.float64
    return case.dtype


def settle(case: Case, rec: CallRecord) -> str:
    """Recompute a disagreeing call by float64 central differences: which side is right."""
    w = build(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for j in range(rec.index + 1):
            advance(case, w, j)
        x = make_x(case, w, rec.index).double()
        net64 = copy.deepcopy(w.target()).double()
        en = rec.entry
        try:
            fd = finite_differences(en, w.oracle_f(net64), net64, x)
        finally:
            _reset_globals()
    tol = {1: 1e-6, 2: 1e-4}[en.order]
    _, e_oracle = compare(fd, rec.want, torch.float64, 1) if rec.want is not None else (None, float("nan"))
    _, e_jm = compare(rec.got, fd, _result_dtype(case, rec), en.order)
    scale = _max_abs(fd)
    oracle_ok = e_oracle <= tol * (scale + R.FLOOR)
    jm_ok = e_jm <= R.TOL[_result_dtype(case, rec)][en.order] * (scale + R.FLOOR)
    verdict = ("jacmode wrong" if oracle_ok and not jm_ok else "oracle wrong" if jm_ok and not oracle_ok
               else "both agree with FD" if jm_ok else "neither agrees with FD")
    rec.fd = f"{verdict} (|FD - oracle| = {e_oracle:.2g}, |FD - jacmode| = {e_jm:.2g})"
    return verdict


def _max_abs(v: Any) -> float:
    if isinstance(v, tuple):
        return max(_max_abs(t) for t in v)
    return float(v.detach().abs().max()) if v.numel() else 0.0


FAILING = ("silently_wrong", "raw_error", "state")


# ---------------------------------------------------------------------------------------------
# The tally and the table of failures.


class StateTally:
    """Outcomes of every call, the failing calls, and the finite-difference verdicts."""

    def __init__(self) -> None:
        self.cases: list[Case] = []
        self.calls: dict[str, int] = {}
        self.failing: list[tuple[Case, CallRecord]] = []
        self.refusals: list[tuple[Case, CallRecord]] = []  # clear errors where a fresh call gives a result
        self.settled: dict[str, int] = {}

    def record(self, case: Case, records: list[CallRecord]) -> None:
        self.cases.append(case)
        for rec in records:
            self.calls[rec.status] = self.calls.get(rec.status, 0) + 1
            if rec.status in FAILING:
                self.failing.append((case, rec))
            elif rec.status == "stale_error":
                self.refusals.append((case, rec))

    def settle_sample(self, per_group: int = 2, limit: int = 40) -> None:
        """Finite differences for numeric disagreements: first one per change, then up to ``per_group``
        per change x entry point, ``limit`` in all."""
        numeric = [(c, r) for c, r in self.failing if r.status == "silently_wrong" and r.detail.startswith("max |jacmode")]
        first = {}
        for c, r in numeric:
            first.setdefault(c.change, (c, r))
        seen: dict[tuple[str, str], int] = {}
        done = 0
        for case, rec in [*first.values(), *numeric]:
            key = (case.change, rec.entry.name)
            if rec.fd is not None or seen.get(key, 0) >= per_group or done >= limit:
                continue
            seen[key] = seen.get(key, 0) + 1
            done += 1
            try:
                verdict = settle(case, rec)
            except Exception as err:  # noqa: BLE001 -- reported, not judged
                verdict = rec.fd = f"finite differences failed ({type(err).__name__})"
            self.settled[verdict] = self.settled.get(verdict, 0) + 1

    def distinct(self) -> dict[str, int]:
        return {"cases": len({dataclasses.astuple(c) for c in self.cases}),
                "change x entry": len({(c.change, c.entry) for c in self.cases}),
                "change x entry x convention": len({(c.change, c.entry, c.convention) for c in self.cases}),
                "changes": len({c.change for c in self.cases}), "entries": len({c.entry for c in self.cases})}

    def groups(self) -> list[tuple[str, str, str, int, int, int, int, float, str]]:
        """(class, change, entry, silently wrong, raw, state, stale errors, max error, call indices) per
        change x entry with a failing or stale call."""
        g: dict[tuple[str, str, str], list[Any]] = {}
        for case, rec in self.failing + self.refusals:
            en = rec.entry.name + ("*" if case.mix else "")
            row = g.setdefault((CHANGES[case.change].klass, case.change, en), [0, 0, 0, 0, 0.0, set()])
            row[{"silently_wrong": 0, "raw_error": 1, "state": 2, "stale_error": 3}[rec.status]] += 1
            if not math.isnan(rec.err) and rec.status == "silently_wrong":
                row[4] = max(row[4], rec.err)
            row[5].add(rec.index)
        return [(k, ch, en, a, b, c, d, e, ",".join(map(str, sorted(idx))))
                for (k, ch, en), (a, b, c, d, e, idx) in sorted(g.items())]

    def summary(self) -> list[str]:
        d = self.distinct()
        lines = [f"{d['cases']} distinct cases ({d['changes']} changes x {d['entries']} entry points: "
                 f"{d['change x entry']} pairs, {d['change x entry x convention']} with the convention), "
                 f"{sum(self.calls.values())} calls",
                 "calls: " + ", ".join(f"{k} {v}" for k, v in sorted(self.calls.items()))]
        if self.refusals:
            lines.append(f"stale errors (a clear error where a fresh call on the same state gives a result; listed, "
                         f"not failures): {len(self.refusals)}")
        if self.settled:
            lines.append("finite differences on a sample of the numeric disagreements: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.settled.items())))
        if self.failing or self.refusals:
            lines.append("")
            lines.append(f"{'class':<16} {'change':<22} {'entry':<17} {'wrong':>5} {'raw':>4} {'state':>5} {'stale':>5}"
                         f" {'max err':>8}  call indices")
            for k, ch, en, a, b, c, d, e, idx in self.groups():
                lines.append(f"{k:<16} {ch:<22} {en:<17} {a:>5} {b:>4} {c:>5} {d:>5} {e:>8.3g}  {idx}")
            lines.append("(wrong: silently wrong; raw: raw errors; state: model left changed; stale: stale clear errors;"
                         " max err over the numeric disagreements, 0 where the wrong results are results owing an error;"
                         " entry* = in a case alternating two entry points)")
            lines.append("")
            lines.append("failing and stale calls (first 60):")
            for case, rec in (self.failing + self.refusals)[:60]:
                err = "" if math.isnan(rec.err) else f" max err {rec.err:.3g}"
                fd = f" [FD: {rec.fd}]" if rec.fd else ""
                lines.append(f"  {CHANGES[case.change].klass} | {case.describe()} | call {rec.index}: "
                             f"{rec.status}{err}: {rec.detail[:220]}{fd}")
        return lines

    def dump(self, path: str) -> None:
        import json

        rows = [{"class": CHANGES[c.change].klass, "change": c.change, "entry": r.entry.name, "mix": c.mix, "convention": c.convention,
                 "case": c.describe(), "call": r.index, "status": r.status, "err": r.err, "detail": r.detail,
                 "fd": r.fd} for c, r in self.failing]
        with open(path, "w") as fh:
            json.dump({"distinct": self.distinct(), "calls": self.calls, "settled": self.settled,
                       "groups": self.groups(), "failing": rows,
                       "refusals": [(c.describe(), r.index, r.detail) for c, r in self.refusals]}, fh, indent=1)

