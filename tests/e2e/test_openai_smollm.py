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
    """The session's SmolLM2 server (float32, 64 blocks of 16 tokens, max_model_len 1024),
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
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)
