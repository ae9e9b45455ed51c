"""The calibrated constants: a data file shipped with the package, read once at import, written by bench/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.calibrate import FIT_TERMS
from jacmode._planning import calibrated, engines, memory, ntk, plan

TERMS = {"call", "pass_ops", "vmap_ops", "pass_flops", "pass_conv", "pass_bytes", "dir_flops", "dir_conv",
         "dir_bytes", "dir_spill", "result", "seed", "conv_out", "conv_spill", "pages", "special"}


def test_the_loader_and_the_data_file_agree() -> None:
    raw = json.loads((Path(calibrated.__file__).parent / "calibrated.json").read_text())
    assert calibrated.path() == Path(calibrated.__file__).parent / "calibrated.json"
    assert calibrated.MACHINE == raw["MACHINE"] and calibrated.SPILL_BYTES == raw["SPILL_BYTES"]
    assert calibrated.FRESH_BYTES == raw["FRESH_BYTES"]
    assert calibrated.COST == raw["COST"] and calibrated.MEMORY == raw["MEMORY"]
    assert calibrated.NTK_COST == {m: tuple(c) for m, c in raw["NTK_COST"].items()}
    assert isinstance(calibrated.SPILL_BYTES, int)
    assert all(isinstance(v, float) for c in calibrated.COST.values() for v in c.values())


def test_the_planner_reads_the_loaded_constants() -> None:
    """One set of numbers: the cost, memory and NTK models hold the loader's objects, with every term."""
    assert engines.cost("cpu") is calibrated.COST and plan.SPILL_BYTES == calibrated.SPILL_BYTES
    assert engines.FRESH_BYTES == calibrated.FRESH_BYTES
    assert memory.MEMORY is calibrated.MEMORY and ntk.NTK_COST is calibrated.NTK_COST
    assert set(calibrated.COST) == set(engines.WHAT)  # one set of constants per engine, none for a gone one
    assert all(set(c) == TERMS for e, c in calibrated.COST.items() if e != "reverse-probes")
    assert set(calibrated.COST["reverse-probes"]) == set(FIT_TERMS)  # its own terms besides (engines.py)
    assert set(calibrated.NTK_COST) == set(ntk.METHODS) and all(len(c) == 4 for c in calibrated.NTK_COST.values())
    assert all(v >= 0 for c in calibrated.COST.values() for v in c.values())


def test_a_file_without_a_name_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "calibrated.json"
    bad.write_text(json.dumps({"MACHINE": "m", "SPILL_BYTES": 1, "COST": {}}))
    with pytest.raises(ValueError, match=r"lack \['MEMORY', 'NTK_COST'\]; re-run `python -m bench.calibrate --write`"):
        calibrated.load(bad)


def test_the_calibrators_write_the_data_file_and_keep_the_other_names(tmp_path: Path) -> None:
    from bench import calibrate, calibrate_ntk

    target = tmp_path / "calibrated.json"
    target.write_text(calibrated.path().read_text())
    costs = {m: {k: v * 2 + 1.234567e-9 for k, v in c.items()} for m, c in calibrated.COST.items()}
    assert calibrate.write_constants(costs, {**calibrated.MEMORY, "jvp_live": 9.0}, path=str(target)) == str(target)
    data = calibrated.load(target)
    assert data["COST"]["forward"]["call"] == float(f"{costs['forward']['call']:.4g}")
    assert data["MEMORY"]["jvp_live"] == 9.0 and data["NTK_COST"] == {m: list(c) for m, c in calibrated.NTK_COST.items()}
    calibrate_ntk._write({m: (1.23456e-3, 0.0, 2e-11, 0.0) for m in ntk.METHODS}, path=str(target))
    data = calibrated.load(target)
    assert data["NTK_COST"]["structured"] == [1.23e-3, 0.0, 2e-11, 0.0] and data["MEMORY"]["jvp_live"] == 9.0
    assert calibrated.path().read_text() != target.read_text()  # the package's file was not touched


def test_a_file_without_the_probe_engine_constants_still_plans(monkeypatch) -> None:
    """An older data file (no "reverse-probes"): the probe engine is priced as the generic reverse engine."""
    import torch
    import jacmode as jm

    net, x = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)), torch.randn(16, 3)
    priced = jm.plan(net, x, wrt="params").costs["reverse"]
    older = {k: v for k, v in calibrated.COST.items() if k != "reverse-probes"}
    monkeypatch.setattr(calibrated, "_BY_DEVICE", {"cpu": older})
    fallback = jm.plan(net, x, wrt="params")
    assert fallback.engine == "reverse-probes" and fallback.costs["reverse"] != priced


def test_a_device_type_reads_its_own_constants_file_else_the_cpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate --every --device cuda --write writes calibrated-cuda.json beside the CPU's file; the
    planner prices a call on that device type with it, and with the CPU's constants where there is none."""
    from bench import calibrate

    doubled = {m: {k: 2 * v + 1e-9 for k, v in c.items()} for m, c in calibrated.COST.items()}
    target = tmp_path / "calibrated-xpu.json"
    assert calibrate.write_device_constants(doubled, "xpu", path=str(target)) == str(target)
    assert set(calibrated.load(target, device=True)) == {"MACHINE", "COST"}
    with pytest.raises(ValueError, match=r"lack \['SPILL_BYTES', 'MEMORY', 'NTK_COST'\]"):
        calibrated.load(target)  # not a CPU file
    real = calibrated.device_path
    monkeypatch.setattr(calibrated, "device_path", lambda kind: target if kind == "xpu" else real(kind))
    monkeypatch.setattr(calibrated, "_BY_DEVICE", {"cpu": calibrated.COST})
    assert calibrated.cost("cpu") is calibrated.COST
    assert calibrated.cost("xpu")["reverse"]["call"] == float(f"{doubled['reverse']['call']:.4g}")
    assert calibrated.cost("nowhere") is calibrated.COST  # no file: the CPU's constants
    terms = {"call": 1.0}
    assert engines.estimate("reverse", terms, "xpu") == calibrated.cost("xpu")["reverse"]["call"]
    assert engines.estimate("reverse", terms) == calibrated.COST["reverse"]["call"]
    assert calibrated.device_path("cpu") == calibrated.path()
