"""Lark expansions (the right side of ``name: ...``) to GBNF, for ``lark_grammar``.

:class:`ExpansionConverter` is a recursive descent over one definition's tokens that writes the
GBNF expression (terminals inline in terminals), follows each token in a rule by the ignore
expression when the grammar has ``%ignore``, and tracks each expansion's least length to refuse
zero-width terminals, as Lark does.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import NamedTuple

from kvflow.structured.lark_regex import Expression, class_ebnf, parenthesized, regex_to_ebnf

Token = tuple[str, str, int]  # (kind, text, line number)


class Definition(NamedTuple):
    """One rule or terminal: its GBNF name, line, expansion tokens, and whether it is a
    terminal (Lark: an upper-case name)."""

    name: str
    line: int
    tokens: list[Token]
    terminal: bool


def gbnf_name(name: str, ignore: bool) -> str:
    """The GBNF name of a Lark rule: ``start`` is ``root`` unless ``%ignore`` puts
    ``root ::= <ignore> start`` first."""
    return "root" if name == "start" and not ignore else name


def is_terminal(name: str) -> bool:
    """Lark's rule: upper-case names (``NAME``, ``_NAME``) are terminals, others rules."""
    return name.isupper()  # Lark's rule: TERMINAL (also _TERMINAL), rule (also _rule)


class ExpansionConverter:
    """Recursive descent over one definition's tokens, writing GBNF:

        alternatives := sequence ('|' sequence)*
        sequence     := item* ('->' name)?          (empty -> ""; the alias is dropped)
        item         := atom ('?' | '*' | '+' | '~' number ('..' number)?)?
        atom         := name | literal ('..' literal)? | regex | '(' alternatives ')'
                      | '[' alternatives ']'

    Each step returns (expression, least length in characters); the least lengths find
    zero-width terminals. Two choices keep xgrammar fast (its per-token mask time with a
    49k-token vocabulary, ``WORD+`` with ``%ignore WS``: 61 ms with a rule per terminal and an
    ``__ignore`` rule, 0.06 ms so): a terminal's definition is one expression, the terminals
    it refers to written inline (as Lark compiles a terminal into one regex); and with
    ``%ignore`` each token in a rule is followed by the ignore expression itself.
    """

    def __init__(self, definitions: dict[str, Definition],
                 ignored: list[tuple[list[Token], int]]) -> None:
        self.definitions = definitions
        self.lexed: dict[str, int] = {}  # terminals used as tokens -> a line using them
        self.inlined: dict[str, tuple[Expression, int] | None] = {}  # None: visiting
        self.ignore = self._ignore_expression(ignored) if ignored else None

    def expansion(self, tokens: list[Token], line: int, in_rule: bool) -> Expression:
        """The GBNF for one definition's tokens (``in_rule``: a rule's, whose tokens take
        the ignore expression; else a terminal's, other terminals inline).

        Raises:
            ValueError: for a syntax error, an undefined name, a zero-width token, a
                terminal referring to a rule or to itself, or an unsupported regex,
                naming the line.
        """
        return self._expansion(tokens, line, in_rule)[0]

    def check_terminals(self) -> None:
        """Raises ValueError for a terminal used as a token that matches the empty string."""
        for name, line in self.lexed.items():
            if self._terminal(name, line)[1] == 0:
                raise ValueError(f"Lark grammar line {line}: terminal '{name}' matches the "
                                 "empty string (Lark refuses zero-width terminals)")

    def _ignore_expression(self, ignored: list[tuple[list[Token], int]]) -> str:
        """``x*`` or ``(a | b ...)*`` over the ignored terminals, a top-level ``+`` of each
        dropped (``(x+)* = x*``, which keeps xgrammar's parse unambiguous)."""
        items = []
        for tokens, line in ignored:
            if len(tokens) == 1 and tokens[0][0] == "name" and tokens[0][1] in self.definitions \
                    and is_terminal(tokens[0][1]):  # the definition itself, unparenthesized
                expression, least = self._terminal(tokens[0][1], line)
            else:
                expression, least = self._expansion(tokens, line, in_rule=False)
            if least == 0:
                raise ValueError(f"Lark grammar line {line}: %ignore "
                                 f"{' '.join(t[1] for t in tokens)} matches the empty string "
                                 "(Lark refuses zero-width terminals)")
            if expression.kind == "quantified" and expression.text.endswith("+"):
                expression = Expression(expression.text[:-1], "atom")
            items.append(expression)
        if len(items) == 1:
            return parenthesized(items[0]) + "*"
        return "(" + " | ".join(e.text for e in items) + ")*"

    def _expansion(self, tokens: list[Token], line: int, in_rule: bool) -> tuple[Expression, int]:
        expression, least, _ = self._alternatives(tokens, 0, None, line, in_rule)
        return expression, least

    def _terminal(self, name: str, line: int) -> tuple[Expression, int]:
        """A terminal's definition as one expression and its least length (memoized;
        ValueError if it refers to itself)."""
        if name in self.inlined:
            found = self.inlined[name]
            if found is None:
                raise ValueError(f"Lark grammar line {line}: terminal '{name}' refers to "
                                 "itself (Lark terminals cannot be recursive)")
            return found
        self.inlined[name] = None
        definition = self.definitions[name]
        self.inlined[name] = self._expansion(definition.tokens, definition.line, False)
        return self.inlined[name]

    def _alternatives(self, tokens: list[Token], at: int, closer: str | None, line: int,
                      in_rule: bool) -> tuple[Expression, int, int]:
        parts, least = [], None
        while True:
            sequence, length, at = self._sequence(tokens, at, line, in_rule,
                                                  aliased=in_rule and closer is None)
            parts.append(sequence)
            least = length if least is None else min(least, length)
            if at < len(tokens) and tokens[at][0] == "|":
                at += 1
                continue
            break
        if at < len(tokens) and tokens[at][0] != closer:
            _, word, where = tokens[at]
            raise ValueError(f"Lark grammar line {where}: unexpected {word!r}")
        if at == len(tokens) and closer is not None:
            raise ValueError(f"Lark grammar line {tokens[-1][2] if tokens else line}: "
                             f"missing {closer!r}")
        if len(parts) == 1:
            return parts[0], least, at
        return Expression(" | ".join(p.text for p in parts), "alternatives"), least, at

    def _sequence(self, tokens: list[Token], at: int, line: int, in_rule: bool,
                  aliased: bool) -> tuple[Expression, int, int]:
        items, least = [], 0
        while at < len(tokens) and tokens[at][0] not in ("|", ")", "]"):
            kind, word, where = tokens[at]
            if kind == "alias":
                at = _alias(tokens, at, aliased)
                break
            if kind in ("?", "*", "+"):
                raise ValueError(f"Lark grammar line {where}: {word!r} follows nothing")
            first = at
            atom, length, at = self._atom(tokens, at, in_rule)
            quantifier = tokens[at][0] if at < len(tokens) and tokens[at][0] in "?*+" else ""
            at += bool(quantifier)
            counted = not quantifier and at < len(tokens) and tokens[at][0] == "~"
            if kind == "[":  # [x] = (x)?; [x]? = (x)?; [x]* = [x]+ = (x)*
                quantifier = "?" if quantifier in ("", "?") else "*"
            if quantifier:
                atom = Expression(parenthesized(atom) + quantifier, "quantified")
                length = 0 if quantifier in ("?", "*") else length
            if counted:  # a rule inside is written out: xgrammar 0.2.9 crashed on b ::= b{2}
                written_out = any(k == "name" and not is_terminal(w)
                                  for k, w, _ in tokens[first:at])
                atom, length, at = _counted(atom, length, tokens, at, written_out)
            items.append(atom)
            least += length
        if not items:
            return Expression('""', "atom"), 0, at
        if len(items) == 1:
            return items[0], least, at
        return Expression(" ".join(i.text if i.kind != "alternatives" else f"({i.text})"
                                   for i in items), "sequence"), least, at

    def _atom(self, tokens: list[Token], at: int, in_rule: bool) -> tuple[Expression, int, int]:
        """One atom (a token in a rule followed by the ignore expression with ``%ignore``)."""
        kind, word, where = tokens[at]
        if kind in ("(", "["):
            inner, least, at = self._alternatives(tokens, at + 1, ")" if kind == "(" else "]",
                                                  where, in_rule)
            return Expression(f"({inner.text})", "atom"), least, at + 1
        if kind == "name":
            expression, least = self._reference(word, where, in_rule)
            token = in_rule and is_terminal(word)
        elif kind == "regex":
            closing = word.rindex("/")
            expression, least = _regex(word[1:closing], word[closing + 1:], where)
            token = in_rule
        elif kind == "literal":
            expression, least, at = self._literal(tokens, at, where)
            token = in_rule
        else:
            raise ValueError(f"Lark grammar line {where}: unexpected {word!r}")
        if token and least == 0:
            raise ValueError(f"Lark grammar line {where}: {word} matches the empty string "
                             "(Lark refuses zero-width terminals)")
        if token and self.ignore:
            expression = Expression(f"{parenthesized(expression)} {self.ignore}", "sequence")
        return expression, least, at + 1

    def _reference(self, name: str, line: int, in_rule: bool) -> tuple[Expression, int]:
        if name not in self.definitions:
            raise ValueError(f"Lark grammar line {line}: '{name}' is not defined")
        if not is_terminal(name):
            if not in_rule:
                raise ValueError(f"Lark grammar line {line}: a terminal refers to the rule "
                                 f"'{name}' (Lark terminals refer to terminals only)")
            return Expression(gbnf_name(name, self.ignore is not None), "atom"), 1
        if in_rule:
            self.lexed.setdefault(name, line)
            return Expression(name, "atom"), 1  # zero width is checked on the definition
        expression, least = self._terminal(name, line)
        return Expression(parenthesized(expression), "atom"), least

    def _literal(self, tokens: list[Token], at: int, line: int) -> tuple[Expression, int, int]:
        """A literal, a case-insensitive literal or a range ``"a".."z"``."""
        word = tokens[at][1]
        if at + 2 < len(tokens) and tokens[at + 1][0] == "range":
            if tokens[at + 2][0] != "literal":
                raise ValueError(f"Lark grammar line {line}: a range needs a literal after '..'")
            low, high = _literal_value(word, line), _literal_value(tokens[at + 2][1], line)
            if len(low) != 1 or len(high) != 1 or low > high:
                raise ValueError(f"Lark grammar line {line}: a range needs two single "
                                 f"characters, the first not after the second ({word}.."
                                 f"{tokens[at + 2][1]})")
            return Expression(class_ebnf(((ord(low), ord(high)),)), "atom"), 1, at + 2
        value = _literal_value(word, line)
        if word.endswith("i"):
            expression, least = _regex(re.escape(value), "i", line)
            return expression, least, at
        return Expression(word, "atom"), len(value), at


def _counted(atom: Expression, length: int, tokens: list[Token], at: int,
             written_out: bool) -> tuple[Expression, int, int]:
    """``atom ~ n`` or ``atom ~ m..n`` (Lark's repetition) as ``atom{n}`` / ``atom{m,n}``, or
    ``written_out`` (for an atom that refers to a rule) as ``atom atom (atom (atom)?)?``:
    xgrammar 0.2.9 crashes the process compiling a rule that is a counted repetition of
    itself (``b ::= b{2}``), which a grammar with such an atom could otherwise produce."""
    where = tokens[at][2]
    kinds = [t[0] for t in tokens[at + 1:at + 4]]
    if kinds[:1] != ["number"]:
        raise ValueError(f"Lark grammar line {where}: '~' needs a count (~ n or ~ m..n)")
    low = high = int(tokens[at + 1][1])
    at += 2
    if kinds[1:] == ["range", "number"]:
        high = int(tokens[at + 1][1])
        at += 2
    if low > high:
        raise ValueError(f"Lark grammar line {where}: the repetition ~ {low}..{high} needs "
                         "its first count not above its second")
    if high == 0:
        return Expression('""', "atom"), 0, at
    if written_out:
        if high > _MAX_WRITTEN_OUT:
            raise ValueError(f"Lark grammar line {where}: a repetition of a rule up to "
                             f"{high} times is not supported (at most {_MAX_WRITTEN_OUT})")
        return _written_out(parenthesized(atom), low, high), low * length, at
    count = f"{{{low}}}" if low == high else f"{{{low},{high}}}"
    return Expression(parenthesized(atom) + count, "quantified"), low * length, at


_MAX_WRITTEN_OUT = 100  # copies of a repeated rule reference in the GBNF


def _written_out(item: str, low: int, high: int) -> Expression:
    """``item`` ``low`` times, then up to ``high - low`` more as nested optionals."""
    tail = ""
    for _ in range(high - low):
        tail = f"({item} {tail})?" if tail else f"({item})?"
    parts = [item] * low + ([tail] if tail else [])
    if len(parts) == 1:
        return Expression(parts[0], "atom" if parts[0] == item else "quantified")
    return Expression(" ".join(parts), "sequence")


def _alias(tokens: list[Token], at: int, aliased: bool) -> int:
    """Past ``-> name``, which Lark allows at the end of a rule's top-level alternative, the
    name a rule name (lower case)."""
    where = tokens[at][2]
    if not aliased:
        raise ValueError(f"Lark grammar line {where}: an alias (-> name) belongs at the end "
                         "of a rule's alternative, not in a group, a terminal or %ignore")
    if at + 1 == len(tokens) or tokens[at + 1][0] != "name":
        raise ValueError(f"Lark grammar line {where}: '->' without a name")
    if not re.fullmatch(r"_?[a-z][_a-z0-9]*", tokens[at + 1][1]):
        raise ValueError(f"Lark grammar line {where}: an alias names a rule, in lower case "
                         f"(not {tokens[at + 1][1]!r})")
    at += 2
    if at < len(tokens) and tokens[at][0] != "|":
        raise ValueError(f"Lark grammar line {where}: an alias (-> name) must end its "
                         "alternative")
    return at


def _literal_value(word: str, line: int) -> str:
    """The string a Lark literal ``"..."`` / ``"..."i`` stands for (Python escapes)."""
    text = word.removesuffix("i")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        raise ValueError(f"Lark grammar line {line}: invalid literal {word}") from None


def _regex(pattern: str, flags: str, line: int) -> tuple[Expression, int]:
    try:
        return regex_to_ebnf(pattern, flags)
    except ValueError as e:
        raise ValueError(f"Lark grammar line {line}: in /{pattern}/{flags}: {e}") from None
