"""vLLM 0.32's ``session_id`` request field in the KV cache events, through the server.

As vLLM 0.32 does: a request's session is its body's ``session_id``, else its ``X-Session-ID``
header; every ``BlockStored`` of the blocks the request stores carries it (BlockRemoved and
AllBlocksCleared carry none); blocks already stored by another request are not stored again,
so they keep the first request's session. Oracle: the prompt's token ids from the tokenizer,
cut to full blocks by hand; the events read back with msgspec's untyped decoder (the raw map
keys). A bad value is a 400 naming the field (or the header).
"""

from __future__ import annotations

import msgspec
import pytest
import zmq
from transformers import AutoTokenizer

from tests.serving_client import served_client
from tests.test_kv_events import Subscriber

BLOCK_SIZE = 4
FIRST = "the quick brown fox jumps over a lazy dog while kvflow pages keys"
OTHER = "prefix caching reuses blocks and chunked prefill splits long prompts"


@pytest.fixture(scope="module")
def served(tiny_chat_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv_session")
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{folder}/pub"}
    with served_client(tiny_chat_model, enable_prefix_caching=True,
                       kv_events_config=events) as client:
        ctx = zmq.Context()
        try:
            yield client, Subscriber(ctx, events["endpoint"])
        finally:
            ctx.destroy(linger=0)


def stored(sub: Subscriber) -> list[dict]:
    """The raw BlockStored maps of the batches sent since the last call."""
    return [e for _, payload in sub.drain() for e in msgspec.msgpack.decode(payload)[1]
            if e["type"] == "BlockStored"]


def complete(client, prompt: str, **extra):
    headers = extra.pop("headers", None)
    return client.post("/v1/completions", headers=headers, json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})


def test_each_endpoints_session_reaches_its_stored_blocks(served, tiny_chat_model):
    client, sub = served
    ids = AutoTokenizer.from_pretrained(tiny_chat_model)(FIRST).input_ids
    full = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert complete(client, FIRST, session_id="conv-1").status_code == 200
    events = stored(sub)
    assert [t for e in events for t in e["token_ids"]] == ids[:full]
    assert {e.get("session_id") for e in events} == {"conv-1"}
    first_hashes = {h for e in events for h in e["block_hashes"]}

    # the same prompt in another session: its blocks were stored already, not again
    assert complete(client, FIRST, session_id="conv-9").status_code == 200
    assert not first_hashes & {h for e in stored(sub) for h in e["block_hashes"]}

    # no body field: the header's; neither: no session_id key on the wire
    assert complete(client, OTHER, headers={"X-Session-ID": "hdr-2"}).status_code == 200
    assert {e.get("session_id") for e in stored(sub)} == {"hdr-2"}
    assert complete(client, OTHER + " again", session_id="").status_code == 200
    events = stored(sub)
    assert events and all("session_id" not in e for e in events)

    # the body's field wins over the header; chat and responses carry it too
    resp = client.post("/v1/chat/completions", headers={"X-Session-ID": "hdr"}, json={
        "model": "m", "messages": [{"role": "user", "content": FIRST + " in chat"}],
        "max_tokens": 1, "session_id": "chat-3"})
    assert resp.status_code == 200, resp.text
    assert {e.get("session_id") for e in stored(sub)} == {"chat-3"}
    resp = client.post("/v1/responses", json={
        "model": "m", "input": OTHER + " in a response", "max_output_tokens": 1,
        "session_id": "resp-4"})
    assert resp.status_code == 200, resp.text
    assert {e.get("session_id") for e in stored(sub)} == {"resp-4"}


def test_a_beam_searchs_step_requests_carry_its_session(served):
    """Beam search runs a request per beam and step (kvflow/beam_search.py): the blocks each
    stores carry the search's session."""
    client, sub = served
    resp = complete(client, "beam search keeps the best two of many candidate tokens here",
                    use_beam_search=True, n=2, max_tokens=6, session_id="beam-5")
    assert resp.status_code == 200, resp.text
    events = stored(sub)
    assert events and {e.get("session_id") for e in events} == {"beam-5"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_bad_session_is_a_400_naming_it(served, path):
    client, _ = served
    body = {"model": "m", "max_tokens": 1}
    body.update({"/v1/completions": {"prompt": "hi"}, "/v1/responses": {"input": "hi"},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}
                 }[path])
    if path == "/v1/responses":
        body.pop("max_tokens")
    for value, param, headers in (("x" * 257, "session_id", None), (7, "session_id", None),
                                  (None, "X-Session-ID", {"X-Session-ID": "x" * 257})):
        sent = body if value is None else {**body, "session_id": value}
        resp = client.post(path, json=sent, headers=headers)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text
    ok = client.post(path, json={**body, "session_id": "x" * 256})
    assert ok.status_code == 200, ok.text
