"""Generated code that calls torch's Python bindings instead of its aten operator objects.

NOTE: [Bindings of generated code]
make_fx records ``torch.ops.aten.<name>.<overload>`` objects, and a ``GraphModule`` calls them
as they are: each call goes through the operator's schema matching in Python and the JIT's
argument conversion, about 4-6 microseconds on this CPU for an ``as_strided`` or an ``empty``,
against 2 for the same ``torch.as_strided`` through its generated binding. At B = 2 a
parameter Jacobian's graph of 30 operations spent more time there than in its kernels.

:func:`fast` copies a graph with each operation's target replaced by the binding of the same
name, where torch has one: ``torch._C._VariableFunctions`` (the functions of ``torch``, not its
Python wrappers such as ``torch.functional.split``), then ``torch._C._nn``, then the methods of
``torch._C.TensorBase`` (``view``, ``copy_``, in-place ops). A binding resolves the overload from
the arguments, which for one name and the traced arguments is the traced one. Nothing is taken on
trust: on the generating call both graphs run on the same inputs and the copy serves only if
every result is bitwise equal to the original's (the same kernels run), otherwise the original
does. Operations without a binding (``threshold_backward``, ``convolution_backward``) stay aten
calls. Compiled code is made from the original graph: Inductor reads aten.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch import Tensor
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
_MODULES = (torch._C._VariableFunctions, torch._C._nn)
_PLAIN = (Tensor, torch.nn.Parameter)
_RENAMED = {"_unsafe_view": "reshape"}  # a view of a fresh contiguous tensor: the same values and aliasing


def binding(target: Any) -> Optional[Callable[..., Any]]:
    """The Python binding of an aten operator overload, or None where torch has none."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    name = _RENAMED.get(name, name)
    mutable = target._schema.is_mutable and not any(
        a.alias_info is not None and a.alias_info.is_write and a.kwarg_only for a in target._schema.arguments)
    owners = (torch._C.TensorBase,) if mutable else (*_MODULES, torch._C.TensorBase)  # x.copy_(y), x.add_(y)
    for owner in owners:
        fn = getattr(owner, name, None)
        if fn is not None and callable(fn) and (owner is not torch._C._VariableFunctions or getattr(torch, name, None) is fn):
            return fn  # fx writes a function of torch._C._VariableFunctions as torch.<name>: the same object
    return None


def fast(gm: fx.GraphModule, inputs: Sequence[Any]) -> fx.GraphModule:
    """A copy of ``gm`` with bindings for aten calls (see the note), checked on ``inputs``: bitwise the
    same results as ``gm`` (kept as its ``aten_graph``), or ``gm`` itself."""
    if not all(type(t) in _PLAIN for t in inputs if isinstance(t, Tensor)):  # a subclass's
        return gm  # __torch_function__ would see the bindings' calls, not aten's
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    changed = False
    for node in graph.nodes:
        fn = binding(node.target) if node.op == "call_function" else None
        if fn is not None:
            node.target = fn
            changed = True
    if not changed:
        return gm
    copy = fx.GraphModule(gm, graph)
    try:
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor)}
        want = [t.clone() if isinstance(t, Tensor) and t.untyped_storage().data_ptr() in storages else t
                for t in tree_leaves(gm.forward(*inputs))]  # a result written into an input: the copy's run rewrites it
        got = tree_leaves(copy.forward(*inputs))
    except Exception:  # noqa: BLE001 -- a binding that does not take the traced arguments
        return gm
    same = len(want) == len(got) and all(
        (torch.equal(w, g) and w.dtype == g.dtype and w.stride() == g.stride()) if isinstance(w, Tensor)
        else w == g for w, g in zip(want, got))
    if not same:
        return gm
    copy.aten_graph = gm  # what the rewrites made, for whoever inspects the code (tests)
    return copy
