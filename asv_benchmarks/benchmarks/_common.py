"""What the suites share: the device, and a suite over one problem of bench.baselines.

The problems, their models and the baseline idioms live in ``bench.baselines`` so that
``python -m bench.bench`` times exactly the same code. Set ``JACMODE_ASV_DEVICE=cuda`` to run
the suites on a GPU (each timed call then ends with ``torch.cuda.synchronize``).
"""

from __future__ import annotations

import os

import torch

from bench.baselines import METHODS, PROBLEMS, preload, runs_at

preload()  # torch.func's lazy imports, so that peakmem compares methods and not imports
DEVICE = os.environ.get("JACMODE_ASV_DEVICE", "cpu")


def sync() -> None:
    """Wait for the device, so that a timing covers the work and not only its launch."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class _ProblemSuite:
    """time_* and peakmem_* of every method of one problem over its batch sizes B.

    Subclasses set ``problem`` and ``params = (PROBLEMS[problem].sizes, list(METHODS[problem]))``.
    The loops and the O(B^2) idiom are skipped above ``PROBLEMS[problem].small`` (asv shows n/a).
    peakmem is asv's: the peak resident memory of the benchmark's process, set-up included.
    """

    problem = ""
    param_names = ["B", "method"]
    timeout = 600

    def setup(self, batch: int, method: str) -> None:
        if not runs_at(self.problem, method, batch):
            raise NotImplementedError(f"{method} is not timed at B={batch}")
        torch.manual_seed(0)
        self.model, self.x = PROBLEMS[self.problem].make(batch, DEVICE)
        self.fn = METHODS[self.problem][method]
        self.fn(self.model, self.x[:2])  # one-time costs (lazy imports, caches) out of the timings
        sync()

    def time_jacobian(self, batch: int, method: str) -> None:
        self.fn(self.model, self.x)
        sync()

    def peakmem_jacobian(self, batch: int, method: str) -> None:
        self.fn(self.model, self.x)


def params_of(problem: str) -> tuple[list, list]:
    """The asv ``params`` of a problem's suite: (batch sizes, methods)."""
    return list(PROBLEMS[problem].sizes), list(METHODS[problem])
