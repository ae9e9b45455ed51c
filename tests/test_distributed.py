"""jacmode over 2 gloo processes on loopback returns what one process returns; faults end cleanly."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _dist_worker  # noqa: E402

import jacmode as jm  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(cases: str, outdir: str, timeout: float = 90.0) -> tuple[dict[str, list[str]], float]:
    """Start 2 ranks on ``cases`` (see _dist_worker.main), wait (bounded) for both, return each
    case's error texts per rank and the wall time."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dist_worker.main, args=(r, 2, port, cases, outdir)) for r in range(2)]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, timeout - (time.perf_counter() - start)))
    elapsed = time.perf_counter() - start
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {}
    for name in cases.split("+"):
        paths = [os.path.join(outdir, f"{r}.{name}.err") for r in range(2)]
        errors[name] = [open(path).read() if os.path.exists(path) else "" for path in paths]
    return errors, elapsed


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[str]], float]:
    """One launch of 2 ranks for both tests (each launch spawns two fresh Pythons that import
    torch and jacmode): the results first, then the case where rank 1 dies."""
    outdir = str(tmp_path_factory.mktemp("dist"))
    errors, elapsed = _launch("results+dying", outdir)
    return outdir, errors, elapsed


def test_two_ranks_return_what_one_process_returns_and_fail_together(launched: tuple) -> None:
    outdir, errors, _ = launched
    assert errors["results"] == ["", ""], errors["results"]
    one = _dist_worker.results()
    net, data = _dist_worker.problem()
    x = data.tensors[0]
    full = jm.jacobian(net, x, wrt="params")
    torch.testing.assert_close(one["out_plain"], full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(one["ggn_diag"], jm.ggn(net, x, diagonal=True), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(one["ntk"], jm.ntk(net, x, x[:9]), rtol=1e-10, atol=1e-12)
    for r in range(2):
        got = torch.load(os.path.join(outdir, f"{r}.results.pt"))
        error = bytes(got.pop("error").tolist()).decode()  # rank 1 failed on batch 3, round 1
        assert error.startswith("batch 3 on rank 1 failed: " + (
            "OSError: unreadable sample 12" if r == 1 else "an error on rank 1 (see its traceback)"))
        assert "out= holds final values in rows 0..7; later rows do not" in error
        error = bytes(got.pop("sum_error").tolist()).decode()
        assert error.startswith("batch 3 on rank 1 failed: ")
        assert set(got) == set(one)
        for key in one:
            torch.testing.assert_close(got[key], one[key], rtol=1e-10, atol=1e-12, msg=key)


def test_a_dead_rank_ends_the_others_within_the_timeout(launched: tuple) -> None:
    _, errors, elapsed = launched
    assert errors["results"] == ["", ""], "the launch failed before rank 1 died"
    assert "another rank probably died" in errors["dying"][0]  # rank 0 raised: it was not killed at the timeout
    assert elapsed < 90
