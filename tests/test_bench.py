"""The bench command and the baselines it shares with the asv suites.

The baselines are checked against the float64 references of conftest (so a benchmark can never time
a wrong answer); the command is run end to end on tiny sizes and its JSON checked. No timing is
asserted beyond being positive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ref_input_jacobian, ref_param_jacobian
from bench import bench as _bench, bench_report as _bench_report
from bench.baselines import METHODS, PROBLEMS, runs_at

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


# jacmode's forward mode over 15,910 parameters is slow in float64 and is tested with jacmode's own tests.
@pytest.mark.parametrize("method", [m for m in METHODS["params"] if m not in ("jacmode forward", "allocate+fill (floor)")])
def test_params_baselines_match_the_reference(method: str) -> None:
    model, x = PROBLEMS["params"].make(3, "cpu")
    model, x = model.double(), x.double()
    got = METHODS["params"][method](model, x)
    assert got.shape == (3, 10, 15910)
    torch.testing.assert_close(got, ref_param_jacobian(model, x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", list(METHODS["dydt"]))
def test_dydt_baselines_match_the_reference(method: str) -> None:
    net, t = PROBLEMS["dydt"].make(7, "cpu")
    net, t = net.double(), t.double()
    got = METHODS["dydt"][method](net, t)
    assert got.shape in {(7, 4), (7, 4, 1)}
    torch.testing.assert_close(got.reshape(7, 4), ref_input_jacobian(net, t)[..., 0], rtol=1e-9, atol=1e-12)


def test_problems_are_the_same_for_every_method() -> None:
    (m1, x1), (m2, x2) = PROBLEMS["params"].make(4, "cpu"), PROBLEMS["params"].make(4, "cpu")
    torch.testing.assert_close(x1, x2, rtol=0, atol=0)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_quadratic_idioms_are_skipped_at_large_batches() -> None:
    assert runs_at("dydt", "users' loop", 1000) and not runs_at("dydt", "users' loop", 100_000)
    assert runs_at("dydt", "jacmode", 100_000)
    quick = _bench.cases(quick=True)
    assert ("params", 512, "users' loop") not in quick and ("params", 512, "jacmode") in quick
    assert not any(method.startswith("jacmode ") for _, _, method in quick)
    assert ("params", 512, "jacmode forward") in _bench.cases(quick=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench", "--quick", "--tiny", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(SRC)}, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text())


def test_bench_json_has_every_case_and_the_machine(tiny_run: tuple) -> None:
    proc, report = tiny_run
    rows = report["results"]
    assert [(r["problem"], r["B"], r["method"]) for r in rows] == _bench.cases(quick=True, tiny=True)
    assert {"date", "device", "torch", "jacmode", "quick"} <= set(report["machine"])
    assert report["machine"]["torch"] == torch.__version__
    assert report["machine"]["torch_threads"] == 1  # --tiny runs on one thread
    assert "VmHWM" in report["memory"] or "ru_maxrss" in report["memory"]
    for r in rows:
        assert "error" not in r, r
        assert r["median_ms"] > 0 and all(t > 0 for t in r["times_ms"]) and r["peak_bytes"] >= 0
        expected = [r["B"], 10, 15910] if r["problem"] == "params" else [r["B"], 4]
        assert r["shape"][: len(expected)] == expected
        if r["method"] == "jacmode":
            assert r["ratio"] == 1.0
    big = next(r for r in rows if r["problem"] == "params" and r["B"] == 4 and r["method"] == "jacmode")
    assert big["peak_bytes"] >= 4 * 10 * 15910 * 4  # the result alone: honest memory, not a delta of 0


def test_bench_prints_the_table(tiny_run: tuple) -> None:
    proc, report = tiny_run
    assert "| problem | B | method | median ms | time / jacmode | peak memory |" in proc.stdout
    assert proc.stdout.count("| dydt |") == sum(r["problem"] == "dydt" for r in report["results"])
    assert report["machine"]["device"] in proc.stdout


def test_bench_plot(tiny_run: tuple, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _bench_report.plot(tiny_run[1], str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _bench_report.check_plotting() is False
    assert "pip install 'jacmode[plot]'" in capsys.readouterr().err
    args = _parse(["bench", "--tiny", "--plot", "x.png"])
    assert _bench.main(args) == 2


def test_missing_tqdm_gives_plain_progress_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    items = list(_bench._progress([("dydt", 4, "jacmode"), ("dydt", 16, "jacmode")]))
    err = capsys.readouterr().err
    assert len(items) == 2 and "tqdm is not installed" in err and "bench [2/2] dydt B=16 jacmode" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_cuda_without_cuda_is_refused(capsys: pytest.CaptureFixture) -> None:
    assert _bench.main(_parse(["bench", "--device", "cuda", "--tiny"])) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_threads_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert _bench.main(_parse(["bench", "--threads", "0"])) == 2
    assert "--threads expects a positive number, got 0" in capsys.readouterr().err


def test_python_m_jacmode_says_where_the_tools_went(capsys: pytest.CaptureFixture) -> None:
    from jacmode.__main__ import main

    assert main(["demo"]) == 2 and "run `python -m bench.demo` (or `make demo`)" in capsys.readouterr().out
    assert main(["bench", "--quick"]) == 2 and "`python -m bench.bench`" in capsys.readouterr().out
    assert main([]) == 2 and "bench/" in capsys.readouterr().out


def test_the_tooling_is_not_in_the_package() -> None:
    import jacmode

    assert not (Path(jacmode.__file__).parent / "tools").exists()
    assert (ROOT / "bench" / "demo.py").exists() and (ROOT / "bench" / "calibrate.py").exists()


def _parse(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    _bench.add_arguments(sub.add_parser("bench"))
    return parser.parse_args(argv)


def test_regret_draw_auto_equals_the_explicit_modes() -> None:
    """A small fixed draw of bench.regret: auto's result is both explicit modes' (float64), no timings."""
    from bench import regret

    cases = regret.draw(6, seed=1, max_entries=20_000)
    assert len({c.label for c in cases}) == 6
    for case in cases:
        assert regret.results_agree(case) is None
    s = regret.summary([{"regret": r, "error": e} for r, e in ((1.0, 1.0), (1.3, 3.0), (0.9, 0.8))])
    assert s["cases"] == 3 and s["worst"] == 1.3 and s["median"] == 1.0 and abs(s["predicted_within_2x"] - 2 / 3) < 1e-12
