"""Problem 1's model over an MNIST-shaped data set, in one process or several (docs/datasets.md).

    torchrun --nproc_per_node=2 examples/datasets_distributed.py     # 2 processes (gloo; NCCL on GPUs)
    python examples/datasets_distributed.py                           # 1 process: the same numbers

Every rank builds the same random data set, wraps it in a DataLoader with a DistributedSampler,
and calls jacmode as one process would; jacmode splits the batches by rank and combines the
results (all_reduce for the GGN, all_gather for per-sample rows), so every rank prints the same.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import jacmode as jm


def main(samples: int = 60_000, batch_size: int = 1_000, threads: int = 1,
         save: Optional[str] = None, progress: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """The GGN diagonal over the data set, an NTK block and per-sample gradients of a subset."""
    torch.set_num_threads(threads)
    if "RANK" in os.environ and not dist.is_initialized():  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
    torch.manual_seed(0)  # the same model and data on every rank
    net = nn.Sequential(nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)).to(device)  # problem 1's MLP
    x, y = torch.randn(samples, 784, device=device), torch.randn(samples, 10, device=device)
    data = TensorDataset(x, y)

    def loader(dataset: TensorDataset, size: int) -> DataLoader:
        split = DistributedSampler(dataset, shuffle=False) if dist.is_initialized() else None
        return DataLoader(dataset, batch_size=size, sampler=split)

    start = time.perf_counter()
    ggn_diag = jm.ggn(net, loader(data, batch_size), diagonal=True, progress=progress)
    seconds = time.perf_counter() - start
    few = TensorDataset(x[:500], y[:500])
    results = {
        "ggn_diag": ggn_diag,
        "ntk_trace": jm.ntk(net, loader(few, 100), x[:50], trace=True, progress=False),
        "grads": jm.per_sample_grads(net, loader(few, 100), lambda out, t: ((out - t) ** 2).sum(1),
                                     progress=False),
    }
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if rank == 0:
        print(f"{world} process(es), {threads} thread(s) each: ggn diagonal over {samples} samples "
              f"in batches of {batch_size}: {seconds:.2f} s (first call, with its one-off probes); |diag| = {ggn_diag.norm():.6e}; "
              f"ntk {tuple(results['ntk_trace'].shape)}, per-sample grads {tuple(results['grads'].shape)}")
        if save:
            torch.save({k: v.cpu() for k, v in results.items()} | {"seconds": torch.tensor(seconds)}, save)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=60_000)
    parser.add_argument("--batch-size", type=int, default=1_000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--save", help="rank 0 saves the results (torch.save) to this path")
    args = parser.parse_args()
    try:
        main(args.samples, args.batch_size, args.threads, args.save)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
