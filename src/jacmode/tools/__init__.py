"""Tooling run by people and CI (bench, demo, calibration, baselines); never imported by the library."""
