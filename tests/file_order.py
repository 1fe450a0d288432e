"""The order in which ``pytest -n 2`` hands out test files: costliest first.

pytest-xdist's ``--dist loadfile`` gives each worker a whole file at a time, in the order the
workers collected them (with ``--no-loadscope-reorder``, pyproject's addopts; xdist otherwise
sorts files by their number of tests, which put the few-test, many-second files last: one
worker ran the last of them alone while the other idled). Handing out the costliest files
first (the "longest processing time first" rule of list scheduling, Graham 1969) leaves only
short files for the end, so the two workers finish close together. The costs are the seconds
a file took (set-up, calls and teardown, one worker) in a measured run, kept in
``tests/file_costs.txt`` (``scripts/file_costs.py`` writes it from a run's
``--durations=0 -vv`` output).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COSTS_PATH = Path(__file__).with_name("file_costs.txt")
# The cost of a file the table does not list (a new one): about the median listed file's calls.
DEFAULT_COST_S = 1.0


def read_costs(path: Path = COSTS_PATH) -> dict[str, float]:
    """``{test file's path relative to the repository root: seconds}`` from ``path``'s
    ``seconds path`` lines (``#`` starts a comment line). {} when the file is missing.
    Raises ValueError naming the line when one is not ``seconds path``."""
    if not path.exists():
        return {}
    costs = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            costs[parts[1]] = float(parts[0])
        except ValueError:
            raise ValueError(f"{path}:{number}: expected 'seconds path', got {line!r}") from None
    return costs


def costliest_files_first(items: Sequence[Any], costs: dict[str, float],
                          default: float = DEFAULT_COST_S) -> list[Any]:
    """``items`` (pytest items, or anything with a ``nodeid``) reordered by file: the files
    by descending cost (``costs[path]``, ``default`` where not listed; ties keep their
    collection order), each file's items together and in their own order. The file of an item
    is its node id up to the first ``::`` (as xdist's ``--dist loadfile`` groups them)."""
    files: dict[str, list[Any]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files, key=lambda name: -costs.get(name, default))  # stable: ties kept
    return [item for name in order for item in files[name]]
