"""The server on the packaged SmolLM2-135M-Instruct: a real chat answer, multi-byte (CJK) text
streamed without a split character, and a client that hangs up mid-stream freeing its KV
blocks at once.

The server computes in float32 (the Q4_1 GGUF dequantizes to it exactly): these tests compare
greedy answers, and in bf16 the first token of the capital-of-France answer is a near-tie
("The" vs "L", 0.08 nats apart) that one CPU's rounding may flip. Greedy texts compared with
each other may still part only where the top-2 logprobs are within ``TIE_TOL``.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import SMOLLM2 as MODEL
from tests.e2e.conftest import SMOLLM2_NUM_KV_BLOCKS as NUM_KV_BLOCKS

TIE_TOL = 1e-3  # nats: fp32 results of two kernel paths (prefix-cache hit or not) differ less

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The session's SmolLM2 server (float32, 64 blocks of 16 tokens, max_model_len 1008),
    shared with tests/e2e/test_openai_reported.py."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    return load_tokenizer(resolve_model(MODEL), None)


def test_chat_answers(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    assert "Paris" in resp.choices[0].message.content
    assert resp.usage.completion_tokens <= 12
    # the answer is not a coin toss: its first token leads the runner-up by a clear margin
    first = resp.choices[0].logprobs.content[0].top_logprobs
    assert first[0].logprob - first[1].logprob > 0.02, first


def assert_same_greedy(a: list[int], b: list[int], a_steps) -> None:
    """Greedy token ids ``a`` and ``b`` of one prompt are equal, or part only at a step where
    ``a``'s top-2 logprobs (``a_steps``, chat logprobs with top_logprobs >= 2) are within
    ``TIE_TOL`` (a legitimate near-tie; the continuations may differ from there on)."""
    for step, (x, y) in enumerate(zip(a, b)):
        if x != y:
            top = a_steps[step].top_logprobs
            assert top[0].logprob - top[1].logprob <= TIE_TOL, (step, a, b, top)
            return
    assert len(a) == len(b)


def test_cjk_stream_never_splits_a_character(client, tokenizer):
    """Greedy Chinese output: byte-level BPE splits each CJK character over several tokens.
    No streamed piece holds a partial character, and the pieces join to exactly
    tokenizer.decode of the generated ids; the non-streamed request (a prefix-cache hit) gives
    the same greedy tokens (see ``assert_same_greedy``)."""
    request = {"model": MODEL, "max_tokens": 24, "temperature": 0,
               "messages": [{"role": "user", "content": "Translate to Chinese: Hello world"}],
               "logprobs": True, "top_logprobs": 2,
               "extra_body": {"return_token_ids": True}}
    pieces, token_ids, steps = [], [], []
    for chunk in client.chat.completions.create(stream=True, **request):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            token_ids.extend(getattr(c, "token_ids", None) or [])
            steps.extend(c.logprobs.content if c.logprobs and c.logprobs.content else [])
    text = "".join(pieces)
    assert text == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert len(steps) == len(token_ids)
    assert not any("\ufffd" in p for p in pieces)
    assert any(ord(ch) >= 0x2E80 for ch in text)  # CJK came out
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)  # split over tokens
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.message.content == tokenizer.decode(whole.token_ids, skip_special_tokens=True)
    assert_same_greedy(token_ids, whole.token_ids, steps)


def _wait_for(server, predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if predicate(metrics):
            return metrics
        time.sleep(0.05)
    raise AssertionError(f"metrics never satisfied the condition: {metrics}")


def test_disconnect_mid_stream_frees_blocks(server):
    usable = NUM_KV_BLOCKS - 1
    before = _wait_for(server, lambda m: server.value(m, "kvflow:kv_cache_free_blocks") ==
                       usable)
    body = {"model": MODEL, "prompt": "Once upon a time, in a land far away,",
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        events = (line for line in resp.iter_lines() if line.startswith("data: "))
        for _ in range(3):
            next(events)
        during = server.metrics()
        assert server.value(during, "kvflow:num_requests_running") == 1
        assert server.value(during, "kvflow:kv_cache_free_blocks") < usable
    # The client hung up after 3 chunks: the request is aborted and every block is free again.
    after = _wait_for(server, lambda m: server.value(m, "kvflow:kv_cache_free_blocks") == usable
                      and server.value(m, "kvflow:num_requests_running") == 0)

    def grew(name, **labels):
        return server.value(after, name, **labels) - server.value(before, name, **labels)

    assert grew("kvflow:request_success_total", finished_reason="abort") == 1
    assert grew("kvflow:request_success_total", finished_reason="length") == 0
    assert 3 <= grew("kvflow:generation_tokens_total") < 400


def test_named_tool_call_returns_valid_arguments(client):
    """tool_choice naming a function: the grammar forces the arguments to the schema."""
    import json

    import jsonschema

    schema = {"type": "object",
              "properties": {"city": {"type": "string", "maxLength": 40},
                             "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"]}
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": schema}}]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice  # OpenAI's under a named function
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)


# ---- tools: definitions, history turns, and one output constraint ------------------------------
TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
TOOL_TURNS = [{"role": "user", "content": "What time is it in UTC?"},
              {"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
# SmolLM2's template renders no tool_calls: the server writes them in the Hermes format its
# tool instructions ask for (hand-written here).
CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def refused(resp: httpx.Response) -> tuple[str, str]:
    """(param, code) of a 400."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error", error
    return error["param"], error["code"]


def hf_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_history_tool_calls_reach_the_prompt(server, tokenizer):
    """An assistant turn's tool_calls are in the prompt, not dropped. Oracle: the HF
    tokenizer's rendering of the turn with the hand-written Hermes call as its content
    (SmolLM2's template has no tool_calls); /v1/chat/completions prompts the model with the
    same ids as /tokenize. A template that renders tool_calls gets them as they are:
    tests/e2e/test_openai_fields.py (a server that takes request templates)."""
    as_text = [TOOL_TURNS[0], {"role": "assistant", "content": CALL_TEXT}, TOOL_TURNS[2]]
    expected = hf_ids(tokenizer, as_text)
    tokens = post(server, "/tokenize", {"messages": TOOL_TURNS}).json()["tokens"]
    assert tokens == expected
    without = [TOOL_TURNS[0], {"role": "assistant", "content": ""}, TOOL_TURNS[2]]
    assert len(tokens) > len(hf_ids(tokenizer, without))
    chat = post(server, "/v1/chat/completions", {"messages": TOOL_TURNS, "max_tokens": 1,
                                                 "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_token_ids"] == expected



def _with_call(call) -> list[dict]:
    return [TOOL_TURNS[0], {"role": "assistant", "content": None, "tool_calls": call},
            TOOL_TURNS[2]]


BAD_HISTORY = [  # (messages, param, code)
    (_with_call("x"), "messages.1.tool_calls", "invalid_type"),
    (_with_call([5]), "messages.1.tool_calls.0", "invalid_type"),
    (_with_call({"a": 1}), "messages.1.tool_calls", "invalid_type"),
    (_with_call([]), "messages.1.tool_calls", "empty_array"),
    (_with_call([{k: v for k, v in CALL.items() if k != "id"}]), "messages.1.tool_calls.0.id",
     "missing_required_parameter"),
    (_with_call([{**CALL, "type": "banana"}]), "messages.1.tool_calls.0.type", "invalid_value"),
    (_with_call([{**CALL, "function": {"name": "get_time"}}]),
     "messages.1.tool_calls.0.function.arguments", "missing_required_parameter"),
    (_with_call([{**CALL, "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]),
     "messages.1.tool_calls.0.function.arguments", "invalid_type"),
    (_with_call([{**CALL, "function": {"name": 5, "arguments": "{}"}}]),
     "messages.1.tool_calls.0.function.name", "invalid_type"),
    ([{**TOOL_TURNS[0], "tool_calls": [CALL]}], "messages.0.tool_calls", "invalid_value"),
    ([*TOOL_TURNS[:2], {**TOOL_TURNS[2], "tool_call_id": 1}], "messages.2.tool_call_id",
     "invalid_type"),
    ([*TOOL_TURNS[:2], {**TOOL_TURNS[2], "tool_call_id": ""}], "messages.2.tool_call_id",
     "empty_string"),
    ([{**TOOL_TURNS[0], "tool_call_id": "call_1"}], "messages.0.tool_call_id",
     "invalid_value"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("messages,param,code", BAD_HISTORY,
                         ids=[f"{p}:{c}" for _, p, c in BAD_HISTORY])
def test_malformed_history_tool_calls_are_400(server, path, messages, param, code):
    """OpenAI's shape for an assistant's tool_calls ({id, type "function", function {name,
    arguments as JSON text}}), only on assistant turns; tool_call_id a non-empty string, on tool
    turns."""
    body = {"messages": messages, **({"max_tokens": 1} if path != "/tokenize" else {})}
    assert refused(post(server, path, body)) == (param, code)


def _tool(name: str = "get_time", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name,
                                             "parameters": parameters or {"type": "object"}}}


# a valid JSON schema xgrammar does not compile (minProperties beyond the named properties)
UNCOMPILED = {"type": "object", "minProperties": 1}

BAD_TOOLS = [  # (tools, tool_choice, param, code)
    ([_tool("get time")], None, "tools.0.function.name", "invalid_value"),
    ([_tool("wetter_ä")], "auto", "tools.0.function.name", "invalid_value"),
    ([_tool("a" * 65)], None, "tools.0.function.name", "string_above_max_length"),
    ([_tool(), _tool("add"), _tool()], None, "tools.2.function.name", "invalid_value"),
    ([_tool(parameters={"type": "banana"})], None, "tools.0.function.parameters",
     "invalid_value"),
    ([_tool(parameters={"type": "banana"})], "auto", "tools.0.function.parameters",
     "invalid_value"),
    ([_tool(parameters={"type": "banana"})], "none", "tools.0.function.parameters",
     "invalid_value"),
    ([_tool(), _tool("add", {"type": "object", "properties": {"a": {"type": "banana"}}})],
     "auto", "tools.1.function.parameters", "invalid_value"),
    ([_tool(parameters={"type": "object", "required": "tz"})], None,
     "tools.0.function.parameters", "invalid_value"),
    ([_tool(parameters=UNCOMPILED)], "required", "tools.0.function.parameters",
     "invalid_value"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("tools,tool_choice,param,code", BAD_TOOLS,
                         ids=[f"{p}:{c}:{t}" for _, t, p, c in BAD_TOOLS])
def test_bad_tool_definitions_are_400(server, path, tools, tool_choice, param, code):
    """Function names by OpenAI's rule ^[a-zA-Z0-9_-]{1,64}$ and unique; parameters a valid
    JSON schema whatever the tool_choice, and one the grammar backend compiles when the
    call is forced (required, named)."""
    body = {"messages": TOOL_TURNS[:1], "tools": tools,
            **({"tool_choice": tool_choice} if tool_choice else {})}
    if path != "/tokenize":
        body["max_tokens"] = 1
    assert refused(post(server, path, body)) == (param, code)


def test_valid_schema_the_grammar_cannot_enforce_is_taken_under_auto(server, tokenizer):
    """Under tool_choice auto the model writes calls unconstrained, so a valid schema the
    grammar backend refuses (UNCOMPILED; a 400 when forced, BAD_TOOLS) is taken, and the
    tool reaches the prompt as any tool does."""
    body = {"messages": TOOL_TURNS[:1], "tools": [_tool("check", UNCOMPILED)]}
    resp = post(server, "/v1/chat/completions", {**body, "max_tokens": 1, "tool_choice": "auto"})
    assert resp.status_code == 200, resp.text
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert "minProperties" in tokenizer.decode(tokens)


def test_longest_tool_name_is_accepted(server, tokenizer):
    """A 64-character name of every allowed kind of character is fine: the tool reaches the
    prompt (SmolLM2's template reads no tools: the Hermes instructions carry it)."""
    name = ("Get_time-" * 8)[:64]
    resp = post(server, "/tokenize", {"messages": TOOL_TURNS[:1], "tools": [_tool(name)]})
    assert resp.status_code == 200, resp.text
    assert name in tokenizer.decode(resp.json()["tokens"])


NAMED = {"type": "function", "function": {"name": "get_time"}}
OTHER_CONSTRAINTS = {
    "structured_outputs": {"choice": ["a", "b"]},
    "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "[0-9]+", "guided_choice": ["a", "b"],
    "guided_grammar": 'root ::= "a"'}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("field", [*OTHER_CONSTRAINTS, "json_schema"])
def test_forced_tool_call_with_another_constraint_is_400(server, field, tool_choice, stream):
    """tool_choice required / named is a grammar of its own: another output constraint with
    it is refused as two constraints are ("set only one of ..."), not dropped."""
    value = OTHER_CONSTRAINTS.get(field)
    if field == "json_schema":
        field, value = "response_format", {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object"}}}
    body = {"messages": TOOL_TURNS[:1], "tools": [TOOL], "tool_choice": tool_choice,
            "max_tokens": 8, "stream": stream, field: value}
    resp = post(server, "/v1/chat/completions", body)
    assert refused(resp) == ("tool_choice", "invalid_value")
    assert resp.json()["error"]["message"].startswith(f"set only one of {field}, tool_choice")


def test_auto_tool_choice_keeps_the_other_constraint(server):
    """tool_choice auto forces nothing: an output constraint with it is honoured (the reply
    is one of the structured_outputs choices)."""
    body = {"messages": TOOL_TURNS[:1], "tools": [TOOL], "tool_choice": "auto",
            "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_tokenize_counts_what_chat_prompts(server, tool_choice):
    """/tokenize with tools and a tool_choice gives the ids chat prompts the model with (under
    "none" the tools are left out of the prompt on both)."""
    body = {"messages": [{"role": "user", "content": "What time is it in UTC?"}],
            "tools": [TOOL]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    tokens = post(server, "/tokenize", body).json()["tokens"]
    chat = post(server, "/v1/chat/completions", {**body, "max_tokens": 1,
                                                 "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_token_ids"] == tokens
