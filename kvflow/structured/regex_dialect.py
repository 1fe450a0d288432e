"""A ``regex`` constraint as xgrammar reads it: the pattern rewritten where xgrammar's regex
dialect differs from the common one (Python's ``re``, which ``re.fullmatch`` checks an output
against; JavaScript's, PCRE's and RE2's agree on these points).

xgrammar (0.2.9) matches any character with ``.``, a newline included, where those dialects
match any character but ``\\n``: the constraint ``x.y`` let ``"x\\ny"`` through. It reads the
anchors ``\\A``, ``\\Z`` and ``\\z`` as the letters ``A``, ``Z`` and ``z`` (``\\Aab\\Z``
forced the output ``AabZ``), as it reads every letter escape it does not know (``\\g``,
``\\K``, ...; Python's ``re`` refuses those). So ``.`` outside a character class becomes
``[^\\n]``, and those escapes are refused (``^`` and ``$``, which xgrammar reads as anchors,
say what ``\\A`` and ``\\Z`` say for a whole output). xgrammar's ``.``, negated classes and
``\\D`` / ``\\W`` / ``\\S`` also match the UTF-16 surrogates U+D800-U+DFFF, whose 3-byte
spelling (``ED A0-BF xx``) is not UTF-8 (the text decodes to three U+FFFD, which ``.{1}``
does not match): each of those leaves them out (``_NO_SURROGATES``; inside a class that is not
negated, ``\\D`` / ``\\W`` / ``\\S`` still let them through). JSON-schema ``pattern`` strings are not
rewritten: xgrammar reads them as JSON string contents, where no raw newline can stand, and
ECMA-262, their dialect, reads ``\\A`` as the letter too.
"""

from __future__ import annotations

_NO_SURROGATES = r"\uD800-\uDFFF"
_ANY_BUT_NEWLINE = rf"[^\n{_NO_SURROGATES}]"
_NEGATED_SHORTHANDS = frozenset("DWS")
# the letter escapes xgrammar (0.2.9) matches as the letter itself (it logs "Escape sequence
# ... is not recognized"), found by compiling each; the anchors among them
_READ_AS_LETTER = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
_ANCHORS = {"A": "^", "Z": "$", "z": "$"}


def xgrammar_regex(pattern: str) -> str:
    """``pattern`` with each ``.`` outside a character class written ``[^\\n]``, and the
    surrogates left out of ``.``, negated classes and ``\\D`` / ``\\W`` / ``\\S`` outside a class.

    Raises:
        ValueError: for a letter escape xgrammar would read as the letter (``\\A``, ``\\Z``,
            ``\\z``, ``\\g``, ...), naming it, its position and what to write instead.
    """
    out, i, in_class, negated = [], 0, False, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] in _READ_AS_LETTER:
                raise ValueError(_letter_escape_error(pattern[i + 1], i, in_class))
            escape = pattern[i:i + 2]
            if pattern[i + 1] in _NEGATED_SHORTHANDS and not in_class:
                escape = f"[^\\{pattern[i + 1].lower()}{_NO_SURROGATES}]"
            out.append(escape)
            i += 2
            continue
        if in_class:  # xgrammar ends a class at its first unescaped "]" ("[]" is empty)
            in_class = char != "]"
            if not in_class and negated:
                char = _NO_SURROGATES + char
        elif char == "[":
            in_class = True
            negated = pattern.startswith("^", i + 1)
            if negated:  # the "^" is copied here so that "[^]" reads as xgrammar reads it
                out.append("[^")
                i += 2
                continue
        elif char == ".":
            char = _ANY_BUT_NEWLINE
        out.append(char)
        i += 1
    return "".join(out)



def _letter_escape_error(letter: str, position: int, in_class: bool) -> str:
    """Why the escape ``\\<letter>`` at ``position`` is refused, and what to write instead."""
    said = f"\\{letter} at position {position} is read as the letter {letter!r}"
    if letter in _ANCHORS and not in_class:
        return (f"{said}, not as an anchor, by kvflow's grammar engine (xgrammar); write "
                f"{_ANCHORS[letter]!r} instead (the output must match the whole regex anyway)")
    return (f"{said} by kvflow's grammar engine (xgrammar), which knows no such escape "
            f"(nor does Python's re); write {letter!r} if the letter is meant")
