"""Reported failing inputs (issue 22), replayed against ``kvflow serve`` on the packaged
SmolLM2-135M-Instruct (float32: no bf16 near-ties), streamed and not: stop strings spanning
tokens, min_tokens holding stop strings back, JSON-schema key order, lone surrogates, null
message content, and /metrics before the first request. Oracles: the greedy text without
the option (cut by hand), the HF tokenizer's own template rendering, the metric's definition.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.conftest import SMOLLM2 as MODEL
from tests.e2e.conftest import SMOLLM2_ARGS
from tests.e2e.conftest import SMOLLM2_NUM_KV_BLOCKS as NUM_KV_BLOCKS

pytestmark = pytest.mark.slow


def prestart_servers(fixture):
    """This module's servers, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(MODEL, SMOLLM2_ARGS, None)]


@pytest.fixture(scope="module")
def server(smollm2_server):
    """The session's SmolLM2 server (float32, 64 blocks of 16 tokens, max_model_len 1008),
    shared with tests/e2e/test_openai_smollm.py."""
    return smollm2_server


@pytest.fixture(scope="module")
def tokenizer():
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    return load_tokenizer(resolve_model(MODEL), None)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def streamed(server, path: str, body: dict) -> tuple[str, str | None]:
    """(joined text, last finish_reason) of a streamed request."""
    pieces, finish = [], None
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                pieces.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                finish = c.get("finish_reason") or finish
    return "".join(pieces), finish


def whole(server, path: str, body: dict) -> tuple[str, str | None]:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    c = resp.json()["choices"][0]
    return c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"]


def test_metrics_true_before_the_first_request(server):
    """/metrics as read once the server was ready, before any request reached it
    (``metrics_at_start``; the server is shared): the gauges already describe the idle
    engine."""
    m = server.metrics_at_start
    usable = NUM_KV_BLOCKS - 1  # block 0 is the null block
    assert server.value(m, "kvflow:kv_cache_free_blocks") == usable
    assert server.value(m, "kvflow:kv_cache_usable_blocks") == usable
    for name in ("kvflow:kv_cache_usage_perc", "kvflow:num_requests_running",
                 "kvflow:num_requests_waiting"):
        assert (name, (("engine", "0"),)) in m and server.value(m, name) == 0
    for reason in ("stop", "length", "abort"):
        key = ("kvflow:request_success_total", (("finished_reason", reason),))
        assert key in m and m[key] == 0


@pytest.mark.parametrize("send", [whole, streamed], ids=["whole", "streamed"])
def test_stop_string_spanning_tokens(server, send):
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    plain, _ = send(server, "/v1/completions", body)
    assert plain.startswith(" with a quick brown bear.")
    for max_tokens in (12, 5):  # 5: "bear" is the last token allowed
        got = send(server, "/v1/completions",
                    {**body, "max_tokens": max_tokens, "stop": ["quick brown bear"]})
        assert got == (" with a ", "stop")
    chat = {"messages": [{"role": "user", "content": "Say: the quick brown fox"}],
            "max_tokens": 16, "temperature": 0}
    text, _ = send(server, "/v1/chat/completions", chat)
    stop = text[2:9]  # several tokens, from the middle of a token on
    assert send(server, "/v1/chat/completions", {**chat, "stop": [stop]}) == \
        (text[:text.index(stop)], "stop")


@pytest.mark.parametrize("send", [whole, streamed], ids=["whole", "streamed"])
def test_min_tokens_holds_back_stop_strings(server, tokenizer, send):
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0,
            "return_token_ids": True}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    boundary = len(tokenizer.decode(plain["token_ids"][:10]))  # text of the first 10 tokens
    expected = plain["text"][:plain["text"].index(",", boundary)]
    assert len(tokenizer.encode(expected, add_special_tokens=False)) >= 10
    assert send(server, "/v1/completions", {**body, "min_tokens": 10, "stop": [","]}) == \
        (expected, "stop")


def test_json_schema_key_order(server):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"]}
    body = {"messages": [{"role": "user", "content": "Give two numbers as JSON."}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "pair", "schema": schema}}}
    text, finish = whole(server, "/v1/chat/completions", body)
    assert finish == "stop"
    assert [k for k, _ in json.loads(text, object_pairs_hook=list)] == ["zeta", "alpha"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "abc \ud800 def", "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "abc", "stream": True, "stop": ["\udfff"]}, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc \ud800"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}],
                              "stream": True}, "messages.0.content"),
    ("/tokenize", {"prompt": "abc \ud800 def"}, "prompt"),
])
def test_lone_surrogate_is_a_400(server, path, body, param):
    raw = json.dumps(body).encode()  # the surrogate travels as a \ud800 escape
    resp = httpx.post(f"{server.url}{path}", content=raw, timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 1}).status_code == 200


TOOL_LOOP = [
    {"role": "user", "content": "What time is it in UTC?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]
NULL_TURN = [{"role": "user", "content": "A"}, {"role": "assistant", "content": None},
             {"role": "user", "content": "B"}]


# SmolLM2's template renders no tool_calls: the server writes them as the Hermes text its
# tool instructions ask for (hand-written here).
TOOL_LOOP_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("messages", [TOOL_LOOP, NULL_TURN], ids=["tool_loop", "null_turn"])
def test_null_content_renders_as_empty_text(server, tokenizer, messages):
    """Null content renders as "" (what vLLM and OpenAI clients expect); a parts array as its
    text. Oracle: the HF tokenizer's rendering of the same turns with content "" (an
    assistant's tool calls as their Hermes text)."""
    as_text = [{"role": m["role"], "content": TOOL_LOOP_CALL if "tool_calls" in m else
                m["content"] or ""} for m in messages]
    expected = tokenizer.encode(tokenizer.apply_chat_template(
        as_text, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["prompt_token_ids"] == expected
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} if m["content"] else m
             for m in messages]
    assert post(server, "/tokenize", {"messages": parts}).json()["tokens"] == expected
    assert streamed(server, "/v1/chat/completions", body)[1] is not None


def test_idle_keep_alive_connection_outlives_client_expiry(server):
    """The 30-minute soak lost one request to aiohttp's ServerDisconnectedError: at arrival
    gaps near 5 s the client reused a pooled connection just as uvicorn (5 s keep-alive by
    default) closed it. The server now keeps idle connections for --timeout-keep-alive
    (20 s): a second request on the same connection after 6 idle seconds is answered."""
    import http.client
    import time
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() is not None
        sock = conn.sock
        time.sleep(6.0)
        conn.request("GET", "/health")  # raises RemoteDisconnected if the server closed it
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        assert conn.sock is sock  # the same TCP connection, not a new one
    finally:
        conn.close()
