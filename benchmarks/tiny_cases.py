"""What the check scripts on the test suite's tiny models share (``worker_faults.py``,
``server_signals.py``, ``parallel_consistency.py``, ``dp_serve_check.py``; imported as
``python benchmarks/<name>.py`` puts this folder on ``sys.path``): a tiny model saved to a
folder, and the case names given on the command line."""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from collections.abc import Iterable


def build_model(folder: str, name: str = "llama") -> str:
    """The test suite's tiny model ``name`` (tests/conftest.py: its tokenizer, weights seeded
    by the name's CRC-32), saved under ``folder/name`` unless it is there already; returns
    that path. Run from the repository root (``tests`` is imported from there)."""
    sys.path.insert(0, os.getcwd())
    from tests import conftest

    path = os.path.join(folder, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        tokenizer = conftest.tiny_tokenizer.__wrapped__()
        conftest.build_tiny_model(name, path, tokenizer, zlib.crc32(name.encode()))
    return path


def parse_cases(doc: str, cases: Iterable[str]) -> list[str]:
    """The case names given on the command line (all of ``cases`` when none); an unknown name
    exits 2 naming the known ones. ``doc``: the script's docstring (its first paragraph is
    the help text)."""
    cases = list(cases)
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(cases)} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(cases))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(cases)}")
    return args.cases or cases
