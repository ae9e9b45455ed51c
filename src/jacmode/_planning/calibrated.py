"""Constants of the cost, memory and NTK models: read once at import from ``calibrated.json``.

The data file ships with the package (next to this module) and is written by the calibrators of the
repository's ``bench/``: ``python -m bench.calibrate --write`` (``COST``, ``MEMORY``) and
``python -m bench.calibrate_ntk --write`` (``NTK_COST``); nothing edits source. The names:

- ``MACHINE``: where the constants were fitted (text).
- ``SPILL_BYTES``: activations of one pass beyond which bytes cost more (1/4 of L3).
- ``FRESH_BYTES``: results at least this large come from the operating system afresh on every call
  (glibc's largest ``mmap`` threshold), so the first write to each page pays a page fault (optional, 32 MiB).
- ``COST``: per engine ("forward", "forward-layerwise", "reverse", "reverse-probes"), seconds per unit
  of each term of the cost model (``_planning/plan.py``).
- ``MEMORY``: the workspace multipliers of the memory model (``_planning/memory.py``).
- ``NTK_COST``: per NTK method, the constants (c0, c1, c2, c3) of its time (``_planning/ntk.py``).

The constants of ``COST`` are the CPU's. A file ``calibrated-<device type>.json`` next to it
(``calibrated-cuda.json``, written by ``python -m bench.calibrate --every --device cuda --write``)
holds another device type's ``MACHINE`` and ``COST``; the planner prices a call on that device
with them (:func:`cost`), and with the CPU's where there is none.

Example:
    >>> sorted(COST) == ["forward", "forward-layerwise", "reverse", "reverse-probes"]
    True
    >>> load(DATA_FILE)["MEMORY"] == MEMORY
    True
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, Union

DATA_FILE = "calibrated.json"  # a resource of this package (jacmode/_planning/calibrated.json)


def _resource() -> Any:
    return resources.files(__package__ or "jacmode._planning").joinpath(DATA_FILE)


def path() -> Path:
    """Where the data file lies (the calibrators write it there; an installed package has it too)."""
    return Path(str(_resource()))


def device_path(device_type: str) -> Path:
    """Where the constants of ``device_type`` lie (``calibrated.json`` for "cpu")."""
    name = DATA_FILE if device_type == "cpu" else f"calibrated-{device_type}.json"
    return Path(str(resources.files(__package__ or "jacmode._planning").joinpath(name)))


def load(source: Union[str, Path] = DATA_FILE, device: bool = False) -> dict[str, Any]:
    """The data file's contents, checked for the names the planner reads; ``source``: a path or the
    resource name; ``device``: a device type's file (``MACHINE`` and ``COST`` only)."""
    if str(source) == DATA_FILE:
        text = _resource().read_text()
    else:
        text = Path(source).read_text()
    data = json.loads(text)
    names = ("MACHINE", "COST") if device else ("MACHINE", "SPILL_BYTES", "COST", "MEMORY", "NTK_COST")
    missing = [k for k in names if k not in data]
    if missing:
        raise ValueError(f"{source}: the calibrated constants lack {missing}; re-run `python -m bench.calibrate --write` "
                         "(and `python -m bench.calibrate_ntk --write`) from the repository root, or restore the file.")
    return data


_DATA = load()
MACHINE: str = str(_DATA["MACHINE"])
SPILL_BYTES: int = int(_DATA["SPILL_BYTES"])
FRESH_BYTES: int = int(_DATA.get("FRESH_BYTES", 32 << 20))
COST: dict[str, dict[str, float]] = {m: {k: float(v) for k, v in c.items()} for m, c in _DATA["COST"].items()}
MEMORY: dict[str, float] = {k: float(v) for k, v in _DATA["MEMORY"].items()}
NTK_COST: dict[str, tuple[float, ...]] = {m: tuple(float(v) for v in c) for m, c in _DATA["NTK_COST"].items()}
del _DATA
_BY_DEVICE: dict[str, dict[str, dict[str, float]]] = {"cpu": COST}


def cost(device_type: str) -> dict[str, dict[str, float]]:
    """The cost constants of ``device_type``: its own file's where the package has one, else the
    CPU's (``COST``). Each file is read once per process."""
    found = _BY_DEVICE.get(device_type)
    if found is None:
        path = device_path(device_type)
        found = COST
        if path.is_file():
            found = {m: {k: float(v) for k, v in c.items()} for m, c in load(path, device=True)["COST"].items()}
        _BY_DEVICE[device_type] = found
    return found
