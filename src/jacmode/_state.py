"""Leave the user's model exactly as it was found.

NOTE: [Model state during a call]
jacmode differentiates the model functionally, so it never writes parameters or ``.grad``. Two
things can still change a model during a call: BatchNorm layers in training mode update their
running statistics on every forward pass (which also fails under ``vmap``), and a user's forward
may raise halfway. ``preserved_state`` therefore

* detaches the running statistics of BatchNorm layers in training mode (of ``f``, or of the modules
  a plain function ``f`` refers to, see ``used_modules``) for the duration of the
  call (the layers then normalise with batch statistics, which is what training mode computes,
  and write nothing) -- the approach of ``torch.func.replace_all_batch_norm_modules_``, undone on
  exit;
* records the parameter objects of every module (``torch.func.functional_call`` leaves a
  transformed tensor behind in a module registered twice), the training flags, ``requires_grad``
  flags and the version
  counters of all buffers, restores the flags on exit, puts back a parameter or buffer
  only where a transformed tensor was left in its place (see [What the guard writes back]: what
  another thread wrote meanwhile stays), and restores any buffer that a custom layer modified in
  place from a copy taken lazily only for modules in training mode.

It also changes one process-wide setting for the duration of the call (``_kernels_in``):
it switches off the inference fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoder``
and restricts ``scaled_dot_product_attention`` to its math backend, because the fused kernels
(``_transformer_encoder_layer_fwd``, flash attention) have no forward-AD rule and no vmap rule
(vmap falls back to a slow loop over the batch). The flags are global, so entries are counted
across threads and the last one out restores them.

A call with ``wrt`` a dict of tensors (``functional_call``'s convention, ``_functional.py``) runs
on a structural copy of the model with those tensors in its slots (:func:`bind`, torch's
``_reparametrize_module``), and the copy's own tensors back on exit; :func:`bound_values` names
them for the code that must tell them apart.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.stateless import _reparametrize_module

from ._threads import _BEGUN, bind_stamp, disturbed


_KERNELS_LOCK = threading.Lock()
_KERNELS: dict[str, Any] = {"users": 0, "fastpath": True, "sdpa": None}


def _sdp_flags() -> list[tuple[Any, Any, bool]]:
    """(getter, setter, wanted) of each backend flag of scaled_dot_product_attention: MATH only."""
    import torch.nn.attention as attention

    names = getattr(attention, "_backend_names", None)
    if not isinstance(names, dict):
        return []
    out = []
    for name, val in names.items():
        get, put = getattr(torch._C, f"_get_{name}_sdp_enabled", None), getattr(torch._C, f"_set_sdp_use_{name}", None)
        if get is None or put is None:
            return []
        out.append((get, put, getattr(SDPBackend, val) == SDPBackend.MATH))
    return out


_SDP_FLAGS = _sdp_flags()


_MHA = torch.backends.mha
_MHA_GLOBAL = isinstance(getattr(_MHA, "_is_fastpath_enabled", None), bool)  # set_fastpath_enabled's own flag


def _kernels_in() -> None:
    """Use only attention kernels that jvp and vmap can transform (see the note above), until
    :func:`_kernels_out`: the first user in saves the flags and sets them, the last one out restores
    them, the others only count (functions: ``_Preserved`` calls them on every call)."""
    with _KERNELS_LOCK:
        if _KERNELS["users"] == 0:
            if _MHA_GLOBAL:  # what get/set_fastpath_enabled read and write, without two calls
                _KERNELS["fastpath"] = _MHA._is_fastpath_enabled
                _MHA._is_fastpath_enabled = False
            else:  # pragma: no cover -- another torch
                _KERNELS["fastpath"] = _MHA.get_fastpath_enabled()
                _MHA.set_fastpath_enabled(False)
            if _SDP_FLAGS:
                _KERNELS["sdpa"] = [get() for get, _, _ in _SDP_FLAGS]
                for _, put, wanted in _SDP_FLAGS:
                    put(wanted)
            else:  # a torch without the flag functions: its own context
                _KERNELS["sdpa"] = contextlib.ExitStack()
                _KERNELS["sdpa"].enter_context(sdpa_kernel([SDPBackend.MATH]))
        _KERNELS["users"] += 1


def _kernels_out() -> None:
    with _KERNELS_LOCK:
        _KERNELS["users"] -= 1
        if _KERNELS["users"] == 0:
            saved = _KERNELS["sdpa"]
            if isinstance(saved, list):
                for (_, put, _), value in zip(_SDP_FLAGS, saved):
                    put(value)
            else:
                saved.close()
            if _MHA_GLOBAL:
                _MHA._is_fastpath_enabled = _KERNELS["fastpath"]
            else:  # pragma: no cover
                _MHA.set_fastpath_enabled(_KERNELS["fastpath"])


_MKLDNN: dict[str, Any] = {"users": 0, "enabled": True}


@contextlib.contextmanager
def without_mkldnn() -> Iterator[None]:
    """torch's native CPU kernels instead of mkldnn's for a block (counted across threads, as above).

    For reverse mode under ``torch.inference_mode()``, where grad mode cannot be switched on (see
    [Grad mode of the reverse engines] in ``_autodiff/reverse.py``) and the mkldnn RNN kernels then
    keep no workspace for their backward.
    """
    with _KERNELS_LOCK:
        if _MKLDNN["users"] == 0:
            _MKLDNN["enabled"] = torch.backends.mkldnn.set_flags(False, None, None, None)[0]
        _MKLDNN["users"] += 1
    try:
        yield
    finally:
        with _KERNELS_LOCK:
            _MKLDNN["users"] -= 1
            if _MKLDNN["users"] == 0:
                torch.backends.mkldnn.set_flags(_MKLDNN["enabled"], None, None, None)


@dataclass
class ModelView:
    """What one walk of a module's tree found at the start of a call (shared by the call's steps).

    Attributes:
        modules: ``f.modules()``, in that order.
        training: their training flags.
        params: ``f.parameters()`` (each parameter once), in that order.
        flags: the parameters' ``requires_grad`` flags.
    """

    modules: list[nn.Module]
    training: tuple[bool, ...]
    params: list[nn.Parameter]
    flags: tuple[bool, ...]


def used_modules(fn: Any, depth: int = 3) -> list[nn.Module]:
    """The modules a plain function refers to: in its closure and globals, a bound method's
    ``self``, a ``functools.partial``'s function and arguments, and so on through nested
    functions (``depth`` levels); also the modules held in the attributes of a plain object it
    refers to (``self.model`` of a trainer, ``cfg.net``), one level deep.
    """
    if isinstance(fn, Keyed):  # a call of several arguments: the user's function
        fn = fn.f
    if isinstance(fn, nn.Module):
        return [fn]
    if depth == 0:
        return []
    if isinstance(fn, functools.partial):
        found = [fn.func, *fn.args, *fn.keywords.values()]
    elif inspect.ismethod(fn):
        found = [fn.__self__, fn.__func__]
    elif inspect.isfunction(fn):
        found = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
        glob = fn.__globals__
        found += [glob[n] for n in fn.__code__.co_names if n in glob]
    else:
        return []
    out: dict[int, nn.Module] = {}
    for obj in found:
        if isinstance(obj, nn.Module) or callable(obj):
            for m in used_modules(obj, depth - 1):
                out.setdefault(id(m), m)
        elif not isinstance(obj, (type, types.ModuleType)) and isinstance(getattr(obj, "__dict__", None), dict):
            for v in list(vars(obj).values()):
                if isinstance(v, nn.Module):
                    out.setdefault(id(v), v)
    return list(out.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def modules_of(f: Any) -> list[nn.Module]:
    """``f.modules()`` for a module, else every module of those a plain function refers to
    (:func:`used_modules`), each once: what :func:`preserved_state` guards."""
    if isinstance(f, nn.Module):  # f.modules(), without its generators: it runs on every call
        found: list[nn.Module] = [f]
        seen: set[int] = {id(f)}
        try:  # pre-order, each module once: recursion is the faster walk of the usual shallow trees
            if f._modules:
                _pre_order(f, found, seen)
            return found
        except RecursionError:  # a tree deeper than the interpreter's limit: the same walk with a stack
            pass
        found, seen = [], set()
        stack = [f]
        while stack:
            m = stack.pop()
            i = id(m)
            if i in seen:
                continue
            seen.add(i)
            found.append(m)
            children = m._modules
            if children:
                stack.extend([c for c in reversed(children.values()) if c is not None])
        return found
    return list({id(m): m for root in used_modules(f) for m in root.modules()}.values())


def _pre_order(m: nn.Module, found: list[nn.Module], seen: set[int]) -> None:
    for c in m._modules.values():
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            found.append(c)
            if c._modules:
                _pre_order(c, found, seen)


def preserved_state(f: Any, modules: Optional[list[nn.Module]] = None, survey: Optional["Survey"] = None,
                    grad: Optional[bool] = None, kernels: bool = True) -> "_Preserved":
    """Run a block and leave ``f`` exactly as found, even on error: ``f`` if it is an ``nn.Module``,
    else the modules it refers to (:func:`used_modules`: a lambda around a model, ``functional_call``).

    ``modules``: :func:`modules_of` ``f`` when the caller has it already (one walk per call).
    ``survey``: what the profile's key read of those modules just before (``_profile.walked``:
    the training flags, parameter slots, parameters and buffers), so that a call walks its
    modules once for the key and the guard; it must be of ``modules`` and taken right before.
    ``grad``: also set grad mode within the block (``torch.no_grad()`` / ``enable_grad()``
    entered inside the guard, without their own contexts), and restore it on exit.
    ``kernels``: False leaves the attention kernels' flags alone (``_kernels_in``), for an engine
    that runs no attention (a profile hit of Taylor mode over a program without attention ops).
    Yields the :class:`ModelView` of the module (None when ``f`` is not a module, or when the
    caller gave the ``survey``: it has the walk).
    """
    return _Preserved(modules_of(f) if modules is None else modules, isinstance(f, nn.Module), survey, grad,
                      kernels)


class Survey:
    """One walk of a call's modules, as the guard records them (see :func:`preserved_state`).

    Attributes:
        training: the modules' training flags, in order.
        slots: (module, name, parameter or None) of every parameter slot.
        params: every parameter once (``f.parameters()``'s order).
        buffers: (module, name, buffer) of every buffer that is not None.
    """

    __slots__ = ("training", "slots", "params", "buffers", "flags")

    def __init__(self, training: tuple[bool, ...], slots: list[tuple[nn.Module, str, Any]],
                 params: list[Any], buffers: list[tuple[nn.Module, str, Any]],
                 flags: Optional[tuple[bool, ...]] = None) -> None:
        # no .grad: jacmode never writes it, and reading it races with a backward pass that another
        # thread runs on the model (see [What the guard writes back])
        self.training, self.slots, self.params, self.buffers = training, slots, params, buffers
        self.flags = tuple([p.requires_grad for p in params]) if flags is None else flags


def survey(modules: list[nn.Module]) -> Survey:
    """The :class:`Survey` of ``modules`` (the guard's own walk when no key walked them before)."""
    training = tuple([m.training for m in modules])
    slots = [(m, name, p) for m in modules if m._parameters for name, p in m._parameters.items()]
    params = list({id(p): p for _, _, p in slots if p is not None}.values())
    buffers = [(m, name, b) for m in modules if m._buffers for name, b in m._buffers.items() if b is not None]
    return Survey(training, slots, params, buffers)


class _Preserved:
    """The context of :func:`preserved_state` (see the note above): a class rather than generator
    contexts, since every call of every entry point enters one (its steps are inlined for that)."""

    __slots__ = ("modules", "is_module", "training", "slots", "params", "flags", "buffers",
                 "copies", "versions", "patched", "survey", "grad", "grad_was", "kernels", "stamp")

    def __init__(self, modules: list[nn.Module], is_module: bool, survey: Optional[Survey] = None,
                 grad: Optional[bool] = None, kernels: bool = True) -> None:
        self.modules, self.is_module, self.survey, self.grad, self.kernels = modules, is_module, survey, grad, kernels

    def __enter__(self) -> Optional[ModelView]:
        kernels = self.kernels
        if kernels:
            _kernels_in()
        self.stamp = bind_stamp()
        try:
            modules = self.modules
            given = self.survey
            found = given if given is not None else survey(modules)
            self.survey = None  # a context entered twice walks again
            self.training = training = found.training
            self.slots = found.slots
            self.params = params = found.params
            self.flags = found.flags
            self.buffers = buffers = found.buffers
            patched: list[tuple[Any, Any, Any, Any]] = []
            self.patched = patched
            if buffers:
                self.copies = [b.detach().clone() if m.training else None for m, _, b in buffers]
                self.versions = [b._version for _, _, b in buffers]
            if any(training):
                for bn, flag in zip(modules, training):
                    if flag and isinstance(bn, _BATCHNORM) and bn.track_running_stats:
                        patched.append((bn, bn.running_mean, bn.running_var, bn.num_batches_tracked))
                        bn.running_mean = None
                        bn.running_var = None
                        bn.track_running_stats = False
            if self.grad is not None:
                self.grad_was = torch.is_grad_enabled()
                torch._C._set_grad_enabled(self.grad)
        except BaseException:
            if kernels:
                _kernels_out()
            raise
        return ModelView(modules, training, params, found.flags) if self.is_module and given is None else None

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.grad is not None:
                torch._C._set_grad_enabled(self.grad_was)
            for bn, mean, var, count in self.patched:
                bn.running_mean, bn.running_var, bn.num_batches_tracked = mean, var, count
                bn.track_running_stats = True
            for m, flag in zip(self.modules, self.training):
                if m.training is not flag:  # nn.Module.__setattr__ is slow: only where a flag moved
                    m.training = flag
            # another thread's bind (a dict call, functional_call in fn) owns what its slots hold now
            stamp = self.stamp
            ours = (_BEGUN[0] == stamp[0] and not stamp[1]) or not disturbed(
                stamp, lambda: {id(m) for m in self.modules})
            for m, name, p in self.slots if ours else ():  # functional_call fails to restore a module registered twice
                now = m._parameters.get(name)
                if now is not p and _left_behind(now, p):
                    m._parameters[name] = p
            for p, flag in zip(self.params, self.flags):
                if p.requires_grad is not flag:
                    p.requires_grad_(flag)
            if self.buffers:
                with torch.no_grad():
                    for (m, name, b), copy, version in zip(self.buffers, self.copies, self.versions):
                        now = m._buffers.get(name)  # type: ignore[assignment]  # training mode: as its values, see the note below
                        if ours and now is not b and (_left_behind(now, b) or (copy is not None and not _transformed(b))):
                            m._buffers[name] = b
                        if b._version != version and copy is not None:
                            b.copy_(copy)
        finally:
            if self.kernels:
                _kernels_out()


_BATCHNORM = nn.modules.batchnorm._BatchNorm


def _transformed(t: Any) -> bool:
    """A tensor of a transform or a trace (torch.func's wrapped tensors, fake tensors), which no
    model holds on its own; see :func:`_left_behind`."""
    if not isinstance(t, torch.Tensor):
        return False
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # not imported: no fake tensor exists
    return torch._C._functorch.is_functorch_wrapped_tensor(t) or (fake is not None and isinstance(t, fake.FakeTensor))


def _left_behind(now: Any, saw: Any) -> bool:
    """Whether the guard puts ``saw`` (the slot's tensor on entry) back in place of ``now``.

    NOTE: [What the guard writes back]
    Another thread may change the model while a call runs: its backward writes ``.grad``, a
    training step swaps a tensor, another jacmode call runs. The guard therefore writes a slot back
    only where the call left something behind that no model holds on its own: a transformed or
    fake tensor (``functional_call`` under a transform fails to restore a module registered twice)
    in place of a plain one. Anything else in the slot is someone's deliberate change and stays,
    with one exception: the buffers of modules in training mode, which the call's own forward
    passes update (``self.calls = self.calls + 1``, as in place) and whose slots and values the
    guard restores as they were on entry; a training step in another thread that updates them
    during the call has those updates undone (docs/structure.md, "Threads").
    ``.grad`` is neither read nor written: jacmode never changes it (its engines take
    ``autograd.grad``, never ``backward``), and touching it while another thread's backward pass
    writes it is a data race inside torch.
    """
    return _transformed(now) and not _transformed(saw)


class RngReplay:
    """Capture the random state of a device so that each chunk of directions draws the same numbers.

    Random layers (dropout in training mode) must draw one mask per sample, shared by all output
    directions; a chunked computation runs the forward pass once per chunk, so the generator is
    reset before each chunk.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def reset(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class Keyed:
    """A function jacmode makes per call that computes what a user's function ``f`` computes (the
    flat function of a call of several arguments, ``_args.Flat``): the caches keep its entries
    under ``f``, with :meth:`subkey` (the call's structure) added to their keys."""

    f: Any

    def subkey(self) -> tuple:
        raise NotImplementedError


# ---- tensors bound into a model's slots for one call (wrt a dict: _functional.py) ----

# id(module) -> stack of the dicts bound to it by jacmode (innermost last). The module is never
# the user's: a call with wrt a dict runs on a structural copy of the model that only its thread
# reads (_functional.bound_copy), so no other thread ever sees the dict's tensors.
_BOUND: dict[int, list[dict[str, Tensor]]] = {}


def bound_values(model: Any) -> Optional[dict[str, Tensor]]:
    """The dict name -> tensor that jacmode bound to ``model`` for the current call, or None."""
    stack = _BOUND.get(id(model))
    return stack[-1] if stack else None


@contextlib.contextmanager
def bind(model: nn.Module, values: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """Run a block with ``model`` holding ``values`` in its slots; its own tensors back on exit (see the
    note). ``model`` is a copy only the calling thread reads (``_functional.bound_copy``).

    Yields the bound tensors by name, in the dict's order (a tensor given for two names bound as two views).
    """
    seen: set[int] = set()
    tied = _tied_names(model)
    held: dict[str, Tensor] = {}
    for name, t in values.items():
        if id(t) in seen and not (tied.get(name) and any(values.get(o) is t for o in tied[name])):
            t = t.view_as(t)  # its own object: its own columns, as jacrev over the dict gives
        seen.add(id(t))
        held[name] = t
    with _reparametrize_module(model, dict(held), tie_weights=True):
        _BOUND.setdefault(id(model), []).append(held)
        try:
            yield held
        finally:
            stack = _BOUND[id(model)]
            stack.pop()
            if not stack:
                del _BOUND[id(model)]


def _tied_names(model: nn.Module) -> dict[str, list[str]]:
    """name -> the other names of the same tensor in ``model`` (tied weights), for names that have some."""
    by_id: dict[int, list[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        if t is not None:
            by_id.setdefault(id(t), []).append(name)
    return {n: [o for o in names if o != n] for names in by_id.values() if len(names) > 1 for n in names}
