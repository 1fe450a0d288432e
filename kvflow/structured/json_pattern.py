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

from kvflow.structured.regex_dialect import (
    SHORTHANDS,
    complement,
    merged_ranges,
    without_surrogates,
)
from kvflow.structured.schema_patterns import map_patterns, map_schemas

Ranges = list[tuple[int, int]]

_JSON_ESCAPES = {0x22: '\\\\"', 0x5C: "\\\\\\\\", 0x08: "\\\\b", 0x0C: "\\\\f", 0x0A: "\\\\n",
                 0x0D: "\\\\r", 0x09: "\\\\t"}  # regex text matching the JSON escape
_CONTROL_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
# what a JSON string may hold raw: no control character, quote or backslash
_JSON_RAW = complement(((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)))
# "." matches no line terminator (ECMA-262: LF, CR, U+2028, U+2029; Python's re: LF)
_DOT = list(complement(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))))


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
    module docstring says."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "[":
            text, i = _class(pattern, i)
            out.append(text)
            continue
        if char == "\\" and i + 1 < len(pattern):
            text, i = _escape(pattern, i)
            out.append(text)
            continue
        if char == ".":
            out.append(_class_text(_DOT))
        else:
            out.append(_literal(ord(char)))
        i += 1
    return "".join(out)


def _literal(code: int) -> str:
    """Regex text for the character ``code`` written in a JSON string."""
    if code in _JSON_ESCAPES:
        return f"({_JSON_ESCAPES[code]})"
    if code < 0x20:
        return f"(\\\\u{code:04x})"
    return chr(code)


def _escape(pattern: str, i: int) -> tuple[str, int]:
    """The escape at ``pattern[i] == "\\\\"`` rewritten, and the position after it."""
    letter = pattern[i + 1]
    if letter.lower() in SHORTHANDS:
        return _class_text(_shorthand(letter)), i + 2
    code, end = _code_point(pattern, i)
    if code is not None and (code < 0x20 or code in _JSON_ESCAPES):
        return _literal(code), end
    return pattern[i:end], end


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


def _class(pattern: str, start: int) -> tuple[str, int]:
    """The class at ``pattern[start] == "["`` as explicit ranges, and the position after it;
    the class as written when it holds an escape not read here or does not end."""
    negated = pattern.startswith("^", start + 1)
    i = start + 2 if negated else start + 1
    ranges: Ranges = []
    while i < len(pattern) and pattern[i] != "]":
        low, i = _class_item(pattern, i, ranges)
        if low is None:
            return _class_as_written(pattern, start)
        if low >= 0 and pattern.startswith("-", i) and i + 1 < len(pattern) and \
                pattern[i + 1] != "]":
            high, i = _class_item(pattern, i + 1, [])
            if high is None or high < low:
                return _class_as_written(pattern, start)
            ranges.append((low, high))
        elif low >= 0:
            ranges.append((low, low))
    if i >= len(pattern):
        return pattern[start:], len(pattern)
    merged = merged_ranges(ranges)
    return _class_text(list(complement(merged)) if negated else merged), i + 1


def _class_as_written(pattern: str, start: int) -> tuple[str, int]:
    i = start + 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return pattern[start:i + 1], i + 1


def _class_item(pattern: str, i: int, ranges: Ranges) -> tuple[int | None, int]:
    """One class item at ``i``: its code point, -1 for a shorthand (its ranges added to
    ``ranges``) or None for an escape not read here; and the position after it."""
    if pattern[i] != "\\" or i + 1 >= len(pattern):
        return ord(pattern[i]), i + 1
    if pattern[i + 1].lower() in SHORTHANDS:
        ranges.extend(_shorthand(pattern[i + 1]))
        return -1, i + 2
    return _code_point(pattern, i)


def _class_text(ranges: Ranges) -> str:
    """Regex text for one character of ``ranges`` written raw in a JSON string: a negated
    class (``[^...]``) leaving out the surrogates, the characters JSON escapes and what
    ``ranges`` does not hold. Only a class of such characters alone (``["\\\\]``) is
    written as their JSON escapes (more alternatives in every class would multiply
    xgrammar's conversion time)."""
    ranges = merged_ranges(ranges)
    kept = [(max(low, a), min(high, b)) for low, high in without_surrogates(ranges)
            for a, b in _JSON_RAW if max(low, a) <= min(high, b)]
    if kept:  # written negated: xgrammar's cheap case (module docstring)
        outside = [(a, b) for a, b in complement(merged_ranges(kept)) if a <= b]
        return "[^" + "".join(_code(a) + ("" if a == b else "-" + _code(b))
                              for a, b in outside) + "]"
    escapes = [_JSON_ESCAPES[code] for code in sorted(_JSON_ESCAPES)
               if any(low <= code <= high for low, high in ranges)]
    return "(" + "|".join(escapes) + ")" if escapes else "[^\\u0000-\\u{10FFFF}]"


def _code(code: int) -> str:
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\u{{{code:X}}}"
