"""Probe engine: per-layer inputs and output cotangents of any module graph, in one forward and one reverse pass.

Interface (used by the parameter Jacobian and by per-sample gradients, NTK and GGN products):

* ``cov = coverage(model, named_params)`` -- which selected parameters a rule covers (``cov.covered``:
  name -> (module, attr); ``cov.modules``: module -> {attr: name}) and why the others are not (``cov.uncovered``: name -> reason: no rule for
  the module type, tied / shared by several modules, parametrized, a module instance the rule refuses).
* ``rec = record(model, x, cov)`` -- ONE forward pass of ``model(x)`` with temporary forward hooks on
  the covered modules (removed in ``finally``, also when the model raises). Each hook records the
  module's inputs and returns ``out + z`` with ``z`` a zero probe that requires grad; ``rec.output``
  is the model output (B, *out), ``rec.calls`` one :class:`Call` per module call (a module called
  twice gives two calls, whose blocks add up).
* ``rec.pullback(V)`` -- cotangents V (K, B, *out) (K = Y one-hot rows for a Jacobian, 1 for a loss
  gradient, Y columns of a GGN factor) pulled back in ONE reverse pass vectorised over K
  (``torch.func.vmap`` over ``autograd.grad``; ``is_grads_batched=True`` with ``create_graph`` or
  inside a transform) to every probe; returns one G (K, B, *out_layer) per call, aligned with
  ``rec.calls``.
* ``call.rule.per_sample(call.module, call.inputs, G)`` -> {attr: (B, K, *param.shape)} and
  ``call.rule.write(...)`` (into views of a result) turn them into per-sample blocks (``_rules/``).
  ``cov.rules`` gives each covered module's rule: a closed-form one (``_rules/modules.py``), or the
  module-local vmap rule (``_rules/local.LOCAL``) for a module with parameters and no closed form,
  whose ``attr`` is the parameter's dotted name below the module and whose ``call.inputs`` is
  ``(args, kwargs)``; ``coverage(..., local=False)`` leaves those parameters uncovered.

NOTE: [Probes, not outputs]
Cotangents are taken with respect to the probe z added to each covered module's output, never
with respect to the output itself: an in-place operation after the layer (``ReLU(inplace=True)``)
rewrites that output, and autograd would then hand back the cotangent of the rewritten tensor.
The probe sits between the layer and whatever follows, so residual connections, concatenations,
functional activations and custom ``forward`` code need no rules: autograd carries them.
Per-sample gradients take the outputs themselves where nothing rewrote them (``record``'s
``outputs``: the same cotangents, bit for bit, without a probe's tensor, add and reverse-pass
node); the outputs' version counters tell afterwards whether one was modified in place, and then
that call is not used and the probes serve the later calls. A module
input modified in place after the call is detected by its version counter (``Call.stale``), and a
module that holds another tensor than the selected parameter when it runs (``functional_call``
inside forward) by the hook itself, which raises NotCovered: the generic engine then runs.
Parameters that a rule covers but the model also uses elsewhere (``x @ emb.weight.T``) are not
visible to hooks; ``_probes/layerwise.py`` therefore checks completeness once per model and
signature. Hooks do not fire inside ``torch.func`` transforms: run this engine outside them.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.nn.utils import parametrize

from .._threads import transient_hooks
from .._transforms import in_transform
from .._rules.base import NotCovered, Rule
from .._rules.local import LOCAL
from .._rules.modules import rule_for


@dataclass
class Coverage:
    """Which selected parameters the rules cover, and why the others are not covered."""

    covered: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    uncovered: dict[str, str] = field(default_factory=dict)
    rules: dict[nn.Module, Rule] = field(default_factory=dict)  # covered module -> its rule
    tensors: dict[str, Tensor] = field(default_factory=dict)  # covered name -> the selected parameter
    # what ``_probes/layerwise.write_rows`` derives from a selection once: names -> its plan
    plans: dict[tuple[str, ...], Any] = field(default_factory=dict, repr=False, compare=False)
    # what a call learned of the model (shared by the copies ``dataclasses.replace`` makes): "rewritten",
    # a covered module's output was modified in place after its call (see :func:`record`'s ``outputs``)
    found: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def modules(self) -> dict[nn.Module, dict[str, str]]:
        """covered module -> {its selected attribute: the parameter's name}."""
        out: dict[nn.Module, dict[str, str]] = {}
        for name, (module, attr) in self.covered.items():
            out.setdefault(module, {})[attr] = name
        return out


def coverage(model: nn.Module, named_params: Sequence[tuple[str, Tensor]], local: bool = True) -> Coverage:
    """Sort the selected parameters into covered (module, attr) and uncovered (with a reason).

    A model with a true attribute ``_jacmode_no_probes`` is not covered at all (the generic
    engines run it). A parameter whose module has no rule is assigned, with ``local``, to the module-local vmap rule
    (``_rules/local.py``) of its highest ancestor below the model whose subtree holds no module
    with a rule (``nn.MultiheadAttention`` for its ``out_proj``, whose ``forward`` never runs).
    """
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    by_prefix: dict[str, nn.Module] = {}
    ruled: set[str] = set()  # prefixes of modules whose subtree holds a module with a rule
    for prefix, module in model.named_modules(remove_duplicate=False):
        by_prefix[prefix] = module
        if rule_for(module) is not None:
            parts = prefix.split(".") if prefix else []
            ruled.update(".".join(parts[:i]) for i in range(len(parts) + 1))
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr, prefix))
    cov = Coverage()
    if getattr(model, "_jacmode_no_probes", False):  # tools and tests that time the generic engines
        cov.uncovered.update((name, "probes switched off for this model") for name, _ in named_params)
        return cov
    for name, p in named_params:
        found = owners.get(id(p), [])
        if len({id(m) for m, _, _ in found}) != 1 or len({a for _, a, _ in found}) != 1:
            cov.uncovered[name] = "shared by several modules or attributes (tied weights)"
            continue
        module, attr, prefix = found[0]
        rule = rule_for(module)
        if "parametrizations." in name or parametrize.is_parametrized(module):
            cov.uncovered[name] = "parametrized module"
            continue
        if rule is None and local and prefix:
            while "." in prefix and prefix.rsplit(".", 1)[0] not in ruled:
                prefix = prefix.rsplit(".", 1)[0]
            module, attr, rule = by_prefix[prefix], name[len(prefix) + 1 :], LOCAL
        if rule is None or (rule is not LOCAL and attr not in rule.attrs):
            what = type(module).__name__ + ("" if rule is None else f".{attr}")
            cov.uncovered[name] = f"no per-sample rule for {what}"
            continue
        why = rule.unsupported(module)
        if why is not None:
            cov.uncovered[name] = why
            continue
        cov.covered[name] = (module, attr)
        cov.rules[module] = rule
        cov.tensors[name] = p
    return cov


def _held(module: nn.Module, attr: str) -> Optional[Tensor]:
    """The tensor ``module`` holds as its parameter ``attr`` (a dotted name below it) right now."""
    *path, last = attr.split(".")
    for part in path:
        module = module._modules.get(part)  # type: ignore[assignment]
        if module is None:
            return None
    return module._parameters.get(last)


@dataclass
class Call:
    """One call of a covered module: its inputs, the probe on its output, the input versions."""

    module: nn.Module
    rule: Rule
    inputs: tuple[Any, ...]
    probe: Tensor  # the probe, or the module's output itself (``record(..., outputs=True)``)
    versions: tuple[int, ...]
    output_version: Optional[int] = None  # the output's version when ``probe`` is the output

    @property
    def stale(self) -> bool:
        """Whether an input was modified in place after the call (the recorded values are wrong)."""
        args = self.inputs[0] if self.rule is LOCAL else self.inputs
        return tuple(t._version for t in args if isinstance(t, Tensor)) != self.versions

    @property
    def rewritten(self) -> bool:
        """Whether the output taken as the probe was modified in place after the call (its
        cotangent would then be the rewritten tensor's)."""
        return self.output_version is not None and self.probe._version != self.output_version


@dataclass
class Recording:
    """The output of one probed forward pass and its calls (see the module docstring)."""

    output: Tensor
    calls: list[Call]
    modified: bool = False  # the model modified its input in place (see :func:`record`)

    def pullback(
        self, V: Tensor, retain_graph: bool = False, create_graph: bool = False, batched: bool = True
    ) -> list[Tensor]:
        """G (K, B, *out_layer) per call for cotangents V (K, B, *out) of the output."""
        probes = [c.probe for c in self.calls]
        retain_graph = retain_graph or create_graph
        if not probes:
            return []
        if batched and V.shape[0] > 1 and not create_graph and not in_transform():
            # torch.func.vmap, not is_grads_batched: the latter runs torch's older vmap, which has no
            # batching rule for tanh_backward, gelu_backward, silu_backward, layer norm's backward
            # and more, and loops over the K directions for each of them (300 calls at K = 300)
            def pull(v: Tensor) -> tuple[Tensor, ...]:
                gs = torch.autograd.grad(self.output, probes, v, retain_graph=retain_graph, allow_unused=True)
                return tuple(g if g is not None else v.new_zeros(p.shape) for g, p in zip(gs, probes))

            grads = vmap(pull)(V)
        elif batched and V.shape[0] > 1:
            grads = torch.autograd.grad(
                self.output, probes, V, retain_graph=retain_graph, create_graph=create_graph,
                allow_unused=True, is_grads_batched=True,
            )
        else:  # one direction at a time on the same tape
            rows = [
                torch.autograd.grad(self.output, probes, v, retain_graph=retain_graph or k < V.shape[0] - 1,
                                    create_graph=create_graph, allow_unused=True)
                for k, v in enumerate(V)
            ]
            grads = tuple(
                torch.stack([r[i] if r[i] is not None else torch.zeros_like(p) for r in rows])
                for i, p in enumerate(probes)
            )
        return [
            g if g is not None else V.new_zeros(V.shape[0], *p.shape) for g, p in zip(grads, probes)
        ]

    def blocks(self, cov: Coverage, Gs: Sequence[Tensor]) -> dict[str, Tensor]:
        """{name: (B, K, *param.shape)} of the covered parameters, summed over the calls of each module.

        ``Gs`` are the cotangents of :meth:`pullback`; raises NotCovered for a call whose input was
        modified in place after it.
        """
        out: dict[str, Tensor] = {}
        for call, G in zip(self.calls, Gs):
            if call.stale:
                raise NotCovered("a module input was modified in place after the call")
            names = cov.modules.get(call.module, {})
            for attr, block in call.rule.per_sample(call.module, call.inputs, G).items():
                name = names.get(attr)
                if name is not None:
                    out[name] = out[name] + block if name in out else block
        return out


_NO_KWARGS: dict[str, Any] = {}

# NOTE: [Hooks of one call]
# The hooks :func:`record` puts on the user's modules are there for every thread that runs those
# modules meanwhile (a training step on the same model, another jacmode call). Each hook therefore
# acts only within the forward pass it was placed for: ``_RUNNING.token`` (per thread) is that
# call's token while its ``model(x)`` runs; any other pass finds another token (or none), and the
# hook returns without recording or changing the output.
_RUNNING = threading.local()


def record(model: nn.Module, x: Tensor, cov: Coverage, modules: Optional[Sequence[nn.Module]] = None,
           clone: bool = True, outputs: bool = False) -> Recording:
    """Run ``model(x)`` once with probes on the covered modules (or on ``modules``); hooks removed after.

    The model runs on a copy of x (it may modify its input in place) unless ``clone`` is False,
    for callers that know it does not (a profile's finding; x then must be neither an inference
    tensor nor require grad, see :func:`can_skip_clone`). ``Recording.modified`` tells whether the
    input the model ran on was modified in place during the call.

    ``outputs``: where a closed-form rule's module returns one tensor that requires grad, that
    output itself stands for the probe (no zero tensor, no add, no node in the reverse pass: at
    B = 512 on problem 1's class, 0.2 ms of a 1.6 ms probed pass right after a fill of the result);
    the caller must then check :attr:`Call.rewritten` after its reverse pass (see the note
    [Probes, not outputs]: an output modified in place after the call has the rewritten tensor's
    cotangent) and take the probes where any call says so.
    """
    calls: list[Call] = []
    token = object()  # this call's forward pass (see [Hooks of one call])

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        if getattr(_RUNNING, "token", None) is not token:  # another thread's or another call's pass
            return None
        first = out[0] if isinstance(out, tuple) and out else out
        if not isinstance(first, Tensor) or not first.is_floating_point():
            return None
        rule = cov.rules[module]
        for attr, name in cov.modules.get(module, {}).items():
            held = module._parameters.get(attr) if rule is not LOCAL else _held(module, attr)  # (not dotted)
            if name in cov.tensors and held is not cov.tensors[name]:
                raise NotCovered(f"{type(module).__name__}.{attr} in use is not the parameter {name!r} "
                                 "(functional_call or a swap in forward): the rules would read the wrong tensor")
        versions = tuple(t._version for t in args if isinstance(t, Tensor))
        if outputs and first is out and first.requires_grad and rule is not LOCAL:
            calls.append(Call(module, rule, args, first, versions, first._version))
            return None
        z = torch.zeros_like(first, requires_grad=True)
        calls.append(Call(module, rule, (args, kwargs) if rule is LOCAL else args, z, versions))
        return (first + z, *out[1:]) if isinstance(out, tuple) else first + z

    def plain(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:  # a rule that reads no keywords
        return hook(module, args, _NO_KWARGS, out)

    # with_kwargs only where the rule reads them (the module-local vmap rule): torch's call of such a
    # hook costs twice as much to register and more to run
    outer = getattr(_RUNNING, "token", None)
    with transient_hooks():  # no guard is traced while these hooks are on the user's modules
        handles = [m.register_forward_hook(hook, with_kwargs=True) if cov.rules.get(m) is LOCAL
                   else m.register_forward_hook(plain) for m in (modules if modules is not None else cov.modules)]
        try:
            with torch.enable_grad():
                xin = x.clone() if clone else x  # by default never the caller's x: the model may modify its input
                version = xin._version
                _RUNNING.token = token
                output = model(xin)
        finally:
            _RUNNING.token = outer
            for h in handles:
                h.remove()
    if not isinstance(output, Tensor):
        raise TypeError(f"model: expected a Tensor output, got {type(output).__name__}")
    return Recording(output, calls, xin._version != version)


def can_skip_clone(x: Tensor) -> bool:
    """Whether :func:`record` may run the model on x itself: not an inference tensor (autograd cannot
    save it for backward), not requiring grad (a leaf refuses in-place writes), not in inference mode."""
    return not (x.requires_grad or x.is_inference() or torch.is_inference_mode_enabled())
