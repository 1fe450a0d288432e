"""vLLM 0.32's ``thinking_token_budget`` through ``kvflow serve --reasoning-parser think``
(completions and chat, whole and streamed, with n-gram speculative decoding on) on the tiny
random Llama, whose chat template opens the think block itself (``<assistant><think>``, as
Qwen3's 2507 thinking models do).

Oracle: a plain transformers greedy loop (tests/test_thinking_budget.py's ``_expected``): the
unbudgeted reply cut at the budget, the ``</think>`` marker's tokens (several with the tiny
tokenizer), then the greedy continuation of that prefix. Chat's reply splits at the marker
into ``reasoning`` (the budget's tokens) and ``content``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_thinking_budget import _expected, _markers

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size", "8",
        "--max-model-len", "256", "--served-model-name", MODEL, "--reasoning-parser", "think",
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 3})]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant><think>{% endif %}")
PROMPT = "the quick brown fox<think>"
MESSAGES = [{"role": "user", "content": "kvflow pages keys and values"}]
MAX_TOKENS = 20  # _expected's length


def prestart_servers(fixture):
    model = fixture("built_models").with_chat_template("tiny_thinking_budget",
                                                       fixture("tiny_llama").path, TEMPLATE)
    return [(model, ARGS, None)]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "return_token_ids": True, **body})


def _prompt_ids(server, body: dict) -> list[int]:
    resp = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def _events(resp: httpx.Response) -> list[dict]:
    assert resp.status_code == 200, resp.text
    return [json.loads(line[6:]) for line in resp.text.splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("budget", [0, 5])
def test_completions_end_thinking_at_the_budget(server, tiny_llama, tiny_tokenizer, budget):
    prompt = _prompt_ids(server, {"prompt": PROMPT})
    end = _markers(tiny_tokenizer).reasoning_end_token_ids
    assert prompt[-len(_markers(tiny_tokenizer).reasoning_start_token_ids):] == \
        _markers(tiny_tokenizer).reasoning_start_token_ids
    expected = _expected(tiny_llama.hf_model, prompt, budget, end)
    body = {"prompt": PROMPT, "thinking_token_budget": budget, "n": 2}
    choices = _post(server, "/v1/completions", body).json()["choices"]
    assert [c["token_ids"] for c in choices] == [expected, expected]
    assert choices[0]["text"] == tiny_tokenizer.decode(expected, skip_special_tokens=True)
    streamed = _events(_post(server, "/v1/completions", {**body, "n": 1, "stream": True}))
    assert "".join(c["text"] for e in streamed for c in e["choices"]) == choices[0]["text"]
    assert [t for e in streamed for c in e["choices"] for t in c.get("token_ids") or []] == \
        expected


def test_chat_splits_at_the_forced_marker(server, tiny_llama, tiny_tokenizer):
    budget = 4
    prompt = _prompt_ids(server, {"messages": MESSAGES})
    expected = _expected(tiny_llama.hf_model, prompt, budget,
                         _markers(tiny_tokenizer).reasoning_end_token_ids)
    body = {"messages": MESSAGES, "thinking_token_budget": budget}
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["message"]["reasoning"] == tiny_tokenizer.decode(expected[:budget],
                                                                   skip_special_tokens=True)
    text = tiny_tokenizer.decode(expected, skip_special_tokens=True)
    assert choice["message"]["content"] == text[text.index("</think>") + 8:].lstrip()
    reasoning = content = ""
    for event in _events(_post(server, "/v1/chat/completions", {**body, "stream": True})):
        for c in event["choices"]:
            reasoning += c["delta"].get("reasoning") or ""
            content += c["delta"].get("content") or ""
    assert (reasoning, content) == (choice["message"]["reasoning"],
                                    choice["message"]["content"])


def test_unlimited_and_unreached_budgets_change_nothing(server):
    """-1 / null (vLLM's unlimited) and a budget above max_tokens (vLLM takes it: never
    reached) give the unbudgeted reply."""
    plain = _post(server, "/v1/completions", {"prompt": PROMPT}).json()["choices"][0]
    for value in (-1, None, MAX_TOKENS + 1):
        got = _post(server, "/v1/completions", {"prompt": PROMPT,
                                                "thinking_token_budget": value})
        assert got.json()["choices"][0]["token_ids"] == plain["token_ids"], value


@pytest.mark.parametrize("path,value,code", [
    ("/v1/completions", -2, "integer_below_min_value"),
    ("/v1/chat/completions", 1.5, "invalid_type"),
    ("/v1/completions", "3", "invalid_type"),
    ("/v1/chat/completions", True, "invalid_type"),
    ("/v1/completions", 2**63, "integer_above_max_value"),
])
def test_bad_budgets_are_refused_naming_the_field(server, path, value, code):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    resp = _post(server, path, {**body, "thinking_token_budget": value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("thinking_token_budget", code), error


def test_beam_search_refuses_a_budget(server):
    """Beam search runs above the engine, one-token steps per beam: it would drop the
    budget unread, so a budget with ``use_beam_search`` is a 400 naming it (-1 passes)."""
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 4}
    resp = _post(server, "/v1/completions", {**body, "thinking_token_budget": 3})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "thinking_token_budget" and "beam search" in error["message"]
    resp = _post(server, "/v1/completions", {**body, "thinking_token_budget": -1})
    assert resp.status_code == 200, resp.text
