"""The server applies the model's generation_config.json sampling defaults to the fields a
request leaves unset, and only to those: a field set to the default value (``max_tokens: 16``
on /v1/completions, ``temperature: 1.0``) keeps it. Checked against transformers' greedy
``generate`` with the model's repetition penalty, and against the offline engine with the file
ignored. The model is the tiny Llama with ``{"temperature": 0.0, "repetition_penalty": 2.0,
"max_new_tokens": 6, "top_k": 5}`` (tests/test_generation_config.py builds it the same way).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from tests.test_generation_config import GEN_DEFAULTS, PROMPT, hf_greedy, with_generation_config

MODEL = "tiny-gen"
ENGINE_ARGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64",
               "--block-size", "4", "--max-model-len", "64", "--served-model-name", MODEL]
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _gen_model(tiny_llama, built_models) -> str:
    return built_models("gen", lambda folder: with_generation_config(
        tiny_llama.path, Path(folder), GEN_DEFAULTS))[0]


def prestart_servers(fixture):
    """This module's servers, taken with ``start_server.declared`` and started ahead
    (``_prestart_next_module`` in conftest.py)."""
    return [(_gen_model(fixture("tiny_llama"), fixture("built_models")), ENGINE_ARGS, None)]


@pytest.fixture(scope="module")
def gen_model(tiny_llama, built_models) -> str:
    return _gen_model(tiny_llama, built_models)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def tokenizer(gen_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gen_model)


def test_completion_without_sampling_fields_uses_the_model_defaults(client, tokenizer,
                                                                    tiny_llama):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, extra_body=EXTRA)
    ids = tokenizer.encode(PROMPT)
    assert reply.choices[0].token_ids == hf_greedy(tiny_llama, ids, 6, repetition_penalty=2.0)
    assert reply.usage.completion_tokens == 6


def test_completion_fields_set_to_the_default_value_win(client, gen_model):
    """max_tokens=16 (OpenAI's default), temperature=1.0, repetition_penalty=1.0, top_k=-1:
    the same tokens as the offline engine with the file ignored and the same seed."""
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=11,
        extra_body={**EXTRA, "repetition_penalty": 1.0, "top_k": -1})
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    (plain,) = LLM(model=gen_model, dtype="float32", num_kv_blocks=64, block_size=4,
                   generation_config="none").generate(PROMPT, params, use_tqdm=False)
    assert reply.choices[0].token_ids == plain.outputs[0].token_ids
    assert len(plain.outputs[0].token_ids) == 16


def test_chat_without_max_tokens_uses_max_new_tokens(client, tokenizer, tiny_llama):
    messages = [{"role": "user", "content": "the lazy dog"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, extra_body=EXTRA)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert reply.choices[0].token_ids == hf_greedy(tiny_llama, ids, 6, repetition_penalty=2.0)


def test_default_max_tokens_is_capped_by_the_context(client, tokenizer):
    """A 60-token prompt in a 64-token context: the model's 6 become the 4 that fit, not a
    400 for a length the request never asked for."""
    prompt = list(range(2, 62))
    reply = client.completions.create(model=MODEL, prompt=prompt, extra_body=EXTRA)
    assert reply.usage.completion_tokens == 4
    assert reply.choices[0].finish_reason == "length"
