r"""A ``regex`` constraint's character classes written negated (``regex_classes``), the form
xgrammar (0.2.9) repeats cheaply, as a JSON-schema pattern's are: the strings a constraint
takes are ``re.fullmatch``'s (the oracle, with ``re.ASCII``: xgrammar's ``\d`` and ``\w`` are
ASCII; no non-ASCII space is drawn), and ``[a-z]{1,300}\d`` compiles to the few rules its
JSON-schema pattern does, where xgrammar wrote 130 nested rules for the positive class."""

from __future__ import annotations

import random
import re

import pytest
import xgrammar as xgr

from kvflow.structured import StructuredOutputsParams
from kvflow.structured.regex_classes import negated_regex


@pytest.fixture(scope="module")
def backend(tiny_llama):
    from transformers import AutoTokenizer

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    return XgrammarBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id)


REGEXES = [r"[a-z]{1,30}\d", r"[^a-z]{0,8}[a-z]", r"\w{2,6}\s\d+", r"[\d\-x]{1,5}\]?",
           r"[a\]z-]{1,4}", r"[!-\-]+[-a]", r"[é-ÿ]{1,3}[^\u00e9]", "[😀-🙏]x",
           r"^.{1,5}$", r"\D\W\S", r"[^\d\s]{1,4}", r"a|[b-d]{2}|\.", r"[\x41-\x43\t]*\n",
           r"[^\]^]{2}", r"(?:[A-Z][a-z]{0,3}){1,3}"]
# ASCII letters, digits, punctuation the classes name, whitespace, non-ASCII letters inside
# and outside [é-ÿ], an emoji inside the range and one outside it
_ALPHABET = "abczAKZ059_-]^!,.\\ \t\néÿĀ😀🙏🚀"
_EDGES = ["", "a", "a1", "z9", "ab cd 12", "ab\t1", "-", "]", "x]", "a]z-", "!-,a", "éÿ",
          "x", "😀x", "🙏x", "🚀x", "\n", "abcde", "abcdef", "a\nb", "é!é", "\t\n", "AB\t\n",
          "]]", "^^", "Ab", "AbcdEfgh", "AbcdeF", ".", "bd", "a.", "9 ", "Z_a"]


def _strings(seed: int, count: int = 250) -> list[str]:
    """:data:`_EDGES` and ``count`` random strings over :data:`_ALPHABET` of 0 to 8
    characters."""
    rng = random.Random(seed)
    return _EDGES + ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 8)))
                     for _ in range(count)]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_takes_re_fullmatchs_strings(backend, regex):
    """Classes, negated classes, ``\\d \\w \\s \\D \\W \\S``, ``-`` and ``]`` inside a class,
    unicode ranges (astral too), anchors and ``.`` (no newline): the constraint takes a
    string exactly when ``re.fullmatch`` does."""
    compiled = backend.compile(StructuredOutputsParams(regex=regex))
    oracle = re.compile(regex, re.ASCII)
    for value in _strings(seed=len(regex)):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        got = matcher.accept_string(value.encode()) and matcher.is_terminated()
        assert got == (oracle.fullmatch(value) is not None), (regex, value)


@pytest.mark.parametrize("regex, written", [
    ("[a-z]", r"[^\u0000-\u0060\u007B-\u{10FFFF}]"),
    ("[^a]x", r"[^\u0061\uD800-\uDFFF]x"),
    (r"\d+", r"[^\u0000-\u002F\u003A-\u{10FFFF}]+"),
    (r"[\]-]", r"[^\u0000-\u002C\u002E-\u005C\u005E-\u{10FFFF}]"),
    (r"\.\n\u{41}", r"\.\n\u{41}"),  # literals and escapes as written
    (r"[\p{L}]", r"[\p{L}]"),  # an escape not read here: the class as written
    ("[]", r"[^\u0000-\u{10FFFF}]")])  # xgrammar's empty class: no character
def test_negated_regex_writes_classes_negated(regex, written):
    """Each class as the negated class of what it does not match, surrogates included
    (hand-written expectations)."""
    assert negated_regex(regex) == written


def test_counted_class_compiles_to_the_json_patterns_rules(backend):
    """``[a-z]{1,300}\\d`` as a regex: xgrammar wrote the positive class's count before
    ``\\d`` as 130 nested rules (1.6 s to compile for a 49k vocabulary); written negated it
    is the JSON-schema pattern's grammar (``utf8_grammar._pattern_rules``: one negated class
    counted before each digit), 0.1 s."""
    from kvflow.structured.utf8_grammar import _pattern_rules

    compiled = backend.compile(StructuredOutputsParams(regex=r"[a-z]{1,300}\d"))
    text = str(compiled.grammar)
    assert text.count("::=") < 40
    assert "::= (([^\\0-`{-\\U0010ffff]))" in text
    json_rules = xgr.Grammar.from_ebnf(_pattern_rules(r"^[a-z]{1,300}\d$", ""))
    assert text == str(backend._compiler.compile_grammar(json_rules).grammar)
