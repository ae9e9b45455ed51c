"""The examples of the documentation pages run and print what the pages say (doctest)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
# Pages whose ```pycon examples are checked; add a page here when it gains examples.
PAGES = ["index.md", "structure.md"]


@pytest.mark.parametrize("page", PAGES)
def test_page_examples(page: str) -> None:
    result = doctest.testfile(
        str(DOCS / page), module_relative=False, verbose=False, report=True,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    assert result.attempted > 3, f"{page}: no examples found"
    assert result.failed == 0, f"{page}: {result.failed} of {result.attempted} examples failed (see above)"
