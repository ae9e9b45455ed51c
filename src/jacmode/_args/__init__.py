"""Describe a call ``f(*args, **kwargs)`` once as a flat problem, and restore torch.func's layout.

NOTE: [Several arguments]
The engines work on one function of one tensor: ``fn(z)`` with z of shape (b, D), b samples along
dim 0, returning (b, *out). A call in torch.func's language (several positional arguments,
``argnums`` choosing the differentiated ones, pytrees of tensors, keyword arguments, ``has_aux``,
pytree outputs) is reduced to that form here, once per call:

* the differentiated leaves (the tensors of ``args[i]`` for ``i`` in ``argnums``) are flattened per
  sample and concatenated along dim 1 into z (B, D) (unbatched: into (N,)); a single
  differentiated tensor is passed to the engines as it is, so a call ``f(x)`` is not wrapped at
  all (same function object, same caches, same speed as before);
* every other tensor (positional, in a pytree, or keyword) is a *rider*: batched along dim 0 with
  the samples (``in_dims=0``, vmap's default) or broadcast (``in_dims=None``); non-tensors are
  passed through untouched;
* :class:`Flat` is the flat function. It calls f on the whole batch with the riders as given;
  an engine that evaluates a sub-batch (probes on a few samples, chunks of samples) first asks
  :func:`take` for the flat function of those rows, so batched riders follow the samples. A flat
  function called on a batch of another size without :func:`take` raises instead of pairing
  samples with the wrong riders;
* outputs: the leaves of f's output pytree (after dropping the auxiliary output of ``has_aux``)
  are flattened per sample and concatenated into (b, Y); a single output tensor is returned as is;
* :meth:`Call.jacobian` turns the flat Jacobian (B, Y, D) back into torch.func's layout: for an
  int ``argnums`` the output pytree of input pytrees, for a tuple ``argnums`` the output pytree of
  tuples (one entry per argnum) of input pytrees, each block (B, *out_leaf, *in_leaf); and
  :meth:`Call.outputs` does the same for per-sample results shaped like f's output, (B, *out).

The vector products (``_vector.py``: jvp, vjp, hvp, linearize, G v) describe their calls with the same
:func:`describe_call` (``as_leaves=True``, unbatched): their engines take the differentiated leaves
as a list, not concatenated, so no flat function is built; :meth:`Call.on_leaves` evaluates f on
such a list and returns its output leaves and aux, the output structure recorded as for
:class:`Flat`. A product with respect to parameters describes the functional call of the model at
the selected tensors (a dict name -> tensor as the differentiated argument).

The functional style with shared differentiated arguments (``jm.jacobian(fn, params, x, argnums=0,
in_dims=(None, 0))``, ``_functional.py``) is described by the same :func:`describe_call`
(``shared=True``): its differentiated leaves keep their whole shape, B is dim 0 of the batched
riders, and no flat function is built (that call runs as a module of sample rows whose slots are
the shared tensors, ``params.py``); the same :meth:`Call.per_argnum` and :meth:`Call.per_output`
give its result torch.func's layout.

Coordinates of the derivative operators are counted in z: argument ``argnums[0]``'s leaves first,
flat per sample, then the next argnum's; :meth:`Call.coordinate` also reads names (``"t"``, the
name of a parameter of f with one coordinate per sample, or ``("x", 1)``).

The modules: ``flat.py`` (the flat function and its sub-batches), ``call.py`` (the described call
and torch.func's layout), ``describe.py`` (argnums, in_dims, leaves and riders), ``front.py`` (the
entry points' front and tail, old forms, named coordinates), ``params.py`` (the modules of sample
rows: a model called with several arguments, a function of shared tensors).
"""

from __future__ import annotations

from .flat import (  # noqa: F401
    Argnums,
    InDims,
    Leaf,
    Rider,
    Flat,
    traced_body,
    take,
    batched_riders,
    inputs,
    rows_of,
    with_riders,
)
from .call import (  # noqa: F401
    Call,
)
from .describe import (  # noqa: F401
    parameter_names,
    check_argnums,
    _in_dim,
    check_in_dims,
    describe_call,
)
from .front import (  # noqa: F401
    trailing_inputs,  # noqa: F401
    front,
    flat_jacobian,
    finish,
    legacy_trailing,
    coordinate_args,
    resolve,
)
from .params import (  # noqa: F401
    params_call,
    module_of_rows,
    rows_bound,
    params_layout,
)
