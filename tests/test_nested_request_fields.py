"""Nested objects of request bodies take only the keys they declare: another key is a 400 with
an OpenAI error body (code ``unknown_parameter``) whose ``param`` is the key's path, never
silently dropped; top-level unknown fields are kept aside for the server's check
(kvflow/entrypoints/unknown_fields.py). A value no member of a union field takes is a 400
saying what the field takes.

The schema and the error handlers are checked in-process (kvflow's own FastAPI error handlers
on a route that echoes the validated request), so no engine or server starts; one served case
is in tests/e2e/test_openai_fields.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvflow.entrypoints.http_guards import add_error_handlers
from kvflow.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    TokenizeRequest,
)

HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SCHEMA_FMT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                     "strict": True}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.fixture(scope="module")
def client() -> TestClient:
    """kvflow's error handlers on routes that return the validated request as JSON."""
    app = FastAPI()
    add_error_handlers(app)

    @app.post("/chat")
    async def chat(req: ChatCompletionRequest) -> dict[str, Any]:
        return req.model_dump(by_alias=True, exclude_unset=True)

    @app.post("/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return req.model_dump(by_alias=True, exclude_unset=True)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return req.model_dump(by_alias=True, exclude_unset=True)

    @app.post("/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        return {**req.model_dump(by_alias=True, exclude_unset=True),
                "messages_field": req.messages_field}

    return TestClient(app)


def _set(body: dict, path: str, value: Any) -> dict:
    """A copy of ``body`` with ``value`` set at the dotted ``path`` (list indices as ints)."""
    import copy

    out = copy.deepcopy(body)
    *parents, last = path.split(".")
    node: Any = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return out


# (route, a valid body, the dotted path of the key to add: a misspelling or an invented key)
NESTED = [
    ("/chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "messages.0.content.0.foo"),
    ("/chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]},
     "messages.0.content.0.image_url.detial"),
    ("/chat", {"messages": [*HI, {"role": "assistant", "tool_calls": [CALL]}]},
     "messages.1.tool_calls.0.function.argumnets"),
    ("/chat", {"messages": [*HI, {"role": "assistant", "tool_calls": [CALL]}]},
     "messages.1.tool_calls.0.idx"),
    ("/chat", {"messages": HI, "response_format": SCHEMA_FMT},
     "response_format.json_schema.strct"),
    ("/chat", {"messages": HI, "response_format": {"type": "json_object"}},
     "response_format.schema"),
    ("/chat", {"messages": HI, "tools": TOOLS}, "tools.0.function.strct"),
    ("/chat", {"messages": HI, "tools": TOOLS}, "tools.0.strict"),
    ("/chat", {"messages": HI, "tools": TOOLS,
               "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.arguments"),
    ("/chat", {"messages": HI, "tools": TOOLS,
               "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.name"),
    ("/completions", {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}},
     "stream_options.include_usgae"),
    ("/completions", {"prompt": "a", "structured_outputs": {"regex": "a+"}},
     "structured_outputs.flags"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "messages.0.content.0.cache_control"),
]


@pytest.mark.parametrize("route,body,extra", NESTED, ids=[n[2] for n in NESTED])
def test_unknown_nested_key_is_a_400_naming_its_path(client, route, body, extra):
    """The valid body is accepted with its nested values kept (the oracle: the body itself);
    the same body with one more key is a 400 naming that key's path (these were ignored)."""
    ok = client.post(route, json=body)
    assert ok.status_code == 200, ok.text
    parent = extra.rsplit(".", 1)[0]
    echoed: Any = ok.json()
    sent: Any = body
    for key in parent.split("."):
        echoed = echoed[int(key)] if isinstance(echoed, list) else echoed[key]
        sent = sent[int(key)] if isinstance(sent, list) else sent[key]
    assert echoed == sent  # kept as sent
    resp = client.post(route, json=_set(body, extra, 1))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", extra, "unknown_parameter"), error
    assert error["message"] == f"Unrecognized request argument supplied: {extra}"


def test_top_level_unknown_fields_are_kept_for_the_server():
    """The schema keeps a top-level field it does not declare aside (``unknown_fields``, for
    the server to refuse, or log under --ignore-unknown-fields: tests/test_unknown_fields.py)
    instead of refusing it itself; a message's own extra keys (``name``) still reach the chat
    template."""
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi", "name": "bob"}], "frobnicate": 1, "max_token": 2})
    assert req.unknown_fields == ("frobnicate", "max_token")
    assert req.unknown_values == {"frobnicate": 1, "max_token": 2}
    assert req.messages[0].model_dump()["name"] == "bob"


def test_other_part_types_are_refused_for_their_type():
    """An ``input_audio`` part with its payload passes the schema (its payload dropped) so that
    the renderer refuses it for its type, naming the part, not its payload key."""
    from kvflow.chat.messages import ChatTemplateError, normalize_conversation

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}]}]})
    part = req.messages[0].content[0]
    assert part.type == "input_audio" and "input_audio" not in part.model_dump()
    with pytest.raises(ChatTemplateError) as e:
        normalize_conversation([m.model_dump() for m in req.messages])
    assert e.value.param == "messages.0.content.0" and "'input_audio'" in str(e.value)


@pytest.mark.parametrize("part,key", [
    ({"type": "text", "text": "hi", "image_url": {"url": "data:image/png;base64,AA"}},
     "image_url"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}, "text": "hi"},
     "text"),
    ({"type": "text", "text": "hi", "refusal": "no"}, "refusal"),
])
def test_a_part_carries_only_its_own_types_payload(client, part, key):
    """A declared key of another part type (an image on a text part) was never read; now a
    400 naming it. The same part without it passes, and null for it passes (unset)."""
    messages = [{"role": "user", "content": [part]}]
    resp = client.post("/chat", json={"messages": messages})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (f"messages.0.content.0.{key}",
                                                "unknown_parameter"), error
    assert f"a {part['type']!r} content part carries {part['type']} only" in error["message"]
    alone = {k: v for k, v in part.items() if k != key}
    for sent in (alone, {**alone, key: None}):
        resp = client.post("/chat", json={"messages": [{"role": "user", "content": [sent]}]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["messages"][0]["content"][0] == sent


PROMPT_TAKES = "a string, a list of integers, a list of strings or a list of lists of integers"


@pytest.mark.parametrize("route,body,param,expected", [
    ("/completions", {"prompt": [5, "a"]}, "prompt", PROMPT_TAKES),
    ("/completions", {"prompt": [[5], ["a"]]}, "prompt", PROMPT_TAKES),
    ("/completions", {"prompt": "a", "stop": 5}, "stop", "a string or a list of strings"),
    # a list member of scalars said "a list of objects (union[str,bool,int,float])"
    ("/completions", {"prompt": "a", "vllm_xargs": {"k": {"b": 1}}}, "vllm_xargs.k",
     ("a string, a boolean, an integer, a number or a list of strings, booleans, integers or "
      "numbers")),
    ("/chat", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     "a string or a list of objects (ContentPart)"),
    ("/chat", {"messages": HI, "tool_choice": 5}, "tool_choice",
     "one of 'none', 'auto', 'required' or an object (NamedToolChoice)"),
])
def test_a_value_no_union_member_takes_names_the_members(client, route, body, param,
                                                         expected):
    """A value that fits no member of a union field (a mixed list of token ids and strings)
    said the first member's complaint ("prompt: Input should be a valid string"); now what
    the field takes, by the schema's own members."""
    resp = client.post(route, json={**({"prompt": "a"} if route == "/completions" else {}),
                                    **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_type"), error
    assert error["message"] == f"{param}: expected {expected}"


@pytest.mark.parametrize("body,param,message", [
    ({"structured_outputs": {}}, "structured_outputs",
     ("structured_outputs must set exactly one of json, json_object, regex, choice, grammar, "
      "structural_tag (got none)")),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "structured_outputs.choice must be a non-empty list of non-empty strings"),
    ({"guided_choice": [""]}, "guided_choice",
     "guided_choice must be a non-empty list of non-empty strings"),
])
def test_structured_outputs_errors_use_the_request_names(body, param, message):
    """A bad ``structured_outputs`` said "SamplingParams.structured_outputs ..." (kvflow's
    class) and ``guided_choice`` "guided_choice.choice"; now the request's own field path."""
    from kvflow.entrypoints.structured_requests import RequestFieldError, request_constraint

    with pytest.raises(RequestFieldError) as e:
        request_constraint(CompletionRequest.model_validate({"prompt": "a", **body}))
    assert (e.value.param, str(e.value)) == (param, message)


@pytest.mark.parametrize("index", [None, 0, 1])
def test_a_streamed_tool_call_index_echoed_back_must_be_its_position(index):
    """Clients that build the assistant message from the stream echo each call's ``index``:
    the call's own position (0 here) is accepted and kept from the template, which sees
    OpenAI's shape (``arguments`` parsed); another position is refused naming the key."""
    from kvflow.chat.messages import ChatTemplateError, normalize_conversation

    call = CALL if index is None else {**CALL, "index": index}
    req = ChatCompletionRequest.model_validate(
        {"messages": [*HI, {"role": "assistant", "tool_calls": [call]}]})
    conversation = [m.model_dump() for m in req.messages]
    if index == 1:
        with pytest.raises(ChatTemplateError) as e:
            normalize_conversation(conversation)
        assert e.value.param == "messages.1.tool_calls.0.index"
        return
    rendered = normalize_conversation(conversation)[1]["tool_calls"]
    assert rendered == [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": {}}}]


def test_an_empty_list_of_content_parts_is_a_400(client):
    """OpenAI's content array has ``minItems: 1``: ``[]`` is a 400 naming the message's
    content (it rendered as empty text before), code ``empty_array`` as other empty arrays
    (it was ``invalid_value``); an empty string is still content."""
    resp = client.post("/chat", json={"messages": [{"role": "user", "content": []}]})
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": "messages.0.content: a list of content parts must hold at least one part "
                   "(for no content send a string or null)",
        "type": "invalid_request_error", "param": "messages.0.content", "code": "empty_array"})
    assert client.post("/chat", json={"messages": [{"role": "user", "content": ""}]}
                       ).status_code == 200


@pytest.mark.parametrize("field, sent", [("temperature", "NaN"), ("top_p", "Infinity"),
                                         ("presence_penalty", "-Infinity")])
def test_a_number_that_is_not_finite_is_said_plainly(client, field, sent):
    """Python's JSON parser reads NaN and Infinity; the 400 said pydantic's "Input should be a
    finite number". Now in the words of the other number errors, the value as sent."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "' + field + '": ' + sent + "}"
    resp = client.post("/chat", content=body, headers={"Content-Type": "application/json"})
    assert (resp.status_code, resp.json()["error"]) == (400, {
        "message": f"{field}: must be a finite number, got {sent}",
        "type": "invalid_request_error", "param": field, "code": "invalid_value"})


LONG_KEY = "k" * 65


@pytest.mark.parametrize("body,param,code,message", [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "array_above_max_length",
     "metadata: at most 16 key-value pairs, got 17"),
    ({"metadata": {LONG_KEY: "v"}}, f"metadata.{LONG_KEY}", "string_above_max_length",
     "metadata: at most 64 characters per key, got 65"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k", "string_above_max_length",
     "metadata.k: at most 512 characters, got 513"),
    ({"messages": []}, "messages", "empty_array", "messages: at least 1 item, got 0"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role", "missing_required_parameter",
     "messages.0.role: a required field, not sent"),
    ({"temperature": -1}, "temperature", "decimal_below_min_value",
     "temperature: at least 0, got -1"),
    ({"top_p": 1.5}, "top_p", "decimal_above_max_value", "top_p: at most 1, got 1.5"),
    ({"n": 0}, "n", "integer_below_min_value", "n: at least 1, got 0"),
    ({"max_tokens": "abc"}, "max_tokens", "invalid_type",
     "max_tokens: expected an integer, got 'abc'"),
    ({"seed": 1.5}, "seed", "invalid_type", "seed: expected an integer, got 1.5"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value",
     ("response_format.type: expected 'text', 'json_object', 'json_schema' or "
      "'structural_tag', got 'yaml'")),
    ({"tools": [{"type": "function", "function": {"name": "get x"}}]},
     "tools.0.function.name", "invalid_value",
     "tools.0.function.name: must match the pattern '^[a-zA-Z0-9_-]+$', got 'get x'"),
    # OpenAI refuses these (kvflow answered 200): tools must hold at least one tool, and a
    # json_schema response format needs a name by the same rule as a function's
    ({"tools": []}, "tools", "empty_array", "tools: at least 1 item, got 0"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "missing_required_parameter",
     "response_format.json_schema.name: a required field, not sent"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "my schema",
                                                                 "schema": {}}}},
     "response_format.json_schema.name", "invalid_value",
     ("response_format.json_schema.name: must match the pattern '^[a-zA-Z0-9_-]+$', "
      "got 'my schema'")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65}}},
     "response_format.json_schema.name", "string_above_max_length",
     "response_format.json_schema.name: at most 64 characters, got 65"),
], ids=["metadata_pairs", "metadata_key", "metadata_value", "no_messages", "no_role",
        "temperature", "top_p", "n", "max_tokens_string", "seed_float", "response_format",
        "tool_name", "tools_empty", "schema_no_name", "schema_name_space",
        "schema_name_long"])
def test_schema_refusals_name_the_field_and_the_limit_in_plain_words(client, body, param,
                                                                    code, message):
    """Was pydantic's wording: "Dictionary should have at most 16 items after validation, not
    more", "Input should be greater than or equal to 0", "Field required"; now the limit the
    field declares and what the body sent. ``param`` and ``code`` as before."""
    resp = client.post("/chat", json={"messages": HI, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"], error["message"]) == (param, code, message)


def test_a_json_schema_name_of_64_allowed_characters_passes(client):
    """The edge of OpenAI's rule ``^[a-zA-Z0-9_-]{1,64}$``: 64 characters, each kind."""
    name = ("aZ0_-" * 13)[:64]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": {}}}
    resp = client.post("/chat", json={"messages": HI, "response_format": fmt})
    assert resp.status_code == 200, resp.text
    assert resp.json()["response_format"]["json_schema"]["name"] == name


def test_tokenize_refuses_an_empty_tools_list_too(client):
    resp = client.post("/tokenize", json={"messages": HI, "tools": []})
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("tools", "empty_array")


def test_a_tool_message_needs_its_tool_call_id():
    """OpenAI's tool message requires ``tool_call_id`` (the call it answers): one without it
    was rendered (200); now a 400 naming that message's key. With it, it passes."""
    from kvflow.entrypoints.chat_conversation import check_messages
    from kvflow.entrypoints.openai_errors import OpenAIError

    turns = [*HI, {"role": "assistant", "tool_calls": [CALL]},
             {"role": "tool", "content": "42"}]
    req = ChatCompletionRequest.model_validate({"messages": turns})
    with pytest.raises(OpenAIError) as e:
        check_messages(req.messages)
    assert (e.value.param, e.value.code, e.value.status) == \
        ("messages.2.tool_call_id", "missing_required_parameter", 400)
    assert str(e.value).endswith("answers), not sent"), str(e.value)
    turns[2]["tool_call_id"] = None  # sent, as null: said so (was "not sent")
    with pytest.raises(OpenAIError) as e:
        check_messages(ChatCompletionRequest.model_validate({"messages": turns}).messages)
    assert str(e.value).endswith("answers), sent as null"), str(e.value)
    turns[2]["tool_call_id"] = "c1"
    check_messages(ChatCompletionRequest.model_validate({"messages": turns}).messages)


@pytest.mark.parametrize("route", ["/chat", "/tokenize"])
def test_an_assistant_tool_call_id_is_not_empty(client, route):
    """A call's ``id`` is what a tool message's ``tool_call_id`` answers: ``""`` names no call
    (a tool message answering it is refused) and was accepted; now a 400 at that key, code
    string_below_min_length, as pydantic's min_length answers."""
    resp = client.post(route, json={"messages": [*HI, {"role": "assistant",
                                                        "tool_calls": [{**CALL, "id": ""}]}]})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == \
        ("messages.1.tool_calls.0.id", "string_below_min_length"), error
    assert client.post(route, json={"messages": [*HI, {"role": "assistant",
                                                         "tool_calls": [CALL]}]}).status_code \
        == 200


PART = {"type": "text", "text": "a"}
MAX_CONTENT_PARTS = 10_000  # the limit README documents


@pytest.mark.parametrize("route", ["/chat", "/tokenize"])
def test_content_parts_are_capped_per_request(client, route):
    """200,000 text parts in one message were validated on the event loop (1.3 s here, the
    server held meanwhile) and accepted. A request holds at most MAX_CONTENT_PARTS parts,
    all messages together (a string content counting as one): one more is a 400 naming the
    message that passes the limit, the limit and the count, found before any part is
    validated (the bad part at the end is not what is reported); the limit itself passes.
    (One part over the limit takes the same path as 200,000 parts, which cost ~1 s here.)"""
    first = {"role": "system", "content": "s"}  # counts as one part
    at_limit = [first, {"role": "user", "content": [PART] * (MAX_CONTENT_PARTS - 1)}]
    resp = client.post(route, json={"messages": at_limit})
    assert resp.status_code == 200, resp.text[:300]
    assert len(resp.json()["messages"][1]["content"]) == MAX_CONTENT_PARTS - 1
    for parts, total in ((MAX_CONTENT_PARTS, MAX_CONTENT_PARTS + 1),):
        over = [first, {"role": "user", "content": [*[PART] * (parts - 1),
                                                    {"type": "text", "text": 5}]}]
        resp = client.post(route, json={"messages": over})
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"] == {
            "message": "messages.1.content: a request holds at most 10000 content parts, all "
                       "messages together (a string content counts as one); this one holds "
                       f"{total}",
            "type": "invalid_request_error", "param": "messages.1.content",
            "code": "array_above_max_length"}


def test_many_messages_count_against_the_content_part_cap(client):
    """A string content counts as one part, so 10,001 one-line messages are refused too,
    naming the message that passes the limit."""
    many = [{"role": "user", "content": "a"}] * (MAX_CONTENT_PARTS + 1)
    resp = client.post("/chat", json={"messages": many})
    assert resp.status_code == 400, resp.text[:300]
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("messages.10000.content", "array_above_max_length")


@pytest.mark.parametrize("field", ["messages", "input"])
def test_embedding_batches_count_against_the_content_part_cap(client, field):
    """/v1/embeddings' batch of conversations (vLLM 0.32's, in ``messages`` or, as chat
    messages, in ``input``): their messages count together against the cap, the refusal
    naming the conversation and message that pass it under the field sent; at the limit the
    batch validates, read as ``messages``."""
    batch = [[{"role": "user", "content": "a"}] * (MAX_CONTENT_PARTS // 2)] * 2
    resp = client.post("/embeddings", json={field: batch})
    assert resp.status_code == 200, resp.text[:300]
    assert len(resp.json()["messages"]) == 2 and resp.json()["messages_field"] == field
    resp = client.post("/embeddings", json={field: [*batch, [{"role": "user", "content": "a"}]]})
    assert resp.status_code == 400, resp.text[:300]
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        (f"{field}.2.0.content", "array_above_max_length")


def test_embedding_chat_input_errors_name_input(client):
    """Chat messages sent in /v1/embeddings' ``input`` are validated as ``messages``; the
    errors found before validation (a lone surrogate) and by it (an unknown role) name the
    field the client sent, ``input``."""
    raw = '{"input": [{"role": "user", "content": "a\\ud800"}]}'
    resp = client.post("/embeddings", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("input.0.content", "invalid_unicode")
    assert resp.json()["error"]["message"].startswith("input.0.content: ")
    resp = client.post("/embeddings", json={"input": [[{"role": "user", "content": "a"}],
                                                      [{"role": "robot", "content": "b"}]]})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "input.1.0.role"
    assert resp.json()["error"]["message"].startswith("input.1.0.role: ")


MAX_TOOLS = MAX_TOOL_CALLS = 2048  # the limits README documents
MAX_LOGIT_BIAS = 300_000


def _tool(i: int, parameters: Any = None) -> dict:
    return {"type": "function", "function": {"name": f"f{i}",
                                             "parameters": parameters or {"type": "object"}}}


@pytest.mark.parametrize("route", ["/chat", "/tokenize"])
def test_tools_are_capped_per_request(client, route):
    """100,000 tools were validated on the event loop (the schema, then each tool's JSON
    schema checked: seconds) and accepted. A request holds at most MAX_TOOLS tools: one more
    is a 400 at ``tools`` saying the limit and the count (hand-written oracle), found before
    any tool is validated (the bad tool at the end is not what is reported); the limit
    itself passes. (One tool over the limit takes the same path as 100,000 tools, which cost
    ~1 s here.)"""
    resp = client.post(route, json={"messages": HI, "tools": [_tool(i)
                                                             for i in range(MAX_TOOLS)]})
    assert resp.status_code == 200, resp.text[:300]
    assert len(resp.json()["tools"]) == MAX_TOOLS
    for count in (MAX_TOOLS + 1,):
        tools = [*[_tool(i) for i in range(count - 1)], {"type": "function", "function": 5}]
        resp = client.post(route, json={"messages": HI, "tools": tools})
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"] == {
            "message": f"tools: a request holds at most 2048 tools; this one holds {count}",
            "type": "invalid_request_error", "param": "tools", "code": "array_above_max_length"}


@pytest.mark.parametrize("route", ["/chat", "/tokenize"])
def test_tool_calls_are_capped_per_request(client, route):
    """An assistant turn with 100,000 tool_calls was validated on the event loop (2.3 s) and
    rendered. A request holds at most MAX_TOOL_CALLS calls, all messages together: one more
    is a 400 naming ``messages.N.tool_calls`` of the message that passes the limit, the
    limit and the count, before any call is validated; the limit itself passes. (The turn
    that passes the limit by one takes the same path as one of 100,000 calls.)"""
    def turns(*counts: int) -> list[dict]:
        out = [*HI]
        for n in counts:
            out.append({"role": "assistant", "tool_calls": [CALL] * n})
            out.append({"role": "tool", "tool_call_id": "c1", "content": "1"})
        return out

    resp = client.post(route, json={"messages": turns(1000, MAX_TOOL_CALLS - 1000)})
    assert resp.status_code == 200, resp.text[:300]
    for counts in ((1000, MAX_TOOL_CALLS - 999), (MAX_TOOL_CALLS + 1,)):
        messages = turns(*counts)
        messages[-2]["tool_calls"][-1] = {"id": 5}  # invalid, but never reached
        resp = client.post(route, json={"messages": messages})
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"] == {
            "message": f"messages.{2 * len(counts) - 1}.tool_calls: a request holds at most "
                       "2048 tool calls, all messages together; this one holds "
                       f"{sum(counts)}",
            "type": "invalid_request_error", "param": f"messages.{2 * len(counts) - 1}.tool_calls",
            "code": "array_above_max_length"}


@pytest.mark.parametrize("route", ["/chat", "/completions"])
def test_logit_bias_is_capped_per_request(client, route):
    """A logit_bias of millions of entries was validated on the event loop (100,000: 0.12 s,
    a 32 MiB body's ~2.5 million: seconds). No model's vocabulary has MAX_LOGIT_BIAS token
    ids (the largest, Gemma 3's, about 262,000), so no valid request holds more entries: one more is a 400 at
    ``logit_bias`` saying the limit and the count, before any entry is validated (a bad
    value among them is not what is reported); the limit itself passes."""
    base = {"messages": HI} if route == "/chat" else {"prompt": "hi"}
    resp = client.post(route, json={**base, "logit_bias": {str(i): 1 for i in
                                                           range(MAX_LOGIT_BIAS)}})
    assert resp.status_code == 200, resp.text[:300]
    assert len(resp.json()["logit_bias"]) == MAX_LOGIT_BIAS
    bias = {str(i): 1 for i in range(MAX_LOGIT_BIAS)} | {"x": "not a number"}
    resp = client.post(route, json={**base, "logit_bias": bias})
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["error"] == {
        "message": "logit_bias: a request holds at most 300000 entries (more than any "
                   f"model's vocabulary); this one holds {MAX_LOGIT_BIAS + 1}",
        "type": "invalid_request_error", "param": "logit_bias", "code": "array_above_max_length"}
