#!/usr/bin/env python3
"""Split ``src/jacmode/_engines/`` into one folder per route, and rewrite every import of it.

The layout of design.md ("The next layout"): the engines live in one folder per route,

    _autodiff/   the generic engines over torch.func: forward and reverse (vmap over jvp / vjp, mirror
                 images), nested and directional forward mode, loops and fallbacks
    _capture/    captured programs: capture, bound tensors, the Program and its check, Taylor mode over
                 it (taylor, collapsed), generated and compiled code
    _probes/     layer-wise probes: probes, layerwise, layer I/O, and the per-sample-gradient / GGN /
                 NTK engines built on them

next to ``_sparse/``, ``_rules/``, ``_planning/`` and ``_streams/``, which stay. Run from anywhere:

    python dev/relayout.py              # git mv the modules, rewrite the imports, report what is left
    python dev/relayout.py --dry-run    # say what it would do; change nothing
    python dev/relayout.py --check      # exit 1 if anything is still to do (after a merge, say)
    python dev/relayout.py --map profile=_capture   # where an unknown _engines/*.py goes

What it does:

1. Moves each ``_engines/NAME.py`` (``git mv``) to the folder that ``TABLE`` names. A module the table
   does not know goes where most of its relative imports of other engines point (``_autodiff`` when
   none do), and the script says so: check it, and re-run with ``--map NAME=FOLDER`` to choose.
   Sub-folders of ``_engines/`` are left where they are, with a warning. ``_engines/`` goes when
   nothing but its ``__init__.py`` is left.
2. Rewrites the imports of every Python file under src/, tests/, bench/, asv_benchmarks/, examples/,
   dev/ and docs/, parsed with ``ast``: absolute (``jacmode._engines.x``) and relative
   (``from ._engines import x``, ``from .._engines.x import y``), and the relative imports inside
   the moved modules (``from . import taylor``, ``from .capture import Program``), which are
   resolved against the module's old place and written relative to its new one; a
   ``from ... import a, b`` whose names now live in two folders becomes two statements.
3. Rewrites the dotted names and paths in all text (docstrings, comments, monkeypatch targets,
   mkdocstrings identifiers ``::: jacmode._engines.x``, ``_engines/x.py`` in the docs, README.md,
   mkdocs.yml, pyproject.toml), and lists every ``_engines`` it could not rewrite.

It is idempotent: on a tree already laid out it moves nothing and rewrites only what a later merge
brought in (modules found in the new folders are located by where they are).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "jacmode"
OLD = "_engines"
TOOLS = "tools"  # src/jacmode/tools/ -> bench/ (the tooling left the package; a merge may bring files back)

# module -> the folder it belongs in. Known modules of the merged tree, and those other branches were
# adding (codegen, compiled: generated code for captured programs and its torch.compile wrapper).
TABLE: dict[str, str] = {
    # vmap over torch.func transforms, and the slow-but-sure paths
    "forward": "_autodiff",
    "reverse": "_autodiff",
    "nested": "_autodiff",
    "directional": "_autodiff",
    "loops": "_autodiff",
    "fallback": "_autodiff",
    # captured torch.fx programs and Taylor mode over them
    "capture": "_capture",
    "bound": "_capture",
    "program": "_capture",
    "taylor": "_capture",
    "collapsed": "_capture",  # collapsed Taylor mode over a captured Program (imports capture, taylor)
    "codegen": "_capture",
    "compiled": "_capture",
    "compile": "_capture",
    "generated": "_capture",
    # hooks with zero probes and per-module rules, and the products built on their per-layer records
    "probes": "_probes",
    "layerwise": "_probes",
    "layerio": "_probes",
    "products": "_probes",  # per-sample gradients and GGN: per layer via layerio, generic for the rest
    "ntk": "_probes",  # structured NTK via layerio; contraction / products methods next to it
    "traceable": "_autodiff",  # the operators in plain torch.func, inside a user's torch.compile
}

DOCS: dict[str, str] = {
    "_autodiff": (
        "The generic engines over torch.func: forward (vmap over jvp) and reverse (vmap over vjp), mirror\n"
        "images; nested and directional forward mode for any f; loops and fallbacks for functions that\n"
        "defeat vmap or forward mode."
    ),
    "_capture": (
        "Captured programs: the torch.fx graph of f and the tensors it reads per call (capture, bound), the\n"
        "Program that runs it and its check against f, Taylor mode over it (taylor, collapsed), and the\n"
        "generated and compiled code made from it."
    ),
    "_probes": (
        "Layer-wise probes: per-sample parameter Jacobians from forward hooks with zero probes and\n"
        "per-module rules (probes, layerwise), per-layer reductions of their records (layerio), and the\n"
        "per-sample-gradient, GGN and NTK engines built on them."
    ),
}

PY_DIRS = ["src", "tests", "bench", "asv_benchmarks", "examples", "docs"]  # not dev/: it names _engines on purpose
TEXT_FILES = ["README.md", "mkdocs.yml", "pyproject.toml", "Makefile"]
TEXT_EXT = {".py", ".md", ".yml", ".yaml", ".toml", ".txt", ".cfg", ".ini", ".json", ".rst"}
SKIP_DIRS = {".git", ".venv", "__pycache__", "site", "node_modules", ".mypy_cache", ".pytest_cache",
             ".hypothesis", "results", "html", "env"}


def set_root(root: Path) -> None:
    """Work on the repository at ``root`` (tests run the script on a small tree of their own)."""
    global ROOT, SRC, PKG
    ROOT = root.resolve()
    SRC = ROOT / "src"
    PKG = SRC / "jacmode"


def log(msg: str) -> None:
    print(f"relayout: {msg}")


# ---------------------------------------------------------------------------------------------------
# where modules go


def tracked(path: Path) -> bool:
    out = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=ROOT, capture_output=True)
    return out.returncode == 0


def relative_engine_imports(path: Path) -> list[str]:
    """The engines a module under _engines/ imports relatively (``from .x``, ``from . import x``)."""
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.append(node.module.split(".")[0])
            else:
                found.extend(a.name for a in node.names)
    return found


def plan_moves(overrides: dict[str, str]) -> tuple[dict[str, str], list[tuple[Path, Path]]]:
    """(location of every engine module: name -> folder, the moves to make: (old path, new path))."""
    location: dict[str, str] = {}
    for folder in sorted(set(TABLE.values()) | set(overrides.values())):
        d = PKG / folder
        if d.is_dir():
            for f in d.glob("*.py"):
                if f.name != "__init__.py":
                    location[f.stem] = folder
    moves: list[tuple[Path, Path]] = []
    old = PKG / OLD
    if not old.is_dir():
        return {**TABLE, **location, **overrides}, moves
    names = sorted(f.stem for f in old.glob("*.py") if f.name != "__init__.py")
    for sub in sorted(p for p in old.iterdir() if p.is_dir() and p.name != "__pycache__"):
        log(f"WARNING: {sub.relative_to(ROOT)}/ is a folder; left where it is (move it by hand)")
    unknown: list[str] = []
    for name in names:
        known = overrides.get(name) or TABLE.get(name)
        if known is None:
            unknown.append(name)
            continue
        location[name] = known
    for name in unknown:  # after the known ones, so that their votes can count
        votes = Counter(f for f in (location.get(n) or TABLE.get(n) for n in relative_engine_imports(old / f"{name}.py"))
                        if f is not None)
        folder = votes.most_common(1)[0][0] if votes else "_autodiff"
        location[name] = folder
        log(f"NOTE: _engines/{name}.py is not in the table; it goes to {folder}/ (its relative imports: "
            f"{dict(votes) or 'none of the engines'}); re-run with --map {name}=FOLDER to choose")
    for name in names:
        target = PKG / location[name] / f"{name}.py"
        if target.exists():
            raise SystemExit(f"relayout: {target.relative_to(ROOT)} exists already; move _engines/{name}.py by hand")
        moves.append((old / f"{name}.py", target))
    return {**TABLE, **location}, moves


def plan_tool_moves() -> list[tuple[Path, Path]]:
    """src/jacmode/tools/NAME.py -> bench/NAME.py (a branch merged after the tooling left the package)."""
    tools = PKG / TOOLS
    if not tools.is_dir():
        return []
    moves = []
    for f in sorted(tools.glob("*.py")):
        if f.name == "__init__.py":
            continue
        target = ROOT / "bench" / f.name
        if target.exists():
            log(f"WARNING: {f.relative_to(ROOT)} and {target.relative_to(ROOT)} both exist; merge them by hand")
            continue
        moves.append((f, target))
    return moves


def move(old: Path, new: Path, dry: bool) -> None:
    log(f"move {old.relative_to(ROOT)} -> {new.relative_to(ROOT)}")
    if dry:
        return
    new.parent.mkdir(parents=True, exist_ok=True)
    if tracked(old):
        subprocess.run(["git", "mv", str(old), str(new)], cwd=ROOT, check=True)
    else:
        shutil.move(str(old), str(new))
        log(f"  (not tracked by git: moved, not git-mv'ed; `git add {new.relative_to(ROOT)}`)")


def remove_if_empty(folder: Path) -> None:
    left = [p for p in folder.iterdir() if p.name not in ("__init__.py", "__pycache__")]
    if left:
        log(f"WARNING: {folder.relative_to(ROOT)}/ still holds {[p.name for p in left]}; kept")
        return
    init = folder / "__init__.py"
    if init.exists():
        body = ast.parse(init.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring
        if [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]:
            log(f"WARNING: {init.relative_to(ROOT)} held code (re-exports?), removed with the folder:\n"
                + init.read_text())
        if tracked(init):
            subprocess.run(["git", "rm", "-q", "-f", str(init)], cwd=ROOT, check=True)
        else:
            init.unlink()
    shutil.rmtree(folder, ignore_errors=True)
    log(f"removed {folder.relative_to(ROOT)}/")


def apply_moves(moves: list[tuple[Path, Path]], dry: bool) -> None:
    for folder in sorted({new.parent for _, new in moves}):
        init = folder / "__init__.py"
        if not init.exists():
            log(f"create {init.relative_to(ROOT)}")
            if not dry:
                folder.mkdir(exist_ok=True)
                init.write_text(f'"""{DOCS.get(folder.name, "Engines.")}\n"""\n')
                subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
    for old, new in moves:
        move(old, new, dry)
    if (PKG / OLD).is_dir() and not dry:
        remove_if_empty(PKG / OLD)


# ---------------------------------------------------------------------------------------------------
# import rewriting


def package_of(path: Path) -> Optional[list[str]]:
    """The package a file under src/ or bench/ lives in (its own name for an __init__.py), None elsewhere."""
    for base, prefix in ((SRC, []), (ROOT / "bench", ["bench"])):
        try:
            rel = path.relative_to(base)
        except ValueError:
            continue
        return prefix + list(rel.with_suffix("").parts)[:-1]
    return None


def relocate(parts: list[str], location: dict[str, str]) -> list[str]:
    """jacmode._engines.NAME[.rest] -> jacmode.FOLDER.NAME[.rest], jacmode.tools[.rest] -> bench[.rest]."""
    if parts[:2] == ["jacmode", TOOLS]:
        return ["bench", *parts[2:]]
    if len(parts) >= 3 and parts[:2] == ["jacmode", OLD] and parts[2] in location:
        return ["jacmode", location[parts[2]], *parts[2:]]
    return parts


def relative(from_pkg: list[str], target: list[str]) -> str:
    """The relative module name (dots and rest) of target as seen from package from_pkg."""
    common = 0
    while common < min(len(from_pkg), len(target)) and from_pkg[common] == target[common]:
        common += 1
    if common == 0:
        return ".".join(target)
    return "." * (len(from_pkg) - common + 1) + ".".join(target[common:])


def alias_text(a: ast.alias) -> str:
    return a.name if a.asname is None else f"{a.name} as {a.asname}"


def rewrite_python(text: str, path: Path, old_pkg: Optional[list[str]], new_pkg: Optional[list[str]],
                   location: dict[str, str], problems: list[str]) -> str:
    """The file's imports rewritten; old_pkg / new_pkg: its package before and after the move."""
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        problems.append(f"{path.relative_to(ROOT)}: not parsed ({err.msg}); text rewriting only")
        return text
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def pos(lineno: int, col: int) -> int:  # ast columns are utf-8 byte offsets
        line = lines[lineno - 1]
        return offsets[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if old_pkg is None or new_pkg is None:
                continue
            base = old_pkg[: len(old_pkg) - (node.level - 1)]
            module = base + (node.module.split(".") if node.module else [])
        else:
            module = (node.module or "").split(".")
        if module[:2] not in (["jacmode", OLD], ["jacmode", TOOLS]) and (node.level == 0 or old_pkg == new_pkg):
            continue  # nothing of _engines or tools, and a relative import that did not move
        groups: dict[tuple[str, ...], list[ast.alias]] = {}
        if module == ["jacmode", OLD]:  # from jacmode._engines import a, b: by where each name went
            for a in node.names:
                target = ["jacmode", location[a.name]] if a.name in location else module
                if a.name not in location:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: `{a.name}` of jacmode._engines "
                                    "is not a module the script knows; left")
                groups.setdefault(tuple(target), []).append(a)
        else:
            groups[tuple(relocate(module, location))] = list(node.names)

        def spell(target: list[str]) -> str:
            if node.level and new_pkg is not None:
                return relative(new_pkg, target)
            return ".".join(target)

        start, end = pos(node.lineno, node.col_offset), pos(node.end_lineno or node.lineno, node.end_col_offset or 0)
        old_text = text[start:end]
        if len(groups) == 1:
            (only,) = groups
            new_text = re.sub(r"^from\s+[.\w]+", "from " + spell(list(only)), old_text, count=1)
        else:
            indent = " " * node.col_offset
            new_text = ("\n" + indent).join(
                f"from {spell(list(t))} import {', '.join(alias_text(a) for a in names)}" for t, names in groups.items())
        if new_text != old_text:
            edits.append((start, end, new_text))
    for start, end, new_text in sorted(edits, reverse=True):
        text = text[:start] + new_text + text[end:]
    return text


def packaged_bench_modules() -> set[str]:
    """bench/NAME.py that import the bench package (or jacmode.tools): they run as ``python -m bench.NAME``."""
    names = set()
    for f in (ROOT / "bench").glob("*.py"):
        if re.search(r"^\s*(from|import)\s+(bench\b|jacmode\.tools\b|\.)", f.read_text(), flags=re.M):
            names.add(f.stem)
    return names


PACKAGED: set[str] = set()  # filled by main: packaged_bench_modules()


def rewrite_text(text: str, location: dict[str, str], path: Optional[Path] = None) -> str:
    """Dotted names and paths of the old folders in any text: docstrings, docs, config, strings."""
    text = re.sub(r"python bench/(\w+)\.py", lambda m: f"python -m bench.{m.group(1)}" if m.group(1) in PACKAGED
                  else m.group(0), text)
    text = re.sub(r"from jacmode\.tools import", "from bench import", text)
    text = re.sub(r"(?<![\w.])jacmode\.tools\.", "bench.", text)
    text = re.sub(r"(?<![\w.])jacmode/tools/(?=\w+\.py)", "bench/", text)
    if path is None or path.name != "__main__.py":  # which says where the commands went
        text = re.sub(r"python -m jacmode (bench|demo)\b", r"python -m bench.\1", text)

    def dotted(m: re.Match) -> str:
        return f"{location[m.group(1)]}.{m.group(1)}" if m.group(1) in location else m.group(0)

    def slashed(m: re.Match) -> str:
        return f"{location[m.group(1)]}/{m.group(1)}" if m.group(1) in location else m.group(0)

    def from_import(m: re.Match) -> str:  # >>> from jacmode._engines import capture (doctests, docs)
        names = [n.strip() for n in m.group(2).split(",")]
        folders = {location.get(n.split(" as ")[0].strip()) for n in names}
        if len(folders) == 1 and None not in folders:
            return f"{m.group(1)}from jacmode.{folders.pop()} import {m.group(2)}"
        return m.group(0)

    text = re.sub(r"^(.*?)from jacmode\._engines import ([\w, ]+?)[ \t]*$", from_import, text, flags=re.M)
    text = re.sub(r"(?<!\w)_engines\.(\w+)", dotted, text)
    text = re.sub(r"(?<!\w)_engines/(\w+)(?=\.py|\b)", slashed, text)
    return text


def files_to_scan() -> list[Path]:
    out: list[Path] = []
    for d in PY_DIRS:
        base = ROOT / d
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [n for n in dirnames if n not in SKIP_DIRS and not n.startswith(".")]
            for name in filenames:
                p = Path(dirpath) / name
                if p.suffix in TEXT_EXT:
                    out.append(p)
    out += [ROOT / f for f in TEXT_FILES if (ROOT / f).is_file()]
    return sorted(set(out))


def rewrite_all(location: dict[str, str], moved: dict[Path, tuple[list[str], list[str]]],
                dry: bool) -> tuple[list[Path], list[str]]:
    """Rewrite every file; moved: file as it lies now -> (its package before the move, after)."""
    changed: list[Path] = []
    problems: list[str] = []
    for path in files_to_scan():
        if path.resolve() == Path(__file__).resolve():
            continue  # this script names the old folder on purpose
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        new = text
        if path.suffix == ".py":
            old_pkg, new_pkg = moved.get(path, (package_of(path), package_of(path)))
            new = rewrite_python(new, path, old_pkg, new_pkg, location, problems)
        new = rewrite_text(new, location, path)
        if new != text:
            changed.append(path)
            if not dry:
                path.write_text(new)
    return changed, problems


def leftovers() -> list[str]:
    found = []
    for path in files_to_scan():
        if path.resolve() == Path(__file__).resolve() or path.name == "__main__.py":
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if re.search(r"(?<!\w)_engines(?!\w)|jacmode[./]tools\b|python -m jacmode (bench|demo)", line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:110]}")
    return found


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python dev/relayout.py", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="say what would change; change nothing")
    parser.add_argument("--check", action="store_true", help="exit 1 if anything is still to move or rewrite")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: the one holding dev/)")
    parser.add_argument("--map", action="append", default=[], metavar="NAME=FOLDER",
                        help="where _engines/NAME.py goes (e.g. profile=_capture); repeatable")
    args = parser.parse_args(argv)
    set_root(args.root)
    overrides = {}
    for item in args.map:
        name, _, folder = item.partition("=")
        if not folder.startswith("_") or not name:
            parser.error(f"--map expects NAME=_FOLDER, got {item!r}")
        overrides[name.removesuffix(".py")] = folder
    dry = args.dry_run or args.check
    location, moves = plan_moves(overrides)
    tool_moves = plan_tool_moves()
    PACKAGED.update(packaged_bench_modules() | {old.stem for old, _ in tool_moves})
    apply_moves(moves, dry)
    moved = {(old if dry else new): (["jacmode", OLD], ["jacmode", new.parent.name]) for old, new in moves}
    for old, new in tool_moves:
        move(old, new, dry)
        moved[old if dry else new] = (["jacmode", TOOLS], ["bench"])
    if (PKG / TOOLS).is_dir() and not dry:
        remove_if_empty(PKG / TOOLS)
    moves = moves + tool_moves
    changed, problems = rewrite_all(location, moved, dry)
    for path in changed:
        log(f"{'would rewrite' if dry else 'rewrote'} {path.relative_to(ROOT)}")
    for p in problems:
        log(f"WARNING: {p}")
    rest = [] if dry else leftovers()
    if rest:
        log(f"{len(rest)} mention(s) of _engines or jacmode.tools left to read by hand (prose, trees):")
        for line in rest:
            print("    " + line)
    todo = bool(moves or changed)
    log(("nothing to do: the tree has the new layout" if not todo else
         f"{len(moves)} module(s) to move, {len(changed)} file(s) to rewrite" if dry else
         f"moved {len(moves)} module(s), rewrote {len(changed)} file(s); now run the tests, mypy and mkdocs"))
    return 1 if (args.check and todo) else 0


if __name__ == "__main__":
    sys.exit(main())
