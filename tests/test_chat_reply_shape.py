"""The JSON shape of chat replies where kvflow's differed from vLLM 0.32's on the same
request (found by ``benchmarks/vllm_api_diff.py`` against a live vLLM 0.32 CPU server, whose
replies are the oracle; OpenAI's API writes them the same way): a whole reply's message has
no ``tool_calls`` key when there are no calls (kvflow wrote ``[]``), and a streamed reply with
``n`` > 1 sends each choice's role in a chunk of its own (kvflow sent one chunk holding every
choice, so a client reading ``choices[0]`` of each chunk never saw the other choices' role).
vLLM 0.32's ``return_prompt_text`` is served (it was a 400 unknown field). Through
``build_app`` on a real AsyncLLM over the tiny chat model."""

from __future__ import annotations

import json

import pytest

from tests.serving_client import served_client

CH = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "the quick"}], "max_tokens": 3,
        "temperature": 1.0, "seed": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    with served_client(tiny_chat_model) as client:
        yield client


def test_whole_reply_without_tool_calls_has_no_tool_calls_key(client):
    """vLLM 0.32 (``ChatMessage._serialize``) and OpenAI leave ``tool_calls`` out of a message
    without calls; the message's keys are then exactly role and content."""
    resp = client.post(CH, json={**BODY, "n": 2})
    assert resp.status_code == 200, resp.text
    for choice in resp.json()["choices"]:
        assert set(choice["message"]) == {"role", "content"}, choice["message"]


def test_streamed_role_chunks_are_one_per_choice(client):
    """n=3 with ``return_token_ids``: the first three chunks are choice 0, 1, 2's role chunks,
    one choice each, each carrying the prompt's token ids (vLLM 0.32's stream); no later chunk
    carries them, and every chunk holds one choice or none (the usage chunk)."""
    whole = client.post(CH, json={**BODY, "n": 3, "return_token_ids": True}).json()
    resp = client.post(CH, json={**BODY, "n": 3, "return_token_ids": True, "stream": True,
                                 "stream_options": {"include_usage": True}})
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    assert [e["choices"] for e in events[:3]] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
          "finish_reason": None, "stop_reason": None}] for i in range(3)]
    assert [e["prompt_token_ids"] for e in events[:3]] == [whole["prompt_token_ids"]] * 3
    assert all("prompt_token_ids" not in e for e in events[3:])
    assert all(len(e["choices"]) == 1 for e in events[:-1]) and events[-1]["choices"] == []
    assert all("role" not in c["delta"] for e in events[3:] for c in e["choices"])


def test_return_prompt_text_gives_the_rendered_conversation(client, tiny_chat_model):
    """vLLM 0.32's ``return_prompt_text``: the whole reply's ``prompt_text`` and, streamed,
    each choice's role chunk's, are the conversation as transformers renders it (the tiny
    template, add_generation_prompt); without the field there is no ``prompt_text`` key. It
    was a 400 (an unknown field)."""
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(tiny_chat_model).apply_chat_template(
        BODY["messages"], tokenize=False, add_generation_prompt=True)
    whole = client.post(CH, json={**BODY, "return_prompt_text": True})
    assert whole.status_code == 200, whole.text
    assert whole.json()["prompt_text"] == rendered
    assert "prompt_text" not in client.post(CH, json=BODY).json()
    resp = client.post(CH, json={**BODY, "n": 2, "return_prompt_text": True, "stream": True})
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    assert [e.get("prompt_text") for e in events[:2]] == [rendered] * 2
    assert all("prompt_text" not in e for e in events[2:])
