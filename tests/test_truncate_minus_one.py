"""``truncate_prompt_tokens=-1`` on a generation prompt longer than the context keeps its last
``max_model_len - 1`` tokens, leaving one position for the first generated token (vLLM 0.32's
``TokenizeParams.max_truncation_tokens`` for a generation request). kvflow kept
``max_model_len`` tokens, which the context check then refused ("the prompt has 32 tokens but
max_model_len is 32"), so -1 never served a prompt it cut: offline (``SamplingParams``,
``tokenization_kwargs``, ``LLMEngine.add_request``) and on /v1/completions and
/v1/chat/completions. Pooling keeps ``max_model_len`` (it generates nothing).
Oracle: greedy generation from the explicitly cut prompt (its last ``max_model_len - 1`` ids).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.inputs.tokenization import parse_tokenization_kwargs
from kvflow.inputs.truncation import truncation_length
from tests.serving_client import served_client

MAX_MODEL_LEN = 32
LONG_TEXT = " ".join(["the quick brown fox jumps over a lazy dog"] * 6)


def test_minus_one_reads_max_model_len_less_one_for_generation():
    assert truncation_length(-1, MAX_MODEL_LEN, generation=True) == MAX_MODEL_LEN - 1
    assert truncation_length(-1, MAX_MODEL_LEN) == MAX_MODEL_LEN  # pooling
    assert truncation_length(7, MAX_MODEL_LEN, generation=True) == 7
    kwargs = {"truncate_prompt_tokens": -1}
    assert parse_tokenization_kwargs(kwargs, MAX_MODEL_LEN, generation=True).keep == 31
    assert parse_tokenization_kwargs(kwargs, MAX_MODEL_LEN).keep == MAX_MODEL_LEN


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=32,
               block_size=4, max_model_len=MAX_MODEL_LEN)


def test_offline_minus_one_serves_a_long_prompt(llm, tiny_tokenizer):
    ids = tiny_tokenizer.encode(LONG_TEXT)
    assert len(ids) > MAX_MODEL_LEN
    kept = ids[-(MAX_MODEL_LEN - 1):]
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    minus_one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                               truncate_prompt_tokens=-1)
    explicit, cut, text_cut = llm.generate([kept, ids, LONG_TEXT],
                                           [greedy, minus_one, minus_one], use_tqdm=False)
    (by_kwargs,) = llm.generate(LONG_TEXT, greedy, use_tqdm=False,
                                tokenization_kwargs={"truncate_prompt_tokens": -1})
    for out in (cut, text_cut, by_kwargs):
        assert out.prompt_token_ids == kept
        assert out.outputs[0].token_ids == explicit.outputs[0].token_ids
    llm.engine.add_request(ids, minus_one, request_id="engine-cut")  # LLMEngine's own path
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.prompt_token_ids for o in finished] == [kept]
    assert [o.outputs[0].token_ids for o in finished] == [explicit.outputs[0].token_ids]


def test_served_minus_one_serves_long_prompts(tiny_chat_model, tiny_tokenizer):
    ids = tiny_tokenizer.encode(LONG_TEXT)
    messages = [{"role": "user", "content": LONG_TEXT}]
    with served_client(tiny_chat_model, max_model_len=MAX_MODEL_LEN) as client:
        def post(path: str, **body) -> dict:
            resp = client.post(path, json={"model": "m", "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True, **body})
            assert resp.status_code == 200, resp.text
            return resp.json()

        rendered = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
        for path, body, whole in (("/v1/completions", {"prompt": LONG_TEXT}, ids),
                                  ("/v1/completions", {"prompt": ids}, ids),
                                  ("/v1/chat/completions", {"messages": messages}, rendered)):
            kept = whole[-(MAX_MODEL_LEN - 1):]
            explicit = post("/v1/completions", prompt=kept, max_tokens=1)
            for extra in ({}, {"max_tokens": 1}):
                reply = post(path, truncate_prompt_tokens=-1, **body, **extra)
                assert reply["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
                assert reply["choices"][0]["token_ids"] == \
                    explicit["choices"][0]["token_ids"]
                if path == "/v1/chat/completions":
                    assert reply["prompt_token_ids"] == kept
