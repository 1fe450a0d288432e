"""``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` on
/v1/completions and /v1/chat/completions, whole and in a stream's usage chunk, is the
prompt's prefix-cache hits: 0 for a prompt whose first block no earlier request shared, and
``(prompt_tokens - 1) // block_size * block_size`` (computed by hand) for the same prompt
again (its whole blocks but the last token's: the engine computes at least one). A prompt
counts once however many samples ``n`` asks for, as ``prompt_tokens`` does; a list of
prompts sums its prompts' hits. Off (the default) the usage has no details:
tests/test_usage_info.py. vLLM's ``cache_salt``: a salted prompt hits only what the same salt
cached (the same hand-computed count), 0 against unsalted or other-salted copies; a bad salt
is a 400 naming it."""

from __future__ import annotations

import uuid

import httpx
import pytest
from openai.types import CompletionUsage

from tests.e2e.test_openai_ops_routes import ARGS, BLOCK_SIZE, ENV, MODEL

# ARGS has --enable-prompt-tokens-details (and ops routes this module does not call): the server
# is test_openai_ops_routes.py's, kept for the session. Every prompt here starts with a fresh
# random word, so requests sent to it earlier give no prefix-cache hit this module counts.


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """The session's server of ``ARGS`` (``start_server.shared``)."""
    return start_server.shared(tiny_chat_model, ARGS, ENV)


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
    # A salt no request used before keeps ``new`` from hitting any earlier prompt: a fresh
    # word's first block is only a few random characters, which a prompt from earlier in the
    # session shared once in a CI run (4 hits too many); its "z" start keeps it off ``seen``.
    salt = {"extra_body": {"cache_salt": uuid.uuid4().hex}}
    seen, new = fresh_text(), "z" + fresh_text()
    alone = completion_usage(client, seen, stream=False, **salt)
    usage = completion_usage(client, [seen, new], stream, **salt)
    num_new = usage.prompt_tokens - alone.prompt_tokens
    assert num_new > 4 * BLOCK_SIZE
    assert usage.prompt_tokens_details.cached_tokens == hits(alone.prompt_tokens)  # new: 0


def salted_usages(client, path: str, text: str, salts: list[str | None]
                  ) -> tuple[list[int], int]:
    """(the cached tokens of ``text`` sent once per salt in ``salts``, in order, its prompt
    tokens); greedy, 2 tokens, each reply's text checked against the first's (a salt changes
    no output)."""
    hits, texts = [], []
    for salt in salts:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        if path == "chat":
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2,
                temperature=0, **extra)
            texts.append(reply.choices[0].message.content)
        else:
            reply = client.completions.create(model=MODEL, prompt=text, max_tokens=2,
                                              temperature=0, **extra)
            texts.append(reply.choices[0].text)
        hits.append(reply.usage.prompt_tokens_details.cached_tokens)
    assert texts == [texts[0]] * len(texts)
    return hits, reply.usage.prompt_tokens


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_cache_salt_shares_blocks_only_with_the_same_salt(client, path):
    """vLLM's ``cache_salt`` is mixed into the prompt's first block: a salted prompt hits
    only what the same salt cached (every whole block but the last token's, by hand), never
    an unsalted or other-salted copy (not even the chat template's prefix that every
    unsalted chat shares); unsalted copies still share with each other."""
    a, b = (f"{path}-{uuid.uuid4().hex}" for _ in range(2))  # salts no earlier request sent
    got, num_prompt = salted_usages(client, path, fresh_text(), [None, a, a, b, None, b])
    full = hits(num_prompt)
    assert got[1:] == [0, full, 0, full, full]
    # the first, unsalted, hits at most the chat template's prefix that earlier chats shared
    assert got[0] == 0 if path == "completions" else got[0] < full


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_bad_cache_salt_is_a_400_naming_it(server, path, salt):
    body = {"model": MODEL, "max_tokens": 2, "cache_salt": salt,
            **({"prompt": "hi"} if path == "/v1/completions"
               else {"messages": [{"role": "user", "content": "hi"}]})}
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "cache_salt", resp.text


def test_beam_search_steps_carry_the_cache_salt(server):
    """A salted beam search's steps fill the cache under that salt: a later request with
    the same salt hits the prompt's whole blocks, one without it none; a bad salt is a
    400 naming it."""
    prompt = "the salted beams wander through a garden of seven paged blocks"
    beams = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "use_beam_search": True,
        "n": 2, "cache_salt": "beam-salt"})
    assert beams.status_code == 200, beams.text
    num_prompt = beams.json()["usage"]["prompt_tokens"]
    whole_blocks = (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    for salt, hits in [(None, 0), ("beam-salt", whole_blocks)]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                **({} if salt is None else {"cache_salt": salt})}
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hits, salt
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "use_beam_search": True,
        "cache_salt": ""})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
