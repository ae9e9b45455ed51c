"""A progress bar for long work over data sets: tqdm, optional, samples per second."""

from __future__ import annotations

import sys
from typing import Any, Optional


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(progress: Optional[bool], total: Optional[int], desc: str, rank: int) -> Any:
    """A tqdm bar counting samples, or an object with the same ``update``/``close`` that shows nothing.

    ``progress=None`` shows the bar when stderr is a terminal and tqdm is installed;
    ``True`` always shows it (and needs tqdm); ``False`` never. Only rank 0 shows it.
    """
    if progress is False or rank != 0:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if progress:
            raise ImportError(
                "progress=True needs tqdm, which is not installed. Install it with "
                "`pip install 'jacmode[progress]'` (or `pip install tqdm`), or pass progress=None."
            ) from None
        return _Silent()
    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return _Silent()
    return tqdm(total=total, desc=desc, unit=" samples",
                file=sys.stderr)
