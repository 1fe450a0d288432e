r"""A JSON-schema ``pattern`` as a regex over JSON string contents, in UTF-8.

xgrammar (0.2.9) matches a string's ``pattern`` either with rules of its own or with a lazy
regex over the string's raw text (``Regex("...", json_string=true)`` in its grammar). Both
write a literal ``"``, backslash or control character of the pattern raw (``^a"b$`` allowed a
bare quote inside the string, ``^a\nb$`` a raw newline: not JSON), and the lazy regex accepts
overlong UTF-8 (``E0 80-9F xx``, ``F0 80-8F xx xx``: not UTF-8) for a class range that crosses
a UTF-8 length (``.``, ``[^a-z]``) and the UTF-16 surrogates for one that spans them.

:func:`json_pattern` writes the pattern so that xgrammar's plain regex converter
(``Grammar.from_regex``, whose classes are UTF-8) gives JSON text: each character class
(``[...]``, ``[^...]``, ``.``, ``\d`` ... ``\S``) becomes a negated class of explicit ranges
that leaves out the surrogates and the characters JSON escapes (``"``, backslash,
U+0000-U+001F); each literal of those characters becomes its JSON escape, which the decoded
value holds as the character. Negated, as xgrammar (0.2.9) repeats a negated class cheaply
and a positive one not: ``[a-z]{1,100}`` compiled in 0.8 s for a 49k vocabulary, written
``[^\0-`{-\U0010ffff]`` in 0.01 s; ``.{1,100}`` in 3.6 s against 0.01 s, its masks 0.9 ms
against 0.05 ms a token (``benchmarks/pattern_counts.py``). A class holding an escape not
read here (``\p{L}``) is left as written. A character a class holds only through a JSON
escape (a ``"`` or a tab in ``[^a]``) is not offered, as xgrammar did not offer it: the output
is JSON whose value matches the pattern, not every such value. ``utf8_grammar`` puts the converted rules in place of the
pattern (:func:`placeholder_patterns`).
"""

from __future__ import annotations

from typing import Any

from kvflow.structured.regex_classes import Ranges, negated_class, rewrite_classes
from kvflow.structured.regex_dialect import complement
from kvflow.structured.regex_empty import matches_nothing
from kvflow.structured.schema_patterns import map_patterns, map_schemas

_JSON_ESCAPES = {0x22: '\\\\"', 0x5C: "\\\\\\\\", 0x08: "\\\\b", 0x0C: "\\\\f", 0x0A: "\\\\n",
                 0x0D: "\\\\r", 0x09: "\\\\t"}  # regex text matching the JSON escape
# what a JSON string may hold raw: no control character, quote or backslash
_JSON_RAW = list(complement(((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))))
# "." matches no line terminator (ECMA-262: LF, CR, U+2028, U+2029; Python's re: LF)
_DOT = list(complement(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))))
_NOTHING = negated_class([], None)  # a class matching no character


# JSON Schema's ipv4 (RFC 2673 dotted quad): no leading zeros, which xgrammar 0.2.9's own
# ipv4 format allowed ("01.2.3.4"; the JSON Schema test suite and jsonschema refuse them)
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
IPV4_PATTERN = rf"^({_OCTET}\.){{3}}{_OCTET}$"


def strict_formats(schema: Any) -> Any:
    """A copy of ``schema`` with each ``"format": "ipv4"`` (a string schema without a
    ``pattern``) written as the pattern :data:`IPV4_PATTERN`."""
    def one(sub: dict[str, Any]) -> dict[str, Any]:
        if sub.get("format") != "ipv4" or "pattern" in sub:
            return sub
        return {**{k: v for k, v in sub.items() if k != "format"}, "pattern": IPV4_PATTERN}
    return map_schemas(schema, one)


def placeholder_patterns(schema: Any, first: int = 0) -> tuple[Any, dict[str, str]]:
    """A copy of ``schema`` with each ``pattern`` replaced by a placeholder (letters and
    digits, which xgrammar keeps as a lazy ``Regex("...")`` node), and each placeholder's
    pattern; placeholders are numbered from ``first`` (several schemas of one grammar).
    xgrammar's JSON-schema converter spends time on a pattern that grows with its
    text (``.{1,2000}`` written as :func:`json_pattern` writes it: 9.9 s instead of 3.9 s);
    the placeholders cost nothing, and ``utf8_grammar`` puts the patterns in their place."""
    patterns: dict[str, str] = {}

    def placeholder(pattern: str) -> str:
        name = f"kvflowpattern{first + len(patterns)}placeholder"
        patterns[name] = pattern
        return name
    return map_patterns(schema, placeholder), patterns


def json_pattern(pattern: str) -> str:
    """``pattern`` (a JSON-schema ``pattern``, xgrammar's regex dialect) rewritten as the
    module docstring says (``regex_classes.rewrite_classes``)."""
    return rewrite_classes(pattern, _class_text, _DOT, _literal)


def json_pattern_empty(pattern: str) -> bool:
    """True when no JSON string matches ``pattern`` (a JSON-schema ``pattern``, a valid
    regex) as :func:`json_pattern` writes it: a class that every match goes through holds
    no character, or only control characters other than JSON's escapes (``[\\x01]``),
    which a class here leaves out (``regex_empty.matches_nothing``)."""
    return matches_nothing(pattern, lambda ranges: _class_text(ranges) == _NOTHING)


def _literal(code: int | None, written: str) -> str:
    """Regex text for the character ``code`` (``written`` so in the pattern; None: an
    escape that is not one character) written in a JSON string."""
    if code is None or not (code < 0x20 or code in _JSON_ESCAPES):
        return written
    if code in _JSON_ESCAPES:
        return f"({_JSON_ESCAPES[code]})"
    return f"(\\\\u{code:04x})"


def _class_text(ranges: Ranges) -> str:
    """Regex text for one character of ``ranges`` written raw in a JSON string: a negated
    class (``[^...]``) leaving out the surrogates, the characters JSON escapes and what
    ``ranges`` does not hold (``regex_classes.negated_class``). Only a class of such
    characters alone (``["\\\\]``) is written as their JSON escapes (more alternatives in
    every class would multiply xgrammar's conversion time)."""
    text = negated_class(ranges, _JSON_RAW)
    if text != _NOTHING:  # written negated: xgrammar's cheap case (module docstring)
        return text
    escapes = [_JSON_ESCAPES[code] for code in sorted(_JSON_ESCAPES)
               if any(low <= code <= high for low, high in ranges)]
    return "(" + "|".join(escapes) + ")" if escapes else _NOTHING
