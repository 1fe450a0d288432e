"""A ``regex`` constraint as xgrammar reads it: the pattern rewritten where xgrammar's regex
dialect differs from the common one (Python's ``re``, which ``re.fullmatch`` checks an output
against; JavaScript's, PCRE's and RE2's agree on these points).

xgrammar (0.2.9) matches any character with ``.``, a newline included, where those dialects
match any character but ``\\n``: the constraint ``x.y`` let ``"x\\ny"`` through. It reads the
anchors ``\\A``, ``\\Z`` and ``\\z`` as the letters ``A``, ``Z`` and ``z`` (``\\Aab\\Z``
forced the output ``AabZ``), as it reads every letter escape it does not know (``\\g``,
``\\K``, ...; Python's ``re`` refuses those). So ``.`` outside a character class becomes
``[^\\n]``, and those escapes are refused (``^`` and ``$``, which xgrammar reads as anchors,
say what ``\\A`` and ``\\Z`` say for a whole output). xgrammar's ``.``, negated classes,
``\\D`` / ``\\W`` / ``\\S`` (also inside a class: ``[\\D]``) and class ranges that span
them (``[\\u0000-\\uFFFF]``) also match the UTF-16 surrogates U+D800-U+DFFF, whose 3-byte
spelling (``ED A0-BF xx``) is not UTF-8 (the text decodes to three U+FFFD, which ``.{1}``
does not match): each of those leaves them out (:func:`utf8_regex`, also applied to
JSON-schema ``pattern`` strings by ``utf8_grammar``). JSON-schema ``pattern`` strings are not
otherwise rewritten: xgrammar reads them as JSON string contents, where no raw newline can
stand, and ECMA-262, their dialect, reads ``\\A`` as the letter too.
"""

from __future__ import annotations

_NO_SURROGATES = r"\uD800-\uDFFF"
_SURROGATES = (0xD800, 0xDFFF)
_ANY_BUT_NEWLINE = rf"[^\n{_NO_SURROGATES}]"
_ANY_CHAR = f"[^{_NO_SURROGATES}]"
_MAX_CODE_POINT = 0x10FFFF
# \d \w \s as xgrammar (0.2.9) reads them: ASCII digits and word characters, Unicode spaces
# (read from its conversion of [\D], [\W], [\S]; tests/test_structured_utf8.py checks them)
SHORTHANDS = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF)),
}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}  # \xHH, \uHHHH, \UHHHHHHHH: a code point
# the letter escapes xgrammar (0.2.9) matches as the letter itself (it logs "Escape sequence
# ... is not recognized"), found by compiling each; the anchors among them
_READ_AS_LETTER = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
_ANCHORS = {"A": "^", "Z": "$", "z": "$"}


def xgrammar_regex(pattern: str) -> str:
    """``pattern`` with each ``.`` outside a character class written ``[^\\n]``, and the
    UTF-16 surrogates left out of what it matches (:func:`utf8_regex`).

    Raises:
        ValueError: for a letter escape xgrammar would read as the letter (``\\A``, ``\\Z``,
            ``\\z``, ``\\g``, ...), naming it, its position and what to write instead.
    """
    return _rewrite(pattern, _ANY_BUT_NEWLINE, refuse_letters=True)


def utf8_regex(pattern: str) -> str:
    """``pattern`` (xgrammar's regex dialect) matching only UTF-8 text: the surrogates
    U+D800-U+DFFF left out of ``.``, negated classes, ``\\D`` / ``\\W`` / ``\\S`` (inside a
    class too: written as their ranges) and class ranges that span them; nothing else
    changes (a JSON-schema ``pattern``'s ``.`` keeps its meaning)."""
    return _rewrite(pattern, _ANY_CHAR, refuse_letters=False)


def _rewrite(pattern: str, any_char: str, refuse_letters: bool) -> str:
    """``pattern`` with ``.`` written ``any_char`` and the surrogates left out."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            letter = pattern[i + 1]
            if refuse_letters and letter in _READ_AS_LETTER:
                raise ValueError(_letter_escape_error(letter, i, False))
            out.append(f"[^\\{letter.lower()}{_NO_SURROGATES}]" if letter in "DWS"
                       else pattern[i:i + 2])
            i += 2
        elif char == "[":
            text, i = _character_class(pattern, i, refuse_letters)
            out.append(text)
        else:
            out.append(any_char if char == "." else char)
            i += 1
    return "".join(out)


def _character_class(pattern: str, start: int, refuse_letters: bool) -> tuple[str, int]:
    """The class at ``pattern[start] == "["`` without the surrogates, and the position after
    it. xgrammar ends a class at its first unescaped ``]`` (``[]`` is empty, ``[^]]`` is
    ``[^]`` and a ``]``); an unterminated class is copied as written (xgrammar refuses it)."""
    negated = pattern.startswith("^", start + 1)
    i = start + 2 if negated else start + 1
    items: list[str] = []
    while i < len(pattern) and pattern[i] != "]":
        low, text, i = _class_atom(pattern, i, refuse_letters)
        if pattern.startswith("-", i) and i + 1 < len(pattern) and pattern[i + 1] != "]":
            high, high_text, i = _class_atom(pattern, i + 1, refuse_letters)
            if low is not None and high is not None and low <= high:
                items.append(_ranges_text(without_surrogates(((low, high),))))
                continue
            text = f"{text}-{high_text}"
        items.append(text)
    if i >= len(pattern):
        return pattern[start:], len(pattern)
    return "[" + "^" * negated + "".join(items) + _NO_SURROGATES * negated + "]", i + 1


def _class_atom(pattern: str, i: int, refuse_letters: bool) -> tuple[int | None, str, int]:
    """One class item at ``i``: (its code point, or None for an escape of several; its text
    as sent; the position after it)."""
    if pattern[i] != "\\" or i + 1 >= len(pattern):
        return ord(pattern[i]), pattern[i], i + 1
    letter = pattern[i + 1]
    if refuse_letters and letter in _READ_AS_LETTER:
        raise ValueError(_letter_escape_error(letter, i, True))
    if letter in "DWS":  # complement of \d \w \s, written as its ranges
        ranges = complement(SHORTHANDS[letter.lower()])
        return None, _ranges_text(without_surrogates(ranges)), i + 2
    digits = _HEX_ESCAPES.get(letter, 0)
    code = pattern[i + 2:i + 2 + digits]
    if digits and len(code) == digits and all(c in "0123456789abcdefABCDEF" for c in code):
        return int(code, 16), pattern[i:i + 2 + digits], i + 2 + digits
    return None, pattern[i:i + 2], i + 2


def merged_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Inclusive code point ``ranges`` (any order, overlapping or adjacent) as sorted,
    disjoint, non-adjacent ones."""
    out: list[list[int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], high)
        else:
            out.append([low, high])
    return tuple((low, high) for low, high in out)


def complement(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The code points (up to U+10FFFF) outside sorted, disjoint ``ranges``."""
    out, start = [], 0
    for low, high in ranges:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    return (*out, (start, _MAX_CODE_POINT))


def without_surrogates(ranges: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """``ranges`` less U+D800-U+DFFF."""
    out = []
    for low, high in ranges:
        for a, b in ((low, min(high, _SURROGATES[0] - 1)), (max(low, _SURROGATES[1] + 1), high)):
            if a <= b:
                out.append((a, b))
    return out


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    """Class items for code point ranges, each end a ``\\uHHHH`` / ``\\u{HHHHH}`` escape
    (xgrammar reads ``\\UHHHHHHHH`` in a JSON-schema ``pattern`` as the letter ``U``)."""
    def escape(code: int) -> str:
        return f"\\u{code:04X}" if code <= 0xFFFF else f"\\u{{{code:X}}}"
    return "".join(escape(a) + ("" if a == b else "-" + escape(b)) for a, b in ranges)


def _letter_escape_error(letter: str, position: int, in_class: bool) -> str:
    """Why the escape ``\\<letter>`` at ``position`` is refused, and what to write instead."""
    said = f"\\{letter} at position {position} is read as the letter {letter!r}"
    if letter in _ANCHORS and not in_class:
        return (f"{said}, not as an anchor, by kvflow's grammar engine (xgrammar); write "
                f"{_ANCHORS[letter]!r} instead (the output must match the whole regex anyway)")
    return (f"{said} by kvflow's grammar engine (xgrammar), which knows no such escape "
            f"(nor does Python's re); write {letter!r} if the letter is meant")
