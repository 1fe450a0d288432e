"""Reading xgrammar's printing of a grammar (``Grammar.__str__``: EBNF with rules
``name ::= body``, classes ``[...]``, string literals, counts ``{m, n}``): the pieces that
kvflow's rewriting (``utf8_grammar``) and its compile budget (``count_budget``) both scan."""

from __future__ import annotations

import re

from kvflow.structured.regex_dialect import complement, merged_ranges

NAME = re.compile(r"[A-Za-z_]\w*")  # a rule name
COUNT = re.compile(r"\{(\d+), (-?\d+)\}")  # a repetition count as xgrammar prints it
_NAMED_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def class_rules(ebnf: str, negated_only: bool = False) -> dict[str, list[tuple[int, int]]]:
    """The rules of xgrammar's printing ``ebnf`` that are one character class
    (``name ::= (([^a-z]))``; a negated one only, if ``negated_only``), each with the code
    point ranges its class matches."""
    names = {}
    for line in ebnf.splitlines():
        name, _, body = line.partition(" ::= ")
        if body.startswith("(([^" if negated_only else "(([") and body.endswith("]))") and \
                class_ranges(body, 2)[1] == len(body) - 2:
            names[name] = class_ranges(body, 2)[0]
    return names


def class_ranges(ebnf: str, start: int) -> tuple[list[tuple[int, int]], int]:
    """The code point ranges (sorted, disjoint) the class at ``ebnf[start] == "["`` matches,
    and the position after it."""
    negated = ebnf.startswith("^", start + 1)
    i, ranges = start + 2 if negated else start + 1, []
    while i < len(ebnf) and ebnf[i] != "]":
        low, i = code_point(ebnf, i)
        high = low
        if ebnf.startswith("-", i) and not ebnf.startswith("-]", i):
            high, i = code_point(ebnf, i + 1)
        ranges.append((low, high))
    merged = merged_ranges(ranges)
    ranges = list(complement(merged)) if negated else list(merged)
    return [(low, high) for low, high in ranges if low <= high], i + 1


def string_end(text: str, start: int) -> int:
    """The position after the string literal that opens at ``text[start] == '"'``."""
    i = start + 1
    while i < len(text) and text[i] != '"':
        i += 2 if text[i] == "\\" else 1
    return i + 1


def code_point(text: str, i: int) -> tuple[int, int]:
    """The code point written at ``text[i]`` (a character or a C-style escape, as xgrammar
    prints them: ``\\n``, ``\\0``, ``\\x85``, ``\\u2028``, ``\\U0001f600``, ``\\]``) and the
    position after it."""
    if text[i] != "\\" or i + 1 >= len(text):
        return ord(text[i]), i + 1
    letter = text[i + 1]
    digits = _HEX_DIGITS.get(letter, 0)
    if digits:
        return int(text[i + 2:i + 2 + digits], 16), i + 2 + digits
    return _NAMED_ESCAPES.get(letter, ord(letter)), i + 2
