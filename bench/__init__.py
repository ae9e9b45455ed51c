"""Tooling run by people and CI (bench, demo, calibration, targets, baselines): not part of the installed package.

Run from the repository root, e.g. ``python -m bench.demo``, ``python -m bench.bench --quick``,
``python -m bench.calibrate --help`` (``make demo`` and ``make bench`` do that). The library never imports it.
"""

from __future__ import annotations

from pathlib import Path

# The repository root: the working directory of the subprocesses the tools start, so that they
# import ``bench`` (and, with PYTHONPATH=src, ``jacmode``) as the parent does.
ROOT = str(Path(__file__).resolve().parents[1])
