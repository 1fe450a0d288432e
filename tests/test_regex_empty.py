"""``regex_empty.matches_nothing`` and ``json_pattern.json_pattern_empty`` against Python's
``re`` as the oracle: a pattern is empty when no string of up to four characters over a small
alphabet matches it (every non-empty pattern below has such a witness)."""

from __future__ import annotations

import itertools
import re

import pytest

from kvflow.structured.json_pattern import json_pattern_empty
from kvflow.structured.regex_empty import matches_nothing, regex_matches_nothing
from kvflow.structured.xgrammar_convert import regex_text

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


# regex constraints as kvflow hands them to xgrammar (classes negated, surrogates left out):
# (pattern, empty by Python's re over STRINGS, a surrogate-only class counted as empty)
CONSTRAINTS = [r"ab[^\s\S]", r"a|b[^\s\S]", r"x([^\s\S])?", r"[\ud800-\udfff]x",
               r"x[\ud800-\udfff]{0,2}", r".[^\W\w]", r"\d+[^\d\D]", r"[ab]{1,3}x"]


@pytest.mark.parametrize("pattern", CONSTRAINTS)
def test_regex_constraint_empty_agrees_with_re(pattern):
    """``regex_matches_nothing`` on ``regex_text``'s output against ``re`` (a class of
    surrogates alone holds nothing a UTF-8 reply can hold: ``re`` sees it empty over
    STRINGS too, which hold none). xgrammar reads ``[]`` as an empty class, ``re`` does not
    parse it: checked by hand (below)."""
    assert regex_matches_nothing(regex_text(pattern)) == _oracle_empty(pattern)
    assert _oracle_empty(pattern) == (pattern in (r"ab[^\s\S]", r"[\ud800-\udfff]x",
                                                  r".[^\W\w]", r"\d+[^\d\D]"))


def test_regex_constraint_with_an_empty_bracket_class_is_empty():
    assert regex_matches_nothing(regex_text("ab[]c")) is True
    assert regex_matches_nothing(regex_text("ab[]]")) is True  # "[]" then a literal "]"
    assert regex_matches_nothing(regex_text("ab[^]]")) is False
