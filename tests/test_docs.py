"""The examples of the documentation pages run and print what the pages say (doctest)."""

from __future__ import annotations

import doctest
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
# Pages whose ```pycon examples are checked; add a page here when it gains examples.
PAGES = ["index.md", "structure.md", "products.md", "datasets.md", "sparse.md", "functional.md", "transforms.md",
         "pinn.md"]


@pytest.mark.parametrize("page", PAGES)
def test_page_examples(page: str) -> None:
    result = doctest.testfile(
        str(DOCS / page), module_relative=False, verbose=False, report=True,
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    assert result.attempted > 3, f"{page}: no examples found"
    assert result.failed == 0, f"{page}: {result.failed} of {result.attempted} examples failed (see above)"


def test_readme_python_blocks_run() -> None:
    """The README's ```python blocks run, in order, in one namespace (as a reader would paste them)."""
    text = (DOCS.parent / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["dydt"].shape == (100_000, 4)
    assert namespace["J"].shape == (64, 10, 15910)
    assert namespace["grads"].shape == (512, 15910) and namespace["diag"].shape == (15910,)
    assert namespace["K"].shape == (256, 256, 10, 10)
    assert namespace["u_xx"].shape == (10_000, 1) and namespace["d4"].shape == (100_000, 4)
    assert namespace["Js"].layout == torch.sparse_csr and namespace["Js"].shape == (4096, 4096)
    assert namespace["Hs"].layout == torch.sparse_csr and namespace["colors"].n_colors <= 4
