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
  ``+``, repetition ``x ~ n`` / ``x ~ m..n`` (GBNF ``x{n}`` / ``x{m,n}``);
- ``%import common.NAME``, ``%import common.NAME -> ALIAS``, ``%import common (A, B)`` for the
  terminals of Lark's ``common.lark`` (``lark_common``);
- ``%ignore TERMINAL`` / ``%ignore "..."`` / ``%ignore /.../``: Lark's lexer drops the ignored
  terminals between any two tokens. The GBNF follows every terminal occurrence in a rule
  (a named terminal, a literal or a regex written in a rule, not the parts of a terminal's
  own definition) by the ignore expression ``(ignored_1 | ignored_2 ...)*`` (``[ \t...]*``
  for ``WS``), and starts with it: ``root ::= <ignore> start``. So between two adjacent
  tokens, before the first and after the last, any run of ignored terminals is accepted, and
  nowhere inside a token.

A terminal becomes one GBNF rule whose body has the terminals it refers to written inline
(Lark too compiles a terminal to one regex); the parts of an imported terminal get no rule of
their own. Both this and the inline ignore expression are for xgrammar's speed: per-token mask
time for ``start: WORD+`` with ``%ignore WS`` and a 49k-token vocabulary was 61 ms with a rule
per terminal and a separate ``__ignore`` rule, 0.06 ms so.

The language is the grammar's read as a context-free grammar whose terminals are regular
languages: what Lark's Earley parser accepts with ``lexer="dynamic_complete"``. Lark's other
lexers match each terminal once (the regex's first match, not every length), so they can
reject strings of that language (``NAME "s"`` with ``NAME: /[a-z]+/`` on ``cats``). Even
``dynamic_complete`` tries only the prefixes of a terminal's first match (``/a|ab/`` never
matches ``ab``) and skips an ignored terminal by its first match only, which differs when a
token can begin with what an ignored terminal can end with.

Refused (ValueError naming the construct and the line): ``%declare``, ``%override``,
``%extend`` and other directives, imports other than common.lark's terminals, templates
``name{x}``, terminals that match the empty string or refer to rules or
to themselves (Lark refuses them too), the regex constructs ``lark_regex`` refuses, a rule
named ``root``. The output has one rule a line, in the order of
definition (imported terminals after the grammar's own), items separated by one space.
"""

from __future__ import annotations

import re

from kvflow.structured.lark_common import COMMON_TERMINALS
from kvflow.structured.lark_expansion import (
    Definition,
    ExpansionConverter,
    Token,
    gbnf_name,
    is_terminal,
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
  | (?P<number>\d+)
  | (?P<op>[|()\[\]?*+~])
""", re.VERBOSE)
_IMPORT = re.compile(r"%import\s+(?:common\.(\w+)(?:\s*->\s*(\w+))?|common\s*\(([\w\s,]*)\))"
                     r"\s*(?://.*)?$")

_UNSUPPORTED = {
    "{": "templates (name{...}) are not supported",
    "}": "templates (name{...}) are not supported",
    "%": "directives other than %import and %ignore (%declare, %override ...) are not "
         "supported",
}
_DIRECTIVES = {
    "%declare": "%declare is not supported (a declared terminal has no definition)",
}

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
        ``%ignore`` a first rule ``root ::= <ignore expression> start``.

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
    if "root" in names:
        raise ValueError(f"Lark grammar line {names['root'].line}: a rule named 'root' is not "
                         "supported ('start' becomes GBNF's start rule 'root'); rename it")
    converter = ExpansionConverter(names, ignored)
    rules = [f"root ::= {converter.ignore} start"] if converter.ignore else []
    for d in definitions:
        if d.name.startswith("COMMON__"):  # an imported terminal's part: written inline
            continue
        body = converter.expansion(d.tokens, d.line, in_rule=not d.terminal)
        rules.append(f"{gbnf_name(d.name, bool(ignored))} ::= {body.text}")
    converter.check_terminals()
    return "\n".join(rules)


def _definitions(text: str) -> tuple[list[Definition], list[tuple[list[Token], int]]]:
    """The definitions (continuation lines joined, imported terminals appended) and the
    token lists of the ``%ignore`` lines."""
    definitions: list[Definition] = []
    imported: list[Definition] = []
    ignored: list[tuple[list[Token], int]] = []
    continued = False  # whether a '|' line continues a definition here
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("|"):
            if not continued:
                raise ValueError(f"Lark grammar line {number}: a '|' line continues no "
                                 "definition (it follows a directive or starts the grammar)")
            definitions[-1].tokens.extend(_tokens(line, number))
            continue
        continued = not stripped.startswith("%")
        if stripped.startswith("%ignore"):
            ignored.append((_tokens(stripped[len("%ignore"):], number), number))
        elif stripped.startswith("%import"):
            imported.extend(_imports(stripped, number))
        elif stripped.startswith("%"):
            word = stripped.split()[0]
            raise ValueError(f"Lark grammar line {number}: "
                             + _DIRECTIVES.get(word, _UNSUPPORTED["%"]))
        else:
            definitions.append(_definition(line, number))
    unique: dict[str, Definition] = {}
    for d in definitions:
        if d.terminal and not d.tokens:
            raise ValueError(f"Lark grammar line {d.line}: terminal '{d.name}' has an empty "
                             "definition (Lark: terminals cannot be empty)")
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
    tokens = _tokens(line[found.end():], number)
    return Definition(name, number, tokens, is_terminal(name))


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
        if not is_terminal(alias):
            raise ValueError(f"Lark grammar line {number}: common.{name} is a terminal; "
                             f"import it under an upper-case name, not {alias!r}")
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
