"""``truncate_prompt_tokens`` on /v1/completions and /v1/chat/completions (with
``add_special_tokens``) keeps the special tokens the tokenizer adds (a BOS), as vLLM 0.32 cuts
a text prompt without ``truncation_side``: ``tokenizer(text, truncation=True, max_length=k)``
with the generation runner's ``truncation_side="left"``. kvflow kept the last k ids of the
whole encoding, dropping the BOS that Llama and Gemma prompts start with. With vLLM's
``truncation_side: "left"`` (the whole encoding's last k) and for token-id prompts the cut is
unchanged. Oracle: transformers' own truncation of the text, then greedy generation from those
ids sent as the prompt.
"""

from __future__ import annotations

import pytest

from tests.folder_edits import copy_with_bos
from tests.serving_client import served_client

CO, CH = "/v1/completions", "/v1/chat/completions"
TEXT = "the quick brown fox jumps over a lazy dog"
KEEP = 6


@pytest.fixture(scope="module")
def bos_chat_model(tiny_chat_model, tmp_path_factory) -> str:
    """The tiny chat model in a folder of its own whose tokenizer puts ``<bos>`` (id 1)
    first."""
    return copy_with_bos(tiny_chat_model, tmp_path_factory.mktemp("bos_chat") / "model")


@pytest.fixture(scope="module")
def tokenizer(bos_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bos_chat_model)
    tokenizer.truncation_side = "left"  # vLLM's for a generation runner
    return tokenizer


def _hf_cut(tokenizer, text: str) -> list[int]:
    """transformers' cut of ``text`` to ``KEEP`` tokens (the BOS kept)."""
    return tokenizer(text, truncation=True, max_length=KEEP)["input_ids"]


def test_truncation_keeps_the_bos(bos_chat_model, tokenizer):
    whole = tokenizer.encode(TEXT)
    expected = _hf_cut(tokenizer, TEXT)
    assert expected[0] == 1 and expected[1:] == whole[-(KEEP - 1):]  # the oracle keeps it
    messages = [{"role": "user", "content": TEXT}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    with served_client(bos_chat_model) as client:
        def post(path: str, **body) -> dict:
            resp = client.post(path, json={"model": "m", "temperature": 0, "max_tokens": 3,
                                           "ignore_eos": True, "return_token_ids": True,
                                           **body})
            assert resp.status_code == 200, resp.text
            return resp.json()

        def generated(ids: list[int]) -> list[int]:
            return post(CO, prompt=ids)["choices"][0]["token_ids"]

        cut = post(CO, prompt=TEXT, truncate_prompt_tokens=KEEP)
        assert cut["usage"]["prompt_tokens"] == KEEP
        assert cut["choices"][0]["token_ids"] == generated(expected) != generated(whole[-KEEP:])
        # vLLM's truncation_side "left": the whole encoding's last KEEP ids, BOS cut too
        left = post(CO, prompt=TEXT, truncate_prompt_tokens=KEEP, truncation_side="left")
        assert left["choices"][0]["token_ids"] == generated(whole[-KEEP:])
        # token ids are cut as given
        ids_cut = post(CO, prompt=whole, truncate_prompt_tokens=KEEP)
        assert ids_cut["choices"][0]["token_ids"] == generated(whole[-KEEP:])
        # chat: the rendered text with the tokenizer's special tokens, cut as transformers cuts
        chat = post(CH, messages=messages, truncate_prompt_tokens=KEEP, add_special_tokens=True)
        assert chat["prompt_token_ids"] == _hf_cut(tokenizer, rendered)
        assert chat["choices"][0]["token_ids"] == generated(_hf_cut(tokenizer, rendered))
        plain_chat = post(CH, messages=messages, truncate_prompt_tokens=KEEP)  # no BOS added
        assert plain_chat["prompt_token_ids"] == tokenizer.encode(
            rendered, add_special_tokens=False)[-KEEP:]


def test_offline_truncate_prompt_tokens_keeps_the_bos(bos_chat_model, tokenizer):
    """Offline ``SamplingParams(truncate_prompt_tokens=k)`` on a text prompt cuts as the
    server and vLLM 0.32 do (was: the whole encoding's last k, the BOS dropped); token ids and
    ``tokenization_kwargs={"truncation_side": "left"}`` keep their last k."""
    from kvflow import LLM, SamplingParams

    whole, expected = tokenizer.encode(TEXT), _hf_cut(tokenizer, TEXT)
    llm = LLM(bos_chat_model, dtype="float32", num_kv_blocks=32)
    cut = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                         truncate_prompt_tokens=KEEP)
    for prompt in (TEXT, {"prompt": TEXT}):
        out = llm.generate(prompt, cut, use_tqdm=False)[0]
        assert out.prompt_token_ids == expected
    ids = llm.generate({"prompt_token_ids": whole}, cut, use_tqdm=False)[0]
    assert ids.prompt_token_ids == whole[-KEEP:]
    left = llm.generate(TEXT, cut, use_tqdm=False,
                        tokenization_kwargs={"truncation_side": "left"})[0]
    assert left.prompt_token_ids == whole[-KEEP:]
