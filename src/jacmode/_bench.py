"""``python -m jacmode bench``: a representative benchmark subset without asv (to be written)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", metavar="FILE.png")
    parser.add_argument("--json", metavar="FILE")


def main(args: argparse.Namespace) -> int:
    raise SystemExit("bench: not written yet")
