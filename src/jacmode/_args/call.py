"""One call described (:class:`Call`): its leaves and riders, its output layout, torch.func's layout restored.

See the note [Several arguments] in ``_args/__init__.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .._cache import Kind
from .flat import Flat, Leaf, Rider, _fmt
from .._state import preserved_state


# f's output structure per call structure: (TreeSpec, per-sample output leaf shapes)
_OUTPUTS = Kind("output structures of calls with several arguments")


@dataclass
class Call:
    """One call of f, described: the flat function and input, and the layout to restore.

    Attributes:
        fn: the flat function (:class:`Flat`), or f itself for a call of one tensor.
        x: the flat input handed to the engines: (B, D) (unbatched (N,)), or the tensor itself.
        batch: B (1 when unbatched).
    """

    f: Callable[..., Any]
    batched: bool
    argnums: tuple[int, ...]
    int_argnums: bool
    has_aux: bool
    args_spec: TreeSpec  # of (args, kwargs)
    leaves: list[Any]  # all leaves of (args, kwargs), differentiated ones included
    diff: list[Leaf]
    diff_specs: dict[int, TreeSpec]  # argnum -> pytree spec of that argument
    riders: dict[int, Rider]  # leaf index -> rider
    batch: int
    names: tuple[str, ...]  # f's positional parameter names, as far as known
    out_spec: Any = None  # TreeSpec of f's output without aux, once f was evaluated
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)  # per-sample output leaf shapes
    fn: Any = None
    x: Any = None
    simple: bool = False  # one differentiated tensor, nothing else: fn is f, x is that tensor
    flat_rows: bool = True  # the module of sample rows (params.py) returns the output as one tensor
    shared: bool = False  # differentiated arguments shared by every sample (describe_call's shared=True)
    _signature: Optional[tuple] = None

    def signature(self) -> tuple:
        """The call's structure without values: pytree specs, argnums, riders' kinds and shapes,
        the non-tensor arguments (by value when hashable, else by identity). Computed once per call."""
        if self._signature is None:
            self._signature = self._structure()
        return self._signature

    def _structure(self) -> tuple:
        others: list[Any] = []
        for j, v in enumerate(self.leaves):
            if isinstance(v, Tensor):
                r = self.riders.get(j)
                shape = tuple(v.shape[1:]) if r is not None and r.batched else tuple(v.shape)
                others.append(None if r is None else (r.batched, shape, v.dtype, v.device))
            else:
                try:
                    hash(v)
                    others.append(("value", type(v), v))
                except TypeError:
                    others.append(("id", id(v)))
        return (str(self.args_spec), self.argnums, self.int_argnums, self.has_aux, self.batched, self.shared,
                tuple(others))

    def _out_key(self) -> tuple:
        return (self.signature(), tuple(leaf.shape for leaf in self.diff))

    def _remember(self) -> None:
        """Keep the output structure for later calls of the same structure (whose engine may run a
        captured program only, never f itself), under the generation of f's state (_guard.py)."""
        try:
            _OUTPUTS.put(self.f, self._out_key(), (self.out_spec, self.out_shapes))
        except TypeError:  # an unhashable key: not kept
            pass

    def recall(self) -> None:
        """The output structure of an earlier call of the same structure, if known."""
        try:
            known = _OUTPUTS.get(self.f, self._out_key())
        except TypeError:
            known = None
        if known is not None and self.out_spec is None:
            self.out_spec, self.out_shapes = known

    def diff_values(self) -> list[Any]:
        """The differentiated leaves as given, in order."""
        return [self.leaves[leaf.index] for leaf in self.diff]

    # ---- evaluations of f ----------------------------------------------------------------
    def evaluate(self, leaves: Sequence[Any]) -> Any:
        """f's output (with aux) on ``leaves``: every leaf of (args, kwargs), in order."""
        pos, kw = tree_unflatten(list(leaves), self.args_spec)
        return self.f(*pos, **kw)

    def at(self, values: Sequence[Any]) -> Any:
        """f's output (with aux) with the differentiated leaves replaced by ``values``, in order."""
        leaves = list(self.leaves)
        for leaf, v in zip(self.diff, values):
            leaves[leaf.index] = v
        return self.evaluate(leaves)

    def on_leaves(self, values: Sequence[Tensor]) -> tuple[list[Tensor], Any]:
        """f as a function of its differentiated leaves (``describe_call``'s ``as_leaves=True``): the output
        leaves, floating, and the auxiliary output (None without ``has_aux``)."""
        return self.output_leaves(self.at(values), None, floating=True)

    # ---- outputs -------------------------------------------------------------------------
    def output_leaves(self, out: Any, b: Optional[int], floating: bool = False) -> tuple[list[Tensor], Any]:
        """f's output as its leaves and its auxiliary output; the first evaluation records the output
        structure (``b``: the batch, per-sample shapes; None: whole shapes), later ones must keep it."""
        aux = None
        if self.has_aux:
            out, aux = _split_aux(out)
        leaves, spec = tree_flatten(out)
        if not leaves or not all(isinstance(t, Tensor) and (t.is_floating_point() or not floating) for t in leaves):
            kind = "floating tensor" if floating else "tensor"
            raise TypeError(
                f"f: expected f to return a {kind} or a pytree (tuple, list, dict) of {kind}s, got "
                f"{type(out).__name__} ({_fmt(out)}). Return {kind}s only; put anything else in the auxiliary "
                "output with has_aux=True.")
        kept(self, spec, [tuple(t.shape[1:]) if b is not None else tuple(t.shape) for t in leaves])
        return leaves, aux

    def flat_output(self, out: Any, b: Optional[int]) -> Tensor:
        """f's output without aux, as one tensor: a single tensor as is, else (b, Y) / (Y,)."""
        first = self.out_spec is None
        leaves = self.output_leaves(out, b)[0]
        if first:
            self._remember()
        if self.out_spec.num_leaves == 1 and self.out_spec.type is None:
            return leaves[0]
        if b is not None:
            for t in leaves:
                if t.dim() == 0 or t.shape[0] != b:
                    raise ValueError(
                        f"f: every output must have the batch dimension {b} first when batched=True, got an output "
                        f"of shape {tuple(t.shape)}. Return per-sample outputs only (select them, e.g. "
                        "`lambda x: model(x)[0]` for nn.LSTM's (output, (h, c)) with batch_first=True), or pass "
                        "batched=False.")
            return torch.cat([t.reshape(b, -1) for t in leaves], dim=1)
        return torch.cat([t.reshape(-1) for t in leaves])

    def _out_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        lo, blocks = 0, []
        for s in self.out_shapes:
            n = math.prod(s)
            blocks.append((lo, n, s))
            lo += n
        return blocks

    def _ensure(self) -> None:
        """Learn the output structure by one evaluation when no engine evaluated f (rarely needed)."""
        if self.out_spec is None:
            with torch.no_grad(), preserved_state(self.f):
                Flat(self)(self.x.detach())

    def single_output(self) -> bool:
        self._ensure()
        return self.out_spec is not None and self.out_spec.num_leaves == 1 and self.out_spec.type is None

    def outputs(self, flat: Tensor, lead: tuple[int, ...]) -> Any:
        """A per-sample result shaped like the flat output, ``(*lead, *out)``, in f's output pytree."""
        if self.single_output():
            return flat
        return self.per_output(lambda lo, n, s: flat.reshape(*lead, -1)[..., lo:lo + n].reshape(*lead, *s))

    def per_argnum(self, block: Callable[[Leaf], Any]) -> Any:
        """``block(leaf)`` of every differentiated leaf in torch.func's layout: for an int argnums the
        pytree of that argument, for a tuple a tuple of them (one per argnum)."""
        per_arg = [tree_unflatten([block(leaf) for leaf in self.diff if leaf.arg == a], self.diff_specs[a])
                   for a in self.argnums]
        return per_arg[0] if self.int_argnums else tuple(per_arg)

    def per_output(self, block: Callable[[int, int, tuple[int, ...]], Any]) -> Any:
        """``block(lo, n, shape)`` of every output leaf (columns [lo, lo + n) of the flat output, its
        per-sample shape) in f's output pytree; for a single output tensor, its block."""
        self._ensure()
        per_out = [block(lo, n, s) for lo, n, s in self._out_blocks()]
        return per_out[0] if self.single_output() else tree_unflatten(per_out, self.out_spec)

    def jacobian(self, flat: Tensor) -> Any:
        """The flat Jacobian (B, Y, D) (unbatched (Y, N)) in torch.func's layout (see the note)."""
        lead = (flat.shape[0],) if self.batched else ()

        def out_block(lo_y: int, n_y: int, s_y: tuple[int, ...]) -> Any:
            rows = flat[:, lo_y:lo_y + n_y] if self.batched else flat[lo_y:lo_y + n_y]
            return self.per_argnum(lambda leaf: rows[..., leaf.lo:leaf.lo + leaf.size].reshape(*lead, *s_y, *leaf.shape))

        return self.per_output(out_block)

    def hessian(self, flat: Tensor) -> Any:
        """The flat per-sample Hessian (B, Y, D, D) in torch.func's layout (``hessian(f, argnums)``
        under vmap): per output leaf, for an int argnums the input pytree of input pytrees, for a
        tuple the tuple (argnum i) of input pytrees of tuples (argnum j) of input pytrees, each
        block (B, *out_leaf, *in_i_leaf, *in_j_leaf)."""
        lead = (flat.shape[0],)

        def out_block(lo_y: int, n_y: int, s_y: tuple[int, ...]) -> Any:
            rows = flat[:, lo_y:lo_y + n_y]

            def block(li: Leaf, lj: Leaf) -> Tensor:
                return rows[..., li.lo:li.lo + li.size, lj.lo:lj.lo + lj.size].reshape(*lead, *s_y, *li.shape, *lj.shape)

            return self.per_argnum(lambda li: self.per_argnum(lambda lj: block(li, lj)))

        return self.per_output(out_block)

    def aux(self) -> Any:
        """The auxiliary output of ``has_aux=True`` at the call's arguments (one more call of f)."""
        return _split_aux(self.evaluate(self.leaves))[1]

    # ---- coordinates ---------------------------------------------------------------------
    def coordinate(self, c: Any, name: str = "dims") -> int:
        """The column of z of coordinate ``c``: an int (counted flat in z), an argument's name with one
        coordinate per sample (``"t"``), or a pair (name or position, index within that argument)."""
        if isinstance(c, bool):
            raise TypeError(f"{name}: expected coordinates as ints or argument names, got {c!r}.")
        if isinstance(c, int):
            return c
        if isinstance(c, str):
            arg, idx = self._arg_of(c, name), None
        elif isinstance(c, tuple) and len(c) == 2 and isinstance(c[1], int) and isinstance(c[0], (str, int)):
            arg, idx = (self._arg_of(c[0], name) if isinstance(c[0], str) else c[0]), c[1]
        else:
            raise TypeError(
                f"{name}: expected a coordinate as an int, an argument name such as 't', or a pair such as "
                f"('x', 1), got {c!r}.")
        mine = [leaf for leaf in self.diff if leaf.arg == arg]
        if not mine:
            raise ValueError(
                f"{name}: coordinate {c!r} names argument {arg}, which is not differentiated (argnums="
                f"{self.argnums}). Add it to argnums.")
        size = sum(leaf.size for leaf in mine)
        if idx is None:
            if size != 1:
                raise ValueError(
                    f"{name}: argument {c!r} has {size} coordinates per sample; name one of them as "
                    f"({c!r}, i) with 0 <= i < {size}.")
            idx = 0
        if not -size <= idx < size:
            raise ValueError(f"{name}: coordinate {c!r} is out of range: argument {arg} has {size} coordinates "
                             "per sample.")
        return mine[0].lo + idx % size

    def _arg_of(self, label: str, name: str) -> int:
        if label not in self.names:
            raise ValueError(
                f"{name}: {label!r} is not the name of a positional argument of f (its arguments are "
                f"{list(self.names)}). Name coordinates by f's parameter names, or by position as (argnum, i).")
        return self.names.index(label)


def kept(holder: Any, spec: Any, shapes: list[tuple[int, ...]]) -> bool:
    """Keep an output structure in ``holder.out_spec`` and ``holder.out_shapes`` on the first evaluation
    (True), or check that a later one has the same (False), else raise."""
    if holder.out_spec is None:
        holder.out_spec, holder.out_shapes = spec, shapes
        return True
    if spec != holder.out_spec or shapes != holder.out_shapes:
        raise ValueError(
            f"f: returned a different output structure on a later evaluation ({spec} with per-sample shapes "
            f"{shapes}, first {holder.out_spec} with {holder.out_shapes}). jacmode evaluates f several times; "
            "its outputs must keep their structure.")
    return False


def _split_aux(out: Any) -> tuple[Any, Any]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"f: has_aux=True expects f to return a pair (output, aux), got {type(out).__name__} "
            f"({_fmt(out)}). Return `out, aux`, or pass has_aux=False.")
    return out
