"""A ``regex`` constraint as xgrammar reads it: the pattern rewritten where xgrammar's regex
dialect differs from the common one (Python's ``re``, which ``re.fullmatch`` checks an output
against; JavaScript's, PCRE's and RE2's agree on these points).

xgrammar (0.2.9) matches any character with ``.``, a newline included, where those dialects
match any character but ``\\n``: the constraint ``x.y`` let ``"x\\ny"`` through. It reads the
anchors ``\\A``, ``\\Z`` and ``\\z`` as the letters ``A``, ``Z`` and ``z`` (``\\Aab\\Z``
forced the output ``AabZ``), as it reads every letter escape it does not know (``\\g``,
``\\K``, ...; Python's ``re`` refuses those). So ``.`` outside a character class becomes
``[^\\n]``, and those escapes are refused (``^`` and ``$``, which xgrammar reads as anchors,
say what ``\\A`` and ``\\Z`` say for a whole output). JSON-schema ``pattern`` strings are not
rewritten: xgrammar reads them as JSON string contents, where no raw newline can stand, and
ECMA-262, their dialect, reads ``\\A`` as the letter too.
"""

from __future__ import annotations

_ANY_BUT_NEWLINE = r"[^\n]"
# the letter escapes xgrammar (0.2.9) matches as the letter itself (it logs "Escape sequence
# ... is not recognized"), found by compiling each; the anchors among them
_READ_AS_LETTER = frozenset("ghijlmoqyzACEFGHIJKLMNOQRTUVXYZ")
_ANCHORS = {"A": "^", "Z": "$", "z": "$"}


def xgrammar_regex(pattern: str) -> str:
    """``pattern`` with each ``.`` outside a character class written ``[^\\n]``.

    Raises:
        ValueError: for a letter escape xgrammar would read as the letter (``\\A``, ``\\Z``,
            ``\\z``, ``\\g``, ...), naming it, its position and what to write instead.
    """
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\" and i + 1 < len(pattern):
            if pattern[i + 1] in _READ_AS_LETTER:
                raise ValueError(_letter_escape_error(pattern[i + 1], i, in_class))
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:  # xgrammar ends a class at its first unescaped "]" ("[]" is empty)
            in_class = char != "]"
        elif char == "[":
            in_class = True
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
