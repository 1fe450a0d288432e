"""The benchmark and helper scripts import only names that exist.

``benchmarks/*.py`` and ``scripts/*.py`` are not run by the suite (they take minutes and
peers), so a rename in ``kvflow`` or ``tests`` used to break one silently until someone ran it
(``combo_fuzz_server.py`` imported ``TINY_CHAT_TEMPLATE`` from ``tests/e2e/conftest.py`` for a
session after it moved to ``tests/conftest.py``). Each ``from kvflow... import name`` /
``from tests... import name`` in them, at any depth, is checked against the source of the
module it names: the name must be bound at that module's top level (a def, class,
assignment or import, also inside a top-level ``if`` / ``try``) or be a submodule. Read from
the files' syntax trees, so nothing is executed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])
CHECKED_PACKAGES = ("kvflow", "tests")


def module_file(module: str) -> Path | None:
    """The source file of a dotted module of this repository (a package's ``__init__.py``;
    the folder of a namespace package such as ``tests``), or None when there is none."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return path if path.is_dir() else None


def _bound_in(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                names |= _bound_in(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                names |= _bound_in(handler.body)
    return names


def top_level_names(path: Path) -> set[str] | None:
    """Names bound at the top level of the module in ``path``; None when the module can bind
    any name (``from x import *`` or a module ``__getattr__``); a namespace package's folder
    binds none (its names are submodules)."""
    if path.is_dir():
        return set()
    tree = ast.parse(path.read_text(), filename=str(path))
    if any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
           for n in tree.body):
        return None
    names = _bound_in(tree.body)
    return None if "__getattr__" in names else names


def missing_imports(script: Path) -> list[str]:
    """``module.name`` for every name ``script`` imports from this repository's packages
    that the module does not bind (nor has as a submodule), and ``module`` for a module
    that does not exist."""
    missing = []
    for node in ast.walk(ast.parse(script.read_text(), filename=str(script))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
            missing += [m for m in modules if m.split(".")[0] in CHECKED_PACKAGES
                        and module_file(m) is None]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in CHECKED_PACKAGES:
            source = module_file(node.module)
            if source is None:
                missing.append(node.module)
                continue
            names = top_level_names(source)
            for alias in node.names:
                submodule = module_file(f"{node.module}.{alias.name}")
                if names is not None and alias.name not in names and submodule is None:
                    missing.append(f"{node.module}.{alias.name}")
    return missing


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_imports_exist(script: Path) -> None:
    assert missing_imports(script) == []


def test_the_check_finds_a_moved_name(tmp_path: Path) -> None:
    """The check itself: the import that broke combo_fuzz_server.py, an existing one, a
    submodule, a missing module, and a name bound only inside a top-level ``try``."""
    script = tmp_path / "s.py"
    script.write_text("def f():\n"
                      "    from tests.e2e.conftest import TINY_CHAT_TEMPLATE, ServerProcess\n"
                      "from tests.conftest import TINY_CHAT_TEMPLATE\n"
                      "from kvflow import config\n"
                      "import kvflow.no_such_module\n"
                      "from kvflow.runtime.gc_heap import freeze_startup_heap, no_such_name\n")
    assert sorted(missing_imports(script)) == ["kvflow.no_such_module",
                                               "kvflow.runtime.gc_heap.no_such_name",
                                               "tests.e2e.conftest.TINY_CHAT_TEMPLATE"]
    module = tmp_path / "m.py"
    module.write_text("try:\n    import numpy as np\nexcept ImportError:\n    fast = None\n")
    assert top_level_names(module) == {"np", "fast"}
