"""xgrammar's error messages in the user's terms: the location prefix removed, an EBNF
parser error placed in the grammar's text (line, column in characters, the text before it),
and a hint for a grammar written in Lark's syntax."""

from __future__ import annotations

import re

from kvflow.structured.lark_grammar import looks_like_lark

# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "; users need only the rest.
_LOCATION_RE = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


def clean_error(error: Exception) -> str:
    """``error``'s text (xgrammar's) on one line, each line's location prefix removed."""
    lines = [_LOCATION_RE.sub("", line) for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line).strip()


# xgrammar's EBNF errors: "EBNF parser error at line 2, column 1: Expect element, but got x";
# at the end of the grammar the "got" part is empty and the column counts UTF-8 bytes.
_EBNF_ERROR = re.compile(r"EBNF (?:lexer|parser) error at line (\d+), column (\d+): (.*)",
                         re.DOTALL)
_ELEMENT = ('an element (a "quoted string", a [character class], a rule name or a '
            '(parenthesized group))')


def grammar_error(spec: str, message: str) -> str:
    """An EBNF error (``message``, xgrammar's, location prefix removed) in the grammar's
    terms: where (line, column in characters, and the grammar text just before it), what
    was expected and what the grammar has there (its next word, or ``the end of the
    grammar``: xgrammar's own message then ends in an empty "but got"). A message of
    another shape is returned unchanged."""
    found = _EBNF_ERROR.search(message)
    if found is None:
        return message + lark_hint(spec)
    line, byte_column, what = int(found[1]), int(found[2]), found[3].strip()
    lines = spec.split("\n")
    text = lines[line - 1].encode() if line <= len(lines) else b""
    head = text[:byte_column - 1].decode(errors="ignore")
    before = "\n".join([*lines[:line - 1], head])
    after = "\n".join([text[byte_column - 1:].decode(errors="ignore"), *lines[line:]])
    if what.startswith("Expect "):  # "Expect )", "Expect element, but got x"
        expected, _, got = what.removeprefix("Expect ").partition(", but got")
        expected = _ELEMENT if expected.strip() == "element" else repr(expected.strip())
        got = got.strip() or (after.split()[0] if after.strip() else "")
        got = repr(got) if got else "the end of the grammar"
        what = f"expected {expected}, but got {got}"
    shown = before.strip()[-40:]
    where = f"line {line}, column {len(head) + 1}" + (f" (after {shown!r})" if shown else "")
    return f"{where}: {what}" + lark_hint(spec)


def lark_hint(spec: str) -> str:
    """For a grammar written in Lark's syntax that kvflow could not convert
    (``lark_grammar``): a sentence saying which syntax kvflow reads; else empty."""
    if not looks_like_lark(spec):
        return ""
    return (" (this looks like a Lark grammar, rules written 'name: ...'; kvflow reads "
            "GBNF / EBNF, rules written 'name ::= ...' with 'root' the start rule, and "
            "converts Lark's rules, literals, ranges, /regex/ terminals, groups, "
            "quantifiers, %import common and %ignore)")


def quoted_head(text: str, limit: int = 200) -> str:
    """``text`` quoted (``repr``), cut to ``limit`` characters with "..." when longer."""
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")
