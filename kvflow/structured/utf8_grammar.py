"""An xgrammar grammar narrowed to UTF-8 text: no UTF-16 surrogate in what it accepts.

xgrammar (0.2.9) matches a character class against the bytes of a UTF-8-like spelling of a
code point, the surrogates U+D800-U+DFFF included: their 3-byte spelling ``ED A0-BF xx`` is
not UTF-8 (the output decodes to three U+FFFD, a JSON-schema ``pattern`` or ``maxLength`` no
longer holds, strict decoders refuse it). Every negated class (``[^a]``, a JSON string's
characters), every class range that spans the surrogates (``[\\0-\\U0010ffff]``, what a
regex's ``[\\D]`` becomes) and every JSON-schema ``pattern`` (kept as a ``Regex("...")``
node until compile time) let them through, whichever way the grammar was written: EBNF, Lark
(``lark_grammar``), a regex, a JSON schema (its ``format`` and ``pattern`` strings), a
structural tag. :func:`utf8_grammar` rewrites xgrammar's own printing of the grammar (one
canonical EBNF, which it parses back) so that each of those leaves the surrogates out; a
grammar without any is returned as it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import xgrammar as xgr

from kvflow.structured.ebnf_reading import (
    COUNT,
    NAME,
    class_ranges,
    class_rules,
    code_point,
    string_end,
)
from kvflow.structured.json_pattern import json_pattern
from kvflow.structured.regex_dialect import utf8_regex
from kvflow.structured.repeat_counts import compact_repeat, literal_followers

_SURROGATES = (0xD800, 0xDFFF)
_NO_SURROGATES = r"\ud800-\udfff"
_REGEX_NODE = re.compile(r'(?<![\w])Regex\("')
_JSON_STRING_FLAG = re.compile(r'\s*,\s*json_string=true\s*\)')


def utf8_grammar(grammar: xgr.Grammar, patterns: Mapping[str, str] | None = None
                 ) -> xgr.Grammar:
    """``grammar`` accepting only UTF-8 text: its classes and JSON-schema patterns without
    the surrogates (module docstring); ``grammar`` itself when nothing changes. ``patterns``:
    the JSON-schema patterns (``json_pattern.placeholder_patterns``) by the placeholder
    ``grammar`` holds in their place.

    Raises:
        RuntimeError: from xgrammar, should it refuse its own printing rewritten (a bug).
        ValueError: for a JSON-schema pattern that does not convert (:func:`_pattern_rules`).
    """
    ebnf = printed_ebnf(grammar)
    fixed = utf8_ebnf(ebnf, patterns or {})
    return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)


def printed_ebnf(grammar: xgr.Grammar) -> str:
    """xgrammar's printing of ``grammar`` as EBNF text it parses back to the same grammar.

    xgrammar (0.2.9) prints a character below U+0100 as ``\\xHH`` but parses ``\\x`` with
    every hex digit that follows: ``"na\\xefve"`` is read back right, ``"\\xdcn\\xefc"``
    (``Ünïc``, from a JSON-schema ``enum``) as ``Ün`` U+0EFC, and ``[\\xe9a-z]`` is refused.
    Here each ``\\xHH`` is written ``\\u00HH`` (``\\u`` takes exactly four digits)."""
    text = str(grammar)
    if "\\x" not in text:
        return text
    out, i = [], 0
    while i < len(text):
        if text[i] != "\\" or i + 1 >= len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "x":
            out.append("\\u00" + text[i + 2:i + 4])
            i += 4
        else:
            out.append(text[i:i + 2])
            i += 2
    return "".join(out)


def utf8_ebnf(ebnf: str, patterns: Mapping[str, str] | None = None) -> str:
    """xgrammar's printing of a grammar (:func:`printed_ebnf`) with the surrogates left out of
    its negated classes, of its class ranges that span them and of its ``Regex("...")``
    patterns (``regex_dialect.utf8_regex``); a JSON-schema pattern (``Regex("...",
    json_string=true)``, or the placeholder of one in ``patterns``) becomes rules of its own
    (:func:`_pattern_rules`). String literals are copied as written.

    Raises:
        ValueError: for a JSON-schema pattern that does not convert (:func:`_pattern_rules`).
    """
    out, rules, i = [], [], 0
    while i < len(ebnf):
        char = ebnf[i]
        if char == '"':
            end = string_end(ebnf, i)
            out.append(ebnf[i:end])
        elif char == "R" and _REGEX_NODE.match(ebnf, i):
            start = i + len("Regex(")
            end = string_end(ebnf, start)
            pattern = _unescape(ebnf[start + 1:end - 1])
            pattern = (patterns or {}).get(pattern, pattern)
            flag = _JSON_STRING_FLAG.match(ebnf, end)
            if flag is None:
                out.append("Regex(" + json.dumps(utf8_regex(pattern), ensure_ascii=False))
            else:
                rules.append(_pattern_rules(pattern, f"kvflow_pattern_{len(rules)}_"))
                out.append(f"(kvflow_pattern_{len(rules) - 1}_root)")
                end = flag.end()
        elif char == "[":
            text, end = _character_class(ebnf, i)
            out.append(text)
        else:
            out.append(char)
            end = i + 1
        i = end
    return _inline_pattern_roots("".join(out), rules) + "".join(f"\n{r}" for r in rules)


_PATTERN_RULE = re.compile(r"^(\w+) ::= \(kvflow_pattern_(\d+)_root\)$", re.MULTILINE)


def _inline_pattern_roots(ebnf: str, rules: list[str]) -> str:
    """``ebnf`` with each string ``"\\"" name "\\""`` whose rule ``name`` is a pattern's
    (``name ::= (kvflow_pattern_N_root)``, as xgrammar writes a ``pattern`` string) holding
    the body of the pattern's root rule in place of ``name``: xgrammar fills a mask cheaply
    for a negated class repeated right before a quote it leaves out, in one rule
    (``"\\"" c{1, 100} "\\""``: 0.01 s to compile, 0.03 ms a mask), not for a rule that
    ends with the repetition (2.5 s and 0.6 ms; ``benchmarks/pattern_counts.py``)."""
    for match in _PATTERN_RULE.finditer(ebnf):
        body = rules[int(match.group(2))].split("\n", 1)[0].partition(" ::= ")[2]
        ebnf = ebnf.replace(f'"\\"" {match.group(1)} "\\""', f'"\\"" {body} "\\""')
    return ebnf


def _pattern_rules(pattern: str, prefix: str) -> str:
    """The rules of a JSON-schema ``pattern`` as JSON string contents (``json_pattern``) from
    xgrammar's regex converter, their names prefixed, the first ``<prefix>root``; each
    repetition of a rule that is more than one character class whose count passes
    ``repeat_counts.INLINE_COUNT`` written as rules shared by every count
    (``repeat_counts.compact_repeat``). A class repeated stays xgrammar's repetition at any
    count: ``json_pattern`` writes it negated, which xgrammar repeats cheaply (``.{1,3000}``:
    0.02 s to compile and 0.1 ms a mask, where the shared rules took 2 s and 7 ms); a class
    right after such a count becomes literal alternatives where they are disjoint
    (``repeat_counts.literal_followers``).

    Raises:
        ValueError: for a pattern xgrammar's regex converter refuses once rewritten (kvflow
            never hands a pattern to xgrammar's own JSON-string regex, which wrote quotes
            raw and let overlong UTF-8 through).
    """
    try:
        grammar = utf8_grammar(xgr.Grammar.from_regex(json_pattern(pattern)))
    except RuntimeError as e:
        shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
        raise ValueError(f"the pattern {shown!r} does not convert to a grammar: {e}") from None
    extra: dict[str, str] = {}
    text = _rewrite_counts(printed_ebnf(grammar).strip(), prefix, extra, negated_only=False)
    return text + "".join(f"\n{name} ::= {body}" for name, body in extra.items())


def regex_grammar(grammar: xgr.Grammar) -> xgr.Grammar:
    """``grammar`` (xgrammar's conversion of a ``regex`` constraint) as :func:`utf8_grammar`
    writes it, each count of a negated class (``[^0-9]{2,40}``) followed by a class it does not
    overlap written as literal alternatives (``repeat_counts.literal_followers``:
    ``[^0-9]{2,40}[0-9]`` 1.8 s -> 0.26 s to compile for a 49k vocabulary, masks 2.4 ->
    0.08 ms), as a JSON-schema pattern's are. A constraint's classes reach xgrammar negated
    (``xgrammar_convert.regex_text``), so a positive one's count is taken in too
    (``[a-z]{1,300}\\d``: 0.8 s -> 0.06 s). A class's count past
    ``repeat_counts.INLINE_COUNT`` that ends its sequence (``.{1,300}`` at the regex's end,
    or a group's) is written as ``repeat_counts.compact_repeat``'s shared blocks and chains:
    followed by nothing xgrammar cannot take its cheap counted form, and its own expansion
    (127 nested rules and 128 unrolled repetitions for ``{1,300}``) compiled about 2x slower
    with 3-4x slower masks (``docs/benchmarks.md``). Other counts stay as xgrammar writes them.

    Raises:
        RuntimeError: from xgrammar, should it refuse its own printing rewritten (a bug).
    """
    fixed = utf8_grammar(grammar)
    text = printed_ebnf(fixed)
    trailing: dict[str, str] = {}
    rewritten = _rewrite_counts(text, "", None, negated_only=True, trailing=trailing)
    rewritten += "".join(f"\n{name} ::= {body}" for name, body in trailing.items())
    return fixed if rewritten == text else xgr.Grammar.from_ebnf(rewritten)


def _rewrite_counts(text: str, prefix: str, extra: dict[str, str] | None,
                    negated_only: bool, trailing: dict[str, str] | None = None) -> str:
    """xgrammar's printing ``text`` with its rule names prefixed, each count of a one-class
    rule (a negated one only, if ``negated_only``) passed through :func:`_class_count`
    (``trailing`` given: one that ends its sequence written by
    ``repeat_counts.compact_repeat``, its rules added to ``trailing``) and, where ``extra``
    is given, each other count written by ``compact_repeat`` (its rules added to
    ``extra``)."""
    out, i, classes = [], 0, class_rules(text, negated_only)
    while i < len(text):
        char, name = text[i], NAME.match(text, i)
        if char == '"':
            end = string_end(text, i)
            out.append(text[i:end])
        elif char == "[":
            end = _character_class(text, i)[1]
            out.append(text[i:end])
        elif name is not None:
            end = name.end()
            count = COUNT.match(text, end)
            if count is None:
                out.append(prefix + name.group())
            elif name.group() in classes:
                text_out, end = _class_count(text, prefix, name, count, classes, trailing)
                out.append(text_out)
            elif extra is None:
                end = count.end()
                out.append(text[name.start():end])
            else:
                end = count.end()
                out.append(compact_repeat(prefix + name.group(), int(count.group(1)),
                                          int(count.group(2)), extra))
        else:
            end = i + 1
            out.append(char)
        i = end
    return "".join(out)


def _class_count(text: str, prefix: str, name: re.Match, count: re.Match,
                 classes: dict[str, list[tuple[int, int]]],
                 trailing: dict[str, str] | None) -> tuple[str, int]:
    """The count ``name{m, n}`` of a one-class rule (``text[name.start():count.end()]``),
    its name prefixed, and the position after what was written: a class right after it
    (``name{1, 300} [0-9]``) is taken in as literal alternatives where
    ``repeat_counts.literal_followers`` says so; with ``trailing``, a count that ends its
    sequence (``)`` after it) is ``repeat_counts.compact_repeat``'s (rules added to
    ``trailing``; xgrammar's own up to ``INLINE_COUNT``)."""
    repeat, end = prefix + text[name.start():count.end()], count.end()
    if trailing is not None and text.startswith(")", end):
        return compact_repeat(prefix + name.group(), int(count.group(1)),
                              int(count.group(2)), trailing), end
    if not text.startswith(" [", end):
        return repeat, end
    follower, after = class_ranges(text, end + 1)
    written = literal_followers(repeat, int(count.group(2)), classes[name.group()], follower)
    return (repeat, end) if written is None else (written, after)


def _character_class(ebnf: str, start: int) -> tuple[str, int]:
    """The class at ``ebnf[start] == "["`` without the surrogates, and the position after it."""
    negated = ebnf.startswith("^", start + 1)
    i = start + 2 if negated else start + 1
    items: list[tuple[int, int, str]] = []  # (low, high, text as printed)
    while i < len(ebnf) and ebnf[i] != "]":
        low, at = code_point(ebnf, i)
        high = low
        if ebnf.startswith("-", at) and not ebnf.startswith("-]", at):
            high, at = code_point(ebnf, at + 1)
        items.append((low, high, ebnf[i:at]))
        i = at
    end = i + 1
    if negated:
        if any(low <= _SURROGATES[0] and high >= _SURROGATES[1] for low, high, _ in items):
            return ebnf[start:end], end
        return ebnf[start:i] + _NO_SURROGATES + "]", end
    if not any(low <= _SURROGATES[1] and high >= _SURROGATES[0] for low, high, _ in items):
        return ebnf[start:end], end
    return "[" + "".join(_outside_surrogates(*item) for item in items) + "]", end


def _outside_surrogates(low: int, high: int, text: str) -> str:
    """A class item (``low``-``high``, printed ``text``) without the surrogates."""
    if high < _SURROGATES[0] or low > _SURROGATES[1]:
        return text
    parts = [(low, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, high)]
    return "".join(_escape(a) + ("" if a == b else "-" + _escape(b)) for a, b in parts if a <= b)


def _escape(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _unescape(body: str) -> str:
    """The text of a printed EBNF string literal's body (its C-style escapes read)."""
    out, i = [], 0
    while i < len(body):
        code, i = code_point(body, i)
        out.append(chr(code))
    return "".join(out)
