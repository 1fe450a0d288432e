"""A JSON schema string with a pattern, or a format xgrammar knows, and minLength / maxLength
is refused: xgrammar 0.2.9 compiles it but drops the length limits (it logs "pattern
combined with minLength/maxLength is not supported", "format combined with ..."), so outputs
outside them would pass (checked here on xgrammar itself, the oracle for why). Found by
``benchmarks/xgrammar_crash_fuzz.py``. Look-alikes (a length limit alone, a length written
into the pattern, minLength 0 beside a pattern, a length beside a format xgrammar ignores)
are accepted and enforced."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from kvflow.structured import StructuredOutputsParams, validate
from kvflow.structured.schema_support import LENGTHLESS_FORMATS
from kvflow.structured.xgrammar_convert import json_schema_grammar

VOCAB = ['"', "a", "b", "</s>"] + list("0123456789-:.@/TZPD")
STOP = 3
SUFFIX = ("not enforced together with 'pattern' (write the length into the pattern, e.g. "
          "^[a-z]{3,8}$) (xgrammar, kvflow's grammar engine, accepts this keyword but does not "
          "enforce it)")  # the reason's own fix, not "leave it out" beside it


def _accepts(grammar: xgr.Grammar, text: str) -> bool:
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[STOP])) \
        .compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(VOCAB.index(ch)) for ch in text) and \
        matcher.accept_token(STOP)


@pytest.mark.parametrize("schema, where", [
    ({"type": "string", "pattern": "^a*$", "maxLength": 2}, "'maxLength'"),
    ({"type": "string", "pattern": "^a*$", "minLength": 3}, "'minLength'"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a*$",
                                             "minLength": 1, "maxLength": 2}}},
     "'minLength' at properties.s"),
])
def test_length_beside_pattern_refused(schema, where):
    with pytest.raises(ValueError) as e:
        validate(StructuredOutputsParams(json=schema))
    assert str(e.value) == f"invalid JSON schema in structured_outputs: {where}: {SUFFIX}"


def test_xgrammar_drops_the_length_beside_a_pattern():
    """The reason for the refusal: "aaa" (3 characters) passes maxLength 2, "a" passes
    minLength 3. If a later xgrammar enforces them, the refusal may be relaxed."""
    too_long = xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "pattern": "^a*$", "maxLength": 2}), any_whitespace=False)
    too_short = xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "pattern": "^a*$", "minLength": 3}), any_whitespace=False)
    if not (_accepts(too_long, '"aaa"') or _accepts(too_short, '"a"')):
        pytest.skip("the installed xgrammar enforces the lengths: the refusal may be relaxed")
    assert _accepts(too_long, '"aaa"') and _accepts(too_short, '"a"')


@pytest.mark.parametrize("schema, accepted, refused", [
    ({"type": "string", "maxLength": 2}, ['""', '"a"', '"ab"'], ['"aaa"']),
    ({"type": "string", "minLength": 2}, ['"ab"', '"aaa"'], ['""', '"a"']),
    ({"type": "string", "pattern": "^a{1,2}$"}, ['"a"', '"aa"'], ['""', '"aaa"', '"b"']),
    ({"type": "string", "pattern": "^a*$", "minLength": 0}, ['""', '"aaa"'], ['"b"']),
])
def test_look_alikes_accepted_and_enforced(schema, accepted, refused):
    text = json.dumps(schema)
    validate(StructuredOutputsParams(json=text))
    grammar = json_schema_grammar(text)
    for output, want in [(t, True) for t in accepted] + [(t, False) for t in refused]:
        assert _accepts(grammar, output) == want, output


# a value of each format in LENGTHLESS_FORMATS, longer than 3 characters
FORMAT_EXAMPLES = {
    "date": "2024-01-02", "time": "00:00:00Z", "date-time": "2024-01-02T00:00:00Z",
    "duration": "P1D", "email": "a@b.ab", "hostname": "ab.ab", "ipv4": "1.2.3.4",
    "ipv6": "1::2", "uri": "ab:b", "uri-reference": "a.b", "uri-template": "abab",
    "uuid": "12345678-1234-1234-1234-123456789012", "json-pointer": "/a/b",
    "relative-json-pointer": "0/a",
}


@pytest.mark.parametrize("fmt", sorted(LENGTHLESS_FORMATS))
def test_length_beside_known_format_refused(fmt):
    with pytest.raises(ValueError) as e:
        validate(StructuredOutputsParams(json={"type": "string", "format": fmt,
                                               "maxLength": 2}))
    assert str(e.value).startswith(
        f"invalid JSON schema in structured_outputs: 'maxLength': not enforced together with "
        f"format {fmt!r} (write the format and the length as one pattern instead)")


@pytest.mark.parametrize("fmt", sorted(LENGTHLESS_FORMATS))
def test_xgrammar_drops_the_length_beside_a_format(fmt):
    """The reason: a value of the format, longer than maxLength 2, passes."""
    example = json.dumps(FORMAT_EXAMPLES[fmt])
    assert len(example) > 2 + 2 and all(ch in VOCAB for ch in example)
    grammar = xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "format": fmt, "maxLength": 2}), any_whitespace=False)
    if not _accepts(grammar, example):
        pytest.skip("the installed xgrammar enforces the lengths: the refusal may be relaxed")
    assert _accepts(xgr.Grammar.from_json_schema(
        json.dumps({"type": "string", "format": fmt}), any_whitespace=False), example)


@pytest.mark.parametrize("fmt", ["idn-email", "iri", "regex", "no-such-format"])
def test_length_beside_ignored_format_accepted_and_enforced(fmt):
    """xgrammar ignores these formats and keeps the lengths, so nothing is refused."""
    text = json.dumps({"type": "string", "format": fmt, "maxLength": 2})
    validate(StructuredOutputsParams(json=text))
    grammar = json_schema_grammar(text)
    assert _accepts(grammar, '"ab"') and not _accepts(grammar, '"aba"')


def test_costly_pattern_advice_is_a_schema_that_is_taken():
    """The refusal of a pattern's long count pointed to minLength / maxLength, which beside
    that pattern is refused in turn ("write the length into the pattern"): its advice now says
    they go without a pattern, and that schema is taken."""
    pattern = {"type": "string", "pattern": "^[a-z]{1,5000000}$"}
    with pytest.raises(ValueError) as e:
        validate(StructuredOutputsParams(json=pattern))
    assert str(e.value).endswith("a length limit alone belongs in minLength / maxLength with no "
                                 "pattern (beside a pattern they are refused, not enforced)")
    with pytest.raises(ValueError, match="'maxLength': not enforced together with 'pattern'"):
        validate(StructuredOutputsParams(json={"type": "string", "pattern": "^[a-z]*$",
                                               "maxLength": 50000}))
    validate(StructuredOutputsParams(json={"type": "string", "maxLength": 50000}))
