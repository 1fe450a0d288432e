"""Structured output after the reasoning through ``kvflow serve --reasoning-parser think``
(n-gram speculative decoding on): the tiny random Llama's chat template opens the think block
(``<assistant><think>``), ``thinking_token_budget`` ends it, and ``response_format``
(``json_schema``) constrains only the answer after ``</think>``, as vLLM 0.32 does with a
reasoning parser.

Oracle: transformers' greedy loop for the think tokens (free), ``json.loads`` + ``jsonschema``
for the answer, and for its tokens the same server given a prompt that already closed the
block (its grammar from the first token, vLLM's prompt rule).
"""

from __future__ import annotations

import json

import jsonschema

from tests.e2e.test_thinking_budget_served import (
    ARGS,
    MODEL,
    TEMPLATE,
    _events,
    _prompt_ids,
)
from tests.test_thinking_budget import _greedy, _markers

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "kvflow pages keys and values"}]
BUDGET = 4


def prestart_servers(fixture):
    model = fixture("built_models").with_chat_template("tiny_thinking_budget",
                                                       fixture("tiny_llama").path, TEMPLATE)
    return [(model, ARGS, None)]


def _post(server, path: str, body: dict):
    import httpx

    return httpx.post(f"{server.url}{path}", timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": 48, "return_token_ids": True, **body})


def test_chat_reasons_freely_then_answers_in_json(server, tiny_llama, tiny_tokenizer):
    prompt = _prompt_ids(server, {"messages": MESSAGES})
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    think = _greedy(tiny_llama.hf_model, prompt, BUDGET)
    body = {"messages": MESSAGES, "thinking_token_budget": BUDGET, "response_format": FORMAT}
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["token_ids"][:BUDGET + len(end)] == think + end
    message = choice["message"]
    assert message["reasoning"] == tiny_tokenizer.decode(think, skip_special_tokens=True)
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert choice["finish_reason"] == "stop"
    # the answer's tokens: a completion whose prompt closed the block (grammar from its
    # first token), the same schema
    answer = _post(server, "/v1/completions", {
        "prompt": prompt + think + end, "structured_outputs": {"json": SCHEMA}}).json()["choices"][0]
    assert choice["token_ids"][BUDGET + len(end):] == answer["token_ids"]
    reasoning = content = ""
    for event in _events(_post(server, "/v1/chat/completions", {**body, "stream": True})):
        for c in event["choices"]:
            reasoning += c["delta"].get("reasoning") or ""
            content += c["delta"].get("content") or ""
    assert (reasoning, content) == (message["reasoning"], message["content"])


def test_completions_answer_after_the_forced_marker(server, tiny_llama, tiny_tokenizer):
    ids = _markers(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("the quick brown fox") + ids.reasoning_start_token_ids
    think = _greedy(tiny_llama.hf_model, prompt, BUDGET)
    end = ids.reasoning_end_token_ids
    got = _post(server, "/v1/completions", {
        "prompt": prompt, "thinking_token_budget": BUDGET, "n": 2,
        "structured_outputs": {"json": SCHEMA}}).json()["choices"]
    for choice in got:
        tokens = choice["token_ids"]
        assert tokens[:BUDGET + len(end)] == think + end
        text = tiny_tokenizer.decode(tokens[BUDGET + len(end):], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert got[0]["token_ids"] == got[1]["token_ids"]
