"""Lark grammars converted to the GBNF / EBNF that xgrammar reads.

vLLM accepts grammars in Lark's syntax (``start: "yes" | "no"``); xgrammar, kvflow's grammar
engine, reads GBNF rules (``root ::= "yes" | "no"``). :func:`lark_to_gbnf` converts the subset
of Lark below, following Lark's grammar reference
(https://lark-parser.readthedocs.io/en/latest/grammar.html):

- ``//`` comments, blank lines;
- rule and terminal definitions ``name: expansion``, ``?name:`` and ``!name:`` (the tree
  shaping markers are dropped: they do not change the language), ``NAME.2:`` (the priority is
  dropped: GBNF has no lexer to prioritise);
- alternatives ``a | b``, also on continuation lines that start with ``|``;
- references to rules and terminals, double-quoted literals ``"..."`` (escapes passed on as
  written: xgrammar reads ``\\n``, ``\\t``, ``\\"``, ``\\\\``, ``\\xHH``, ``\\uHHHH`` ...);
- grouping ``( ... )``, optional ``[ ... ]`` (GBNF ``( ... )?``), quantifiers ``?``, ``*``,
  ``+``;
- the start rule ``start`` becomes GBNF's ``root``.

Everything else (regular-expression terminals ``/.../``, ``%import``, ``%ignore``,
``%declare`` and other directives, templates ``name{x}``, aliases ``-> name``, ranges
``"a".."z"``, repetition ``~ n``, case-insensitive literals ``"..."i``) is a ValueError naming
the construct and the line. The output has one rule a line, in the order of definition, the
items of an expansion separated by one space.
"""

from __future__ import annotations

import re

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

_UNSUPPORTED = {
    "regex": "regular-expression terminals (/.../) are not supported; write them as GBNF "
             "character classes",
    "range": 'ranges ("a".."z") are not supported; write them as GBNF character classes '
             "([a-z])",
    "alias": "aliases (-> name) are not supported; leave them out",
    "~": "repetition counts (~ n) are not supported; write the repetitions out",
    "{": "templates (name{...}) are not supported",
    "}": "templates (name{...}) are not supported",
    "%": "directives (%import, %ignore, %declare ...) are not supported",
}
_DIRECTIVES = {
    "%import": "%import is not supported; write the imported rules out",
    "%ignore": "%ignore is not supported (GBNF skips nothing); write the whitespace into the "
               "rules",
    "%declare": "%declare is not supported (a declared terminal has no definition)",
}

Token = tuple[str, str, int]  # (kind, text, line number)


def looks_like_lark(text: str) -> bool:
    """True for grammar text written in Lark's syntax: no GBNF ``::=`` and at least one line
    that starts a definition ``name: ...`` (``?name:``, ``NAME.2:`` too)."""
    return "::=" not in text and any(_DEFINITION.match(line) for line in text.split("\n"))


def lark_to_gbnf(text: str) -> str:
    """The GBNF (xgrammar's EBNF) for a Lark grammar of the subset in the module docstring.

    Args:
        text: the Lark grammar.

    Returns:
        GBNF text, one ``name ::= ...`` rule a line, ``start`` renamed ``root``.

    Raises:
        ValueError: for a construct outside the subset, a syntax error, a rule defined twice
            or referenced but not defined, a grammar without a ``start`` rule or with a rule
            named ``root``; the message names the construct and its line
            (``Lark grammar line 3: ...``).
    """
    definitions = _definitions(text)
    names = {name: line for name, line, _ in definitions}
    if "start" not in names:
        raise ValueError("Lark grammar: no 'start' rule (the start rule, which becomes GBNF's "
                         "'root')")
    if "root" in names:
        raise ValueError(f"Lark grammar line {names['root']}: a rule named 'root' is not "
                         "supported ('start' becomes GBNF's start rule 'root'); rename it")
    rules = []
    for name, line, tokens in definitions:
        for kind, word, at in tokens:
            if kind == "name" and word not in names:
                raise ValueError(f"Lark grammar line {at}: '{word}' is not defined")
        body, _ = _alternatives(tokens, 0, None, line)
        rules.append(f"{_gbnf_name(name)} ::= {body}")
    return "\n".join(rules)


def _gbnf_name(name: str) -> str:
    return "root" if name == "start" else name


def _definitions(text: str) -> list[tuple[str, int, list[Token]]]:
    """(name, line, expansion tokens) per definition, continuation lines joined."""
    definitions: list[tuple[str, int, list[Token]]] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            continue
        if stripped.startswith("%"):
            word = stripped.split()[0]
            raise ValueError(f"Lark grammar line {number}: "
                             + _DIRECTIVES.get(word, _UNSUPPORTED["%"]))
        if stripped.startswith("|"):
            if not definitions:
                raise ValueError(f"Lark grammar line {number}: a '|' line before any "
                                 "definition")
            definitions[-1][2].extend(_tokens(line, number))
            continue
        if _TEMPLATE.match(line):
            raise ValueError(f"Lark grammar line {number}: {_UNSUPPORTED['{']}")
        found = _DEFINITION.match(line)
        if found is None:
            raise ValueError(f"Lark grammar line {number}: expected a definition 'name: ...' "
                             "or a continuation line starting with '|'")
        name = found[2]
        if name in seen:
            raise ValueError(f"Lark grammar line {number}: '{name}' is defined twice (first "
                             f"on line {seen[name]})")
        seen[name] = number
        definitions.append((name, number, _tokens(line[found.end():], number)))
    return definitions


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
        if kind in _UNSUPPORTED:
            raise ValueError(f"Lark grammar line {number}: {_UNSUPPORTED[kind]}")
        if kind == "literal" and word.endswith("i"):
            raise ValueError(f'Lark grammar line {number}: case-insensitive literals ("..."i) '
                             "are not supported")
        if kind != "space":
            out.append((word if kind == "op" else kind, word, number))
    return out


# Recursive descent over one definition's tokens:
#   alternatives := sequence ('|' sequence)*
#   sequence     := item*            (empty -> "")
#   item         := atom ('?' | '*' | '+')?
#   atom         := name | literal | '(' alternatives ')' | '[' alternatives ']'

def _alternatives(tokens: list[Token], at: int, closer: str | None,
                  line: int) -> tuple[str, int]:
    parts = []
    while True:
        sequence, at = _sequence(tokens, at, line)
        parts.append(sequence)
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
    return " | ".join(parts), at


def _sequence(tokens: list[Token], at: int, line: int) -> tuple[str, int]:
    items = []
    while at < len(tokens) and tokens[at][0] not in ("|", ")", "]"):
        kind, word, where = tokens[at]
        if kind in ("?", "*", "+"):
            raise ValueError(f"Lark grammar line {where}: {word!r} follows nothing")
        if kind in ("(", "["):
            closer = ")" if kind == "(" else "]"
            inner, at = _alternatives(tokens, at + 1, closer, where)
            atom = f"({inner})"
            optional = kind == "["
        else:
            atom = _gbnf_name(word) if kind == "name" else word
            optional = False
        at += 1
        quantifier = tokens[at][0] if at < len(tokens) and tokens[at][0] in ("?", "*", "+") else ""
        at += bool(quantifier)
        if optional:  # [x] = (x)?; [x]? = (x)?; [x]* = [x]+ = (x)*
            quantifier = "?" if quantifier in ("", "?") else "*"
        items.append(atom + quantifier)
    return (" ".join(items) if items else '""'), at
