"""asv suite: the regret of ``mode="auto"`` and the prediction error of its engine, on drawn problems.

Every fourth of the first 64 cases drawn by ``bench.regret.draw`` (seed 0: model classes with
norms, residuals and a conv front, parameter subsets, batched and unbatched calls) is timed in each
mode, so that asv shows per commit whether auto keeps up with the faster explicit mode
(``python -m bench.regret`` times all 64 side by side and reports the regret); ``AutoPrediction``
tracks the chosen engine's predicted time over its measured time.

Importable as plain Python: ``python -c "import bench_regret"`` from this folder.
"""

from __future__ import annotations

import time

import torch

import jacmode as jm
from bench.regret import draw

_CASES = {case.label: case for case in draw(64, seed=0)[::4]}


class Regret:
    """Time of one Jacobian per mode over the drawn cases."""

    params = (list(_CASES), ["auto", "forward", "reverse"])
    param_names = ["case", "mode"]
    timeout = 300

    def setup(self, label: str, mode: str) -> None:
        torch.set_num_threads(1)
        self.case = _CASES[label]
        self.model, self.x = self.case.build()
        for _ in range(6):  # caches, and the probe engine's generated code (third call on)
            jm.jacobian(self.model, self.x, mode=mode, **self.case.kwargs())

    def time_jacobian(self, label: str, mode: str) -> None:
        jm.jacobian(self.model, self.x, mode=mode, **self.case.kwargs())


class AutoPrediction:
    """Predicted over measured time of the engine auto chooses (1.0 is a perfect prediction)."""

    params = (list(_CASES),)
    param_names = ["case"]
    timeout = 300

    def setup(self, label: str) -> None:
        torch.set_num_threads(1)
        self.case = _CASES[label]
        self.model, self.x = self.case.build()

    def track_predicted_over_measured(self, label: str) -> float:
        kw = self.case.kwargs()
        for _ in range(6):
            jm.jacobian(self.model, self.x, **kw)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jm.jacobian(self.model, self.x, **kw)
            times.append(time.perf_counter() - t0)
        plan = jm.plan(self.model, self.x, **kw)
        return plan.costs[plan.mode] / sorted(times)[len(times) // 2]

    track_predicted_over_measured.unit = "ratio"
