"""Every grammar kind accepts only UTF-8 text: xgrammar 0.2.9 matched the UTF-16 surrogates
U+D800-U+DFFF (spelled ``ED A0-BF xx``, which is not UTF-8) with negated classes, class ranges
that span them and JSON-schema patterns, whichever way the grammar came (EBNF, Lark, regex,
JSON schema, structural tag). The oracle: Python's strict UTF-8 decoder refuses the bytes the
old grammars accepted, and ``re`` / ``jsonschema`` accept the text they still accept."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from kvflow.structured import StructuredOutputsParams

SURROGATE = "\udab1".encode("utf-8", "surrogatepass")  # ED AA B1


@pytest.fixture(scope="module")
def backend(tiny_llama):
    from transformers import AutoTokenizer

    from kvflow.structured.xgrammar_backend import XgrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    return XgrammarBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _accepts(backend, params: StructuredOutputsParams, data: bytes) -> bool:
    matcher = xgr.GrammarMatcher(backend.compile(params), terminate_without_stop_token=True)
    return matcher.accept_string(data) and matcher.is_terminated()


def _tag(content: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<a>"],
        "tags": [{"begin": "<a>", "content": content, "end": "</a>"}]}})


def _pattern(pattern: str) -> dict:
    return {"type": "string", "pattern": pattern}


# (constraint, text around the character, a character it accepts, a pattern / schema oracle)
CASES = [
    ({"regex": r"[\D]"}, "{}", "é"), ({"regex": r"x[\u0000-\uFFFF]"}, "x{}", "é"),
    ({"regex": r"[a\W]"}, "{}", "%"), ({"regex": r"[\S]"}, "{}", "é"),
    ({"grammar": "root ::= [^a]+"}, "{}", "é"), ({"grammar": 'root ::= [\\0-\\U0010ffff]'}, "{}", "é"),
    ({"grammar": "start: /./+"}, "{}", "é"), ({"grammar": "start: /[^a]/"}, "{}", "é"),
    ({"grammar": "start: /\\W/"}, "{}", "%"),
    ({"json": _pattern("^.$")}, '"{}"', "é"), ({"json": _pattern("^[^a]{1,3}$")}, '"{}"', "é"),
    ({"json": _pattern(r"^[\D]$")}, '"{}"', "é"), ({"json": _pattern(r"^\W$")}, '"{}"', "%"),
    ({"json": _pattern(r"^x[\u0000-\uFFFF]$")}, '"x{}"', "é"),
    ({"json": _pattern("^.{1,300}$")}, '"{}"', "é"),  # past 32: repeat_counts
    ({"json": {"type": "object", "properties": {"k": _pattern("^.+$")}, "required": ["k"]}},
     '{"k": "{}"}', "é"),
    ({"structural_tag": _tag({"type": "json_schema", "json_schema": {"type": "string"}})},
     '<a>"{}"</a>', "é"),
    ({"structural_tag": _tag({"type": "regex", "pattern": r"[\D]"})}, "<a>{}</a>", "é"),
    ({"structural_tag": _tag({"type": "grammar", "grammar": "root ::= [^a]"})}, "<a>{}</a>",
     "é"),
]


@pytest.mark.parametrize("kind, text, good", CASES, ids=[str(c[0])[:48] for c in CASES])
def test_grammars_refuse_surrogates(backend, kind, text, good):
    bad = text.encode().replace(b"{}", SURROGATE)
    with pytest.raises(UnicodeDecodeError):
        bad.decode()
    params = StructuredOutputsParams(**kind)
    assert not _accepts(backend, params, bad)
    accepted = text.replace("{}", good)
    assert _accepts(backend, params, accepted.encode())
    if "regex" in kind:  # the oracle accepts the same text
        assert re.fullmatch(kind["regex"], accepted)
    elif "json" in kind:
        jsonschema.validate(json.loads(accepted), kind["json"])


@pytest.mark.parametrize("letter", "dws")
def test_shorthand_ranges_are_xgrammars(letter):
    """``regex_dialect.SHORTHANDS`` (\\d \\w \\s as xgrammar reads them) against xgrammar's
    own conversion of the negated shorthand in a class."""
    from kvflow.structured.regex_dialect import SHORTHANDS

    printed = str(xgr.Grammar.from_regex(f"[\\{letter.upper()}]"))
    negated = f"[^{''.join(_ranges(SHORTHANDS[letter]))}]"
    for code in [*range(0x3100), 0xFEFF, 0xFF00, 0x10FFFF]:
        if 0xD800 <= code <= 0xDFFF:
            continue
        char = chr(code)
        assert bool(re.fullmatch(negated, char)) == _printed_class_matches(printed, code), hex(code)


def _ranges(ranges):
    return [f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges]


def _printed_class_matches(printed: str, code: int) -> bool:
    from kvflow.structured.ebnf_reading import code_point as _code_point

    body = printed[printed.index("[") + 1:printed.rindex("]")]
    negated, i = body.startswith("^"), int(body.startswith("^"))
    while i < len(body):
        low, i = _code_point(body, i)
        high = low
        if body.startswith("-", i):
            high, i = _code_point(body, i + 1)
        if low <= code <= high:
            return not negated
    return negated


@pytest.mark.parametrize("pattern, sent", [
    (".", r"[^\uD800-\uDFFF]"), (r"[\D]", r"[\u0000-\u002F\u003A-\uD7FF\uE000-\u{10FFFF}]"),
    (r"[^\D]", r"[^\u0000-\u002F\u003A-\uD7FF\uE000-\u{10FFFF}\uD800-\uDFFF]"),
    (r"[\u0000-\uFFFF]", r"[\u0000-\uD7FF\uE000-\uFFFF]"), (r"[\n-\r]", r"[\n-\r]"),
    (r"[a-]", "[a-]"), ("[]a]", "[]a]"), (r"\.[.]", r"\.[.]")])
def test_utf8_regex(pattern, sent):
    from kvflow.structured.regex_dialect import utf8_regex

    assert utf8_regex(pattern) == sent


def test_utf8_ebnf_keeps_strings_and_fixed_classes():
    from kvflow.structured.utf8_grammar import utf8_ebnf

    ebnf = ('root ::= (("[^a]" [^\\0-\\x1f\\"\\\\\\r\\n\\ud800-\\udfff] [^\\]\\-] '
            '[\\0-\\U0010ffff] [a-z]))\n')
    assert utf8_ebnf(ebnf) == ('root ::= (("[^a]" [^\\0-\\x1f\\"\\\\\\r\\n\\ud800-\\udfff] '
                               '[^\\]\\-\\ud800-\\udfff] [\\u0000-\\ud7ff\\ue000-\\U0010ffff] '
                               '[a-z]))\n')


@pytest.mark.parametrize("schema, text", [
    ({"enum": ["café", "naïve", "Ünïcödé 😀"]}, '"Ünïcödé 😀"'),
    ({"const": "\u00e9a\u00ff0"}, '"\u00e9a\u00ff0"'),
    ({"type": "object", "properties": {"\u00e9a": {"const": 1}}, "required": ["\u00e9a"]},
     '{"\u00e9a": 1}')])
def test_non_ascii_literals_survive_the_grammar_rewrite(backend, schema, text):
    """xgrammar 0.2.9 prints U+00EF as ``\\xef`` but reads ``\\x`` with every hex digit after
    it: printed and read back (kvflow's rewrites; xgrammar's own compile cache does the same),
    the enum value "Ünïcödé" was the grammar of "Ün" U+0EFC U+0F6D "é" (a random model wrote
    it; jsonschema refused it)."""
    params = StructuredOutputsParams(json=schema)
    assert _accepts(backend, params, text.encode())
    jsonschema.validate(json.loads(text), schema)
    misread = text.replace("\u00efc", "\u0efc").replace("\u00e9a", "\u0e9a") \
        .replace("\u00ff0", "\u0ff0")
    assert misread != text and not _accepts(backend, params, misread.encode())


@pytest.mark.parametrize("kind, prefix", [
    ({"regex": "<[^>]{1,6}>"}, ""), ({"regex": "<[^>]{1,6}>"}, "<"),
    ({"json": {"type": "string"}}, '"'), ({"grammar": "root ::= [^\\n]+"}, "")])
def test_special_tokens_spell_no_text(backend, tiny_llama, kind, prefix):
    """The tiny model's <bos> and <eos> were allowed as their text: the regex <[^>]{1,6}>
    took <bos> then the stop token (the detokenizer skips both: an empty output, finish
    reason stop), or the stop token first as the text "<eos>". Now no special token is
    allowed where the grammar is not complete."""
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(tiny_llama.path).all_special_ids
    assert special
    matcher = xgr.GrammarMatcher(backend.compile(StructuredOutputsParams(**kind)))
    assert matcher.accept_string(prefix)
    bitmask = xgr.allocate_token_bitmask(1, tiny_llama.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    rejected = set(xgr.testing._get_masked_tokens_from_bitmask(bitmask, tiny_llama.vocab_size))
    assert len(rejected) < tiny_llama.vocab_size  # a text token is allowed
    assert set(special) <= rejected, set(special) - rejected


@pytest.mark.parametrize("pattern, good, bad", [
    ('^a"b$', 'a"b', b'"a"b"'), (r"^\\d$", "\\d", b'"\\d"'), ("^a\\nb$", "a\nb", b'"a\nb"'),
    ("^[^a-z]{1,4}$", "é", b'"\xe0\x9f\xae"'), ("^x.{1,4}$", "x😀", b'"x\xf0\x8f\xbf\xbf"'),
    (r"^\D\W$", "é%", b'"\xe0\x9f\xae%"')])
def test_patterns_yield_json_text(backend, pattern, good, bad):
    """xgrammar 0.2.9 wrote a pattern's literal quote, backslash or newline raw in the JSON
    string (text that is not JSON) and, for a class range across UTF-8 lengths, accepted
    overlong UTF-8 (E0 9F AE, F0 8F BF BF: not UTF-8; seen from the fuzz's [^a-z]{1,4})."""
    schema = {"type": "string", "pattern": pattern}
    params = StructuredOutputsParams(json=schema)
    text = json.dumps(good, ensure_ascii=False)
    jsonschema.validate(json.loads(text), schema)
    assert _accepts(backend, params, text.encode())
    with pytest.raises(ValueError):  # not JSON, or not UTF-8
        json.loads(bad.decode())
    assert not _accepts(backend, params, bad)


@pytest.mark.parametrize("address, valid", [
    ("1.2.3.4", True), ("255.255.255.0", True), ("10.0.0.199", True), ("01.2.3.4", False),
    ("1.2.3.004", False), ("256.1.1.1", False)])
def test_ipv4_format_is_json_schemas(backend, address, valid):
    """xgrammar 0.2.9's ipv4 format allowed leading zeros (01.2.3.4), which JSON Schema's
    ipv4 (and jsonschema, the oracle) refuses; kvflow sends it as a strict pattern."""
    schema = {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
              "required": ["ip"]}
    text = json.dumps({"ip": address})
    checker = jsonschema.FormatChecker()
    assert checker.conforms(address, "ipv4") == valid
    assert _accepts(backend, StructuredOutputsParams(json=schema), text.encode()) == valid
