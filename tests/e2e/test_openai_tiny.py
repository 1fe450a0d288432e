"""The OpenAI API end to end on the tiny Llama: completions and chat, streaming vs whole,
prompt forms, n, seeds, stop strings, logprobs, echo, logit bias and penalties, tokenize,
metrics, and bad input (every bad request gets a 4xx OpenAI error; the server keeps serving).
"""

from __future__ import annotations

import json

import httpx
import pytest

import kvflow

MODEL = "tiny"
MAX_MODEL_LEN = 96
NUM_KV_BLOCKS = 128
ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", str(NUM_KV_BLOCKS),
               "--block-size", "4", "--max-model-len", str(MAX_MODEL_LEN)]
SERVER_ARGS = [*ENGINE_ARGS, "--served-model-name", MODEL]
PROMPT = "the quick brown fox jumps"


def prestart_servers(fixture):
    """This module's server, started ahead (``_prestart_next_module`` in conftest.py)."""
    return [(fixture("tiny_chat_model"), SERVER_ARGS, None)]


@pytest.fixture(scope="module")
def server(start_server, tiny_chat_model):
    """The session's server of ``SERVER_ARGS`` (``start_server.shared``; test_run_batch.py
    compares its batch lines with this server's answers; test_bench_serve.py loads it)."""
    return start_server.shared(tiny_chat_model, SERVER_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model)


def decode(tokenizer, ids):
    """What the server's detokenizer produces for ``ids`` (special tokens skipped)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def complete(client, prompt=PROMPT, **kwargs):
    """A completion with the vLLM extensions passed through extra_body."""
    extra = {k: kwargs.pop(k) for k in ("ignore_eos", "return_token_ids", "top_k", "min_tokens",
                                         "repetition_penalty", "stop_token_ids")
             if k in kwargs}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)


def chat(client, content="hi there", **kwargs):
    extra = {k: kwargs.pop(k) for k in ("ignore_eos", "return_token_ids") if k in kwargs}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], extra_body=extra,
        **kwargs)


def collect_stream(chunks, field="text"):
    """-> ({choice index: joined text}, {index: [finish_reason per chunk]}, usage chunks,
    {index: token ids})."""
    texts, finishes, usages, token_ids = {}, {}, [], {}
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk)
        for c in chunk.choices:
            piece = c.text if field == "text" else c.delta.content
            texts.setdefault(c.index, []).append(piece or "")
            finishes.setdefault(c.index, []).append(c.finish_reason)
            token_ids.setdefault(c.index, []).extend(getattr(c, "token_ids", None) or [])
    return ({i: "".join(p) for i, p in texts.items()}, finishes, usages, token_ids)


# ---- basics --------------------------------------------------------------------------------------
def test_models_health_version(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": kvflow.__version__}
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_completion_text_is_decode_of_token_ids(client, tokenizer):
    resp = complete(client, max_tokens=12, temperature=0, ignore_eos=True,
                    return_token_ids=True)
    (c,) = resp.choices
    assert len(c.token_ids) == 12 == resp.usage.completion_tokens
    assert c.text == decode(tokenizer, c.token_ids)
    assert c.finish_reason == "length"
    assert c.prompt_token_ids == tokenizer.encode(PROMPT)
    assert resp.usage.prompt_tokens == len(c.prompt_token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_prompt_forms(client, tokenizer):
    prompts = ["the quick brown", "kvflow pages keys"]
    greedy = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    as_text = complete(client, prompts, **greedy)
    ids = [tokenizer.encode(p) for p in prompts]
    as_ids = complete(client, ids, **greedy)
    single = complete(client, ids[1], **greedy)
    assert [c.index for c in as_text.choices] == [0, 1]
    assert [c.text for c in as_text.choices] == [c.text for c in as_ids.choices]
    assert single.choices[0].text == as_text.choices[1].text
    assert as_text.usage.prompt_tokens == sum(len(i) for i in ids)
    assert as_text.usage.completion_tokens == 12


# ---- streaming -----------------------------------------------------------------------------------
def test_completion_stream_equals_whole(client):
    params = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 20, "ignore_eos": True}
    whole = complete(client, **params)
    texts, finishes, usages, _ = collect_stream(complete(
        client, stream=True, stream_options={"include_usage": True}, **params))
    assert texts == {c.index: c.text for c in whole.choices}
    assert texts[0] != texts[1]  # n samples of a seeded request use seed + i
    for index in (0, 1):  # finish_reason on the last chunk of each choice only
        assert finishes[index][-1] == "length"
        assert all(f is None for f in finishes[index][:-1])
    (usage_chunk,) = usages
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 40 == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_equals_whole(client, tokenizer):
    params = {"temperature": 1.0, "seed": 11, "n": 2, "max_tokens": 16, "ignore_eos": True,
              "return_token_ids": True}
    whole = chat(client, **params)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **params))
    assert {c.delta.role for c in chunks[0].choices} == {"assistant"}
    texts, finishes, usages, token_ids = collect_stream(chunks, field="content")
    for c in whole.choices:
        assert texts[c.index] == c.message.content == decode(tokenizer, c.token_ids)
        assert token_ids[c.index] == c.token_ids
        assert finishes[c.index][-1] == "length"
    (usage_chunk,) = usages
    assert usage_chunk.usage.completion_tokens == 32 == whole.usage.completion_tokens
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}],
                                             tokenize=False, add_generation_prompt=True)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_raw_sse_format(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [c["usage"] is not None for c in chunks].count(True) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request (``data: [DONE]`` checked and left out)."""
    resp = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body, "stream": True},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    events = [line[len("data: "):] for line in resp.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


STREAM_BODIES = {"/v1/completions": {"prompt": PROMPT},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}


@pytest.mark.parametrize("path", list(STREAM_BODIES))
@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_stats_on_every_chunk(server, path, include_usage):
    """``continuous_usage_stats`` (vLLM's): every chunk's usage is the prompt's tokens and the
    tokens streamed so far, counted here from the chunks' own ``token_ids`` (0 on chat's role
    chunk); the last equals the non-streamed usage. ``include_usage`` adds the usage-only last
    chunk, and only it."""
    body = {**STREAM_BODIES[path], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60).json()
    chunks = sse_chunks(server, path, {**body, "stream_options": {
        "continuous_usage_stats": True, "include_usage": include_usage}})
    prompt_tokens, streamed = whole["usage"]["prompt_tokens"], 0
    for chunk in chunks[:-1] if include_usage else chunks:
        streamed += sum(len(c.get("token_ids") or []) for c in chunk["choices"])
        assert chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": streamed,
                                  "total_tokens": prompt_tokens + streamed}, chunk
    assert streamed == 12 and chunks[-1]["usage"] == whole["usage"]
    assert (chunks[-1]["choices"] == []) == include_usage


@pytest.mark.parametrize("path", list(STREAM_BODIES))
def test_stream_first_chunk_of_each_choice_carries_prompt_token_ids(server, path, tokenizer):
    """``return_token_ids`` streamed: the first chunk of each choice carries the prompt's
    token ids (per choice on completions, as vLLM; on chat's role chunk of each choice),
    equal to the non-streamed reply's; no later chunk repeats them."""
    prompts = {"prompt": ["the quick brown", "kvflow pages keys"]} \
        if path == "/v1/completions" else {}
    body = {**STREAM_BODIES[path], **prompts, "n": 2, "max_tokens": 4, "temperature": 1.0,
            "seed": 3, "return_token_ids": True}
    whole = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60).json()
    chunks = sse_chunks(server, path, body)
    if path == "/v1/completions":
        expected = {c["index"]: c["prompt_token_ids"] for c in whole["choices"]}
        assert expected == {i: tokenizer.encode(prompts["prompt"][i // 2]) for i in range(4)}
        firsts: dict[int, list[int]] = {}
        for chunk in chunks:
            for c in chunk["choices"]:
                if c["index"] in firsts:
                    assert "prompt_token_ids" not in c, chunk
                else:
                    firsts[c["index"]] = c["prompt_token_ids"]
        assert firsts == expected
    else:
        assert [chunk["prompt_token_ids"] for chunk in chunks[:2]] == \
            [whole["prompt_token_ids"]] * 2  # each choice's role chunk, as vLLM 0.32's
        assert [[c["index"] for c in chunk["choices"]] for chunk in chunks[:2]] == [[0], [1]]
        assert all("prompt_token_ids" not in chunk for chunk in chunks[2:])


@pytest.mark.parametrize("path", list(STREAM_BODIES))
def test_unknown_stream_options_key_is_a_400(server, path):
    """A key ``stream_options`` does not declare is refused (it would be ignored), naming
    the key, with OpenAI's ``unknown_parameter``."""
    body = {"model": MODEL, **STREAM_BODIES[path], "stream": True,
            "stream_options": {"include_usage": True, "foo": 1}}
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == ("stream_options.foo", "unknown_parameter")


def test_null_max_tokens_means_unset(server, tokenizer):
    """An explicit null ``max_tokens`` (chat: or ``max_completion_tokens``) is the same as
    leaving it out: 16 tokens on completions (OpenAI's default; the tiny model's
    generation config sets none), what the context leaves on chat (96 - prompt tokens)."""
    def ids(path, body):
        out = httpx.post(f"{server.url}{path}", json={
            "model": MODEL, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            **body}, timeout=60).json()
        return out["choices"][0]["token_ids"]

    omitted = ids("/v1/completions", {"prompt": PROMPT})
    assert len(omitted) == 16
    assert ids("/v1/completions", {"prompt": PROMPT, "max_tokens": None}) == omitted
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    left = MAX_MODEL_LEN - len(tokenizer.encode(rendered, add_special_tokens=False))
    chat_omitted = ids("/v1/chat/completions", {"messages": messages})
    assert len(chat_omitted) == left
    for nulls in ({"max_tokens": None}, {"max_completion_tokens": None},
                  {"max_tokens": None, "max_completion_tokens": None}):
        assert ids("/v1/chat/completions", {"messages": messages, **nulls}) == chat_omitted


def test_multibyte_prompt_streams_whole_characters(client, tokenizer):
    """Random byte-level tokens after a CJK/emoji prompt: the streamed pieces join to exactly
    tokenizer.decode of the generated ids, and equal the non-streamed text."""
    prompt = "你好世界 🙂🎉 こんにちは，世界！"
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 32, "ignore_eos": True,
              "return_token_ids": True}
    texts, _, _, token_ids = collect_stream(complete(client, prompt, stream=True, **params))
    assert len(token_ids[0]) == 32
    assert texts[0] == decode(tokenizer, token_ids[0])
    assert complete(client, prompt, **params).choices[0].text == texts[0]


# ---- sampling semantics over HTTP ----------------------------------------------------------------
def test_seeded_requests_reproduce(client):
    def run(seed):
        return complete(client, temperature=1.5, seed=seed, max_tokens=20,
                        ignore_eos=True).choices[0].text

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_n2_usage_sums_samples(client):
    resp = chat(client, n=2, temperature=1.0, seed=5, max_tokens=24, return_token_ids=True)
    assert len(resp.choices) == 2
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in resp.choices)


def _stop_string_across_tokens(tokenizer, ids):
    """A 2-4 character string made of the end of one token's text and the start of the next,
    first occurring at that boundary; returns (stop, cut offset, tokens up to it) or None."""
    full = decode(tokenizer, ids)
    for k in range(1, len(ids) - 1):
        head, rest = decode(tokenizer, ids[:k + 1]), decode(tokenizer, ids[k + 1:])
        if not full.startswith(head) or head + rest != full:
            continue
        stop = head[-2:] + rest[:2]
        if len(head) >= 2 and len(rest) >= 1 and "\ufffd" not in stop and \
                full.find(stop) == len(head) - 2:
            token_end = next(j for j in range(k + 1, len(ids) + 1)
                             if len(decode(tokenizer, ids[:j])) >= len(head) - 2 + len(stop))
            return stop, len(head) - 2, token_end
    return None


def test_stop_string_across_tokens(client, tokenizer):
    for prompt in (PROMPT, "kvflow pages keys and values", "prefix caching reuses"):
        ids = complete(client, prompt, max_tokens=24, temperature=0, ignore_eos=True,
                       return_token_ids=True).choices[0].token_ids
        found = _stop_string_across_tokens(tokenizer, ids)
        if found:
            break
    assert found, "no token boundary with printable text on both sides"
    stop, cut, token_end = found
    expected = decode(tokenizer, ids)[:cut]
    params = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop],
              "return_token_ids": True}
    (c,) = complete(client, prompt, **params).choices
    assert (c.text, c.finish_reason, c.stop_reason) == (expected, "stop", stop)
    assert c.token_ids == ids[:token_end]  # generation stopped at the token completing it
    texts, finishes, _, _ = collect_stream(complete(client, prompt, stream=True, **params))
    assert texts[0] == expected and finishes[0][-1] == "stop"


def test_completion_logprobs(client):
    (c,) = complete(client, max_tokens=8, temperature=0, ignore_eos=True, logprobs=3,
                    return_token_ids=True).choices
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and sampled <= 0.0
        assert sampled == pytest.approx(max(top.values()))  # greedy: the sampled is the best


def test_chat_logprobs(client):
    (c,) = chat(client, max_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
                top_logprobs=3).choices
    assert len(c.logprobs.content) == 6
    for item in c.logprobs.content:
        values = [t.logprob for t in item.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert item.logprob == pytest.approx(values[0])
        own = bytes(item.bytes)  # the token's own bytes, whatever its text
        try:
            assert item.token == own.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: "" until the token completing it,
            assert item.token == "" or item.token.encode().endswith(own)  # which reads it whole
    joined = b"".join(bytes(item.bytes) for item in c.logprobs.content)
    assert joined.decode("utf-8", errors="replace") == c.message.content


def test_echo(client, tokenizer):
    (c,) = complete(client, echo=True, max_tokens=5, temperature=0, ignore_eos=True,
                    return_token_ids=True).choices
    assert c.text == PROMPT + decode(tokenizer, c.token_ids)
    texts, _, _, _ = collect_stream(complete(client, echo=True, max_tokens=5, temperature=0,
                                             ignore_eos=True, stream=True))
    assert texts[0] == c.text


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer, tiny_llama):
    """echo + logprobs: the prompt's tokens come first with their logprobs (HF's log-softmax
    of the prompt logits; the first token has none), then the completion's; streamed alike."""
    import torch

    ids = tokenizer.encode(PROMPT)
    (c,) = complete(client, echo=True, logprobs=2, max_tokens=3, temperature=0,
                    ignore_eos=True).choices
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    with torch.no_grad():
        ref = torch.log_softmax(tiny_llama.hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        assert len(lp.top_logprobs[p]) >= 2
    assert "".join(lp.tokens[:len(ids)]) == PROMPT
    chunks = list(complete(client, echo=True, logprobs=2, max_tokens=3, temperature=0,
                           ignore_eos=True, stream=True))
    streamed = [v for ch in chunks for ch_c in ch.choices if ch_c.logprobs
                for v in ch_c.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


@pytest.mark.parametrize("logprobs,prompt_logprobs", [(1, 4), (4, 1)])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_and_prompt_logprobs_each_give_their_own_k(server, tokenizer, tiny_llama,
                                                        logprobs, prompt_logprobs, stream):
    """echo + logprobs + prompt_logprobs with two different k: the echoed prompt's
    ``top_logprobs`` hold ``logprobs`` alternatives (as the completion's tokens do) and
    ``prompt_logprobs`` holds ``prompt_logprobs`` ones, each HF's top k plus the prompt's own
    token; the engine computes the larger k once (both lists had 5 entries per token)."""
    import json

    import httpx
    import torch

    ids = tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs, "max_tokens": 2, "temperature": 0,
            "return_tokens_as_token_ids": True, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        tops = [t for c in choices if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
        entries = next(c["prompt_logprobs"] for c in choices if c.get("prompt_logprobs"))
    else:
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        choice = resp.json()["choices"][0]
        tops, entries = choice["logprobs"]["top_logprobs"], choice["prompt_logprobs"]
    with torch.no_grad():
        ref = torch.log_softmax(tiny_llama.hf_model(torch.tensor([ids])).logits[0].float(), -1)
    assert tops[0] is None and entries[0] is None
    for p in range(1, len(ids)):
        want = set(ref[p - 1].topk(logprobs).indices.tolist()) | {ids[p]}
        assert set(tops[p]) == {f"token_id:{t}" for t in want}
        want = set(ref[p - 1].topk(prompt_logprobs).indices.tolist()) | {ids[p]}
        assert set(entries[p]) == {str(t) for t in want}
        for t in want:
            assert entries[p][str(t)]["logprob"] == pytest.approx(float(ref[p - 1, t]),
                                                                  abs=1e-4)
    assert all(len(top) == logprobs for top in tops[len(ids):])  # greedy: in its top k


def test_echo_text_offsets_index_the_returned_text_across_split_characters(client, tokenizer):
    """echo + logprobs with a prompt whose 2- and 3-byte characters are split across byte
    tokens: each piece decoded alone to U+FFFD and the prompt's offsets summed those, so they
    ran past the prompt and the completion's (starting at len(prompt)) went back below them.
    Now every offset is where the token's text starts in prompt + completion text (oracle
    from the tokens' bytes), non-decreasing; streamed the same."""
    from tests.test_text_offsets import stable_offsets

    prompt = "the café 你 fox"
    ids = tokenizer.encode(prompt)
    want_prompt = stable_offsets(tokenizer, ids)
    assert len(set(want_prompt)) < len(ids)  # some character spans several tokens
    params = {"echo": True, "logprobs": 1, "max_tokens": 24, "temperature": 1.0, "seed": 7,
              "ignore_eos": True, "return_token_ids": True}
    (c,) = complete(client, prompt, **params).choices
    offsets = c.logprobs.text_offset
    assert offsets[:len(ids)] == want_prompt
    # the completion's random bytes may be invalid UTF-8 (the oracle then differs on
    # which U+FFFD a token starts at): its offsets start at the echo's end and never go back
    assert offsets[len(ids)] == len(prompt)
    assert offsets == sorted(offsets) and offsets[-1] <= len(c.text)
    chunks = list(complete(client, prompt, stream=True, **params))
    streamed = [o for ch in chunks for cc in ch.choices if cc.logprobs
                for o in cc.logprobs.text_offset]
    assert streamed == offsets



def test_streamed_text_offsets_under_a_stop_string_equal_the_whole_response(client, tokenizer):
    """A stop string completed by the 3rd of three tokens: the stream sent each token while
    its text was held back (a stop-string prefix), the 2nd with the offset it has before the
    cut (1), then the last one capped at the cut text's end (0): [0, 1, 0], going back and
    past the returned text "". Hand-computed: the text is empty, so every offset is 0, as
    the whole response says; the stream must send the same offsets (and token ids)."""
    hash_id = tokenizer.convert_tokens_to_ids("#")
    params = {"max_tokens": 8, "temperature": 0, "logit_bias": {str(hash_id): 100},
              "stop": ["###"], "logprobs": 0, "return_token_ids": True}
    (c,) = complete(client, **params).choices
    assert c.text == "" and c.finish_reason == "stop" and c.token_ids == [hash_id] * 3
    assert c.logprobs.text_offset == [0, 0, 0]
    chunks = list(complete(client, stream=True, **params))
    streamed = [o for ch in chunks for cc in ch.choices if cc.logprobs
                for o in cc.logprobs.text_offset]
    assert streamed == [0, 0, 0]
    assert [t for ch in chunks for cc in ch.choices for t in cc.token_ids or []] == \
        [hash_id] * 3

def test_logit_bias_forces_a_token(client, tokenizer):
    token = tokenizer.encode(" fox")[-1]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
        (c,) = complete(client, max_tokens=6, ignore_eos=True, logit_bias={str(token): 100},
                        return_token_ids=True, **sampling).choices
        assert c.token_ids == [token] * 6


def test_penalties_match_offline_engine(client, tiny_chat_model):
    """Presence, frequency and repetition penalties reach the sampler: the server's greedy
    tokens equal the offline engine's for the same SamplingParams."""
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}
    (c,) = complete(client, max_tokens=16, temperature=0, ignore_eos=True,
                    return_token_ids=True, **penalties).choices
    llm = kvflow.LLM(model=tiny_chat_model, dtype="float32", device="cpu",
                     num_kv_blocks=NUM_KV_BLOCKS, block_size=4, max_model_len=MAX_MODEL_LEN)
    params = kvflow.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, **penalties)
    (offline,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert c.token_ids == offline.outputs[0].token_ids


# ---- tokenizer endpoints -------------------------------------------------------------------------
def test_tokenize_detokenize(server, tokenizer):
    resp = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert resp["tokens"] == tokenizer.encode(PROMPT) and resp["count"] == len(resp["tokens"])
    assert resp["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    resp = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert resp["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": resp["tokens"]}).json()
    assert text == {"prompt": rendered}


# ---- metrics -------------------------------------------------------------------------------------
def test_metrics_counters_move(server, client, tokenizer):
    prompt = "prefix caching reuses blocks of tokens"
    num_prompt = len(tokenizer.encode(prompt))
    before = server.metrics()
    complete(client, prompt, max_tokens=5, temperature=0, ignore_eos=True)
    after = server.metrics()

    def grew(name, **labels):
        return server.value(after, name, **labels) - server.value(before, name, **labels)

    assert grew("kvflow:prompt_tokens_total") == num_prompt
    assert grew("kvflow:generation_tokens_total") == 5
    assert grew("kvflow:request_success_total", finished_reason="length") == 1
    assert grew("kvflow:time_to_first_token_seconds_count") == 1
    assert grew("kvflow:e2e_request_latency_seconds_count") == 1
    assert grew("kvflow:inter_token_latency_seconds_count") == 4
    assert grew("kvflow:request_time_per_output_token_seconds_count") == 1  # one sample
    tpot = grew("kvflow:request_time_per_output_token_seconds_sum")  # mean of its 4 gaps
    assert abs(tpot - grew("kvflow:inter_token_latency_seconds_sum") / 4) < 1e-3
    assert grew("kvflow:request_prompt_tokens_sum") == num_prompt
    assert grew("kvflow:request_generation_tokens_sum") == 5
    assert grew("kvflow:prefix_cache_queries_total") == num_prompt
    assert server.value(after, "kvflow:num_requests_running") == 0
    assert server.value(after, "kvflow:kv_cache_usable_blocks") == NUM_KV_BLOCKS - 1
    assert server.value(after, "kvflow:kv_cache_free_blocks") == NUM_KV_BLOCKS - 1
    # vLLM's prompt tokens by source: every prompt token computed or a local hit, none loaded
    by_source = {source: grew("kvflow:prompt_tokens_by_source_total", source=source)
                 for source in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(by_source.values()) == num_prompt and by_source["external_kv_transfer"] == 0
    complete(client, prompt, max_tokens=5, temperature=0, ignore_eos=True)  # same prefix
    again = server.metrics()

    def grew_again(name, **labels):
        return server.value(again, name, **labels) - server.value(after, name, **labels)

    hits = grew_again("kvflow:prefix_cache_hits_total")
    assert hits == (num_prompt - 1) // 4 * 4  # whole 4-token blocks, one token left to compute
    assert grew_again("kvflow:prompt_tokens_cached_total") == hits
    assert grew_again("kvflow:prompt_tokens_by_source_total", source="local_cache_hit") == hits
    assert grew_again("kvflow:prompt_tokens_by_source_total",
                      source="local_compute") == num_prompt - hits
    assert grew_again("kvflow:prompt_tokens_cached_by_source_total", source="device") == hits
    for source in ("host", "p2p", "disk", "external_unspecified"):  # no connector: 0, exported
        assert (("kvflow:prompt_tokens_cached_by_source_total",
                 (("engine", "0"), ("source", source))) in again)
        assert server.value(again, "kvflow:prompt_tokens_cached_by_source_total",
                            source=source) == 0
    for name in ("kvflow:external_prefix_cache_queries_total",
                 "kvflow:external_prefix_cache_hits_total"):
        assert ((name, (("engine", "0"),)) in again) and server.value(again, name) == 0
    for reason in ("capacity", "deferred"):  # idle: nothing waits
        key = ("kvflow:num_requests_waiting_by_reason", (("engine", "0"), ("reason", reason)))
        assert again[key] == 0
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):  # no limit set: none
        assert again["kvflow:admission_rejections_total", (("reason", reason),)] == 0
    (info,) = [(dict(labels), v) for (name, labels), v in again.items()
               if name == "kvflow:cache_config_info"]
    assert info == ({"engine": "0", "block_size": "4", "cache_dtype": "auto",
                     "enable_prefix_caching": "True", "prefix_caching_hash_algo": "blake2b",
                     "num_gpu_blocks": str(NUM_KV_BLOCKS),
                     "num_gpu_blocks_override": str(NUM_KV_BLOCKS),
                     "kv_cache_memory_bytes": "None"}, 1)


# ---- bad input -----------------------------------------------------------------------------------
LONG_TEXT = "the quick brown fox jumps over a lazy dog " * 12
C, CH = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [  # (id, path, body, status, param)
    ("invalid_json", C, b'{"prompt": "x",', 400, None),
    ("max_tokens_type", C, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature_type", C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("prompt_type", C, {"prompt": 5}, 400, None),
    ("prompt_missing", C, {"max_tokens": 3}, 400, "prompt"),
    ("empty_text", C, {"prompt": ""}, 400, "prompt"),
    ("empty_list", C, {"prompt": []}, 400, "prompt"),
    ("empty_ids", C, {"prompt": [[]]}, 400, "prompt.0"),
    ("empty_text_in_list", C, {"prompt": ["a", ""]}, 400, "prompt.1"),  # was "prompt"
    ("empty_ids_in_list", C, {"prompt": [[5], []]}, 400, "prompt.1"),
    ("ids_out_of_vocab", C, {"prompt": [3, 99999]}, 400, "prompt.1"),  # was "prompt"
    ("listed_ids_out_of_vocab", C, {"prompt": [[3], [3, 99999]]}, 400, "prompt.1.1"),
    ("max_tokens_0", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens_bool", C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("temperature_bool", C, {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("max_tokens_negative", C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("max_tokens_too_large", C, {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ("logit_bias_out_of_vocab", C, {"prompt": "x", "logit_bias": {"99999": 1}}, 400,
     "logit_bias"),
    ("logit_bias_bad_key", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias_too_big", C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    ("stop_token_out_of_vocab", C, {"prompt": "x", "stop_token_ids": [99999]}, 400,
     "stop_token_ids"),
    ("top_p_0", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("temperature_negative", C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature_nan", C, b"{\"prompt\": \"x\", \"temperature\": NaN}", 400, "temperature"),
    ("stop_wrong_type", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    ("prompt_wrong_type", C, {"prompt": 5}, 400, "prompt"),
    ("empty_body", C, b"", 400, None),
    ("presence_penalty_3", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition_penalty_0", C, {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("n_above_cap", C, {"prompt": "x", "n": 17}, 400, "n"),
    ("n_0", C, {"prompt": "x", "n": 0}, 400, "n"),
    ("min_tokens_above_max", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens"),
    ("empty_stop", C, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("seed_too_large", C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("logprobs_above_cap", C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("stream_options_without_stream", C,
     {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("unknown_model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat_no_messages", CH, {"messages": []}, 400, "messages"),
    ("chat_messages_type", CH, {"messages": "hi"}, 400, "messages"),
    ("chat_unknown_role", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role"),
    ("chat_max_tokens_bool", CH, {"messages": HI, "max_tokens": False}, 400, "max_tokens"),
    ("chat_top_logprobs_without_logprobs", CH, {"messages": HI, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat_top_logprobs_above_cap", CH, {"messages": HI, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("chat_image_part", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages.0.content.0"),
    ("chat_too_long", CH, {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400,
     "messages"),
    ("detokenize_out_of_vocab", "/detokenize", {"tokens": [99999]}, 400, "tokens.0"),
    ("tokenize_nothing", "/tokenize", {}, 400, "prompt"),
    ("unknown_route", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", [r[1:] for r in BAD_REQUESTS],
                         ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server, path, body, status, param):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} \
        if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{server.url}{path}", timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and isinstance(error["type"], str)
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error


# (/v1/load_lora_adapter, off on this server: tests/test_lora_runtime_updating.py)
JSON_BODIES = {C: {"prompt": "x", "max_tokens": 1}, CH: {"messages": HI, "max_tokens": 1},
               "/tokenize": {"prompt": "x"}, "/detokenize": {"tokens": [5]}}


@pytest.mark.parametrize("path", list(JSON_BODIES))
@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded"])
def test_body_not_sent_as_json_is_a_400_naming_its_content_type(server, path, content_type):
    """A JSON body is read only when sent as ``application/json``: OpenAI reads no fields from
    a body of another type (its answer is that ``model`` is missing) and vLLM refuses it with
    a 400; kvflow's 400 names the type it got (code ``unsupported_media_type``), never a 5xx,
    also for a body that is not valid JSON either."""
    for body in (json.dumps(JSON_BODIES[path]).encode(), b'{"prompt": '):
        headers = {} if content_type is None else {"Content-Type": content_type}
        resp = httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=30)
        assert resp.request.headers.get("content-type") == content_type
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error",
                                                  "unsupported_media_type")
        named = f"'{content_type}'" if content_type else "no Content-Type header"
        assert named in error["message"] and "application/json" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_are_read(server, content_type, tokenizer):
    """JSON with a charset parameter, in any case, or a ``+json`` type is read (hand-checked:
    /tokenize of "x" gives the tokenizer's ids)."""
    resp = httpx.post(f"{server.url}/tokenize", content=b'{"prompt": "x"}',
                      headers={"Content-Type": content_type}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] == tokenizer.encode("x")


def test_body_encoding_and_depth_errors_say_what_is_wrong(server, tokenizer):
    """A compressed body (any Content-Encoding but ``identity``) is a 415 naming the coding
    (was: gzip read as text "not UTF-8", and a ``br`` header on plain JSON silently read);
    JSON nested past the parser's recursion limit is a 400 saying so (was: "not UTF-8");
    bytes that are not UTF-8 still say that. ``identity`` is read (hand-checked: the
    tokenizer's ids of "x")."""
    import gzip

    url, raw = f"{server.url}/tokenize", b'{"prompt": "x"}'
    for encoding, body in (("gzip", gzip.compress(raw)), ("br", raw), ("gzip, identity", raw)):
        resp = httpx.post(url, content=body, timeout=30, headers={
            "Content-Type": "application/json", "Content-Encoding": encoding})
        error = resp.json()["error"]
        assert (resp.status_code, error["code"]) == (415, "unsupported_content_encoding")
        assert f"Content-Encoding {encoding!r}" in error["message"]
    resp = httpx.post(url, content=raw, timeout=30, headers={
        "Content-Type": "application/json", "Content-Encoding": "identity"})
    assert resp.status_code == 200 and resp.json()["tokens"] == tokenizer.encode("x")
    for body, says in ((b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                        "nested too deeply"), (b'{"prompt": "\xff"}', "UTF-8")):
        resp = httpx.post(url, content=body, headers={"Content-Type": "application/json"},
                          timeout=30)
        error = resp.json()["error"]
        assert (resp.status_code, error["code"]) == (400, "invalid_json"), resp.text
        assert says in error["message"], error


def test_max_tokens_is_capped_by_the_context(server):
    """A 90-token prompt in the 96-token context: without max_tokens, OpenAI's default of 16
    becomes the 6 tokens that fit (vLLM's rule, and kvflow's for a generation config's
    default); an explicit 16 is clamped the same way, as vLLM 0.32's ``get_max_tokens``
    clamps it (was a 400 context_length_exceeded), finish_reason ``length``. Only a
    max_tokens above max_model_len is refused, whatever the prompt (vLLM's
    ``max_tokens=... cannot be greater than max_model_len``)."""
    body = {"model": MODEL, "prompt": [3 + i % 50 for i in range(90)], "temperature": 0,
            "ignore_eos": True}
    for extra in ({}, {"max_tokens": 16}):
        out = httpx.post(f"{server.url}{C}", json={**body, **extra}, timeout=60).json()
        assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == \
            (6, "length"), out
    error = httpx.post(f"{server.url}{C}", json={**body, "max_tokens": 97}).json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "integer_above_max_value")
    assert error["message"].startswith("max_tokens=97 cannot be greater than this model's "
                                       "maximum context length of 96 tokens"), error


def test_min_tokens_above_what_the_context_leaves_is_refused(server):
    """A 90-token prompt in the 96-token context leaves 6 tokens: min_tokens 7 cannot be
    honoured (vLLM's SamplingParams refuses min_tokens above the clamped max_tokens), so it
    is a 400 naming min_tokens (chat's path calls the same check; was: 6 tokens, min_tokens
    silently cut); min_tokens 6 is served with the 6 tokens."""
    prompt = [3 + i % 50 for i in range(90)]
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 16}
    error = httpx.post(f"{server.url}{C}", json={**body, "min_tokens": 7}).json()["error"]
    assert (error["param"], error["code"]) == ("min_tokens", "invalid_value"), error
    assert "min_tokens=7 is more than the 6 tokens" in error["message"], error
    out = httpx.post(f"{server.url}{C}", json={**body, "min_tokens": 6}, timeout=60).json()
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == \
        (6, "length"), out


def test_listed_prompts_are_each_capped_by_the_context(server):
    """In a list of prompts, each sample's max_tokens is what its own prompt leaves (was: a
    400 naming the prompt too long for max_tokens 16)."""
    body = {"model": MODEL, "prompt": [[3], [3 + i % 50 for i in range(90)]], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    out = httpx.post(f"{server.url}{C}", json=body, timeout=60).json()
    got = sorted((c["index"], c["finish_reason"]) for c in out["choices"])
    assert got == [(0, "length"), (1, "length")], out
    assert out["usage"]["completion_tokens"] == 16 + 6, out


def test_chat_length_error_names_the_length_field_sent(server):
    """Chat's limit set with max_completion_tokens alone, above the 96-token context: the 400
    names max_completion_tokens (was max_tokens, a field the client never sent); set with
    max_tokens, it names max_tokens. At or below max_model_len it is clamped: a reply of
    what the context leaves, finish_reason length."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_completion_tokens", "max_tokens"):
        resp = httpx.post(f"{server.url}/v1/chat/completions", json={**body, field: 100},
                          timeout=60)
        error = resp.json()["error"]
        assert (resp.status_code, error["param"], error["code"]) == \
            (400, field, "integer_above_max_value"), resp.text
        assert f"{field}=100 cannot be greater than" in error["message"], error
    out = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                     json={**body, "max_tokens": 96, "temperature": 0, "ignore_eos": True})
    usage = out.json()["usage"]
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 96, usage


def test_context_errors_name_the_limit_and_the_length(server, tokenizer):
    num = len(tokenizer.encode(LONG_TEXT))
    error = httpx.post(f"{server.url}{C}", json={"prompt": LONG_TEXT}).json()["error"]
    assert f"{num} tokens" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    error = httpx.post(f"{server.url}{C}", json={"prompt": [3] * 10, "max_tokens": 97}).json()
    assert "96" in error["error"]["message"] and "max_tokens=97" in error["error"]["message"]


def test_server_serves_after_bad_input(server, client):
    for _, path, body, _, _ in BAD_REQUESTS[:5]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.post(f"{server.url}{path}", **kwargs)
    assert httpx.get(f"{server.url}/health").status_code == 200
    resp = complete(client, max_tokens=3, temperature=0, ignore_eos=True)
    assert resp.usage.completion_tokens == 3
    metrics = server.metrics()
    assert server.value(metrics, "kvflow:kv_cache_free_blocks") == NUM_KV_BLOCKS - 1


def test_request_chat_template_needs_a_trusting_server(server, tokenizer):
    """A Jinja chat_template sent by a client runs on the server: without
    --trust-request-chat-template it is a 400 naming the field (chat and /tokenize), and the
    model's own template still serves the same conversation."""
    messages = [{"role": "user", "content": "hi there"}]
    template = "{% for i in range(100000000) %}{% endfor %}x"  # would hold a thread for minutes
    for path, body in (("/v1/chat/completions", {"model": MODEL, "max_tokens": 1}),
                       ("/tokenize", {})):
        resp = httpx.post(f"{server.url}{path}", timeout=30,
                          json={**body, "messages": messages, "chat_template": template})
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == "chat_template", resp.text
        assert "--trust-request-chat-template" in error["message"]
    resp = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert resp.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


def test_body_that_is_not_utf8_is_invalid_json(server):
    """Bytes that are not UTF-8 text under ``application/json``: a 400 with code
    ``invalid_json`` saying why (FastAPI's own answer had no code)."""
    resp = httpx.post(f"{server.url}{C}", content=b'{"prompt": "h\xff\xfei", "max_tokens": 2}',
                      headers={"Content-Type": "application/json"}, timeout=30)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["code"] == "invalid_json", resp.text
    assert "UTF-8" in error["message"]


@pytest.mark.parametrize("path,body", [
    ("/pooling", {"input": "hi"}), ("/pooling", {"input": "hi", "task": "generate"}),
    ("/pooling", {"messages": HI}), ("/score", {"text_1": "a", "text_2": "b"}),
    ("/v2/rerank", {"query": "a", "documents": ["b"]})])
def test_pooling_routes_on_a_generating_server_are_wrong_task(server, path, body):
    """/pooling and vLLM's /score and /v2/rerank aliases are served; a generating model
    answers them 400 ``wrong_task`` naming ``model``, as it answers /v1/embeddings."""
    resp = httpx.post(f"{server.url}{path}", timeout=30, json=body)
    assert resp.status_code == 400, resp.text
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == \
        ("model", "wrong_task")
    if path == "/pooling":  # every pooling engine task serves it, not only embed
        assert resp.json()["error"]["message"] == (
            "this server's model runs task='generate' (--task); /pooling needs a pooling "
            "model (--task embed, score, classify or token_classify): use /v1/completions "
            "or /v1/chat/completions")
