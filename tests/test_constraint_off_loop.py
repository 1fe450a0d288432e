"""A request's output constraint (``response_format`` / ``structured_outputs`` / ``guided_*``,
or the grammar of tool_choice ``required`` / a named tool) is converted to a grammar once in
the API process, in a worker thread when the body is large: a large schema takes hundreds of
ms (2,048 small tools: the server's loop was held ~0.2 s twice, once building SamplingParams
and once queueing). Oracles: the thread the conversion ran in, the number of conversions
(counted at ``kvflow.structured.validate``) and hand-written error bodies."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from types import SimpleNamespace

import pytest

from kvflow import structured
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.preprocess import INLINE_CHARS
from kvflow.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.entrypoints.sampling_requests import check_constraint, sampling_params
from kvflow.entrypoints.structured_requests import tool_choice_mode, tool_constraint
from kvflow.inputs.processor import InputProcessor
from kvflow.sampling_params import SamplingParams
from kvflow.structured import CheckedConstraints, StructuredOutputsParams

HI = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def conversions(monkeypatch) -> list[tuple[int, tuple[str, str]]]:
    """(thread id, key) of each ``kvflow.structured.validate`` call (the conversion)."""
    calls = []
    validate = structured.validate
    monkeypatch.setattr(structured, "validate", lambda params: calls.append(
        (threading.get_ident(), params.key)) or validate(params))
    return calls


def _engine(tiny_tokenizer) -> SimpleNamespace:
    return SimpleNamespace(processor=InputProcessor(tiny_tokenizer, 256, 320, 0))


def test_each_constraint_is_converted_once(conversions):
    """Equal constraints (new objects, same key) are converted once; another is converted;
    one that fails is converted (and fails) every time, never remembered as checked."""
    checked = CheckedConstraints(capacity=2)
    checked.check(StructuredOutputsParams(json=SCHEMA))
    checked.check(StructuredOutputsParams(json=dict(SCHEMA)))
    checked.check(StructuredOutputsParams(regex="[a-z]+"))
    assert len(conversions) == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="invalid regex"):
            checked.check(StructuredOutputsParams(regex="(abc"))
    assert len(conversions) == 4
    checked.check(StructuredOutputsParams(choice=["x"]))  # capacity 2: the schema drops out
    checked.check(StructuredOutputsParams(json=SCHEMA))
    assert [key[0] for _, key in conversions] == ["json", "regex", "regex", "regex", "choice",
                                                  "json"]


def test_key_is_built_once_per_object_and_anew_when_a_field_is_set(monkeypatch):
    """A request's constraint is checked twice and looked up more: its key (the schema's
    JSON text, milliseconds for a large schema) and digest are built once per object; setting
    a field builds them anew. Oracle: json.dumps and hashlib, called here."""
    builds = []
    make_key = StructuredOutputsParams._make_key
    monkeypatch.setattr(StructuredOutputsParams, "_make_key",
                        lambda self: builds.append(1) or make_key(self))
    params = StructuredOutputsParams(json=SCHEMA)
    checked = CheckedConstraints()
    for _ in range(3):
        checked.check(params)
    text = json.dumps(SCHEMA, separators=(",", ":"))
    assert (params.key, len(builds)) == (("json", text), 1)
    assert params.digest == hashlib.sha256(f"json:{text}".encode()).digest()
    params.json = {"type": "string"}
    assert (params.key, len(builds)) == (("json", '{"type":"string"}'), 2)
    assert params.digest == hashlib.sha256(b'json:{"type":"string"}').digest()
    assert params == StructuredOutputsParams(json={"type": "string"})  # key not a field


@pytest.mark.parametrize("num_tools", [2, 2048])
def test_tool_grammar_is_converted_once_off_the_loop_when_large(tiny_tokenizer, conversions,
                                                                num_tools):
    """tool_choice required: ``check_constraint`` converts the tools' grammar (in a worker
    thread for a body over INLINE_CHARS bytes, inline for a small one); building the
    SamplingParams and queueing (``make_requests``) then convert nothing."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": SCHEMA}}
             for i in range(num_tools)]
    req = ChatCompletionRequest.model_validate({"messages": HI, "tools": tools,
                                                "tool_choice": "required"})
    size = len(req.model_dump_json())
    assert (size > INLINE_CHARS) is (num_tools > 2)
    engine = _engine(tiny_tokenizer)
    grammar = tool_constraint(req, tool_choice_mode(req))

    async def run() -> int:
        await check_constraint(engine, req, grammar, size)
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(conversions) == 1
    assert (conversions[0][0] != loop_thread) is (num_tools > 2)
    params = sampling_params(engine, req, 4, None, grammar)
    engine.processor.make_requests("r", [5, 6], params)
    assert len(conversions) == 1


def test_unknown_body_size_counts_as_large(tiny_tokenizer, conversions):
    """A chunked body (no Content-Length: ``size`` None) is converted in a worker thread."""
    req = CompletionRequest.model_validate({"prompt": "a", "structured_outputs": {
        "regex": "[a-z]{3}"}})

    async def run() -> int:
        await check_constraint(_engine(tiny_tokenizer), req, None, None)
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert [key for _, key in conversions] == [("regex", "[a-z]{3}")]
    assert conversions[0][0] != loop_thread


@pytest.mark.parametrize("size", [10, INLINE_CHARS + 1])
def test_bad_schema_is_the_same_400_inline_or_in_a_thread(tiny_tokenizer, size):
    """A schema that does not convert: a 400 at ``response_format.json_schema.schema``
    with the grammar engine's reason, whichever thread converted it."""
    req = ChatCompletionRequest.model_validate({"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}})
    with pytest.raises(OpenAIError) as e:
        asyncio.run(check_constraint(_engine(tiny_tokenizer), req, None, size))
    assert e.value.body()["error"] == {
        "message": "invalid JSON schema in response_format.json_schema.schema: "
                   "'uniqueItems': repeated items "
                   "are not prevented (xgrammar, kvflow's grammar engine, accepts this "
                   "keyword but does not enforce it; leave it out)",
        "type": "invalid_request_error", "param": "response_format.json_schema.schema",
        "code": "invalid_value"}


def test_two_constraints_are_refused_before_any_conversion(tiny_tokenizer, conversions):
    """response_format with tool_choice required: the 400 naming ``tool_choice`` (one
    constraint only) comes before anything is converted."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    req = ChatCompletionRequest.model_validate({
        "messages": HI, "tools": tools, "tool_choice": "required",
        "response_format": {"type": "json_object"}})
    with pytest.raises(OpenAIError) as e:
        asyncio.run(check_constraint(_engine(tiny_tokenizer), req,
                                     tool_constraint(req, "required"), 10))
    assert (e.value.status, e.value.param, str(e.value)) == (
        400, "tool_choice", ("set only one of response_format, tool_choice: each constrains "
                            "the output"))
    assert conversions == []


def test_offline_generate_converts_a_repeated_constraint_once(tiny_tokenizer, conversions):
    """LLM.generate's path (``make_requests``) remembers the constraints it checked too."""
    processor = InputProcessor(tiny_tokenizer, 256, 320, 0)
    for i in range(3):
        processor.make_requests(f"r{i}", [5, 6], SamplingParams(
            max_tokens=2, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    assert len(conversions) == 1
