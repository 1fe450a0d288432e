"""A grammar that does not compile within ``--structured-output-compile-timeout`` is an
OpenAI 400 through the server, and the engine keeps serving. The limit here is 1 ms: the
first constrained request's compile also builds the grammar backend (the tokenizer loaded in
the core process, its token tables), which takes far longer, so it times out every time;
the same grammar is then refused at once (the timed-out compile stays cached as failed),
whole or streamed (an error event in the stream). The error's ``param`` is the request field
that held the grammar."""

from __future__ import annotations

import json
import time

import httpx
import pytest

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "8",
        "--max-model-len", "128", "--served-model-name", MODEL,
        "--structured-output-compile-timeout", "0.001", "--trust-request-chat-template"]
GRAMMAR = 'root ::= "yes" | "no"'
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the tiny model has none


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_llama").path, ARGS, None)]


def _body(**extra) -> dict:
    return {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 8,
            "temperature": 0, **extra}


def _free_blocks(server) -> float:
    return server.value(server.metrics(), "kvflow:kv_cache_free_blocks")


@pytest.fixture(scope="module")
def timed_out(server, free_at_start) -> httpx.Response:
    """The first constrained request's answer (its compile passed the 1 ms limit); the free
    KV blocks were read before it."""
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json=_body(structured_outputs={"grammar": GRAMMAR}))


def test_grammar_past_the_limit_is_a_400(timed_out):
    assert timed_out.status_code == 400, timed_out.text
    error = timed_out.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        "the grammar did not compile within 0.001 s")
    assert "--structured-output-compile-timeout" in error["message"]
    assert error["param"] == "structured_outputs.grammar"


def test_same_grammar_refused_at_once_whole_and_streamed(server, timed_out, free_at_start):
    began = time.monotonic()
    again = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json=_body(structured_outputs={"grammar": GRAMMAR}))
    assert again.status_code == 400 and again.json() == timed_out.json()
    assert time.monotonic() - began < 5
    two = httpx.post(f"{server.url}/v1/completions", timeout=60,  # n=2: both samples end
                     json=_body(structured_outputs={"grammar": GRAMMAR}, n=2, seed=1))
    assert two.status_code == 400 and two.json() == timed_out.json()
    streamed = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json=_body(structured_outputs={"grammar": GRAMMAR}, stream=True))
    events = [line.removeprefix("data: ") for line in streamed.text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == timed_out.json()  # the 400's body as an error event
    plain = httpx.post(f"{server.url}/v1/completions", timeout=60, json=_body())
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] in (
        "stop", "length")
    deadline = time.monotonic() + 10
    while _free_blocks(server) != free_at_start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _free_blocks(server) == free_at_start


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", _body(guided_grammar=GRAMMAR), "guided_grammar"),
    ("/v1/completions", _body(guided_grammar=GRAMMAR, stream=True), "guided_grammar"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 8,
                              "messages": [{"role": "user", "content": "yes or no?"}], "chat_template": TEMPLATE,
                              "structured_outputs": {"grammar": GRAMMAR}},
     "structured_outputs.grammar"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "stream": True,
                              "messages": [{"role": "user", "content": "yes or no?"}], "chat_template": TEMPLATE,
                              "structured_outputs": {"grammar": GRAMMAR}},
     "structured_outputs.grammar"),
])
def test_the_error_names_the_field_that_held_the_grammar(server, timed_out, path, body, param):
    """The same grammar (refused at once from the cache) sent in another field, or to chat:
    the 400 (or the stream's error event) names that field."""
    resp = httpx.post(f"{server.url}{path}", timeout=60, json=body)
    if body.get("stream"):
        events = [line.removeprefix("data: ") for line in resp.text.splitlines()
                  if line.startswith("data: ")]
        assert resp.status_code == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
    assert error["message"] == timed_out.json()["error"]["message"]
    assert error["param"] == param
