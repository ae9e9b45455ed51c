"""``python -m jacmode``: says where the command-line tools went (the repository's ``bench/``).

The demo, the benchmarks and the calibrators are tooling, not part of the installed package; they
live in ``bench/`` at the root of the repository and run from there:

    make demo                          # python -m bench.demo
    make bench                         # python -m bench.bench --quick
    python -m bench.calibrate --help   # re-fit the cost model of mode="auto"
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

_MOVED = {"demo": "python -m bench.demo", "bench": "python -m bench.bench"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print where the tool asked for lives now; exit status 2 (nothing was run).

    Example:
        >>> main(["demo"])
        python -m jacmode demo moved out of the package: run `python -m bench.demo` (or `make demo`) from the repository root.
        2
    """
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else ""
    if command in _MOVED:
        print(f"python -m jacmode {command} moved out of the package: run `{_MOVED[command]}` "
              f"(or `make {command}`) from the repository root.")
    else:
        print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
