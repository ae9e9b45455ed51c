"""Checks of the paths that differ on a GPU, each against the same call on the CPU (float64).

Run on a GPU machine from the repository root: ``PYTHONPATH=src python dev/gpu_verify.py``. Each
check prints one line (ok, or what differed); the script never stops at a failure.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch
from torch import Tensor, nn

import jacmode as jm


class Tokens(nn.Module):
    """Float token ids cast with ``.long()`` in forward (noise would move them off the table)."""

    def __init__(self, couple: bool = False) -> None:
        super().__init__()
        self.emb, self.fc, self.couple = nn.Embedding(10, 4), nn.Linear(4, 3), couple

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids.long()).mean(1)
        return self.fc(h - h.mean(0) if self.couple else h)


class LastHidden(nn.Module):
    """An LSTM's last hidden state (cuDNN's kernel on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


def check(name: str, run: Callable[[], Any]) -> None:
    try:
        print(f"{name}: {run()}", flush=True)
    except Exception as err:  # noqa: BLE001 -- a line, and the next check
        print(f"{name}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
        traceback.print_exc()


def same(got: Any, want: Any, tol: float = 1e-9) -> str:
    leaves = lambda t: torch.utils._pytree.tree_flatten(t)[0]  # noqa: E731
    err = max(float((g.detach().cpu().double() - w.detach().cpu().double()).abs().max()) for g, w in
              zip(leaves(got), leaves(want)))
    return f"ok (max error {err:.1e})" if err <= tol else f"DIFFERS (max error {err:.1e})"


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (12, 6)).double()
    y = torch.randint(0, 3, (12,))
    cpu = Tokens().double()
    gpu = Tokens().double().to(dev)
    gpu.load_state_dict(cpu.state_dict())
    check("float ids, jacobian params", lambda: same([jm.jacobian(gpu, ids.to(dev), wrt="params") for _ in range(3)][-1],
                                                     jm.jacobian(cpu, ids, wrt="params")))
    check("float ids, per_sample_grads", lambda: same(
        jm.per_sample_grads(gpu, ids.to(dev), nn.CrossEntropyLoss(), y=y.to(dev)),
        jm.per_sample_grads(cpu, ids, nn.CrossEntropyLoss(), y=y)))

    def coupled() -> str:
        m = Tokens(couple=True).double().to(dev)
        try:
            jm.jacobian(m, ids.to(dev), wrt="params")
        except jm.CoupledBatchError as err:
            return f"ok (refused: {str(err)[:80]})"
        return "NOT REFUSED"

    check("float ids coupled", coupled)

    x = torch.randn(5, 7, 3, dtype=torch.float64)
    lcpu = LastHidden().double()
    lgpu = LastHidden().double().to(dev)
    lgpu.load_state_dict(lcpu.state_dict())
    def lstm(wrt: str) -> str:
        return same([jm.jacobian(lgpu, x.to(dev), wrt=wrt) for _ in range(2)][-1], jm.jacobian(lcpu, x, wrt=wrt))

    for wrt in ("inputs", "params"):
        check(f"LSTM on cuDNN, jacobian {wrt}", lambda: lstm(wrt))  # noqa: B023 -- called at once

    ln = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    xh = torch.randn(4, 6)
    ref = jm.jacobian(ln.double(), xh.double())
    for dtype in (torch.float16, torch.bfloat16):
        m = ln.to(dev, dtype)
        check(f"LayerNorm {dtype}, auto", lambda: same(jm.jacobian(m, xh.to(dev, dtype)), ref, 5e-2))  # noqa: B023

        def forward(m: nn.Module = m, dtype: torch.dtype = dtype) -> str:
            try:
                return same(jm.jacobian(m, xh.to(dev, dtype), mode="forward"), ref, 5e-2)
            except ValueError as err:
                return f"ok (clear error: {str(err)[:160]})"

        check(f"LayerNorm {dtype}, mode='forward'", forward)


if __name__ == "__main__":
    main()
