"""``regex_empty.matches_nothing`` and ``json_pattern.json_pattern_empty`` against Python's
``re`` as the oracle: a pattern is empty when no string of up to four characters over a small
alphabet matches it (every non-empty pattern below has such a witness)."""

from __future__ import annotations

import itertools
import re

import pytest

from kvflow.structured.json_pattern import json_pattern_empty
from kvflow.structured.regex_empty import matches_nothing

ALPHABET = "abx1 \x01"
STRINGS = ["".join(chars) for n in range(5) for chars in itertools.product(ALPHABET, repeat=n)]
PATTERNS = [
    r"^a[^\s\S]b$", r"[^\s\S]", r"a|[^\s\S]", r"([^\s\S])?x", r"[^\s\S]*", r"(?:a[^\s\S])",
    r"(?=a)a", r"(?P<n>[^\s\S])", r"\d+", r"[a-z]{1,300}\d", r"[^\s\S]{0,3}", r"[^\s\S]{2}",
    r"(a|b[^\s\S])x", r"(a[^\s\S]|b[^\s\S])x", r"[^\s\S]+?", r".{1,300}\d", r"[^\W\w]b",
    r"a(b|(x[^\d\D])){1,2}", r"a(b|(x[^\d\D])){2}", r"^[ab]+$",
]


def _oracle_empty(pattern: str) -> bool:
    compiled = re.compile(pattern)
    return not any(compiled.search(text) for text in STRINGS)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_nothing_agrees_with_re(pattern):
    ours = matches_nothing(pattern.replace("(?P<", "(?<"), lambda ranges: not ranges)
    assert ours == _oracle_empty(pattern)


def test_json_pattern_class_of_control_characters_is_empty():
    """A class of control characters other than JSON's escapes matches nothing in a JSON
    string as ``json_pattern`` writes it; the same character outside a class does."""
    assert json_pattern_empty(r"a[\x01]") is True
    assert json_pattern_empty(r"a\x01") is False
    assert json_pattern_empty(r"a[\n\x01]") is False  # \n: JSON's escape \n
    assert json_pattern_empty(r"[^\s\S]|ok") is False
