"""Chat ``echo`` (vLLM 0.32's rule, ``chat_completion/serving.py``) and
``continue_final_message`` on a last message of any role, through ``build_app`` on a real
AsyncLLM over the tiny chat model (FastAPI's TestClient). ``echo`` was a 400 and
``continue_final_message`` after a user message a 400 too. Oracles: the same request
without ``echo`` (same seed, so the same samples), the tiny template's text written by hand,
and transformers' log-softmax for the prompt logprobs ``echo`` asks for."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from tests.serving_client import served_client

CH = "/v1/chat/completions"
USER = {"role": "user", "content": "the quick"}
PARTIAL = {"role": "assistant", "content": "brown fox"}
SAMPLED = {"max_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True,
           "return_token_ids": True}


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    with served_client(tiny_chat_model) as client:
        yield client


def _reply(client: TestClient, **body) -> dict:
    resp = client.post(CH, json={"model": "m", **SAMPLED, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _contents(reply: dict) -> list[str | None]:
    return [c["message"]["content"] for c in reply["choices"]]


def _stream(client: TestClient, **body) -> list[dict]:
    resp = client.post(CH, json={"model": "m", **SAMPLED, **body, "stream": True})
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("messages,options,echo", [
    # continue_final_message: the reply is the assistant's, whose message comes last
    ([USER, PARTIAL], {"add_generation_prompt": False, "continue_final_message": True},
     "brown fox"),
    # a new assistant turn after an assistant message (add_generation_prompt true)
    ([USER, PARTIAL], {}, "brown fox"),
    # a reply of the user's role continues the user's message (was a 400)
    ([USER], {"add_generation_prompt": False, "continue_final_message": True}, "the quick"),
    # the last message is the user's, the reply the assistant's: nothing echoed
    ([USER], {}, ""),
    # content parts: their text, "\n"-joined
    ([USER, {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]}],
     {"add_generation_prompt": False, "continue_final_message": True}, "a\nb"),
])
def test_echo_prepends_the_last_message_of_the_replys_role(client, messages, options, echo):
    """Every choice (n=2) is the echo followed by what the same request generates without
    ``echo``; streamed, each choice's role chunk comes first, then one chunk per choice
    holding the echo (none when it is empty), then the generated text."""
    plain = _reply(client, messages=messages, n=2, **options)
    echoed = _reply(client, messages=messages, n=2, echo=True, **options)
    assert [c["token_ids"] for c in echoed["choices"]] == \
        [c["token_ids"] for c in plain["choices"]]
    assert _contents(echoed) == [echo + text for text in _contents(plain)]
    role = "user" if messages[-1] is USER and options else "assistant"
    assert {c["message"]["role"] for c in echoed["choices"]} == {role}

    events = _stream(client, messages=messages, n=2, echo=True, **options)
    assert [[(c["index"], c["delta"]) for c in e["choices"]] for e in events[:2]] == \
        [[(i, {"role": role, "content": ""})] for i in range(2)]  # one role chunk per choice
    rest = events[2:]
    if echo:
        keys = ("index", "delta", "logprobs", "finish_reason")
        assert [[{k: c[k] for k in keys} for c in e["choices"]] for e in events[2:4]] == [
            [{"index": i, "delta": {"content": echo}, "logprobs": None,
              "finish_reason": None}] for i in range(2)]
        rest = events[4:]
    streamed = ["", ""]
    for e in rest:
        for c in e["choices"]:
            streamed[c["index"]] += c["delta"].get("content") or ""
    assert [echo + s for s in streamed] == _contents(echoed)
    assert all("prompt_logprobs" not in e for e in events)


def test_continue_final_message_after_a_user_message_renders_as_transformers(client,
                                                                           tiny_chat_model):
    """The prompt is the conversation rendered with the user's message left open:
    transformers' ``apply_chat_template(..., continue_final_message=True)`` text (the tiny
    template: ``<user>the quick``), tokenized without special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    text = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=False,
                                   continue_final_message=True)
    assert text == "<user>the quick"
    reply = _reply(client, messages=[USER], add_generation_prompt=False,
                   continue_final_message=True, max_tokens=1)
    assert reply["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)


def test_echo_with_beam_search_prepends_to_every_beam(client):
    """Beam search (n=2 beams) echoes as sampling does, streamed too (was a 400: chat's
    ``echo`` was refused with beam search as completions' is); no prompt logprobs."""
    body = {"messages": [USER, PARTIAL], "add_generation_prompt": False,
            "continue_final_message": True, "use_beam_search": True, "n": 2,
            "temperature": 0, "seed": None}
    plain = _reply(client, **body)
    echoed = _reply(client, **body, echo=True)
    assert _contents(echoed) == ["brown fox" + text for text in _contents(plain)]
    assert echoed.get("prompt_logprobs") is None
    events = _stream(client, **body, echo=True)
    assert [c["delta"] for e in events[:2] for c in e["choices"]] == \
        [{"role": "assistant", "content": ""}] * 2  # one role chunk per beam
    assert [c["delta"] for e in events[2:4] for c in e["choices"]] == \
        [{"content": "brown fox"}] * 2


@pytest.mark.parametrize("logprobs", [{}, {"logprobs": True, "top_logprobs": 2}])
def test_echo_returns_the_prompt_logprobs_with_top_logprobs_alternatives(
        client, tiny_chat_model, logprobs):
    """vLLM asks for ``prompt_logprobs=top_logprobs`` (0 when unset) with ``echo``: the
    whole reply carries one entry per prompt token, None first, each holding the prompt's
    token and the top ``top_logprobs``, equal to transformers' log-softmax; the choices'
    own logprobs are as without ``echo``."""
    from transformers import AutoModelForCausalLM

    reply = _reply(client, messages=[USER, PARTIAL], echo=True, max_tokens=2, **logprobs)
    ids, entries = reply["prompt_token_ids"], reply["prompt_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    k = logprobs.get("top_logprobs", 0)
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        top = ref[pos - 1].topk(k).indices.tolist() if k else []
        assert set(entries[pos]) == {str(t) for t in {ids[pos], *top}}
        for tid, entry in entries[pos].items():
            assert entry["logprob"] == pytest.approx(float(ref[pos - 1, int(tid)]), abs=1e-4)
    choice_logprobs = reply["choices"][0]["logprobs"]
    assert (choice_logprobs is None) == (not logprobs)
    if logprobs:
        assert len(choice_logprobs["content"]) == 2
    assert _reply(client, messages=[USER, PARTIAL], max_tokens=2).get("prompt_logprobs") \
        is None
