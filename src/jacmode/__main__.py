"""Command line: ``python -m jacmode demo`` and ``python -m jacmode bench``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jacmode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="solve the two problems jacmode was founded on, check and time them")
    bench = sub.add_parser("bench", help="time jacmode against the idioms it replaces")
    from .tools.bench import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .tools.demo import main as demo

        return demo()
    from .tools.bench import main as run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
