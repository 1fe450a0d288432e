r"""Whether a regex matches no string at all: a character class that holds no character
(``[^\s\S]``, or for a JSON-schema ``pattern`` one of control characters JSON cannot hold
raw), in a part of the pattern that every match must go through. Served, such a constraint
lets the output start and then allows no token at that point, so the reply ends with
``length`` after a prefix; refused instead (``xgrammar_convert.bad_pattern``).

A recursive descent over the regex text (alternatives ``|``, groups, one atom per class,
escape or character, quantifiers ``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}``): a
sequence is empty when one of its items is, an item whose quantifier allows zero repetitions
never is, an alternation is empty when every branch is. Anchors, lookarounds and escapes not
read as one character count as matching something, so the answer errs towards "not empty".

Checked for every regex kvflow compiles: a ``regex`` constraint (``structured_outputs.regex``,
``guided_regex``) and a structural tag's ``regex`` format (:func:`regex_matches_nothing`,
from ``xgrammar_validate`` and ``xgrammar_convert.structural_tag_text``), and a JSON
schema's ``pattern`` strings and ``patternProperties`` names (``json_pattern``'s test, from
``xgrammar_convert.bad_pattern``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvflow.structured.regex_classes import Ranges, class_ranges, shorthand_ranges

_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")
_QUANTIFIER = re.compile(r"[*+?]|\{(\d+)(?:,(\d*))?\}")


# why an empty regex constraint is refused (after "the regex matches no string: ")
EMPTY_REGEX = ("a character class that every match goes through holds no character (it is "
               "empty, as [^\\s\\S] or [], or holds only UTF-16 surrogates, which are not "
               "UTF-8 text): a reply would stop there, cut off")


def regex_matches_nothing(converted: str) -> bool:
    """True when no text matches a ``regex`` constraint as kvflow hands it to xgrammar
    (``converted``: ``xgrammar_convert.regex_text``'s output, every class written negated
    without the surrogates, so an empty one holds no range)."""
    return matches_nothing(converted, lambda ranges: not ranges)


def matches_nothing(pattern: str, class_empty: Callable[[Ranges], bool]) -> bool:
    """True when no string matches ``pattern`` (a regex in xgrammar's dialect, assumed
    valid): some class that every match passes through is empty by ``class_empty`` (given
    its code point ranges, sorted and disjoint; e.g. ``lambda ranges: not ranges``)."""
    empty, _ = _alternation(pattern, 0, class_empty)
    return empty


def _alternation(pattern: str, i: int, class_empty: Callable[[Ranges], bool]
                 ) -> tuple[bool, int]:
    """(every branch empty, position of the closing ``)`` or the end) from ``i``."""
    empty, i = _sequence(pattern, i, class_empty)
    while i < len(pattern) and pattern[i] == "|":
        branch, i = _sequence(pattern, i + 1, class_empty)
        empty = empty and branch
    return empty, i


def _sequence(pattern: str, i: int, class_empty: Callable[[Ranges], bool]
              ) -> tuple[bool, int]:
    """(one item empty, position of the ``|``, ``)`` or end that closes it) from ``i``."""
    empty = False
    while i < len(pattern) and pattern[i] not in "|)":
        item, i = _atom(pattern, i, class_empty)
        quantifier = _QUANTIFIER.match(pattern, i)
        if quantifier is not None:
            optional = quantifier.group(0) in ("*", "?") or quantifier.group(1) == "0"
            item = item and not optional
            i = quantifier.end() + (pattern[quantifier.end():quantifier.end() + 1] in ("?", "+"))
        empty = empty or item
    return empty, i


def _atom(pattern: str, i: int, class_empty: Callable[[Ranges], bool]) -> tuple[bool, int]:
    """(this atom matches nothing, the position after it) at ``i``."""
    char = pattern[i]
    if char == "(":
        lookaround = next((p for p in _LOOKAROUNDS if pattern.startswith(p, i)), "")
        start = i + max(1, len(lookaround))
        if not lookaround and pattern.startswith("(?<", i):  # a named group (?<name>...)
            start = pattern.find(">", i) + 1 or len(pattern)
        elif not lookaround and pattern.startswith("(?", i):  # (?:...)
            start = i + 3
        empty, end = _alternation(pattern, start, class_empty)
        return empty and not lookaround, end + 1
    if char == "[":
        ranges, end = class_ranges(pattern, i)
        return ranges is not None and class_empty(_proper(ranges)), end
    if char == "\\" and i + 1 < len(pattern):
        shorthand = shorthand_ranges(pattern[i + 1])
        return shorthand is not None and class_empty(_proper(shorthand)), i + 2
    return False, i + 1


def _proper(ranges: Ranges) -> Ranges:
    """``ranges`` without the empty ones (low > high) a complement may hold."""
    return [(low, high) for low, high in ranges if low <= high]
