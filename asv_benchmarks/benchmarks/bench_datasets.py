"""Suite 6: whole data sets (issue 14), problem 1's class MLP(784, 20, 10), one process.

- ggn(diagonal=True) over 60,000 MNIST-shaped samples: a DataLoader in batches of 1,000 against
  one batch of 60,000 (peak memory is the point: one batch's workspace, not 60,000 samples').
- Per-sample parameter Jacobians of 2,000 samples (1.27 GB): ``jm.jacobians`` into a NumPy
  memmap ``.npy`` in batches of 100 against the in-memory ``jm.jacobian`` of all 2,000.
The two-process figures need torchrun: ``examples/datasets_distributed.py`` (docs/datasets.md).
"""

import os
import tempfile

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import jacmode as jm
from bench.baselines import mnist_mlp


class GgnOverDataSet:
    params = ["loader of 1,000", "one batch"]
    param_names = ["input"]
    timeout = 300

    def setup(self, source: str) -> None:
        torch.manual_seed(0)
        self.net, x = mnist_mlp(), torch.randn(60_000, 784)
        self.data = DataLoader(TensorDataset(x), batch_size=1_000) if source != "one batch" else x
        jm.ggn(self.net, x[:1_000], diagonal=True)  # caches out of the timings

    def time_ggn_diagonal(self, source: str) -> None:
        jm.ggn(self.net, self.data, diagonal=True, progress=False)

    def peakmem_ggn_diagonal(self, source: str) -> None:
        jm.ggn(self.net, self.data, diagonal=True, progress=False)


class JacobiansToDisk:
    params = ["memmap in batches of 100", "in memory"]
    param_names = ["target"]
    timeout = 300

    def setup(self, target: str) -> None:
        torch.manual_seed(0)
        self.net, self.x = mnist_mlp(), torch.randn(2_000, 784)
        self.dir = tempfile.mkdtemp()
        jm.jacobian(self.net, self.x[:100], wrt="params")  # caches out of the timings

    def teardown(self, target: str) -> None:
        for name in os.listdir(self.dir):
            os.remove(os.path.join(self.dir, name))
        os.rmdir(self.dir)

    def _run(self, target: str) -> None:
        if target == "in memory":
            jm.jacobian(self.net, self.x, wrt="params")
            return
        path = os.path.join(self.dir, "J.npy")
        out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(2_000, 10, 15_910))
        jm.jacobians(self.net, iter(self.x.split(100)), out=out, progress=False)
        del out
        os.remove(path)

    def time_jacobians(self, target: str) -> None:
        self._run(target)

    def peakmem_jacobians(self, target: str) -> None:
        self._run(target)
