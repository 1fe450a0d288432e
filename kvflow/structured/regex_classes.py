r"""Each character class of a regex written as a negated class of explicit ranges, the form
xgrammar (0.2.9) repeats cheaply; shared by JSON-schema ``pattern`` strings (``json_pattern``)
and ``regex`` constraints (:func:`negated_regex`).

xgrammar compiles a counted positive class in time growing with the count and fills its
masks slowly: ``[a-z]{1,100}`` before a JSON string's closing quote compiled in 0.8 s for a
49k vocabulary, written ``[^\0-`{-\U0010ffff]`` in 0.01 s; ``.{1,100}`` in 3.6 s against 0.01 s, its masks 0.9 ms
against 0.05 ms a token; a ``regex`` constraint ``[a-z]{1,300}\d`` 0.8-1.6 s against
0.06-0.1 s once its count is followed by literal alternatives (``utf8_grammar.regex_grammar``;
``benchmarks/pattern_counts.py``). :func:`rewrite_classes` reads each class (``[...]``,
``[^...]``, ``.``, ``\d`` ... ``\S``) as code point ranges and hands them to a writer of the
caller's: ``json_pattern`` keeps only what a JSON string holds raw, :func:`negated_regex`
every character but the UTF-16 surrogates. Written negated, a count with nothing after it
(at a regex's end) gains nothing reliable; past 128 ``utf8_grammar.regex_grammar`` writes it
as shared blocks (``docs/benchmarks.md``). A class holding an escape not read here
(``\p{L}``, ``\b``) is left as written, as is an unterminated one.
"""

from __future__ import annotations

from collections.abc import Callable

from kvflow.structured.regex_dialect import (
    SHORTHANDS,
    complement,
    merged_ranges,
    without_surrogates,
)

Ranges = list[tuple[int, int]]

_CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
# what a regex constraint's "." matches (Python's re, as regex_dialect.xgrammar_regex reads it)
_NOT_NEWLINE = list(complement(((0x0A, 0x0A),)))


def rewrite_classes(pattern: str, class_text: Callable[[Ranges], str], dot: Ranges,
                    literal: Callable[[int | None, str], str]) -> str:
    """``pattern`` with each character class read here written by ``class_text`` (given
    its code point ranges, sorted and disjoint), ``.`` as the class ``dot``, and each
    literal character or other escape by ``literal`` (its code point, None for an escape
    that is not one character such as ``\\b``; its text as written)."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "[":
            ranges, end = class_ranges(pattern, i)
            out.append(pattern[i:end] if ranges is None else class_text(ranges))
        elif char == "\\" and i + 1 < len(pattern):
            letter = pattern[i + 1]
            if letter.lower() in SHORTHANDS:
                out.append(class_text(_shorthand(letter)))
                end = i + 2
            else:
                code, end = _code_point(pattern, i)
                out.append(literal(code, pattern[i:end]))
        else:
            out.append(class_text(dot) if char == "." else literal(ord(char), char))
            end = i + 1
        i = end
    return "".join(out)


def negated_regex(pattern: str) -> str:
    """``pattern`` (a ``regex`` constraint in xgrammar's dialect,
    ``regex_dialect.xgrammar_regex``'s output) with each class written negated
    (:func:`negated_class`), ``.`` matching any character but a newline; literals and
    other escapes as written."""
    return rewrite_classes(pattern, lambda ranges: negated_class(ranges, None), _NOT_NEWLINE,
                           lambda code, written: written)


def negated_class(ranges: Ranges, allowed: Ranges | None) -> str:
    """Regex text for one character of ``ranges`` (and of ``allowed``, sorted and disjoint,
    when given) other than a UTF-16 surrogate: a negated class of explicit ranges,
    ``[^...]``; a class matching nothing (``[^\\u0000-\\u{10FFFF}]``) when none is left."""
    kept = without_surrogates(merged_ranges(ranges))
    if allowed is not None:
        kept = [(max(low, a), min(high, b)) for low, high in kept
                for a, b in allowed if max(low, a) <= min(high, b)]
    outside = [(a, b) for a, b in complement(merged_ranges(kept)) if a <= b]
    return "[^" + "".join(_code(a) + ("" if a == b else "-" + _code(b))
                          for a, b in outside) + "]"


def class_ranges(pattern: str, start: int) -> tuple[Ranges | None, int]:
    """The code point ranges (sorted, disjoint) of the class at ``pattern[start] == "["``
    and the position after it; None for a class holding an escape not read here or a
    reversed range, or one that does not end (the position is then the pattern's end).
    The class ends at its first unescaped ``]``, as xgrammar reads it (``[]`` is empty)."""
    negated = pattern.startswith("^", start + 1)
    i = start + 2 if negated else start + 1
    ranges: Ranges = []
    while i < len(pattern) and pattern[i] != "]":
        low, i = _class_item(pattern, i, ranges)
        if low is None:
            return None, _class_end(pattern, start)
        if low >= 0 and pattern.startswith("-", i) and i + 1 < len(pattern) and \
                pattern[i + 1] != "]":
            high, i = _class_item(pattern, i + 1, [])
            if high is None or high < low:
                return None, _class_end(pattern, start)
            ranges.append((low, high))
        elif low >= 0:
            ranges.append((low, low))
    if i >= len(pattern):
        return None, len(pattern)
    merged = merged_ranges(ranges)
    return (list(complement(merged)) if negated else list(merged)), i + 1


def _class_end(pattern: str, start: int) -> int:
    i = start + 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return min(i + 1, len(pattern))


def _class_item(pattern: str, i: int, ranges: Ranges) -> tuple[int | None, int]:
    """One class item at ``i``: its code point, -1 for a shorthand (its ranges added to
    ``ranges``) or None for an escape not read here; and the position after it."""
    if pattern[i] != "\\" or i + 1 >= len(pattern):
        return ord(pattern[i]), i + 1
    if pattern[i + 1].lower() in SHORTHANDS:
        ranges.extend(_shorthand(pattern[i + 1]))
        return -1, i + 2
    return _code_point(pattern, i)


def shorthand_ranges(letter: str) -> Ranges | None:
    """The code point ranges (sorted, disjoint) of the shorthand class ``\\<letter>``
    (``d``, ``D``, ``w``, ``W``, ``s``, ``S``); None for any other escape letter."""
    return _shorthand(letter) if letter.lower() in SHORTHANDS else None


def _shorthand(letter: str) -> Ranges:
    ranges = SHORTHANDS[letter.lower()]
    return list(complement(ranges)) if letter.isupper() else list(ranges)


def _code_point(pattern: str, i: int) -> tuple[int | None, int]:
    """The character an escape at ``i`` stands for (None: not one character), and the
    position after the escape."""
    letter = pattern[i + 1]
    if letter in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[letter], i + 2
    if letter == "u" and pattern.startswith("{", i + 2) and "}" in pattern[i + 3:]:
        end = pattern.index("}", i + 3)
        digits = pattern[i + 3:end]
        return (int(digits, 16), end + 1) if _is_hex(digits) else (None, i + 2)
    digits = pattern[i + 2:i + 2 + _HEX_ESCAPES.get(letter, 0)]
    if letter in _HEX_ESCAPES and len(digits) == _HEX_ESCAPES[letter] and _is_hex(digits):
        return int(digits, 16), i + 2 + len(digits)
    if not letter.isalnum():  # an escaped punctuation character: itself
        return ord(letter), i + 2
    return None, i + 2


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdefABCDEF" for c in text)


def _code(code: int) -> str:
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\u{{{code:X}}}"
