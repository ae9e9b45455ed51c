"""dev/relayout.py on a small tree of its own: moves, import rewriting, unknown modules, re-runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "relayout.py"
E = "_eng" + "ines"  # spelled apart, so that the script never rewrites this file's tree

TREE = {
    "src/jacmode/__init__.py": "",
    "src/jacmode/_cache.py": "X = 0\n",
    f"src/jacmode/{E}/__init__.py": '"""Engines."""\n',
    f"src/jacmode/{E}/forward.py": """
        from .._cache import X
        from . import taylor as _taylor
        from .capture import Program  # noqa: F401 -- kept
        from .reverse import r

        def run():
            return _taylor.seeds + Program + X + r
        """,
    f"src/jacmode/{E}/reverse.py": "r = 3\n",
    f"src/jacmode/{E}/nested.py": "seeds = 2\n",
    f"src/jacmode/{E}/program.py": "Program = 1\n",
    f"src/jacmode/{E}/capture.py": f'"""Builds a :class:`~jacmode.{E}.program.Program` (``{E}/program.py``)."""\nfrom .program import Program\n',
    f"src/jacmode/{E}/taylor.py": "from .nested import seeds\nfrom .capture import Program\n",
    f"src/jacmode/{E}/probes.py": "from .reverse import r\n",
    f"src/jacmode/{E}/layerwise.py": "w = 5\n",
    f"src/jacmode/{E}/mystery.py": "from .probes import r\nfrom . import layerwise\n",
    "src/jacmode/_jacobian.py": f"""
        from ._{E[1:]} import forward, probes as _p
        from ._{E[1:]}.capture import Program

        def go():
            return forward.run() + _p.r + Program
        """,
    "src/jacmode/_planning/__init__.py": "",
    "src/jacmode/_planning/decide.py": f"""
        from .._{E[1:]} import (
            forward,
            taylor,
        )

        def f():
            from .._{E[1:]}.reverse import r
            from jacmode.{E} import mystery
            return forward.run() + taylor.seeds + r + mystery.layerwise.w
        """,
    "tests/test_x.py": f"""
        from jacmode.{E} import capture
        import jacmode.{E}.forward as fw

        TARGET = "jacmode.{E}.forward.run"
        """,
    "docs/x.md": f"::: jacmode.{E}.capture\n\nSee `{E}/taylor.py`.\n\n>>> from jacmode.{E} import taylor\n",
}


def make_tree(root: Path) -> None:
    for rel, text in TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], cwd=root, check=True)


def relayout(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_relayout_moves_rewrites_and_is_idempotent(tmp_path: Path) -> None:
    make_tree(tmp_path)
    dry = relayout(tmp_path, "--check")
    assert dry.returncode == 1 and f"move src/jacmode/{E}/forward.py -> src/jacmode/_autodiff/forward.py" in dry.stdout
    assert (tmp_path / f"src/jacmode/{E}/forward.py").exists()  # --check changes nothing

    run = relayout(tmp_path)
    assert run.returncode == 0, run.stderr
    pkg = tmp_path / "src/jacmode"
    assert not (pkg / E).exists()
    for folder, names in {"_autodiff": ["forward", "reverse", "nested"], "_capture": ["capture", "program", "taylor"],
                          "_probes": ["probes", "layerwise", "mystery"]}.items():
        assert (pkg / folder / "__init__.py").exists()
        assert all((pkg / folder / f"{n}.py").exists() for n in names), folder
    assert "mystery.py is not in the table; it goes to _probes/" in run.stdout

    forward = (pkg / "_autodiff/forward.py").read_text()
    assert "from .._cache import X\nfrom .._capture import taylor as _taylor\n" in forward
    assert "from .._capture.capture import Program  # noqa: F401 -- kept\nfrom .reverse import r\n" in forward
    assert (pkg / "_capture/taylor.py").read_text() == "from .._autodiff.nested import seeds\nfrom .capture import Program\n"
    assert "~jacmode._capture.program.Program` (``_capture/program.py``)" in (pkg / "_capture/capture.py").read_text()
    assert (pkg / "_jacobian.py").read_text().startswith(
        "from ._autodiff import forward\nfrom ._probes import probes as _p\nfrom ._capture.capture import Program\n")
    decide = (pkg / "_planning/decide.py").read_text()
    assert "from .._autodiff import forward\nfrom .._capture import taylor\n" in decide
    assert "    from .._autodiff.reverse import r\n    from jacmode._probes import mystery\n" in decide
    test = (tmp_path / "tests/test_x.py").read_text()
    assert "from jacmode._capture import capture\nimport jacmode._autodiff.forward as fw\n" in test
    assert 'TARGET = "jacmode._autodiff.forward.run"' in test
    assert (tmp_path / "docs/x.md").read_text() == (
        "::: jacmode._capture.capture\n\nSee `_capture/taylor.py`.\n\n>>> from jacmode._capture import taylor\n")

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    code = "import jacmode._jacobian as j, jacmode._planning.decide as d; print(j.go(), d.f())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.stdout.split() == ["10", "16"], out.stderr
    status = subprocess.run(["git", "status", "--short"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert f"RM src/jacmode/{E}/forward.py -> src/jacmode/_autodiff/forward.py" in status  # git mv: history kept

    again = relayout(tmp_path, "--check")
    assert again.returncode == 0 and "nothing to do" in again.stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_merge_after_the_relayout_is_rewritten_and_map_chooses(tmp_path: Path) -> None:
    make_tree(tmp_path)
    assert relayout(tmp_path).returncode == 0
    pkg = tmp_path / "src/jacmode"
    (pkg / E).mkdir()  # a branch merged later still adds to the old folder and imports from it
    (pkg / E / "codegen.py").write_text("from .program import Program\nfrom .taylor import seeds\n")
    (pkg / E / "helper.py").write_text("h = 1\n")
    (pkg / "_profile.py").write_text(f"from ._{E[1:]} import codegen, layerwise\nfrom ._{E[1:]}.helper import h\n")
    run = relayout(tmp_path, "--map", "helper=_autodiff")
    assert run.returncode == 0, run.stderr
    assert (pkg / "_capture/codegen.py").read_text() == "from .program import Program\nfrom .taylor import seeds\n"
    assert (pkg / "_autodiff/helper.py").exists() and not (pkg / E).exists()
    assert (pkg / "_profile.py").read_text() == (
        "from ._capture import codegen\nfrom ._probes import layerwise\nfrom ._autodiff.helper import h\n")
    assert "not tracked by git" in run.stdout
    assert relayout(tmp_path, "--check").returncode == 0


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_tools_merged_back_into_the_package_go_to_bench(tmp_path: Path) -> None:
    make_tree(tmp_path)
    files = {
        "src/jacmode/__init__.py": '__version__ = "0"\n',
        "src/jacmode/tools/__init__.py": '"""Tooling."""\n',
        "src/jacmode/tools/newbench.py": "from .. import __version__\nfrom .baselines import MLP\n"
                                         "from jacmode.tools.timing import median_ms\nv = (__version__, MLP, median_ms)\n",
        "bench/__init__.py": "", "bench/baselines.py": "MLP = 1\n", "bench/timing.py": "median_ms = 2\n",
        "bench/script.py": '"""Run: ``PYTHONPATH=src python bench/script.py``."""\nfrom jacmode.tools.baselines import MLP\n',
        "bench/alone.py": '"""Run: ``python bench/alone.py``."""\nimport torch\n',
        "tests/test_y.py": "from jacmode.tools.newbench import v\nfrom jacmode.tools import baselines\n",
        "docs/y.md": "Run `python -m jacmode.tools.newbench` or `python -m jacmode bench`.\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    run = relayout(tmp_path)
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "src/jacmode/tools").exists()
    assert (tmp_path / "bench/newbench.py").read_text().startswith(
        "from jacmode import __version__\nfrom .baselines import MLP\nfrom bench.timing import median_ms\n")
    assert (tmp_path / "tests/test_y.py").read_text() == "from bench.newbench import v\nfrom bench import baselines\n"
    assert (tmp_path / "docs/y.md").read_text() == "Run `python -m bench.newbench` or `python -m bench.bench`.\n"
    assert (tmp_path / "bench/script.py").read_text() == (
        '"""Run: ``PYTHONPATH=src python -m bench.script``."""\nfrom bench.baselines import MLP\n')
    assert (tmp_path / "bench/alone.py").read_text().startswith('"""Run: ``python bench/alone.py``."""')
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    out = subprocess.run([sys.executable, "-c", "import bench.newbench as n; print(n.v)"], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert out.stdout.strip() == "('0', 1, 2)", out.stderr
    assert relayout(tmp_path, "--check").returncode == 0
