"""Public functions that raise say so: every public function or method whose body raises an
exception has a ``Raises:`` section (or names the raise) in its docstring."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvflow"


def _own_raises(fn: ast.AST) -> list[ast.Raise]:
    """``raise X`` statements of ``fn`` itself (not of nested functions; bare re-raises skipped)."""
    found, stack = [], list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Raise) and node.exc is not None:
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def undocumented_raisers(source: str) -> list[str]:
    out = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("_") or not _own_raises(node):
            continue
        doc = ast.get_docstring(node) or ""
        if "raise" not in doc.lower():
            out.append(f"{node.name} (line {node.lineno})")
    return out


def test_public_functions_that_raise_document_it():
    missing = {str(p.relative_to(ROOT.parent)): bad for p in sorted(ROOT.rglob("*.py"))
               if (bad := undocumented_raisers(p.read_text()))}
    assert not missing, f"add a Raises: section to {missing}"


def test_the_check_catches_an_undocumented_raise():
    src = ('def f(x):\n    """Doc."""\n    raise ValueError(x)\n'
           'def g(x):\n    """Doc.\n\n    Raises:\n        ValueError: always.\n    """\n'
           '    raise ValueError(x)\n'
           'def h():\n    def _inner():\n        raise KeyError\n    return _inner\n'
           'def _private():\n    raise ValueError\n')
    assert undocumented_raisers(src) == ["f (line 1)"]
