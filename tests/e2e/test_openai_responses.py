"""POST /v1/responses end to end on the tiny random model (the tools template of
test_openai_structured). Oracles: the same request through /v1/chat/completions (same text,
same token counts, same tool calls), the openai package's own pydantic types (every body and
every stream event validates; the client parses them), a hand-written event order, and
``jsonschema`` for ``text.format`` json_schema. Bad input is a 4xx naming the field; the
engine keeps serving and holds no KV block afterwards."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvflow.entrypoints.protocol.responses_api import CHAT_FIELDS
from tests.e2e.test_openai_structured import ARGS, MODEL, SCHEMA

# test_openai_structured's template (tools named first), plus each assistant turn's calls
TEMPLATE = ("{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} "
            "{% endfor %}\n{% endif %}{% for m in messages %}<{{ m['role'] }}>"
            "{{ m['content'] }}{% for c in m['tool_calls'] or [] %}[{{ c['function']['name'] }}"
            "]{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")

TOOLS = [{"type": "function", "name": "get_weather", "description": "weather",
          "parameters": SCHEMA},
         {"type": "function", "name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
              for t in TOOLS]
EVENTS = TypeAdapter(ResponseStreamEvent)
# enable_in_reasoning (vLLM's): the tiny model never writes </think>, and the structured and
# forced-tool tests below need their grammar from the first token (by default it would wait
# for the end of the reasoning, as vLLM's does)
SERVER_ARGS = [*ARGS, "--reasoning-parser", "think",
               "--structured-outputs-config", '{"enable_in_reasoning": true}']
STORE_SIZE = 4
# the server of this module and test_openai_responses_extras.py (``start_server.shared``; it
# runs first, so its block count is this module's alone): it keeps STORE_SIZE replies
SHARED_ARGS = [*SERVER_ARGS, "--responses-store-size", str(STORE_SIZE)]


def responses_model(tiny_llama, built_models) -> str:
    """The tiny Llama with ``TEMPLATE`` as its chat template (one folder per session)."""
    return built_models.with_chat_template("tiny_responses", tiny_llama.path, TEMPLATE)


def prestart_servers(fixture):
    return [(responses_model(fixture("tiny_llama"), fixture("built_models")), SHARED_ARGS,
             None)]


@pytest.fixture(scope="module")
def server(start_server, tiny_llama, built_models):
    """The session's server of ``SHARED_ARGS`` (``start_server.shared``)."""
    return start_server.shared(responses_model(tiny_llama, built_models), SHARED_ARGS)


def respond(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)


def chat(server, messages, **body) -> dict:
    resp = httpx.post(f"{server.url}/v1/chat/completions",
                      json={"model": MODEL, "messages": messages, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def whole(server, **body) -> dict:
    """A non-streamed reply, checked against the openai package's ``Response``."""
    resp = respond(server, **body)
    assert resp.status_code == 200, resp.text
    Response.model_validate(resp.json())
    return resp.json()


def streamed(server, **body) -> list[dict]:
    """The SSE events of a streamed reply (``event:`` line checked against the data's type,
    each event validated as the openai package's ``ResponseStreamEvent``)."""
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for block in resp.read().decode().split("\n\n"):
            if not block:
                continue
            name_line, data_line = block.split("\n")
            event = json.loads(data_line.removeprefix("data: "))
            assert name_line == f"event: {event['type']}"
            EVENTS.validate_python(event)
            events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def output_text(reply: dict) -> str:
    return "".join(p["text"] for item in reply["output"] if item["type"] == "message"
                   for p in item["content"])


def assert_usage_is_chats(reply: dict, chat_reply: dict) -> None:
    usage = reply["usage"]
    assert usage["input_tokens"] == chat_reply["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat_reply["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def assert_no_leak(server, free_at_start: float) -> None:
    deadline = time.monotonic() + 10
    while (free := server.value(server.metrics(), "kvflow:kv_cache_free_blocks")) \
            != free_at_start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free == free_at_start


# ---- text ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [4, 40])
def test_text_reply_is_chats(server, max_tokens):
    """A string input with instructions: the text, token counts and finish equal chat's for
    the same conversation (system + user), greedy; cut by length -> incomplete."""
    reply = whole(server, input="the quick brown fox", instructions="be brief",
                  max_output_tokens=max_tokens, temperature=0, metadata={"k": "v"})
    oracle = chat(server, [{"role": "system", "content": "be brief"},
                           {"role": "user", "content": "the quick brown fox"}],
                  max_completion_tokens=max_tokens, temperature=0)
    choice = oracle["choices"][0]
    assert output_text(reply) == choice["message"]["content"]
    assert_usage_is_chats(reply, oracle)
    cut = choice["finish_reason"] == "length"
    assert reply["status"] == ("incomplete" if cut else "completed")
    assert reply["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)
    assert reply["id"].startswith("resp_") and reply["object"] == "response"
    (item,) = reply["output"]
    assert item["id"].startswith("msg_") and item["role"] == "assistant"
    assert (reply["metadata"], reply["max_output_tokens"], reply["instructions"]) == \
        ({"k": "v"}, max_tokens, "be brief")


def test_openai_client_parses_the_reply(server):
    client = server.client()
    resp = client.responses.create(model=MODEL, input="hello there", max_output_tokens=8,
                                   temperature=0)
    oracle = chat(server, [{"role": "user", "content": "hello there"}],
                  max_completion_tokens=8, temperature=0)
    assert resp.output_text == oracle["choices"][0]["message"]["content"]
    assert resp.usage.output_tokens == oracle["usage"]["completion_tokens"]


@pytest.mark.parametrize("output", ["2", [{"type": "input_text", "text": "2"},
                                           {"type": "input_text", "text": "3"}]])
def test_input_items_render_as_chat_messages(server, output):
    """Roles, text parts, function_call and function_call_output items (output a string or
    text parts): the same prompt (input tokens) and text as chat's messages with tool_calls
    and a tool turn."""
    items = [{"role": "developer", "content": "dev"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "a"},
                          {"type": "input_text", "text": "b"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "c",
                                                "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "add",
              "arguments": '{"a": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": output}]
    messages = [{"role": "developer", "content": "dev"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": output if isinstance(
                    output, str) else [{"type": "text", "text": p["text"]} for p in output]}]
    reply = whole(server, input=items, max_output_tokens=6, temperature=0)
    oracle = chat(server, messages, max_completion_tokens=6, temperature=0)
    assert output_text(reply) == oracle["choices"][0]["message"]["content"]
    assert_usage_is_chats(reply, oracle)


# ---- streaming -----------------------------------------------------------------------------------
def test_stream_event_order_and_text(server):
    body = {"input": "the quick brown fox", "max_output_tokens": 12, "temperature": 0}
    events = streamed(server, **body)
    reply = whole(server, **body)
    kinds = [e["type"] for e in events]
    last = f"response.{reply['status']}"
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added",
                     *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", last]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == output_text(reply)
    assert events[-4]["text"] == text
    final = events[-1]["response"]
    Response.model_validate(final)
    assert output_text(final) == text
    # the same usage, but the whole reply (sent second) found the prompt's whole blocks in the
    # prefix cache: all but the last token's, by hand from the server's block size
    cached = reply["usage"].pop("input_tokens_details")["cached_tokens"]
    final["usage"].pop("input_tokens_details")
    assert final["usage"] == reply["usage"]
    block_size = int(SERVER_ARGS[SERVER_ARGS.index("--block-size") + 1])
    assert cached == (reply["usage"]["input_tokens"] - 1) // block_size * block_size
    assert events[0]["response"]["status"] == "in_progress"


def test_openai_client_stream_events(server):
    client = server.client()
    kinds, deltas = [], []
    with client.responses.create(model=MODEL, input="hello", max_output_tokens=6,
                                 temperature=0, stream=True) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert "".join(deltas) == output_text(whole(server, input="hello", max_output_tokens=6,
                                                temperature=0))


# ---- structured output and tools -----------------------------------------------------------------
def test_json_schema_format(server):
    fmt = {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
    for seed_temp in (0, 0.8):
        body = {"input": "the quick brown fox", "max_output_tokens": 48,
                "temperature": seed_temp, "text": {"format": fmt}}
        reply = whole(server, **body)
        assert reply["text"]["format"]["name"] == "weather"
        if seed_temp == 0:
            oracle = chat(server, [{"role": "user", "content": "the quick brown fox"}],
                          max_completion_tokens=48, temperature=0, response_format={
                              "type": "json_schema",
                              "json_schema": {"name": "weather", "schema": SCHEMA}})
            assert output_text(reply) == oracle["choices"][0]["message"]["content"]
        if reply["status"] == "completed":
            jsonschema.validate(json.loads(output_text(reply)), SCHEMA)
        else:
            assert output_text(reply).startswith("{")


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"},
                                         "required"])
def test_forced_tool_choice_gives_function_calls(server, tool_choice):
    """tool_choice named / required (a grammar forces the calls): function_call items with
    chat's names and arguments; streamed, the argument deltas join to the same arguments."""
    body = {"input": "the quick brown fox", "tools": TOOLS, "tool_choice": tool_choice,
            "max_output_tokens": 64, "temperature": 0}
    reply = whole(server, **body)
    chat_choice = tool_choice if tool_choice == "required" else \
        {"type": "function", "function": {"name": "get_weather"}}
    oracle = chat(server, [{"role": "user", "content": "the quick brown fox"}],
                  tools=CHAT_TOOLS, tool_choice=chat_choice, max_completion_tokens=64,
                  temperature=0)
    calls = [i for i in reply["output"] if i["type"] == "function_call"]
    expected = [(c["function"]["name"], c["function"]["arguments"])
                for c in oracle["choices"][0]["message"]["tool_calls"] or []]
    assert [(c["name"], c["arguments"]) for c in calls] == expected and calls
    assert all(c["id"].startswith("fc_") and c["call_id"].startswith("call_") for c in calls)
    assert_usage_is_chats(reply, oracle)
    events = streamed(server, **body)
    args: dict[str, str] = {}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            args[e["item_id"]] = args.get(e["item_id"], "") + e["delta"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["name"], e["arguments"]) for e in done] == expected
    assert [args.get(e["item_id"], "") for e in done] == [a for _, a in expected]


# ---- store and previous_response_id --------------------------------------------------------------
def test_store_and_previous_response_id(server):
    first = whole(server, input="hello", instructions="sys", max_output_tokens=5,
                  temperature=0)
    got = httpx.get(f"{server.url}/v1/responses/{first['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == first
    second = whole(server, input="again", previous_response_id=first["id"],
                   max_output_tokens=5, temperature=0)
    assert second["previous_response_id"] == first["id"]
    # the instructions are not carried over (OpenAI's rule); the first reply is a turn
    oracle = chat(server, [{"role": "user", "content": "hello"},
                           {"role": "assistant", "content": output_text(first)},
                           {"role": "user", "content": "again"}],
                  max_completion_tokens=5, temperature=0)
    assert output_text(second) == oracle["choices"][0]["message"]["content"]
    assert_usage_is_chats(second, oracle)
    events = streamed(server, input="x", max_output_tokens=3)  # a streamed reply is stored
    got = httpx.get(f"{server.url}/v1/responses/{events[-1]['response']['id']}", timeout=10)
    assert got.json() == events[-1]["response"]
    query = httpx.get(f"{server.url}/v1/responses/{first['id']}?stream=true", timeout=10)
    assert query.status_code == 400 and query.json()["error"]["param"] == "stream"
    unstored = whole(server, input="x", store=False, max_output_tokens=2)
    missing = httpx.get(f"{server.url}/v1/responses/{unstored['id']}", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == \
        "response_not_found"


def test_x_request_id_header_leaves_response_ids_unique(server):
    """A response is stored under its id, so an ``X-Request-Id`` header does not name it (as
    vLLM's /v1/responses ignores the header; chat and completions take it): two requests
    sending one header get two ids, each retrieving its own reply."""
    replies = []
    for _ in range(2):
        resp = httpx.post(f"{server.url}/v1/responses", timeout=60,
                          headers={"X-Request-Id": "gw-1"},
                          json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
        assert resp.status_code == 200, resp.text
        replies.append(resp.json())
    assert replies[0]["id"] != replies[1]["id"]
    for reply in replies:
        assert re.fullmatch(r"resp_[0-9a-f]{32}", reply["id"]), reply["id"]
        got = httpx.get(f"{server.url}/v1/responses/{reply['id']}", timeout=10)
        assert got.status_code == 200 and got.json() == reply


# ---- errors --------------------------------------------------------------------------------------
BAD = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     400, "input.1.role"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]},
     400, "input.0.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "txt": "a"}]}]},
     400, "input.0.content.0.txt"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "hi", "tools": [TOOLS[0], {"type": "file_search", "vector_store_ids": []}]},
     400, "tools.1.type"),
    ({"input": "hi", "tools": [{**TOOLS[1], "parameters": {"type": 3}}]}, 400,
     "tools.0.parameters"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning.effort"),
    ({"input": "hi", "truncation": "sometimes"}, 400, "truncation"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include.0"),
    # vLLM 0.32's chat fields its Responses request does not declare (seed, stop, ... it
    # does: tests/e2e/test_openai_fields.py's responses cases)
    ({"input": "hi", "n": 2}, 400, "n"),
    ({"input": "hi", "thinking_token_budget": 4}, 400, "thinking_token_budget"),
    ({"input": "hi", "stop": 5}, 400, "stop"),
    ({"input": "hi", "background": True, "store": False}, 400, "background"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 100_000}, 400, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400,
     "text.format.schema"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "zz"}},
     400, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": []}, 400, "input"),
    ({"input": "hi", "model": "other"}, 404, "model"),
    ({"input": [{"role": "user", "content": ["a"]}]}, 400, "input.0.content.0.type"),
    ({"input": [{"type": "message", "content": "a"}]}, 400, "input.0.role"),
    # any arguments text is taken (vLLM 0.32 renders '{no' as {}), text only
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c",
                                                   "name": "f", "arguments": 5}]},
     400, "input.1.arguments"),
    ({"input": "hi", "tools": [{"type": "function", "name": 5}]}, 400, "tools.0.name"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, 400,
     "tools.0.parameters"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": 5}}, 400,
     "tool_choice.name"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    # two constraints at once: the message names text.format, not chat's response_format
    ({"input": "hi", "tools": TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, 400, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": 5}}}}, 400, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": "hi", "instructions": 5}, 400, "instructions"),
    ({"input": "hi", "metadata": {"a": 5}}, 400, "metadata.a"),
    ({"input": "hi", "temperature": 3}, 400, "temperature"),
    ({"input": 5}, 400, "input"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[p for _, _, p in BAD])
def test_bad_input_is_a_4xx_naming_the_field(server, body, status, param):
    resp = respond(server, **body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, resp.text
    assert not re.search(r"max_completion_tokens|response_format|messages\.\d", error["message"])


def test_disconnect_mid_stream_aborts_without_leak(server, free_at_start):
    """A stream the client leaves after two deltas is aborted (counted as an abort, fewer
    tokens generated than asked, every block free again), and the server serves on."""
    body = {"input": "the quick brown fox", "max_output_tokens": 200, "temperature": 0}
    oracle = chat(server, [{"role": "user", "content": "the quick brown fox"}],
                  max_completion_tokens=200, temperature=0)
    assert oracle["choices"][0]["finish_reason"] == "length"  # it would run all 200
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as resp:
        deltas = 0
        for line in resp.iter_lines():
            deltas += line == "event: response.output_text.delta"
            if deltas == 2:
                break
    assert_no_leak(server, free_at_start)
    after = server.metrics()

    def grew(name, **labels):
        return server.value(after, name, **labels) - server.value(before, name, **labels)

    assert grew("kvflow:request_success_total", finished_reason="abort") == 1
    assert grew("kvflow:generation_tokens_total") < 200
    assert whole(server, input="hi", max_output_tokens=2)["usage"]["output_tokens"] <= 2
    assert_no_leak(server, free_at_start)


# ---- every field ---------------------------------------------------------------------------------
# OpenAI fields kvflow does not honour: a value that asks for something -> a 400 at ``param``
REFUSED = {"conversation": ("conv_1", "conversation"),
           "max_tool_calls": (2, "max_tool_calls"), "prompt": ({"id": "pmpt_1"}, "prompt"),
           "context_management": ([{"type": "compaction"}], "context_management"),
           "prompt_cache_retention": ("24h", "prompt_cache_retention"),
           "prompt_cache_options": ({"mode": "x"}, "prompt_cache_options"),
           "moderation": ({"model": "m"}, "moderation"), "image": ({"x": 1}, "image"),
           "access_programs": ({"x": 1}, "access_programs"),
           "background_options": ({"x": 1}, "background_options"),
           "reasoning": ({"summary": "auto"}, "reasoning.summary"),
           "service_tier": ("flex", "service_tier"),
           "stream_options": ({"include_obfuscation": True}, "stream_options.include_obfuscation")}
# honoured fields: each checked against chat or by its effect in a test of this module
USED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
        "metadata", "parallel_tool_calls", "tool_choice", "tools", "text", "stream", "store",
        "previous_response_id", "user", "prompt_cache_key", "safety_identifier",
        "include", "top_logprobs",  # output logprobs: test_openai_responses_extras
        "cache_salt", "session_id",  # session_id: tests/test_kv_events_session.py
        "background",  # background: test_openai_responses_background
        "vllm_xargs",  # below without processors; with them: test_openai_logits_processors
        "include_reasoning",  # test_openai_tool_parsers_served (a reasoning parser's server)
        "truncation",  # tests/e2e/test_openai_fields.py's responses cases, as CHAT_FIELDS
        "request_id",  # there too, and test_openai_responses_background
        *CHAT_FIELDS}


def test_vllm_xargs_without_processors_is_a_400_naming_it(server):
    """As on chat: this server runs no custom logits processor, so nothing would read them."""
    for xargs, param in (({"k": 1}, "vllm_xargs"), ({"k": {"nested": 1}}, "vllm_xargs.k")):
        resp = respond(server, input="hi", vllm_xargs=xargs)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text


def test_every_field_is_used_or_refused():
    from kvflow.entrypoints.protocol.responses_api import ResponsesRequest, unhonoured_fields

    assert set(REFUSED) | USED == set(ResponsesRequest.model_fields)
    assert not set(REFUSED) & USED
    assert set(unhonoured_fields()) <= set(REFUSED)  # each marked field is refused here


def test_cache_salt_shares_blocks_only_with_the_same_salt(server):
    """vLLM's ``cache_salt``, passed to the chat request: the same input under a new salt
    hits nothing (not even the template's shared prefix), under the same salt again every
    whole block but the last token's (by hand from the block size); an empty salt is a 400
    naming it."""
    block_size = int(SERVER_ARGS[SERVER_ARGS.index("--block-size") + 1])
    salt, other = (f"salt-{time.monotonic_ns()}-{i}" for i in range(2))
    got = []
    for s in (salt, salt, other):
        resp = respond(server, input="salted words for the prefix cache", max_output_tokens=2,
                       temperature=0, cache_salt=s, store=False)
        assert resp.status_code == 200, resp.text
        got.append(resp.json()["usage"]["input_tokens_details"]["cached_tokens"])
    num_prompt = resp.json()["usage"]["input_tokens"]
    assert got == [0, (num_prompt - 1) // block_size * block_size, 0]
    resp = respond(server, input="hi", cache_salt="")
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unhonoured_field_is_a_400_naming_it(server, field):
    value, param = REFUSED[field]
    resp = respond(server, input="hi", stream=True, **{field: value})
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        (param, "unsupported_parameter")


def test_harmless_values_of_unhonoured_fields_pass(server):
    reply = whole(server, input="hi", max_output_tokens=2, background=False, top_logprobs=0,
                  truncation="disabled", include=[], reasoning={}, service_tier="auto",
                  user="u1", prompt_cache_key="k", safety_identifier="s")
    assert (reply["truncation"], reply["service_tier"], reply["user"]) == \
        ("disabled", "default", "u1")
    assert (reply["prompt_cache_key"], reply["safety_identifier"]) == ("k", "s")


def test_tiny_top_p_is_greedy(server):
    """top_p 1e-6 at temperature 1 keeps only the most likely token: chat's greedy text."""
    reply = whole(server, input="the quick", max_output_tokens=8, temperature=1, top_p=1e-6)
    oracle = chat(server, [{"role": "user", "content": "the quick"}],
                  max_completion_tokens=8, temperature=0)
    assert output_text(reply) == oracle["choices"][0]["message"]["content"]
    assert reply["top_p"] == 1e-6


def test_parallel_tool_calls_false_is_chats(server):
    body = {"tools": TOOLS, "tool_choice": "required", "max_output_tokens": 80,
            "temperature": 0, "parallel_tool_calls": False}
    reply = whole(server, input="the quick brown fox", **body)
    oracle = chat(server, [{"role": "user", "content": "the quick brown fox"}],
                  tools=CHAT_TOOLS, tool_choice="required", max_completion_tokens=80,
                  temperature=0, parallel_tool_calls=False)
    calls = [(i["name"], i["arguments"]) for i in reply["output"]
             if i["type"] == "function_call"]
    assert calls == [(c["function"]["name"], c["function"]["arguments"])
                     for c in oracle["choices"][0]["message"]["tool_calls"]]
    assert len(calls) == 1 and reply["parallel_tool_calls"] is False


def test_json_object_format_is_an_object(server):
    reply = whole(server, input="the quick brown fox", max_output_tokens=48, temperature=0,
                  text={"format": {"type": "json_object"}})
    oracle = chat(server, [{"role": "user", "content": "the quick brown fox"}],
                  max_completion_tokens=48, temperature=0,
                  response_format={"type": "json_object"})
    assert output_text(reply) == oracle["choices"][0]["message"]["content"]
    assert output_text(reply).startswith("{")
    if reply["status"] == "completed":
        assert isinstance(json.loads(output_text(reply)), dict)


def test_input_over_the_item_cap_is_a_400(server):
    resp = respond(server, input=[{"role": "user", "content": "a"}] * 10_001)
    assert resp.status_code == 400
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("input", "array_above_max_length")


def test_openai_stream_helper_rebuilds_the_reply(server):
    """The openai client's ``responses.stream`` accumulates the events into a response (it
    checks each delta against the items announced before it): the calls and usage equal the
    whole reply's."""
    none = {"type": "function", "name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}
    body = {"input": "the quick brown fox", "tools": [*TOOLS, none], "max_output_tokens": 64,
            "tool_choice": {"type": "function", "name": "now"}, "temperature": 0}
    reply = whole(server, **body)
    assert reply["status"] == "completed"  # the helper wants response.completed
    with server.client().responses.stream(model=MODEL, **body) as stream:
        final = stream.get_final_response()
    calls = [(i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert calls == [(i["name"], i["arguments"]) for i in reply["output"]
                     if i["type"] == "function_call"]
    assert final.usage.output_tokens == reply["usage"]["output_tokens"]
