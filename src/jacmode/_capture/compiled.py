"""``torch.compile`` for generated code (``codegen.py``), with a clean fallback.

NOTE: [Compiled generated code]
:func:`compiled` wraps a generated program (a ``GraphModule``, or any callable of tensors) in
``torch.compile(fn, backend=backend, dynamic=False, **kw)``. Static shapes: the generated code is
already specialised to one signature, and torch's guards (shapes, strides, dtypes, devices,
requires_grad of the inputs) recompile when a call differs instead of reusing code made for other
inputs; ``torch._dynamo.config.recompile_limit`` bounds how many versions one function keeps, after
which torch itself runs the code uncompiled. The first call pays for the compilation (Inductor on
CPU: C++ code generation and a C++ compiler, seconds; see bench/compile.py for measured figures).

Inductor on CPU compiles generated code with ``options={"pattern_matcher": False}`` unless the
caller passes options or a mode of its own: its pattern passes turn ``mm`` followed by the bias
add back into ``addmm``, which on CPU first copies the bias into every row of the output (a full
pass), where Inductor would otherwise fuse the add into the activation's kernel (the generated
code writes ``mm`` then ``add_`` for that reason, see ``_rules/linear.py``); 5% of a compiled
Laplacian of the PINN class, nothing measurable on the PINN training step.

Should compiling fail (no C++ compiler, a backend error), the call returns the uncompiled code's
result and a :class:`~jacmode.JacmodeWarning` says why, once per compiled function; later calls
run the uncompiled code directly.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from .._errors import JacmodeWarning


def compiled(fn: Callable[..., Any], backend: Any = "inductor", **kw: Any) -> Callable[..., Any]:
    """``fn`` compiled with ``torch.compile(backend=backend, dynamic=False, **kw)``, falling back to
    ``fn`` itself with a ``JacmodeWarning`` when compilation fails (see the note)."""
    import torch

    state: dict[str, Any] = {"fn": None}
    try:
        state["fn"] = torch.compile(fn, backend=backend, dynamic=False, **kw)
    except Exception as err:  # noqa: BLE001 -- an unknown backend, a bad option
        _warn(backend, err)
        return fn

    def call(*args: Any) -> Any:
        run = state["fn"]
        if run is fn:
            return fn(*args)
        try:
            return run(*args)
        except Exception as err:  # noqa: BLE001 -- compilation failed: the uncompiled code serves
            if not _compile_error(err):
                raise
            state["fn"] = fn
            _warn(backend, err)
            return fn(*args)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def options(backend: Any, device: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``torch.compile`` for generated code on ``device`` (see the note)."""
    if backend == "inductor" and getattr(device, "type", None) == "cpu" and "options" not in kw and "mode" not in kw:
        return {**kw, "options": {"pattern_matcher": False}}
    return kw


def _compile_error(err: BaseException) -> bool:
    """Whether err comes from torch's compiler stack rather than from running the code."""
    import torch._dynamo.exc as exc

    if isinstance(err, (exc.BackendCompilerFailed, exc.InternalTorchDynamoError, exc.Unsupported)):
        return True
    mod = type(err).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch._functorch")) or "CppCompileError" in type(err).__name__


def _warn(backend: Any, err: BaseException) -> None:
    first = " ".join(str(err).split())[:240]
    name = getattr(backend, "__name__", backend)
    warnings.warn(f"torch.compile(backend={name!r}) failed ({type(err).__name__}: {first}); jacmode runs "
                  "the generated code uncompiled, with the same results.", JacmodeWarning, stacklevel=3)
