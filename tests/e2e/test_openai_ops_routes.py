"""vLLM's operational routes on a served tiny Llama (``--enable-server-load-tracking
--enable-tokenizer-info-endpoint``, ``KVFLOW_SERVER_DEV_MODE=1``): /ping answers as /health;
/invocations answers a completions or chat body as the direct endpoint does (greedy, so
equal but for the reply's id and time), whole and streamed; /load counts a request held open
(its body half sent: 1) and is 0 before and after; /tokenizer_info gives the tokenizer's own
class, chat template and special tokens (transformers' tokenizer of the folder is the oracle);
/reset_prefix_cache makes a prompt sent a third time hit 0 cached tokens where the second hit
its whole blocks (hand-computed), with the same text; a reset sent while a long stream runs
leaves that stream's tokens equal to the same request's unstreamed answer; /server_info gives
the engine's settings as served. The refusals and switches: tests/test_ops_routes.py."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import RUNTIME_LORA_ENV

MODEL = "tiny"
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 128
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "128",
        "--served-model-name", MODEL, "--enable-prompt-tokens-details",
        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint"]
# the LoRA load/unload routes for test_unknown_fields_served.py (this module calls none)
ENV = {"KVFLOW_SERVER_DEV_MODE": "1", **RUNTIME_LORA_ENV}


def prestart_servers(fixture):
    """This module's server (see ``prestart_servers`` in conftest.py), shared with
    test_openai_prompt_tokens_details.py and test_unknown_fields_served.py
    (``start_server.shared``)."""
    return [(fixture("tiny_chat_model"), ARGS, ENV)]


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """The session's server of ``ARGS`` (left running: test_openai_prompt_tokens_details.py
    and test_unknown_fields_served.py take it too)."""
    return start_server.shared(tiny_chat_model, ARGS, ENV)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _answer(response: httpx.Response) -> dict:
    """A reply without what differs between two answers to one greedy request: its id, its
    time and the prefix-cache hits (the second of them hits the first's blocks)."""
    assert response.status_code == 200, response.text
    body = response.json()
    body.pop("id"), body.pop("created")
    body["usage"].pop("prompt_tokens_details", None)
    return body


def _load(server) -> int:
    return httpx.get(f"{server.url}/load", timeout=10).json()["server_load"]


def fresh_text() -> str:
    """A prompt no earlier request began with (a random first word)."""
    return f"{uuid.uuid4().hex[:8]} " + " ".join(["lorem ipsum dolor sit"] * 5)


def test_ping_is_health(server):
    health = httpx.get(f"{server.url}/health", timeout=10)
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{server.url}/ping", timeout=10)
        assert (ping.status_code, ping.content) == (health.status_code, health.content) \
            == (200, b"")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 8}),
    ("/v1/completions", {"prompt": ["the lazy dog", "tokens"], "max_tokens": 5, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                              "max_tokens": 8}),
])
def test_invocations_answers_as_the_endpoint(server, path, body):
    body = {"model": MODEL, "temperature": 0, **body}
    assert _answer(_post(server, "/invocations", body)) == _answer(_post(server, path, body))


def _stream_text(server, path: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                text += choice[0].get("text") or choice[0].get("delta", {}).get("content") \
                    or "" if choice else ""
    return text


def test_invocations_streams_as_the_endpoint(server):
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    routed = _stream_text(server, "/invocations", body)
    assert routed and routed == _stream_text(server, "/v1/completions", body)


def test_load_counts_a_request_until_its_response_ends(server):
    assert _load(server) == 0
    body = (b'{"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4, '
            b'"temperature": 0, "stream": true}')
    release, answer = threading.Event(), {}

    def halves():
        yield body[:20]
        release.wait(30)
        yield body[20:]

    def send():  # the server takes the request at its headers and waits for the rest
        with httpx.stream("POST", f"{server.url}/v1/completions", content=halves(), timeout=60,
                          headers={"Content-Type": "application/json",
                                   "Content-Length": str(len(body))}) as response:
            answer["status"] = response.status_code
            answer["text"] = response.read().decode()

    sender = threading.Thread(target=send)
    sender.start()
    try:
        deadline = time.monotonic() + 20
        while _load(server) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _load(server) == 1
    finally:
        release.set()
        sender.join(60)
    assert answer["status"] == 200 and answer["text"].rstrip().endswith("data: [DONE]")
    deadline = time.monotonic() + 10  # the count drops once the server sent the last chunk
    while _load(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _load(server) == 0


def test_tokenizer_info_is_the_tokenizers(server, tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    for key in ("eos_token", "bos_token", "unk_token"):
        if tokenizer.init_kwargs.get(key) is not None:
            assert info[key] == str(tokenizer.init_kwargs[key])
    assert info["model_max_length"] == tokenizer.model_max_length
    assert "vocab_file" not in info and "merges_file" not in info


def _completion(server, text: str, max_tokens: int = 4) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a greedy completion."""
    usage_and_text = _post(server, "/v1/completions", {
        "model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}).json()
    usage = usage_and_text["usage"]
    return (usage_and_text["choices"][0]["text"], usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def test_reset_prefix_cache_drops_the_hits(server):
    text = fresh_text()
    first, prompt_tokens, cached = _completion(server, text)
    assert cached == 0 and prompt_tokens > 4 * BLOCK_SIZE
    second, _, cached = _completion(server, text)
    assert (second, cached) == (first, (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)
    reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert (reset.status_code, reset.json()) == (200, {"success": True})
    assert _completion(server, text)[::2] == (first, 0)


def test_a_reset_during_a_stream_leaves_it_unchanged(server):
    """Whether the engine still runs the stream when the reset arrives (409) or has finished
    it (200), the streamed tokens are the request's unstreamed greedy answer."""
    body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex[:4]} the lazy dog",
            "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    whole = _post(server, "/v1/completions", body)
    assert whole.status_code == 200, whole.text
    expected = whole.json()["choices"][0]["text"]
    text, statuses = "", []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as response:
        # SSE lines end at a newline only: iter_lines also splits inside the JSON at the
        # characters str.splitlines takes for breaks (U+2028, U+0085), which the random
        # prompt's text may hold
        pending = b""
        for chunk in response.iter_bytes():
            *lines, pending = (pending + chunk).split(b"\n")
            for line in (raw.decode() for raw in lines):
                if line.startswith("data: {"):
                    if not statuses:
                        statuses.append(httpx.post(f"{server.url}/reset_prefix_cache",
                                                   timeout=30).status_code)
                    text += json.loads(line[6:])["choices"][0]["text"]
    assert statuses[0] in (200, 409) and text == expected


def test_server_info_is_the_served_config(server, tiny_chat_model):
    info = httpx.get(f"{server.url}/server_info", timeout=10).json()
    assert info["model"] == MODEL
    engine = info["engine_config"]
    assert engine["model_config"]["model"] == tiny_chat_model
    assert engine["cache_config"]["block_size"] == BLOCK_SIZE
    assert info["server_config"]["enable_server_load_tracking"] is True
    assert info["server_config"]["dev_mode"] is True
