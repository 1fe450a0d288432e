"""/v1/completions ``echo`` with ``logprobs`` on a tokenizer that adds a BOS (Llama's,
Gemma's rule), and ``echo`` with ``max_tokens: 0`` (the prompt alone, as vLLM 0.32 and the
legacy OpenAI API return it), through ``build_app`` on a real AsyncLLM over the tiny Llama
(FastAPI's TestClient). The echoed prompt's ``text_offset`` counted the BOS's ``<bos>`` (5
characters) though the echo is the prompt's own text, and ``max_tokens: 0`` was a 400.
Oracles: transformers' log-softmax over the prompt, and the offsets of
``tests/test_text_offsets.stable_offsets`` (the tokens' UTF-8 bytes)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from tests.folder_edits import copy_with_bos
from tests.serving_client import served_client
from tests.test_text_offsets import stable_offsets

CO = "/v1/completions"
PROMPTS = ["the quick brown", "a lazy dog"]


@pytest.fixture(scope="module")
def bos_model(tiny_llama, tmp_path_factory) -> str:
    """The tiny Llama in a folder of its own whose tokenizer puts ``<bos>`` (id 1) first."""
    return copy_with_bos(tiny_llama.path, tmp_path_factory.mktemp("bos_llama") / "model")


@pytest.fixture(scope="module")
def tokenizer(bos_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bos_model)


@pytest.fixture(scope="module")
def client(bos_model):
    with served_client(bos_model) as client:
        yield client


def _reply(client: TestClient, **body) -> dict:
    resp = client.post(CO, json={"model": "m", "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _streamed(client: TestClient, **body) -> tuple[dict[int, dict], list[dict]]:
    """The streamed reply's choices joined per index (text, logprobs lists, token ids, the
    last finish_reason), and its chunks."""
    resp = client.post(CO, json={"model": "m", "temperature": 0, **body, "stream": True})
    assert resp.status_code == 200, resp.text
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    joined: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            j = joined.setdefault(c["index"], {"text": "", "token_ids": [], "logprobs": {
                "text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}})
            j["text"] += c["text"]
            j["token_ids"] += c.get("token_ids") or []
            for key, values in (c["logprobs"] or {}).items():
                j["logprobs"][key] += values
            j["finish_reason"] = c["finish_reason"]
    return joined, chunks


def _hf_prompt_logprobs(tiny_llama, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the ones before it (from the 2nd)."""
    with torch.no_grad():
        logits = tiny_llama.hf_model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[p - 1, ids[p]].item() for p in range(1, len(ids))]


def test_echo_text_offsets_index_the_prompt_text_past_the_added_bos(client, tokenizer,
                                                                    tiny_llama):
    """The echo is the prompt's text, without ``<bos>``: the BOS and the first word's token
    start at 0, each prompt token where its text starts in the prompt, the completion's
    tokens (made ``t`` by ``logit_bias``) after the prompt's text; streamed, the same
    lists."""
    t = tokenizer.convert_tokens_to_ids("t")
    body = {"prompt": PROMPTS[0], "max_tokens": 3, "echo": True, "logprobs": 1,
            "return_token_ids": True, "logit_bias": {str(t): 100}}
    c = _reply(client, **body)["choices"][0]
    ids, out_ids = c["prompt_token_ids"], c["token_ids"]
    assert ids == tokenizer.encode(PROMPTS[0]) and ids[0] == 1 and out_ids == [t] * 3
    lp = c["logprobs"]
    assert c["text"] == PROMPTS[0] + "ttt"
    assert lp["tokens"][0] == "<bos>" and lp["token_logprobs"][0] is None
    assert lp["text_offset"] == [0, *stable_offsets(tokenizer, ids[1:]),
                                 *stable_offsets(tokenizer, out_ids, len(PROMPTS[0]))]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(
        _hf_prompt_logprobs(tiny_llama, ids), abs=1e-4)
    joined, _ = _streamed(client, **body)
    assert joined[0]["text"] == c["text"] and joined[0]["logprobs"] == lp


def test_echo_with_max_tokens_0_returns_each_prompt_alone(client, tokenizer, tiny_llama):
    """``max_tokens: 0`` with ``echo``: every choice (two prompts, n=2) is its prompt's text
    with the prompt tokens' logprobs (the first None) and nothing generated: no token ids,
    finish_reason ``length``, no completion tokens in the usage; streamed, the same
    choices and usage."""
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 0, "echo": True, "logprobs": 0,
            "return_token_ids": True}
    reply = _reply(client, **body)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert reply["usage"] == {"prompt_tokens": sum(map(len, prompt_ids)),
                              "completion_tokens": 0,
                              "total_tokens": sum(map(len, prompt_ids))}
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    for c in reply["choices"]:
        ids = prompt_ids[c["index"] // 2]
        assert c["text"] == PROMPTS[c["index"] // 2] and c["token_ids"] == []
        assert (c["finish_reason"], c["stop_reason"]) == ("length", None)
        assert c["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert c["logprobs"]["text_offset"] == [0, *stable_offsets(tokenizer, ids[1:])]
        assert c["logprobs"]["token_logprobs"][0] is None
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(
            _hf_prompt_logprobs(tiny_llama, ids), abs=1e-4)
    joined, chunks = _streamed(client, **body, stream_options={"include_usage": True})
    assert chunks[-1]["usage"] == reply["usage"]
    assert [joined[i] for i in range(4)] == [
        {key: c[key] for key in ("text", "token_ids", "logprobs", "finish_reason")}
        for c in reply["choices"]]


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),  # nothing to return without echo
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_max_tokens_0_needs_echo_and_no_min_tokens(client, body, param):
    resp = client.post(CO, json={"model": "m", "prompt": PROMPTS[0], **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_max_tokens_0_without_echo_says_echo_takes_it(client):
    """A client sending ``max_tokens: 0`` alone learns the one case the field takes 0 (the
    message said only ``it must be >= 1``, though the docs take 0 with ``echo``)."""
    resp = client.post(CO, json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 0})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "integer_below_min_value"
    assert error["message"] == ("max_tokens=0 is invalid: it must be >= 1 (the most tokens to "
                                "generate); 0 is taken only with echo, which returns the "
                                "prompt alone")
