"""README examples whose output the README quotes print that output.

The n-gram speculation example of "Command line" runs as written (the packaged
SmolLM2-135M-Instruct, ``"adaptive": false`` so the counts do not follow step times) and prints
the ``[speculative: ...]`` line README shows. Oracle: README's own text; the counts are fixed by
the greedy tokens alone (the n-gram proposer reads only them).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvflow.entrypoints.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _speculation_example() -> tuple[list[str], str]:
    """(argv after ``kvflow``, the quoted ``[speculative: ...]`` line) of README's example."""
    text = README.read_text()
    command = re.search(r"^kvflow generate [^\n]*\"1, 2, 3,.*?--speculative-config '[^']*'$",
                        text, re.MULTILINE | re.DOTALL).group(0)
    quoted = re.search(r"^# (\[speculative: [^\]]*\])$", text[text.index(command):],
                       re.MULTILINE).group(1)
    return shlex.split(command.replace("\\\n", " "))[1:], quoted


@pytest.mark.slow  # loads the packaged model: ~12 s of CPU
def test_the_readme_speculation_example_prints_the_quoted_counts(capsys):
    argv, quoted = _speculation_example()
    assert '"adaptive": false' in argv[-1] and "--verbose" in argv
    assert main(argv) == 0
    out = capsys.readouterr()
    assert quoted in (out.out + out.err).splitlines()
