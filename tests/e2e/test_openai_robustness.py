"""Huge inputs and the codes of refused requests, on ``kvflow serve`` with the tiny Llama.

A megabytes-long prompt is tokenized in a worker thread (``/health`` and other clients are
answered meanwhile), refused from a tokenized prefix when that alone is longer than the
context, and a body over ``--max-request-body-size`` gets 413 before it is read; none of it
leaks a KV block. Every 400 decided after validation carries a code and the field; bound
errors name the field's type (OpenAI's ``integer_*`` / ``decimal_*`` / ``string_*`` /
``array_*`` codes). Oracles: the tokenizer's own count, the server's start-up free-block
count, OpenAI's error codes.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

MAX_MODEL_LEN = 128
NUM_KV_BLOCKS = 64
BODY_LIMIT = 4 * 2**20  # --max-request-body-size 4MiB (the default is 32MiB)
# /health latency is timed: no other server starts during this module (conftest.py)
TIMING_SENSITIVE = True
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", "4", "--max-model-len", str(MAX_MODEL_LEN), "--max-n", "2",
        "--max-logprobs", "3", "--max-request-body-size", "4MiB"]
C, CH = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
WORDS = "the quick brown fox jumps over a lazy dog "


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def assert_serving_and_no_leak(server, free_at_start: float) -> None:
    """A small request is answered, and the free blocks come back to the start value."""
    resp = post(server, C, {"prompt": WORDS, "max_tokens": 3, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    deadline = time.monotonic() + 10
    while (free := server.value(server.metrics(), "kvflow:kv_cache_free_blocks")) \
            != free_at_start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free == free_at_start


# ---- huge inputs -------------------------------------------------------------------------------
def test_health_answers_while_a_huge_prompt_is_tokenized(server, free_at_start):
    """One 3 MB word (no piece boundary: the prefix proves nothing, so it is tokenized
    whole, ~1.5 s per MB here) is tokenized off the event loop: /health answers within 1.5 s
    (on the loop it waited for the whole tokenization) and a small completion is served
    meanwhile; the big request then gets a 400 naming max_model_len."""
    big: dict = {}

    def send_big() -> None:
        big["resp"] = post(server, C, {"prompt": "x" * 3_000_000, "max_tokens": 1})

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)  # its body is sent and being tokenized
    latencies, served = [], None
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        latencies.append(time.monotonic() - start)  # asked while the big one was in the works
        if served is None and sender.is_alive():
            served = post(server, C, {"prompt": WORDS, "max_tokens": 2}).status_code
        time.sleep(0.1)
    sender.join()
    assert len(latencies) >= 3, "the big request finished too soon to show anything"
    assert max(latencies) < 1.5, latencies
    assert served == 200
    error = error_of(big["resp"])
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert f"max_model_len is {MAX_MODEL_LEN}" in error["message"]
    assert_serving_and_no_leak(server, free_at_start)


@pytest.mark.parametrize("path", [C, CH])
def test_prompt_refused_from_its_prefix(server, free_at_start, tiny_chat_model, path):
    """3 MB of words: the first 64 Ki characters are already far more than 127 tokens, so
    the prompt is refused (400 context_length_exceeded) without tokenizing the rest, in well
    under the ~5 s that tokenizing all of it takes here. The count in the message is the
    tokenizer's own for the prefix the message names."""
    from transformers import AutoTokenizer

    text = WORDS * (3_000_000 // len(WORDS))
    body = {"prompt": text} if path == C else {"messages": [{"role": "user", "content": text}]}
    start = time.monotonic()
    error = error_of(post(server, path, {**body, "max_tokens": 1}))
    assert time.monotonic() - start < 3.0
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == ("prompt" if path == C else "messages")
    message = error["message"]
    assert f"longer than the {MAX_MODEL_LEN - 1} tokens" in message and "max_model_len" in message
    chars = int(message.split("its first ")[1].split(" of ")[0])
    count = int(message.split("characters are already ")[1].split(" tokens")[0])
    prefix = text[:chars] if path == C else f"<user>{text}"[:chars]
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    assert count == len(tokenizer.encode(prefix, add_special_tokens=path == C))
    assert count > MAX_MODEL_LEN and chars < 2**16
    assert_serving_and_no_leak(server, free_at_start)


@pytest.mark.parametrize("chunked", [False, True], ids=["content_length", "chunked"])
def test_body_over_the_limit_is_413(server, free_at_start, chunked):
    """A 5 MB body over the 4 MiB --max-request-body-size: 413 with an OpenAI error body
    naming the flag and the limit, whether announced by Content-Length or sent in chunks;
    a body just under the limit is read (a 400 for its too-long prompt, not a 413)."""
    payload = b'{"prompt": "' + b"x" * 5_000_000 + b'", "max_tokens": 1}'

    def chunks():
        for i in range(0, len(payload), 65536):
            yield payload[i:i + 65536]

    resp = httpx.post(f"{server.url}{C}", content=chunks() if chunked else payload,
                      headers={"Content-Type": "application/json"}, timeout=60)
    error = error_of(resp, 413)
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert "--max-request-body-size" in error["message"]
    assert str(BODY_LIMIT) in error["message"]
    if not chunked:
        assert str(len(payload)) in error["message"]
    under = post(server, C, {"prompt": WORDS * (BODY_LIMIT // len(WORDS) - 1), "max_tokens": 1})
    assert error_of(under)["code"] == "context_length_exceeded"
    assert_serving_and_no_leak(server, free_at_start)


def test_content_length_over_the_limit_is_413_before_the_body(server):
    """Only the headers sent, announcing a 5 MB body over the 4 MiB limit: the 413 (OpenAI
    error body, Connection: close) comes at once, without the body (it used to wait for it)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        conn.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 5000000\r\n\r\n".encode())
        reply = b""
        while not (b"\r\n\r\n" in reply and reply.endswith(b"}")):  # the whole JSON body
            piece = conn.recv(65536)  # socket.timeout after 5 s: no answer without the body
            assert piece, reply
            reply += piece
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and "5000000 bytes" in error["message"]


# ---- error codes ---------------------------------------------------------------------------------
REFUSED = [  # (path, body, param, code): decided after the schema
    (C, {"prompt": "hi", "n": 3, "temperature": 1}, "n", "integer_above_max_value"),
    (C, {"prompt": "hi", "logprobs": 4}, "logprobs", "integer_above_max_value"),
    (CH, {"messages": HI, "logprobs": True, "top_logprobs": 4}, "top_logprobs",
     "integer_above_max_value"),
    (C, {"prompt": ""}, "prompt", "empty_string"),
    (C, {"prompt": []}, "prompt", "empty_array"),
    (C, {"prompt": [[]]}, "prompt.0", "empty_array"),  # the empty one of the list
    (C, {"prompt": ["hi", ""]}, "prompt.1", "empty_string"),
    (C, {"prompt": [5, 99999]}, "prompt.1", "invalid_value"),  # the bad id, as tokens.1
    (C, {"prompt": [5, -1]}, "prompt.1", "invalid_value"),
    ("/detokenize", {"tokens": [5, 99999]}, "tokens.1", "invalid_value"),  # the bad one
    (C, {"prompt": "hi", "priority": 1}, "priority", "unsupported_value"),
    (CH, {"messages": HI, "priority": -2}, "priority", "unsupported_value"),
    (C, {"prompt": "hi", "suffix": "x"}, "suffix", "unsupported_parameter"),
    ("/tokenize", {}, "prompt", "missing_required_parameter"),
    # the schema's
    (CH, {"messages": [{"role": 5, "content": "hi"}]}, "messages.0.role", "invalid_type"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role",
     "invalid_value"),
    (C, {"prompt": "hi", "temperature": -1}, "temperature", "decimal_below_min_value"),
    (C, {"prompt": "hi", "top_p": 2}, "top_p", "decimal_above_max_value"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p", "decimal_below_min_value"),
    (C, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "decimal_above_max_value"),
    (C, {"prompt": "hi", "min_p": 1.5}, "min_p", "decimal_above_max_value"),
    (C, {"prompt": "hi", "n": 0}, "n", "integer_below_min_value"),
    (C, {"prompt": "hi", "top_k": -2}, "top_k", "integer_below_min_value"),
    (CH, {"messages": []}, "messages", "empty_array"),
    # a bad content part is named (not "content: Input should be a valid string")
    (CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text", "invalid_type"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                      "image_url": "data:image/png;base64,"}]}]},
     "messages.0.content.0.image_url", "invalid_type"),
    (C, {"prompt": "hi", "stop": ["x", 5]}, "stop.1", "invalid_type"),
    (CH, {"messages": HI, "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools.0.function.name", "string_below_min_length"),
]


@pytest.mark.parametrize("path,body,param,code", REFUSED,
                         ids=[f"{p}:{'/'.join(map(str, b))}:{c}" for p, b, _, c in REFUSED])
def test_refused_requests_carry_a_code_and_the_field(server, path, body, param, code):
    error = error_of(post(server, path, body, timeout=30))
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", param, code), error


def test_negative_seed_is_a_seed_but_minus_one_is_unseeded(server):
    """``seed: -2`` is an ordinary seed (vLLM's seed takes any 64-bit integer; OpenAI sets no
    lower bound): two runs give the same sample, which a different seed does not give.
    ``seed: -1`` is no seed, as vLLM's SamplingParams reads it: two runs differ (16 tokens
    at temperature 5 over the whole vocabulary: a repeat by chance is negligible)."""
    def sample(seed: int) -> list[int]:
        resp = post(server, C, {"prompt": WORDS, "max_tokens": 16, "temperature": 5.0,
                                "ignore_eos": True, "seed": seed, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    first = sample(-2)
    assert sample(-2) == first
    assert sample(1) != first
    assert sample(-1) != sample(-1)
