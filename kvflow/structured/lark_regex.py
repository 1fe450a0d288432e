"""Python regular expressions (the dialect of Lark's ``/.../`` terminals) as xgrammar EBNF.

Lark compiles its terminals with Python's ``re``; :func:`regex_to_ebnf` reads a pattern with
Python's own parser (``re._parser``, ``sre_parse`` before 3.11) and writes the same language
in the EBNF that xgrammar compiles: string literals, character classes ``[...]`` / ``[^...]``,
groups, ``|`` and the quantifiers ``? * + {m} {m,} {m,n}``.

Which characters one position matches (``\\d``, ``\\w``, ``\\s``, ``.``, negated classes and
anything under the ``i`` flag) is decided by Python's ``re`` itself: the one-character pattern
is run over every code point once and the matches become ranges. So ``\\d`` keeps its Unicode
digits and ``"k"i`` its Kelvin sign, exactly as Lark matches them.

Refused (ValueError naming the construct): anchors and word boundaries (``^ $ \\A \\Z \\b
\\B``), lookahead / lookbehind, backreferences, conditional groups, atomic groups and
possessive quantifiers (each changes the language in a way a context-free grammar does not
follow), and lazy quantifiers (``*? +? ?? {m,n}?``): Lark's lexers take the regex's first match,
which for a lazy quantifier is the shortest, so ``/".*?"/`` matches no string with an inner
quote, while the greedy reading would allow one.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

try:  # Python 3.11+
    import re._parser as _sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre  # type: ignore[no-redef]

from kvflow.structured.regex_dialect import merged_ranges

_MAX_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)

_CLASS_SPECIALS = "[]-^\\"  # escaped inside an EBNF [...]
Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent code point ranges

_CATEGORY_ESCAPES = {
    _sre.CATEGORY_DIGIT: r"\d", _sre.CATEGORY_NOT_DIGIT: r"\D",
    _sre.CATEGORY_WORD: r"\w", _sre.CATEGORY_NOT_WORD: r"\W",
    _sre.CATEGORY_SPACE: r"\s", _sre.CATEGORY_NOT_SPACE: r"\S",
}
_NOT_SUPPORTED = " are not supported in regular expressions"
_REFUSED = {
    _sre.AT: "anchors and word boundaries (^ $ \\A \\Z \\b \\B)" + _NOT_SUPPORTED,
    _sre.ASSERT: "lookahead / lookbehind assertions" + _NOT_SUPPORTED,
    _sre.ASSERT_NOT: "negative lookahead / lookbehind assertions" + _NOT_SUPPORTED,
    _sre.GROUPREF: "backreferences" + _NOT_SUPPORTED,
    _sre.GROUPREF_EXISTS: "conditional groups (?(id)yes|no)" + _NOT_SUPPORTED,
    _sre.MIN_REPEAT: ("lazy quantifiers (*? +? ?? {m,n}?: Lark's lexer takes the shortest "
                      "match, which GBNF cannot express; write the terminal without one, "
                      "e.g. /\"[^\"]*\"/ for /\".*?\"/)"),
    # Python 3.11+ (getattr: absent before)
    getattr(_sre, "POSSESSIVE_REPEAT", None): "possessive quantifiers (*+ ++ ?+)" + _NOT_SUPPORTED,
    getattr(_sre, "ATOMIC_GROUP", None): "atomic groups (?>...)" + _NOT_SUPPORTED,
}


class Expression(NamedTuple):
    """An EBNF expression and how it binds: ``atom`` (a literal, a class or a parenthesized
    group: takes a quantifier as is), ``quantified`` (``x+``), ``sequence`` or
    ``alternatives`` (both need parentheses before a quantifier)."""

    text: str
    kind: str


def regex_to_ebnf(pattern: str, flags: str = "") -> tuple[Expression, int]:
    """The xgrammar EBNF expression for a Python regular expression, and its least length.

    Args:
        pattern: the regex as Lark holds it (the text between the slashes of ``/.../``).
        flags: Lark's regex flags (the letters after the closing slash), of ``imsux``.

    Returns:
        (the expression, the least number of characters a match has).

    Raises:
        ValueError: for an invalid regex or flag, or a construct listed in the module
            docstring, naming it.
    """
    bits = 0
    for letter in flags:
        if letter not in "imsux":
            raise ValueError(f"regex flag {letter!r} is not supported (Lark's flags: imsux)")
        bits |= getattr(re, letter.upper())
    try:
        parsed = _sre.parse(pattern, bits)
    except re.error as e:
        raise ValueError(f"invalid regular expression /{pattern}/: {e}") from None
    return _sequence(list(parsed), parsed.state.flags), parsed.getwidth()[0]


def parenthesized(expression: Expression) -> str:
    """The expression's text, in parentheses unless it is an atom (ready for a quantifier)."""
    return expression.text if expression.kind == "atom" else f"({expression.text})"


def literal_ebnf(text: str) -> str:
    """An EBNF string literal for ``text`` (``\\"``, ``\\\\``, ``\\uHHHH`` escapes)."""
    return '"' + "".join(_escape(ord(c), '"') for c in text) + '"'


def class_ebnf(ranges: Ranges) -> str:
    """An EBNF character class for code point ranges: ``[...]``, or ``[^...]`` when the
    complement is shorter, or a one-character literal.

    Raises:
        ValueError: for the empty set (a class that matches no character).
    """
    if not ranges:
        raise ValueError("a character class that matches no character")
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return literal_ebnf(chr(ranges[0][0]))
    complement = _complement(ranges)
    if complement and len(complement) < len(ranges):
        return "[^" + _class_items(complement) + "]"
    return "[" + _class_items(ranges) + "]"


# --- the regex tree -> EBNF ------------------------------------------------------------

def _sequence(items: list, flags: int) -> Expression:
    """The expression for a sequence of sre items."""
    parts: list[Expression] = []
    literal: list[str] = []
    for op, av in items:
        if op == _sre.LITERAL and not flags & re.IGNORECASE:
            literal.append(chr(av))
            continue
        if literal:
            parts.append(Expression(literal_ebnf("".join(literal)), "atom"))
            literal = []
        parts.append(_item(op, av, flags))
    if literal:
        parts.append(Expression(literal_ebnf("".join(literal)), "atom"))
    if not parts:
        return Expression('""', "atom")
    if len(parts) == 1:
        return parts[0]
    return Expression(" ".join(p.text if p.kind != "alternatives" else f"({p.text})"
                               for p in parts), "sequence")


def _item(op, av, flags: int) -> Expression:
    if op in _REFUSED:
        raise ValueError(_REFUSED[op])
    if op in (_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN):
        return Expression(class_ebnf(_char_set(op, av, flags)), "atom")
    if op == _sre.BRANCH:
        return Expression(" | ".join(_sequence(list(b), flags).text for b in av[1]),
                          "alternatives")
    if op == _sre.SUBPATTERN:
        _, add, remove, inner = av
        return _sequence(list(inner), (flags | add) & ~remove)
    if op == _sre.MAX_REPEAT:
        low, high, inner = av
        return Expression(parenthesized(_sequence(list(inner), flags))
                          + _quantifier(low, high), "quantified")
    raise ValueError(f"regular-expression construct {op} is not supported")


def _quantifier(low: int, high: int) -> str:
    unbounded = high == _sre.MAXREPEAT
    if (low, unbounded) == (0, True):
        return "*"
    if (low, unbounded) == (1, True):
        return "+"
    if unbounded:
        return f"{{{low},}}"
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _char_set(op, av, flags: int) -> Ranges:
    """The code points one LITERAL / NOT_LITERAL / ANY / IN item matches under ``flags``."""
    if op == _sre.LITERAL and not flags & re.IGNORECASE:
        return ((av, av),)
    if op == _sre.ANY and not flags & re.DOTALL:
        return _complement(((10, 10),))
    if op == _sre.IN and not flags & re.IGNORECASE and all(
            kind in (_sre.LITERAL, _sre.RANGE, _sre.NEGATE) for kind, _ in av):
        ranges = merged_ranges([(v, v) if kind == _sre.LITERAL else v
                             for kind, v in av if kind != _sre.NEGATE])
        return _complement(ranges) if av[0][0] == _sre.NEGATE else ranges
    if op == _sre.NOT_LITERAL and not flags & re.IGNORECASE:
        return _complement(((av, av),))
    if op == _sre.LITERAL:
        pattern = _char_escape(av)
    elif op == _sre.NOT_LITERAL:
        pattern = f"[^{_char_escape(av)}]"
    elif op == _sre.ANY:
        pattern = "."
    else:
        pattern = "[" + "".join(_class_item_pattern(kind, v) for kind, v in av) + "]"
    return _matching(pattern, flags & (re.IGNORECASE | re.DOTALL | re.ASCII))


def _class_item_pattern(kind, value) -> str:
    if kind == _sre.NEGATE:
        return "^"
    if kind == _sre.LITERAL:
        return _char_escape(value)
    if kind == _sre.RANGE:
        return f"{_char_escape(value[0])}-{_char_escape(value[1])}"
    if kind == _sre.CATEGORY and value in _CATEGORY_ESCAPES:
        return _CATEGORY_ESCAPES[value]
    raise ValueError(f"character-class item {kind} {value} is not supported")


def _char_escape(code: int) -> str:
    return f"\\U{code:08x}"


# --- code point sets -----------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _all_chars() -> str:
    """Every code point but the surrogates (which Python strings hold but UTF-8 does not)."""
    return "".join(map(chr, range(_SURROGATES[0]))) + "".join(
        map(chr, range(_SURROGATES[1] + 1, _MAX_CODE_POINT + 1)))


@functools.lru_cache(maxsize=4096)
def _matching(pattern: str, flags: int) -> Ranges:
    gap = _SURROGATES[1] - _SURROGATES[0] + 1

    def code(position: int) -> int:  # string position -> code point, past the surrogates
        return position if position < _SURROGATES[0] else position + gap

    runs = [(code(m.start()), code(m.end() - 1))
            for m in re.finditer(f"(?:{pattern})+", _all_chars(), flags)]
    return merged_ranges(runs)




def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for low, high in ranges:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _MAX_CODE_POINT:
        out.append((start, _MAX_CODE_POINT))
    return tuple(out)


def _class_items(ranges: Ranges) -> str:
    items = []
    for low, high in ranges:  # UTF-8 has no surrogates: leave them out of the class
        for a, b in ((low, min(high, _SURROGATES[0] - 1)),
                     (max(low, _SURROGATES[1] + 1), high)):
            if a <= b:
                items.append(_escape(a, _CLASS_SPECIALS) + ("" if a == b else
                                                             "-" + _escape(b, _CLASS_SPECIALS)))
    return "".join(items)


def _escape(code: int, specials: str) -> str:
    char = chr(code)
    if char == "\\" or char in specials:
        return "\\" + char
    if 0x20 <= code < 0x7F:
        return char
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
