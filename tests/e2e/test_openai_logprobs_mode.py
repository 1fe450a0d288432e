"""``kvflow serve --logprobs-mode processed_logits`` (vLLM's flag): /v1/completions and
/v1/chat/completions logprobs, whole and streamed, and prompt_logprobs, against plain torch over
transformers' logits of the same tiny model (divided by the temperature, top-k masked: a
masked token's value is -inf, -9999.0 in JSON); beam search is refused naming the flag."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

MODEL = "tiny"
ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--block-size", "4",
        "--max-model-len", "96", "--served-model-name", MODEL,
        "--logprobs-mode", "processed_logits"]
PROMPT = [5, 17, 33, 100, 200, 7]
SAMPLING = {"temperature": 0.5, "top_k": 4, "seed": 7, "max_tokens": 4, "ignore_eos": True}


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def expected(tiny_llama, prompt: list[int], out: list[int]) -> list[torch.Tensor]:
    """Per generated token: the step's logits / 0.5, all but the top 4 at -inf ([V])."""
    rows = []
    for t in range(len(out)):
        with torch.no_grad():
            logits = tiny_llama.hf_model(torch.tensor([prompt + out[:t]])).logits[0, -1].float()
        x = logits / SAMPLING["temperature"]
        keep = x.topk(SAMPLING["top_k"]).indices
        rows.append(torch.full_like(x, float("-inf")).index_copy(0, keep, x[keep]))
    return rows


def json_value(v: float) -> float:
    return max(v, -9999.0)  # JSON has no -inf: kvflow and vLLM send -9999.0


def test_completion_logprobs_are_processed_logits(server, tiny_llama):
    reply = post(server, "/v1/completions", {"prompt": PROMPT, "logprobs": 5,
                                             "return_token_ids": True, "prompt_logprobs": 1,
                                             **SAMPLING})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    out = choice["token_ids"]
    refs = expected(tiny_llama, PROMPT, out)
    for token, value, top, ref in zip(out, choice["logprobs"]["token_logprobs"],
                                      choice["logprobs"]["top_logprobs"], refs):
        assert value == pytest.approx(float(ref[token]), abs=2e-4)
        kept = ref.topk(4).values.tolist()  # tokens decoding alike share one key here
        assert max(top.values()) == pytest.approx(kept[0], abs=2e-4)
        assert all(v == -9999.0 or any(abs(v - k) < 2e-4 for k in kept) for v in top.values())
    # prompt logprobs are the raw logits (a prompt token is not sampled)
    with torch.no_grad():
        raw = tiny_llama.hf_model(torch.tensor([PROMPT])).logits[0, :-1].float()
    for p, entry in enumerate(choice["prompt_logprobs"][1:], 1):
        assert entry[str(PROMPT[p])]["logprob"] == pytest.approx(float(raw[p - 1, PROMPT[p]]),
                                                                 abs=2e-4)
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPT, "logprobs": 5, "stream": True,
                            **SAMPLING}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += (c.get("logprobs") or {}).get("token_logprobs") or []
    # the second request reuses the first's cached prompt blocks: equal within rounding (the
    # torch kernels, KVFLOW_NATIVE_CPU=0, are not bitwise invariant to how a prompt is split)
    assert streamed == pytest.approx(choice["logprobs"]["token_logprobs"], abs=2e-4)


def test_chat_logprobs_are_processed_logits(server, tiny_llama):
    messages = [{"role": "user", "content": "the quick brown"}]
    ids = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    body = {"messages": messages, "logprobs": True, "top_logprobs": 5,
            "return_token_ids": True, **SAMPLING}
    whole = post(server, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    content = whole.json()["choices"][0]["logprobs"]["content"]
    out = whole.json()["choices"][0]["token_ids"]
    refs = expected(tiny_llama, ids, out)
    for c, token, ref in zip(content, out, refs):
        assert c["logprob"] == pytest.approx(float(ref[token]), abs=2e-4)
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == pytest.approx([json_value(v) for v in ref.topk(5).values.tolist()],
                                     abs=2e-4)
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, **body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    streamed += [c["logprob"] for c in
                                 ((ch.get("logprobs") or {}).get("content") or [])]
    assert streamed == pytest.approx([c["logprob"] for c in content], abs=2e-4)  # as above


def test_beam_search_refused_naming_the_flag(server):
    reply = post(server, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2,
                                             "temperature": 0, "max_tokens": 2})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "use_beam_search" and "--logprobs-mode" in error["message"]
