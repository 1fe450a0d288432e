"""JSON-schema patterns with counts past 32, and the patterns of structural tags' ``format``
schemas: converted by kvflow (``json_pattern``, ``repeat_counts``) into JSON text in UTF-8.

Before, a count past 32 (``^[^a-z]{40}$``) was left to xgrammar's own JSON-string regex,
which accepted overlong UTF-8 (``E0 81 88``) and matched no text at all for a pattern with a
literal quote, backslash or newline (``^a"x{40}$``: the request could only end at max_tokens);
and a ``format`` structural tag's ``json_schema`` wrote a pattern's quote raw (``^a"b$`` took
``"a"b"``). The oracles: Python's strict UTF-8 decoder, ``json.loads`` and ``re.fullmatch``
on the decoded value."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from kvflow.structured import StructuredOutputsParams
from kvflow.structured.repeat_counts import BLOCK, INLINE_COUNT


@pytest.fixture(scope="module")
def backend(tiny_llama):
    from transformers import AutoTokenizer

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    return XgrammarBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _matcher(backend, params: StructuredOutputsParams) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(backend.compile(params), terminate_without_stop_token=True)


def _accepts(backend, params: StructuredOutputsParams, data: bytes) -> bool:
    matcher = _matcher(backend, params)
    return matcher.accept_string(data) and matcher.is_terminated()


def _oracle(pattern: str, data: bytes) -> bool:
    """Whether ``data`` is a JSON string in UTF-8 whose value matches ``pattern``."""
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError
        return False
    return isinstance(value, str) and re.search(pattern, value) is not None


def _tag(schema: dict, style: str | None = None) -> str:
    content = {"type": "json_schema", "json_schema": schema}
    if style is not None:
        content["style"] = style
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<t>", "content": content, "end": "</t>"}})


def _string(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


# (pattern, JSON texts that must be accepted, byte strings that must not)
LARGE_COUNTS = [
    ("^[^a-z]{40}$", ['"' + "é" * 40 + '"', '"' + "😀" * 40 + '"'],
     [b'"' + b"\xe0\x81\x88" * 40 + b'"', b'"' + b"\xf0\x8f\xbf\xbf" * 40 + b'"']),
    ("^x.{1,300}$", ['"x' + "é" * 299 + '"', '"x😀"'],
     [b'"x\xe0\x9f\xae"', b'"x\xf0\x80\x80\x80"']),
    ('^a"x{40}$', ['"a\\"' + "x" * 40 + '"'], [b'"a"' + b"x" * 40 + b'"']),
    ("^a\\nx{33}$", ['"a\\n' + "x" * 33 + '"'], [b'"a\n' + b"x" * 33 + b'"']),
    ("^[^a-z]{200}$", ['"' + "é" * 200 + '"'], [b'"' + b"\xe0\x81\x88" * 200 + b'"']),
    ("^[a-z\u00e9]{40,60}$", ['"' + "é" * 40 + '"', '"' + "ab" * 30 + '"'],
     [b'"' + b"\xc0\xa9" * 40 + b'"']),
]


@pytest.mark.parametrize("pattern, good, bad", LARGE_COUNTS, ids=[c[0] for c in LARGE_COUNTS])
def test_large_counts_yield_json_text(backend, pattern, good, bad):
    params = StructuredOutputsParams(json=_string(pattern))
    for text in good:
        assert _oracle(pattern, text.encode())
        assert _accepts(backend, params, text.encode()), text
    for data in bad:
        assert not _oracle(pattern, data)
        assert not _accepts(backend, params, data), data


B, INLINE = BLOCK, INLINE_COUNT


@pytest.mark.parametrize("atom, text, low, high", [
    ("x", "x", INLINE + 1, INLINE + 1), ("x", "x", 0, INLINE + 6),
    ("x", "x", B - 1, INLINE + B + 1), ("x", "x", 3 * B, 3 * B), ("x", "x", 1, INLINE + 2 * B + 1),
    ("(ab|c)", "ab", INLINE + 1, -1), ("(ab|c)", "c", 40, INLINE + 72),
    ("[a-z]", "q", INLINE + 1, INLINE + 2 * B + 1), (".", "~", 0, 3 * B)])
def test_large_counts_take_every_count_and_no_other(backend, atom, text, low, high):
    """``x{m,n}`` written as shared blocks and chains (``repeat_counts``) matches exactly
    ``m`` to ``n`` repetitions (``-1``: no bound), checked length by length against
    ``re.fullmatch``."""
    count = f"{{{low},{high}}}" if high >= 0 else f"{{{low},}}"
    pattern = f"^{atom}{count}$"
    params = StructuredOutputsParams(json=_string(pattern))
    compiled = backend.compile(params)
    top = (high if high >= 0 else low) + 3
    for n in range(top + 1):
        data = json.dumps(text * n).encode()
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        got = matcher.accept_string(data) and matcher.is_terminated()
        assert got == bool(re.fullmatch(pattern[1:-1], text * n)), (pattern, n)


def test_large_count_grammar_stays_small():
    """The rules of ``(ab|c){1,3000}`` hold a few dozen positions, not thousands; a class
    repeated (``.{1,3000}``) stays xgrammar's repetition of one negated class, which it
    compiles and fills cheaply at any count."""
    from kvflow.structured.utf8_grammar import _pattern_rules

    rules = _pattern_rules("^(ab|c){1,3000}$", "p_")
    assert rules.count("::=") < 200
    assert "3000}" not in rules and "Regex" not in rules
    rules = _pattern_rules("^.{1,3000}$", "p_")
    assert rules.count("::=") == 2 and "p_root_1{1, 3000}" in rules
    assert "p_root_1 ::= (([^" in rules


# a class's count followed by a class (repeat_counts.literal_followers): written as literal
# alternatives where the classes are disjoint; an overlapping one (the last) stays as it was
FOLLOWED = [r"^[a-z]{1,20}\d$", r"^[^0-9]{2,12}[0-9]x$", r"^[0-9]{3,15}[a-fA-F]$",
            r"^[a-z]{1,10}[0-9][a-z]$", r"^x[a-c]{0,9}[A-Z]\d{0,2}$", r"^.{1,12}\d$"]


def _random_values(seed: int, count: int) -> list[str]:
    """Strings over characters each pattern of ``FOLLOWED`` tells apart (letters of both
    cases inside and outside the classes, digits, a non-ASCII letter; no quote, which a class
    offers only through its JSON escape, ``json_pattern``), of every length from 0 to 24,
    the rest random."""
    import random

    rng, alphabet = random.Random(seed), "abcxyzAFGZ0159é-"
    values = ["", "a1", "ab1", "x", "xA", "xA1", "xabcA12", "000a", "abc" * 8 + "1"]
    for _ in range(count):
        values.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))))
    for n in range(1, 24):  # every length with a digit last, and a letter last
        values += ["a" * n + "7", "b" * n + "xq"[n % 2], "5" * n + "F", "é" * n + "3"]
    return values


@pytest.mark.parametrize("pattern", FOLLOWED)
def test_count_followed_by_a_class_takes_the_patterns_strings(backend, pattern):
    """A class's count followed by a class it does not overlap (``[a-z]{1,300}\\d``) is
    written as one literal alternative per character of the follower, which xgrammar
    compiles in 0.1 s instead of 2-12 s (``benchmarks/pattern_counts.py``); the strings
    taken are ``re.search``'s, checked over edge and random strings (the oracle), each sent
    whole through the compiled grammar's matcher."""
    compiled = backend.compile(StructuredOutputsParams(json=_string(pattern)))
    for value in _random_values(seed=len(pattern), count=300):
        data = json.dumps(value, ensure_ascii=False).encode()
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        got = matcher.accept_string(data) and matcher.is_terminated()
        assert got == (re.search(pattern, value) is not None), (pattern, value)


REGEX_FOLLOWED = [r"^[^0-9]{2,20}[0-9]$", r"^x[^a-c]{0,9}[abc]\d{0,2}$", r"^[^5]{1,12}5$",
                  r"^[a-z]{1,20}\d$"]


@pytest.mark.parametrize("pattern", REGEX_FOLLOWED)
def test_regex_count_followed_by_a_class_takes_the_regexs_strings(backend, pattern):
    """A ``regex`` constraint's negated class counted before a class it does not overlap
    (``[^0-9]{2,20}[0-9]``) is written as literal alternatives too
    (``utf8_grammar.regex_grammar``), and so is a positive class's (the last: written negated
    by ``regex_classes.negated_regex``). The strings taken are ``re.fullmatch``'s (the
    oracle), over edge and random strings."""
    compiled = backend.compile(StructuredOutputsParams(regex=pattern))
    for value in _random_values(seed=len(pattern), count=300) + ["x5", "55", "x\n5"]:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        got = matcher.accept_string(value.encode()) and matcher.is_terminated()
        assert got == (re.fullmatch(pattern[1:-1], value) is not None), (pattern, value)


# regex constraints whose class count (past INLINE_COUNT) ends its sequence: (pattern, the
# counted bounds, the text before the count, the character counted)
TRAILING = [(r"[a-z]{0,500}", 0, 500, "", "q"), (r"x.{1,300}", 1, 300, "x", "é"),
            (r"(ab|[a-c]{130,200})", 130, 200, "", "c"), (r"a[0-9]{150,}", 150, -1, "a", "7"),
            (r"[ab]{129}", 129, 129, "", "b")]


def _trailing_values(low: int, high: int, before: str, char: str) -> list[str]:
    """Every boundary length of ``before + char * n`` (around the bounds and each multiple
    of ``BLOCK``: where blocks and chains meet), a character outside the class last, and
    random strings of the class's and other characters at random lengths."""
    import random

    top = (high if high != -1 else low + 2 * BLOCK) + 2
    lengths = {0, 1, low - 1, low, low + 1, top - 3, top - 2, top - 1, top}
    lengths |= {k * BLOCK + d for k in range(top // BLOCK + 1) for d in (-1, 0, 1)}
    values = [before + char * n for n in sorted(lengths) if n >= 0]
    values += [before + char * max(low, 1) + "\n", before + "Z" + char * low]
    rng = random.Random(low + high)
    for _ in range(60):
        n = rng.randint(max(0, low - 3), top)
        values.append(before + "".join(rng.choice(char * 20 + "aZ\n") for _ in range(n)))
    return values


@pytest.mark.parametrize("pattern, low, high, before, char", TRAILING)
def test_regex_count_ending_its_sequence_takes_the_regexs_strings(backend, pattern, low, high,
                                                                  before, char):
    """A ``regex`` constraint's class count past 128 with nothing after it in its sequence
    (``.{1,300}`` at the end) is written as ``repeat_counts``' blocks and chains
    (``utf8_grammar.regex_grammar``: xgrammar's own expansion compiled 2x slower, masks 3-4x
    slower, on a 49k vocabulary). The strings taken are ``re.fullmatch``'s (the oracle) at
    every boundary length and over random strings; kvflow's grammar holds the shared block."""
    from kvflow.structured.utf8_grammar import regex_grammar
    from kvflow.structured.xgrammar_convert import regex_text

    written = str(regex_grammar(xgr.Grammar.from_regex(regex_text(pattern))))
    assert "root_1_block ::= ((root_1{64, 64}))" in written, written
    compiled = backend.compile(StructuredOutputsParams(regex=pattern))
    for value in _trailing_values(low, high, before, char):
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        got = matcher.accept_string(value.encode()) and matcher.is_terminated()
        assert got == (re.fullmatch(pattern, value) is not None), (pattern, len(value))


def test_regex_negated_class_count_before_a_class_compiles_to_few_rules(backend):
    """As ``test_count_followed_by_a_disjoint_class_compiles_to_few_rules``, for a regex."""
    compiled = backend.compile(StructuredOutputsParams(regex=r"[^0-9]{1,300}[0-9]"))
    assert str(compiled.grammar).count("::=") < 40


def test_count_followed_by_a_disjoint_class_compiles_to_few_rules(backend):
    """xgrammar wrote ``[a-z]{1,300}`` followed by ``\\d`` as 130 nested rules, each one's
    mask filled for the whole vocabulary at compile time (6-12 s for a 49k vocabulary);
    followed by a literal it keeps one counted rule. Overlapping classes (``.{1,300}\\d``)
    are not rewritten (a literal inside the repeated class is not xgrammar's cheap case)."""
    def rules(pattern: str) -> int:
        compiled = backend.compile(StructuredOutputsParams(json=_string(pattern)))
        return str(compiled.grammar).count("::=")
    assert rules(r"^[a-z]{1,300}\d$") < 40
    assert rules(r"^[a-z]{1,300}[A-Za-z]$") > 120  # overlapping: xgrammar's expansion


@pytest.mark.parametrize("schema, string_rule", [
    ({"type": "string", "pattern": "^.{1,100}$"}, "root"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^x[a-z]{3000}$"}},
      "required": ["s"]}, "root_prop_0"),
])
def test_pattern_class_counts_sit_between_the_quotes(schema, string_rule):
    """A class repeated at the end of a pattern is one negated class, repeated by xgrammar
    right before the closing quote in the string's own rule: the form xgrammar compiles in
    0.01 s and fills in 0.03 ms (``.{1,100}`` took 2-3 s and 1-2 ms a token with the class
    positive or the pattern in a rule of its own; ``benchmarks/pattern_counts.py``)."""
    from kvflow.structured.utf8_grammar import printed_ebnf
    from kvflow.structured.xgrammar_convert import json_schema_grammar

    text = printed_ebnf(json_schema_grammar(json.dumps(schema)))
    rules = dict(line.split(" ::= ", 1) for line in text.splitlines())
    body = rules[string_rule]
    count = re.search(r'(kvflow_pattern_0_root_1)\{(\d+), (\d+)\} "\\""\)\)$', body)
    assert body.startswith('(("\\"" ') and count is not None, body
    assert rules[count.group(1)].startswith("(([^"), rules[count.group(1)]


@pytest.mark.parametrize("pattern, good, bad", [
    ('^a"b$', '"a\\"b"', b'"a"b"'), ("^\\\\d$", '"\\\\d"', b'"\\d"'),
    ("^[^a-z]{40}$", '"' + "é" * 40 + '"', b'"' + b"\xe0\x81\x88" * 40 + b'"')])
def test_format_tag_patterns_yield_json_text(backend, pattern, good, bad):
    """A ``format`` structural tag's ``json_schema`` (a tool call's parameters) had its
    pattern converted by xgrammar: a literal quote written raw (``"a"b"``)."""
    schema = {"type": "object", "properties": {"s": _string(pattern)}, "required": ["s"]}
    params = StructuredOutputsParams(structural_tag=_tag(schema))
    good_text, bad_text = f'<t>{{"s": {good}}}</t>', b'<t>{"s": ' + bad + b"}</t>"
    assert _oracle(pattern, good.encode()) and not _oracle(pattern, bad)
    assert _accepts(backend, params, good_text.encode())
    assert not _accepts(backend, params, bad_text)


def test_format_tag_ipv4_is_json_schemas(backend):
    schema = {"type": "string", "format": "ipv4"}
    params = StructuredOutputsParams(structural_tag=_tag(schema))
    assert _accepts(backend, params, b'<t>"1.2.3.4"</t>')
    assert not _accepts(backend, params, b'<t>"01.2.3.4"</t>')


def test_format_tag_xml_style_keeps_patterns_raw(backend):
    """XML styles write a string raw: its pattern is not JSON-escaped."""
    schema = {"type": "object", "properties": {"s": _string('^a"b$')}, "required": ["s"]}
    params = StructuredOutputsParams(structural_tag=_tag(schema, "qwen_xml"))
    matcher = _matcher(backend, params)
    assert matcher.accept_string(b'<t><parameter=s>\na"b')
