"""``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` on
/v1/completions and /v1/chat/completions, whole and in a stream's usage chunk, is the
prompt's prefix-cache hits: 0 for a prompt whose first block no earlier request shared, and
``(prompt_tokens - 1) // block_size * block_size`` (computed by hand) for the same prompt
again (its whole blocks but the last token's: the engine computes at least one). A prompt
counts once however many samples ``n`` asks for, as ``prompt_tokens`` does; a list of
prompts sums its prompts' hits. Off (the default) the usage has no details:
tests/test_usage_info.py."""

from __future__ import annotations

import uuid

import httpx
import pytest
from openai.types import CompletionUsage

MODEL = "tiny"
BLOCK_SIZE = 4
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128",
        "--block-size", str(BLOCK_SIZE), "--max-model-len", "128",
        "--served-model-name", MODEL, "--enable-prompt-tokens-details"]


def prestart_servers(fixture):
    """This module's server, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def fresh_text() -> str:
    """A prompt no earlier request began with (a random first word)."""
    return f"{uuid.uuid4().hex[:8]} " + " ".join(["lorem ipsum dolor sit"] * 5)


def hits(num_prompt: int) -> int:
    """The prefix-cache hits of a prompt sent a second time: its whole blocks, less the
    block of its last token when that token ends a block."""
    return (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


def completion_usage(client, prompt, stream: bool, **kwargs) -> CompletionUsage:
    if not stream:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                         temperature=0, **kwargs).usage
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kwargs))
    (last,) = [c for c in chunks if c.usage is not None]  # the usage chunk only
    assert last.choices == []
    return last.usage


def chat_usage(client, content: str, stream: bool) -> CompletionUsage:
    messages = [{"role": "user", "content": content}]
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                              temperature=0).usage
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    (last,) = [c for c in chunks if c.usage is not None]
    return last.usage


@pytest.mark.parametrize("stream", [False, True])
def test_completions_cached_tokens_are_the_prefix_cache_hits(client, stream):
    text = fresh_text()
    first, second = (completion_usage(client, text, stream) for _ in range(2))
    assert first.prompt_tokens == second.prompt_tokens > 4 * BLOCK_SIZE
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == hits(second.prompt_tokens)


def chat_ids(server, content: str) -> list[int]:
    reply = httpx.post(f"{server.url}/tokenize", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_cached_tokens_are_the_prefix_cache_hits(server, client, stream):
    """Every chat prompt begins with the template's ``<user>``: a new conversation hits the
    whole blocks it shares with one sent before it (its token ids from /tokenize)."""
    before, text = fresh_text(), fresh_text()
    chat_usage(client, before, stream=False)
    ids, ids_before = chat_ids(server, text), chat_ids(server, before)
    shared = next(i for i, (a, b) in enumerate(zip(ids, ids_before)) if a != b)
    assert shared >= 1  # the template's prefix, at least BOS
    first, second = (chat_usage(client, text, stream) for _ in range(2))
    assert first.prompt_tokens == second.prompt_tokens == len(ids) > 4 * BLOCK_SIZE
    assert first.prompt_tokens_details.cached_tokens == shared // BLOCK_SIZE * BLOCK_SIZE
    assert second.prompt_tokens_details.cached_tokens == hits(len(ids))


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_counts_once_for_n_samples(client, stream):
    text = fresh_text()
    once = completion_usage(client, text, stream=False)
    assert once.prompt_tokens_details.cached_tokens == 0
    both = completion_usage(client, text, stream, n=2, seed=3)
    assert both.prompt_tokens == once.prompt_tokens  # one prompt, as prompt_tokens counts it
    assert both.prompt_tokens_details.cached_tokens == hits(once.prompt_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_sums_their_hits(client, stream):
    seen, new = fresh_text(), fresh_text()
    alone = completion_usage(client, seen, stream=False)
    usage = completion_usage(client, [seen, new], stream)
    num_new = usage.prompt_tokens - alone.prompt_tokens
    assert num_new > 4 * BLOCK_SIZE
    assert usage.prompt_tokens_details.cached_tokens == hits(alone.prompt_tokens)  # new: 0
