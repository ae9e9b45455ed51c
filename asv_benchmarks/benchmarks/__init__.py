"""asv suites of jacmode: every module bench_*.py in this folder is collected (see ../asv.conf.json).

The problems, models and baseline idioms come from the repository's ``bench/`` (tooling, not
installed): the repository root goes on ``sys.path`` here, before any suite imports ``bench``.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
