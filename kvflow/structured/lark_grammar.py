"""Lark grammars converted to the GBNF / EBNF that xgrammar reads.

vLLM accepts grammars in Lark's syntax (``start: "yes" | "no"``); xgrammar, kvflow's grammar
engine, reads GBNF rules (``root ::= "yes" | "no"``). :func:`lark_to_gbnf` converts the subset
of Lark below, following Lark's grammar reference
(https://lark-parser.readthedocs.io/en/latest/grammar.html):

- ``//`` comments, blank lines;
- rule and terminal definitions ``name: expansion``, ``?name:`` and ``!name:`` (the tree
  shaping markers are dropped: they do not change the language), ``NAME.2:`` (the priority is
  dropped: it picks between tokenizations, GBNF accepts any);
- alternatives ``a | b``, also on continuation lines that start with ``|``; aliases
  ``-> name`` at the end of an alternative (a tree name: dropped);
- references to rules and terminals, double-quoted literals ``"..."`` (escapes passed on as
  written: xgrammar reads ``\\n``, ``\\t``, ``\\"``, ``\\\\``, ``\\xHH``, ``\\uHHHH`` ...),
  case-insensitive literals ``"..."i``, ranges ``"a".."z"``;
- regular-expression terminals ``/.../flags`` (flags of ``imsux``), translated by
  ``lark_regex.regex_to_ebnf`` (which lists the regex constructs it refuses);
- grouping ``( ... )``, optional ``[ ... ]`` (GBNF ``( ... )?``), quantifiers ``?``, ``*``,
  ``+``;
- ``%import common.NAME``, ``%import common.NAME -> ALIAS``, ``%import common (A, B)`` for the
  terminals of Lark's ``common.lark`` (``lark_common``);
- ``%ignore TERMINAL`` / ``%ignore "..."`` / ``%ignore /.../``: Lark's lexer drops the ignored
  terminals between any two tokens. The GBNF follows every terminal occurrence in a rule
  (a named terminal, a literal or a regex written in a rule, not the parts of a terminal's
  own definition) by ``__ignore ::= (ignored_1 | ignored_2 ...)*``, and starts with it:
  ``root ::= __ignore start``. So between two adjacent tokens, before the first and after
  the last, any run of ignored terminals is accepted, and nowhere inside a token.

The language is the grammar's read as a context-free grammar whose terminals are regular
languages: what Lark's Earley parser accepts with ``lexer="dynamic_complete"``. Lark's other
lexers match each terminal once (the regex's first match, not every length), so they can
reject strings of that language (``NAME "s"`` with ``NAME: /[a-z]+/`` on ``cats``).

Refused (ValueError naming the construct and the line): ``%declare``, ``%override``,
``%extend`` and other directives, imports other than common.lark's terminals, templates
``name{x}``, repetition ``~ n``, terminals that match the empty string or refer to rules or
to themselves (Lark refuses them too), the regex constructs ``lark_regex`` refuses, a rule
named ``root`` or starting with ``__``. The output has one rule a line, in the order of
definition (imported terminals after the grammar's own), items separated by one space.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import NamedTuple

from kvflow.structured.lark_common import COMMON_TERMINALS
from kvflow.structured.lark_regex import (
    Expression,
    class_ebnf,
    parenthesized,
    regex_to_ebnf,
)

# a definition line: optional ?/! marker, name, optional priority, ':' (not '::=')
_DEFINITION = re.compile(r"\s*([?!]?)([_A-Za-z]\w*)(\.-?\d+)?\s*:(?!:=)")
_TEMPLATE = re.compile(r"\s*[?!]?[_A-Za-z]\w*\s*\{")
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>//.*)
  | (?P<literal>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[a-z]*)
  | (?P<name>[_A-Za-z]\w*)
  | (?P<range>\.\.)
  | (?P<alias>->)
  | (?P<op>[|()\[\]?*+])
""", re.VERBOSE)
_IMPORT = re.compile(r"%import\s+(?:common\.(\w+)(?:\s*->\s*(\w+))?|common\s*\(([\w\s,]*)\))"
                     r"\s*(?://.*)?$")
IGNORE_RULE = "__ignore"

_UNSUPPORTED = {
    "~": "repetition counts (~ n) are not supported; write the repetitions out",
    "{": "templates (name{...}) are not supported",
    "}": "templates (name{...}) are not supported",
    "%": "directives other than %import and %ignore (%declare, %override ...) are not "
         "supported",
}
_DIRECTIVES = {
    "%declare": "%declare is not supported (a declared terminal has no definition)",
}

Token = tuple[str, str, int]  # (kind, text, line number)


class Definition(NamedTuple):
    """One rule or terminal: its GBNF name, line, expansion tokens, and whether it is a
    terminal (Lark: an upper-case name)."""

    name: str
    line: int
    tokens: list[Token]
    terminal: bool


def looks_like_lark(text: str) -> bool:
    """True for grammar text written in Lark's syntax: no GBNF ``::=`` and at least one line
    that starts a definition ``name: ...`` (``?name:``, ``NAME.2:`` too)."""
    return "::=" not in text and any(_DEFINITION.match(line) for line in text.split("\n"))


def lark_to_gbnf(text: str) -> str:
    """The GBNF (xgrammar's EBNF) for a Lark grammar of the subset in the module docstring.

    Args:
        text: the Lark grammar.

    Returns:
        GBNF text, one ``name ::= ...`` rule a line; ``start`` renamed ``root``, or with
        ``%ignore`` a first rule ``root ::= __ignore start`` and a last rule ``__ignore``.

    Raises:
        ValueError: for a construct outside the subset, a syntax error, a rule defined twice
            or referenced but not defined, a grammar without a ``start`` rule or with a rule
            named ``root``; the message names the construct and its line
            (``Lark grammar line 3: ...``).
    """
    definitions, ignored = _definitions(text)
    names = {d.name: d for d in definitions}
    if "start" not in names:
        raise ValueError("Lark grammar: no 'start' rule (the start rule, which becomes GBNF's "
                         "'root')")
    for name, d in names.items():
        if name == "root" or name.startswith("__"):
            raise ValueError(f"Lark grammar line {d.line}: a rule named {name!r} is not "
                             "supported ('start' becomes GBNF's start rule 'root', names "
                             "starting '__' are kvflow's); rename it")
    converter = _Converter(names, ignore=bool(ignored))
    rules = ([f"root ::= {IGNORE_RULE} start"] if ignored else [])
    for d in definitions:
        body = converter.expansion(d.tokens, d.line, in_rule=not d.terminal)
        rules.append(f"{_gbnf_name(d.name, bool(ignored))} ::= {body.text}")
    if ignored:
        rules.append(f"{IGNORE_RULE} ::= {converter.ignore_rule(ignored)}")
    converter.check_terminals()
    return "\n".join(rules)


def _gbnf_name(name: str, ignore: bool) -> str:
    return "root" if name == "start" and not ignore else name


def _is_terminal(name: str) -> bool:
    return name.isupper()  # Lark's rule: TERMINAL (also _TERMINAL), rule (also _rule)


def _definitions(text: str) -> tuple[list[Definition], list[tuple[list[Token], int]]]:
    """The definitions (continuation lines joined, imported terminals appended) and the
    token lists of the ``%ignore`` lines."""
    definitions: list[Definition] = []
    imported: list[Definition] = []
    ignored: list[tuple[list[Token], int]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%ignore"):
            ignored.append((_tokens(stripped[len("%ignore"):], number), number))
        elif stripped.startswith("%import"):
            imported.extend(_imports(stripped, number))
        elif stripped.startswith("%"):
            word = stripped.split()[0]
            raise ValueError(f"Lark grammar line {number}: "
                             + _DIRECTIVES.get(word, _UNSUPPORTED["%"]))
        elif stripped.startswith("|"):
            if not definitions:
                raise ValueError(f"Lark grammar line {number}: a '|' line before any "
                                 "definition")
            definitions[-1].tokens.extend(_tokens(line, number))
        else:
            definitions.append(_definition(line, number))
    unique: dict[str, Definition] = {}
    for d in definitions + imported:
        if d.name in unique:
            if d.name.startswith("COMMON__"):  # a dependency two imports share
                continue
            raise ValueError(f"Lark grammar line {d.line}: '{d.name}' is defined twice "
                             f"(first on line {unique[d.name].line})")
        unique[d.name] = d
    return list(unique.values()), ignored


def _definition(line: str, number: int) -> Definition:
    if _TEMPLATE.match(line):
        raise ValueError(f"Lark grammar line {number}: {_UNSUPPORTED['{']}")
    found = _DEFINITION.match(line)
    if found is None:
        raise ValueError(f"Lark grammar line {number}: expected a definition 'name: ...' "
                         "or a continuation line starting with '|'")
    name = found[2]
    return Definition(name, number, _tokens(line[found.end():], number), _is_terminal(name))


def _imports(line: str, number: int) -> list[Definition]:
    """The definitions ``%import common...`` brings: each named terminal under its alias,
    the terminals it refers to under ``COMMON__NAME``."""
    found = _IMPORT.match(line)
    if found is None:
        raise ValueError(f"Lark grammar line {number}: {line!r} is not supported; kvflow "
                         "imports the terminals of Lark's common.lark only (%import "
                         "common.NAME, %import common.NAME -> ALIAS, %import common (A, B))")
    if found[1]:
        pairs = [(found[1], found[2] or found[1])]
    else:
        pairs = [(n, n) for n in re.split(r"[\s,]+", found[3].strip()) if n]
    out: list[Definition] = []
    for name, alias in pairs:
        if name not in COMMON_TERMINALS:
            raise ValueError(f"Lark grammar line {number}: common.{name} is not supported; "
                             "kvflow imports these terminals of common.lark: "
                             + ", ".join(n for n in COMMON_TERMINALS if not n.startswith("_")))
        out.extend(_imported(name, alias, number))
    return out


def _imported(name: str, alias: str, number: int) -> list[Definition]:
    tokens = [(k, f"COMMON__{w}" if k == "name" else w, number)
              for k, w, _ in _tokens(COMMON_TERMINALS[name], number)]
    out = [Definition(alias, number, tokens, True)]
    for _, word, _ in tokens:
        if word.startswith("COMMON__"):
            dependency = word.removeprefix("COMMON__")
            out.extend(_imported(dependency, word, number))
    return out


def _tokens(text: str, number: int) -> list[Token]:
    out: list[Token] = []
    at = 0
    while at < len(text):
        found = _TOKEN.match(text, at)
        if found is None:
            char = text[at]
            what = _UNSUPPORTED.get(char) or (
                "unterminated literal" if char == '"' else f"unexpected character {char!r}")
            raise ValueError(f"Lark grammar line {number}: {what}")
        kind, word = found.lastgroup, found.group()
        at = found.end()
        if kind == "comment":
            break
        if kind != "space":
            out.append((word if kind == "op" else kind, word, number))
    return out


class _Converter:
    """Recursive descent over one definition's tokens, writing GBNF:

        alternatives := sequence ('|' sequence)*
        sequence     := item* ('->' name)?          (empty -> ""; the alias is dropped)
        item         := atom ('?' | '*' | '+')?
        atom         := name | literal ('..' literal)? | regex | '(' alternatives ')'
                      | '[' alternatives ']'

    Each step returns (expression, least length in characters); in a rule with ``%ignore``,
    each token is followed by ``__ignore``. The least lengths find zero-width terminals.
    """

    def __init__(self, definitions: dict[str, Definition], ignore: bool) -> None:
        self.definitions = definitions
        self.ignore = ignore
        self.lexed: dict[str, int] = {}  # terminals used as tokens -> a line using them
        self.least: dict[str, int | None] = {}  # terminal -> least length (None: visiting)

    def expansion(self, tokens: list[Token], line: int, in_rule: bool) -> Expression:
        """The GBNF for one definition's (or ``%ignore`` line's) tokens."""
        return self._expansion(tokens, line, in_rule)[0]

    def ignore_rule(self, ignored: list[tuple[list[Token], int]]) -> str:
        """``(a | b ...)*`` over the ignored terminals, a top-level ``+`` of each dropped
        (``(x+)* = x*``, which keeps xgrammar's parse unambiguous).

        Raises:
            ValueError: for an ignored literal or regex that matches the empty string.
        """
        items = []
        for tokens, line in ignored:
            expression, least = self._expansion(tokens, line, in_rule=False)
            if len(tokens) == 1 and tokens[0][0] == "name" and _is_terminal(tokens[0][1]):
                self.lexed.setdefault(tokens[0][1], line)  # checked by check_terminals
                definition = self.definitions[tokens[0][1]]
                expression = self._expansion(definition.tokens, definition.line, False)[0]
            elif least == 0:
                raise ValueError(f"Lark grammar line {line}: %ignore "
                                 f"{' '.join(t[1] for t in tokens)} matches the empty string "
                                 "(Lark refuses zero-width terminals)")
            if expression.kind == "quantified" and expression.text.endswith("+"):
                expression = Expression(expression.text[:-1], "atom")
            items.append(expression)
        if len(items) == 1:
            return parenthesized(items[0]) + "*"
        return "(" + " | ".join(e.text for e in items) + ")*"

    def check_terminals(self) -> None:
        """Raises ValueError for a terminal used as a token that matches the empty string."""
        for name, line in self.lexed.items():
            if self._least(name, line) == 0:
                raise ValueError(f"Lark grammar line {line}: terminal '{name}' matches the "
                                 "empty string (Lark refuses zero-width terminals)")

    def _expansion(self, tokens: list[Token], line: int, in_rule: bool) -> tuple[Expression, int]:
        expression, least, _ = self._alternatives(tokens, 0, None, line, in_rule)
        return expression, least

    def _least(self, name: str, line: int) -> int:
        if name in self.least:
            if self.least[name] is None:
                raise ValueError(f"Lark grammar line {line}: terminal '{name}' refers to "
                                 "itself (Lark terminals cannot be recursive)")
            return self.least[name]
        self.least[name] = None
        definition = self.definitions[name]
        self.least[name] = self._expansion(definition.tokens, definition.line, False)[1]
        return self.least[name]

    def _alternatives(self, tokens: list[Token], at: int, closer: str | None, line: int,
                      in_rule: bool) -> tuple[Expression, int, int]:
        parts, least = [], None
        while True:
            sequence, length, at = self._sequence(tokens, at, line, in_rule)
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

    def _sequence(self, tokens: list[Token], at: int, line: int,
                  in_rule: bool) -> tuple[Expression, int, int]:
        items, least = [], 0
        while at < len(tokens) and tokens[at][0] not in ("|", ")", "]"):
            kind, word, where = tokens[at]
            if kind == "alias":
                if at + 1 == len(tokens) or tokens[at + 1][0] != "name":
                    raise ValueError(f"Lark grammar line {where}: '->' without a name")
                at += 2
                if at < len(tokens) and tokens[at][0] not in ("|", ")", "]"):
                    raise ValueError(f"Lark grammar line {where}: an alias (-> name) must "
                                     "end its alternative")
                break
            if kind in ("?", "*", "+"):
                raise ValueError(f"Lark grammar line {where}: {word!r} follows nothing")
            atom, length, at = self._atom(tokens, at, in_rule)
            quantifier = tokens[at][0] if at < len(tokens) and tokens[at][0] in "?*+" else ""
            at += bool(quantifier)
            if kind == "[":  # [x] = (x)?; [x]? = (x)?; [x]* = [x]+ = (x)*
                quantifier = "?" if quantifier in ("", "?") else "*"
            if quantifier:
                atom = Expression(parenthesized(atom) + quantifier, "quantified")
            items.append(atom)
            least += 0 if quantifier in ("?", "*") else length
        if not items:
            return Expression('""', "atom"), 0, at
        if len(items) == 1:
            return items[0], least, at
        return Expression(" ".join(i.text if i.kind != "alternatives" else f"({i.text})"
                                   for i in items), "sequence"), least, at

    def _atom(self, tokens: list[Token], at: int, in_rule: bool) -> tuple[Expression, int, int]:
        """One atom (a token in a rule followed by ``__ignore`` when there is ``%ignore``)."""
        kind, word, where = tokens[at]
        if kind in ("(", "["):
            inner, least, at = self._alternatives(tokens, at + 1, ")" if kind == "(" else "]",
                                                  where, in_rule)
            return Expression(f"({inner.text})", "atom"), least, at + 1
        if kind == "name":
            expression, least = self._reference(word, where, in_rule)
            token = in_rule and _is_terminal(word)
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
            expression = Expression(f"{parenthesized(expression)} {IGNORE_RULE}", "sequence")
        return expression, least, at + 1

    def _reference(self, name: str, line: int, in_rule: bool) -> tuple[Expression, int]:
        if name not in self.definitions:
            raise ValueError(f"Lark grammar line {line}: '{name}' is not defined")
        if not _is_terminal(name):
            if not in_rule:
                raise ValueError(f"Lark grammar line {line}: a terminal refers to the rule "
                                 f"'{name}' (Lark terminals refer to terminals only)")
            return Expression(_gbnf_name(name, self.ignore), "atom"), 1
        if in_rule:
            self.lexed.setdefault(name, line)
            return Expression(name, "atom"), 1  # zero width is checked on the definition
        return Expression(name, "atom"), self._least(name, line)

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
