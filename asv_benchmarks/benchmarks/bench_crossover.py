"""asv suite 3: the forward/reverse crossover grid behind jacmode's cost model.

Every fourth case of ``bench.calibrate.regret_grid()`` (14 of its 55: MLPs, elementwise-heavy
nets and a small CNN; wrt inputs and parameters; N/Y from 1/100 to 100/1; B from 1 to 1024) is
timed in each mode, so that asv shows, per commit, whether ``mode="auto"`` keeps up with the faster
explicit mode; asv starts a process per case and mode, and the whole grid would not fit the
suite's 10-minute quick run (``python -m bench.calibrate --regret`` times all 55). The
fit grid (``fit_grid()``) is what ``python -m bench.calibrate`` fits the constants on; it is
kept out of asv because it is only needed when recalibrating. ``MemoryBudget`` tracks the peak
memory of a large parameter Jacobian under ``max_memory``.

Importable as plain Python: ``python -c "import bench_crossover"`` from this folder.
"""

from __future__ import annotations

import torch

import jacmode as jm
from bench.calibrate import Case, regret_grid

_CASES = {case.label: case for case in regret_grid()[::4]}


class Crossover:
    """Time of one Jacobian per mode over the regret grid."""

    params = (list(_CASES), ["auto", "forward", "reverse"])
    param_names = ["case", "mode"]
    timeout = 120

    def setup(self, label: str, mode: str) -> None:
        torch.set_num_threads(1)
        self.case = _CASES[label]
        self.model, self.x = self.case.build()
        jm.jacobian(self.model, self.x, wrt=self.case.wrt, mode=mode)  # warm the caches

    def time_jacobian(self, label: str, mode: str) -> None:
        jm.jacobian(self.model, self.x, wrt=self.case.wrt, mode=mode)



class AutoChoice:
    """Which mode auto picks per case: shows the crossover moving between commits."""

    params = (list(_CASES),)
    param_names = ["case"]

    def setup(self, label: str) -> None:
        self.case = _CASES[label]
        self.model, self.x = self.case.build()

    def track_auto_picks_forward(self, label: str) -> float:
        """1.0 when auto picks forward mode."""
        return float(jm.plan(self.model, self.x, wrt=self.case.wrt).mode == "forward")

    track_auto_picks_forward.unit = "forward?"


class MemoryBudget:
    """Peak memory of a parameter Jacobian (result 1.8 GB; unchunked vmap(jacrev) needs ~4 GB more)."""

    params = (["200MB", "2GB"],)
    param_names = ["max_memory"]
    timeout = 600

    def setup(self, max_memory) -> None:
        torch.set_num_threads(1)
        self.case = Case("seq", 32, 10, 1024, wrt="params", h=1024)
        self.model, self.x = self.case.build()

    def peakmem_params_jacobian(self, max_memory) -> None:
        jm.jacobian(self.model, self.x, wrt="params", max_memory=max_memory)
