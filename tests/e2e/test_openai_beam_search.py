"""``use_beam_search`` on ``kvflow serve`` (the tiny chat Llama): the returned beams equal a
plain torch beam search over the transformers model's logits
(``tests/test_beam_search.reference_beam_search``, near-ties asserted away), on
/v1/completions (one prompt and a list) and /v1/chat/completions; what beam search does not
honour is a 400 naming the field; a client that leaves mid-search leaves no KV block held
and the server answering. Oracles: the torch reference, the server's start-up free-block
count."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import torch

from tests.test_beam_search import reference_beam_search

ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "128", "--block-size",
        "4", "--max-model-len", "256"]
C, CH = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "the lazy dog"}]
TOLERANCE = 1e-4


def prestart_servers(fixture):
    """This module's server, taken with ``start_server.declared`` (conftest.py)."""
    return [(fixture("tiny_chat_model"), ARGS, None)]


@pytest.fixture(scope="module")
def hf_model(tiny_chat_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_chat_model,
                                                dtype=torch.float32).eval()


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def ok(server, path: str, body: dict) -> dict:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_no_leak(server, free_at_start: float) -> None:
    """Nothing runs and the free blocks come back to the start value."""
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        free, running = (server.value(m, "kvflow:kv_cache_free_blocks"),
                         server.value(m, "kvflow:num_requests_running"))
        if (free == free_at_start and running == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (free, running) == (free_at_start, 0)


def _check_choices(choices: list[dict], prompt: list[int], ref, eos: int) -> None:
    assert [prompt + c["token_ids"] for c in choices] == [b.tokens for b in ref]
    for c, beam in zip(choices, ref):
        assert c["finish_reason"] == ("stop" if beam.eos else "length")
        lp = c["logprobs"]
        token_logprobs = lp["token_logprobs"] if "token_logprobs" in lp else \
            [t["logprob"] for t in lp["content"]]
        assert sum(token_logprobs) == pytest.approx(beam.cum_logprob, abs=TOLERANCE)


@pytest.mark.parametrize("width,max_tokens", [(2, 6), (3, 8)])
def test_completion_beams_match_the_reference(server, hf_model, tiny_chat_model, width,
                                              max_tokens, free_at_start):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    texts = ["the quick brown fox", "a lazy dog jumps"]
    hits = server.value(server.metrics(), "kvflow:prefix_cache_hits_total")
    resp = ok(server, C, {"prompt": texts, "use_beam_search": True, "n": width,
                          "max_tokens": max_tokens, "logprobs": 1, "return_token_ids": True})
    assert len(resp["choices"]) == 2 * width
    for i, t in enumerate(texts):
        prompt = tok.encode(t)
        ref = reference_beam_search(hf_model, prompt, width, max_tokens, tok.eos_token_id, 1.0)
        choices = resp["choices"][i * width:(i + 1) * width]
        assert [c["index"] for c in choices] == list(range(i * width, (i + 1) * width))
        _check_choices(choices, prompt, ref, tok.eos_token_id)
        assert all(len(top) <= 2 for c in choices for top in c["logprobs"]["top_logprobs"])
        assert choices[0]["text"] == tok.decode(choices[0]["token_ids"],
                                                skip_special_tokens=True)
    assert resp["usage"]["completion_tokens"] == sum(len(c["token_ids"])
                                                     for c in resp["choices"])
    # the beams' shared prefixes were prefix-cache hits (block_size 4: every step's prompt
    # of 5+ tokens has a full block cached by the step before)
    assert server.value(server.metrics(), "kvflow:prefix_cache_hits_total") > hits
    assert_no_leak(server, free_at_start)


def test_chat_beams_match_the_reference(server, hf_model, tiny_chat_model, free_at_start):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    resp = ok(server, CH, {"messages": HI, "use_beam_search": True, "n": 3, "max_tokens": 6,
                           "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
                           "length_penalty": 0.5})
    prompt = resp["prompt_token_ids"]
    ref = reference_beam_search(hf_model, prompt, 3, 6, tok.eos_token_id, 0.5)
    _check_choices(resp["choices"], prompt, ref, tok.eos_token_id)
    assert_no_leak(server, free_at_start)


@pytest.mark.parametrize("skip", [True, False])
def test_include_stop_str_in_output_text_follows_skip_special_tokens(server, tiny_chat_model,
                                                                      skip, free_at_start):
    """A stopped beam's text with include_stop_str_in_output is the tokenizer's decode of its
    token ids (EOS included) with skip_special_tokens, as vLLM's beam search and a sampled
    request write it: the special EOS shows only with skip_special_tokens false (it showed
    with true too before)."""
    from transformers import AutoTokenizer

    from tests.test_beam_search import EOS_PROMPT

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    resp = ok(server, C, {"prompt": EOS_PROMPT, "use_beam_search": True, "n": 3,
                          "max_tokens": 8, "include_stop_str_in_output": True,
                          "skip_special_tokens": skip, "return_token_ids": True})
    stopped = [c for c in resp["choices"] if c["finish_reason"] == "stop"]
    assert stopped and all(c["token_ids"][-1] == tok.eos_token_id for c in stopped)
    for c in resp["choices"]:
        assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=skip)
    assert all(c["text"].endswith(tok.eos_token) != skip for c in stopped)
    assert_no_leak(server, free_at_start)


@pytest.mark.parametrize("path,width,k", [(C, 2, 6), (CH, 3, 8)])
def test_more_top_logprobs_than_a_step_ranks_are_returned(server, hf_model, tiny_chat_model,
                                                          path, width, k, free_at_start):
    """``logprobs`` (``top_logprobs``) above the ``2 * n`` candidates a beam step ranks: each
    token still has the ``k`` alternatives asked for, transformers' top k at that position
    (they were cut to ``2 * n`` before: 4 of the 6 asked), and the beams stay the
    reference's (only the top ``2 * n`` are candidates)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    base = {"prompt": "the quick brown fox", "logprobs": k} if path == C else \
        {"messages": HI, "logprobs": True, "top_logprobs": k}
    resp = ok(server, path, {**base, "use_beam_search": True, "n": width, "max_tokens": 6,
                             "return_token_ids": True, "return_tokens_as_token_ids": True})
    prompt = resp.get("prompt_token_ids") or tok.encode(base.get("prompt", ""))
    ref = reference_beam_search(hf_model, prompt, width, 6, tok.eos_token_id, 1.0)
    _check_choices(resp["choices"], prompt, ref, tok.eos_token_id)
    for c in resp["choices"]:
        tops = c["logprobs"]["top_logprobs"] if path == C else \
            [{e["token"]: e["logprob"] for e in t["top_logprobs"]}
             for t in c["logprobs"]["content"]]
        assert len(tops) == len(c["token_ids"])
        for j, top in enumerate(tops):
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + c["token_ids"][:j]])).logits[0, -1]
            want = torch.topk(torch.log_softmax(logits.float(), dim=-1), k)
            assert sorted(top) == sorted(f"token_id:{t}" for t in want.indices.tolist())
            for value, t in zip(want.values.tolist(), want.indices.tolist()):
                assert top[f"token_id:{t}"] == pytest.approx(value, abs=TOLERANCE)
    assert_no_leak(server, free_at_start)


def _streamed(server, path: str, body: dict) -> tuple[dict[int, dict], list[dict]]:
    """The SSE chunks of a streamed request, merged per choice index: text (or content) and
    token ids joined, the last finish_reason kept; and every chunk."""
    merged: dict[int, dict] = {}
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            chunks.append(chunk)
            for c in chunk["choices"]:
                m = merged.setdefault(c["index"], {"text": "", "token_ids": [],
                                                   "finish_reason": None})
                m["text"] += c.get("text") or (c.get("delta") or {}).get("content") or ""
                m["token_ids"] += c.get("token_ids") or []
                m["finish_reason"] = c.get("finish_reason") or m["finish_reason"]
    return merged, chunks


@pytest.mark.parametrize("path", [C, CH])
def test_streamed_beams_equal_the_whole_reply(server, hf_model, tiny_chat_model, path,
                                              free_at_start):
    """stream: true (vLLM streams beam search's result when the search ends): the chunks,
    merged per choice, give the reference's beams; the usage chunk counts every token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    base = {"prompt": "the quick brown fox"} if path == C else {"messages": HI}
    body = {**base, "use_beam_search": True, "n": 3, "max_tokens": 6, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    merged, chunks = _streamed(server, path, body)
    whole = ok(server, path, {**body, "stream": False, "stream_options": None})
    prompt = whole["prompt_token_ids"] if path == CH else tok.encode(base["prompt"])
    ref = reference_beam_search(hf_model, prompt, 3, 6, tok.eos_token_id, 1.0)
    assert [prompt + merged[i]["token_ids"] for i in range(3)] == [b.tokens for b in ref]
    for i, beam in enumerate(ref):
        assert merged[i]["finish_reason"] == ("stop" if beam.eos else "length")
        assert merged[i]["text"] == tok.decode(beam.tokens[len(prompt):],
                                               skip_special_tokens=True)
    assert chunks[-1]["usage"]["completion_tokens"] == sum(
        len(b.tokens) - len(prompt) for b in ref)
    assert_no_leak(server, free_at_start)


@pytest.mark.parametrize("path,field,value", [
    (C, "temperature", 0.7),
    (CH, "top_p", 0.5), (C, "logit_bias", {"5": 10}), (C, "stop", ["x"]),
    (CH, "response_format", {"type": "json_object"}), (C, "guided_regex", "[a-z]+"),
    (C, "echo", True), (C, "prompt_logprobs", 1), (C, "presence_penalty", 1.0),
    (C, "min_tokens", 2), (C, "n", 129), (CH, "early_stopping", True),
    (C, "length_penalty", float("inf")), (C, "target_ttft_ms", 500), (CH, "target_tpot_ms", 50),
])
def test_what_beam_search_does_not_honour_is_refused(server, path, field, value,
                                                     free_at_start):
    base = {"prompt": "the quick"} if path == C else {"messages": HI}
    body = {**base, "use_beam_search": True, "n": 2, "max_tokens": 4, field: value}
    if field == "n":
        body["best_of"] = None
    resp = httpx.post(f"{server.url}{path}", content=_json(body), timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field, resp.text
    assert_no_leak(server, free_at_start)


def _json(body: dict) -> str:
    return json.dumps(body).replace("Infinity", "1e999")  # a number JSON parses as inf


def generated(server) -> float:
    return server.value(server.metrics(), "kvflow:generation_tokens_total")


def test_client_gone_mid_search_leaves_no_block(server, free_at_start):
    """A long search (8 beams, 240 tokens each, no EOS: 1,920 step tokens) whose client
    closes its socket once some steps ran: generation stops far short of the whole search,
    every block comes back, and the next request is answered."""
    body = json.dumps({"prompt": "the quick brown fox", "use_beam_search": True, "n": 8,
                       "max_tokens": 240, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    before = generated(server)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while generated(server) < before + 40:  # a few steps of 8 beams
            assert time.monotonic() < deadline, "the search never ran"
            time.sleep(0.02)
    assert_no_leak(server, free_at_start)
    stopped = generated(server)
    time.sleep(0.5)
    assert generated(server) == stopped < before + 8 * 240
    resp = ok(server, C, {"prompt": "the quick", "use_beam_search": True, "n": 2,
                          "max_tokens": 3, "ignore_eos": True})
    assert len(resp["choices"]) == 2 and all(len(c["text"]) > 0 for c in resp["choices"])
    assert_no_leak(server, free_at_start)
