"""A constraint that does not compile is named by the field the client sent: the message said
"invalid regex/grammar/JSON schema in structured_outputs" whatever was sent (``guided_regex``,
``response_format.json_schema.schema``, ...), a bad ``structured_outputs.grammar`` had param
``structured_outputs``, and a schema whose string ``pattern`` is a bad regex gave only
xgrammar's "Regex parsing error at position 4: Unclosed '['". Expectations are hand-written
(xgrammar's own reason kept after the place)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.sampling_requests import check_constraint
from kvflow.inputs.processor import InputProcessor
from kvflow.structured import StructuredOutputsParams, validate

HI = [{"role": "user", "content": "hi"}]
UNDEFINED = 'line 1, column 10 (after \'root ::=\'): Rule "nowhere" is not defined'
OPEN_PAREN = "Regex parsing error at position 5: The parenthesis is not closed."


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


CASES = [  # (request fields, param, message)
    ({"guided_regex": "(abc"}, "guided_regex", f"invalid regex in guided_regex: {OPEN_PAREN}"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar",
     f"invalid grammar in guided_grammar: {UNDEFINED}"),
    ({"guided_json": {"type": "frob"}}, "guided_json",
     'invalid JSON schema in guided_json: Unsupported type "frob"'),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar",
     f"invalid grammar in structured_outputs.grammar: {UNDEFINED}"),
    ({"structured_outputs": {"regex": "(abc"}}, "structured_outputs.regex",
     f"invalid regex in structured_outputs.regex: {OPEN_PAREN}"),
    (_schema({"type": "object", "properties": {"code": {"type": "string", "pattern": "[a-"}}}),
     "response_format.json_schema.schema",
     ("invalid JSON schema in response_format.json_schema.schema: the pattern '[a-' at "
      "properties.code.pattern is not a valid regex: Regex parsing error at position 4: "
      "Unclosed '['")),
    (_schema({"type": "object", "patternProperties": {"[": {"type": "integer"}}}),
     "response_format.json_schema.schema",
     ("invalid JSON schema in response_format.json_schema.schema: the pattern '[' at "
      "patternProperties is not a valid regex: Regex parsing error at position 2: "
      "Unclosed '['")),
    (_schema({"type": "object", "properties": {"code": {"type": "string",
                                                         "pattern": "^a[^\\s\\S]b$"}}}),
     "response_format.json_schema.schema",
     ("invalid JSON schema in response_format.json_schema.schema: the pattern '^a[^\\\\s\\\\S]b$' "
      "at properties.code.pattern matches no string: a character class that every match goes "
      "through holds no character kvflow matches there (it is empty, as [^\\s\\S], or holds "
      "only control characters other than \\b \\f \\n \\r \\t, which a class here does "
      "not match)")),
    # an empty class after a prefix: xgrammar compiled it, the first step allowed "a", and
    # the reply stopped after "ab" with finish_reason length
    ({"structured_outputs": {"regex": "ab[^\\s\\S]"}}, "structured_outputs.regex",
     ("invalid regex in structured_outputs.regex: the regex matches no string: a character "
      "class that every match goes through holds no character (it is empty, as [^\\s\\S] "
      "or [], or holds only UTF-16 surrogates, which are not UTF-8 text): a reply would stop "
      "there, cut off")),
    (_schema({"type": "object", "patternProperties": {"^k[\\x01]$": {"type": "integer"}}}),
     "response_format.json_schema.schema",
     ("invalid JSON schema in response_format.json_schema.schema: the pattern '^k[\\\\x01]$' "
      "at patternProperties matches no string: a character class that every match goes "
      "through holds no character kvflow matches there (it is empty, as [^\\s\\S], or holds "
      "only control characters other than \\b \\f \\n \\r \\t, which a class here does "
      "not match)")),
]


@pytest.mark.parametrize("fields, param, message", CASES,
                         ids=["guided_regex", "guided_grammar", "guided_json", "so_grammar",
                              "so_regex", "schema_pattern", "pattern_properties",
                              "pattern_matching_nothing", "so_regex_matching_nothing",
                              "pattern_properties_matching_nothing"])
def test_constraint_error_names_the_field_sent(tiny_tokenizer, fields, param, message):
    engine = SimpleNamespace(processor=InputProcessor(tiny_tokenizer, 256, 320, 0))
    req = ChatCompletionRequest.model_validate({"messages": HI, **fields})
    with pytest.raises(OpenAIError) as e:
        asyncio.run(check_constraint(engine, req, None, 10))
    assert (e.value.status, e.value.body()["error"]) == (400, {
        "message": message, "type": "invalid_request_error", "param": param,
        "code": "invalid_value"})


def test_offline_pattern_error_names_the_pattern():
    """``SamplingParams.structured_outputs`` offline: the same reason, under its own name."""
    with pytest.raises(ValueError) as e:
        validate(StructuredOutputsParams(json={"type": "string", "pattern": "ab[c"}))
    assert str(e.value) == ("invalid JSON schema in structured_outputs: the pattern 'ab[c' at "
                            "pattern is not a valid regex: Regex parsing error at position 5: "
                            "Unclosed '['")
    validate(StructuredOutputsParams(json={"type": "string", "pattern": "ab[c]"}))  # valid
