"""A stop token ends the text without being part of it (vLLM v1's detokenizer rule): the EOS
or a ``stop_token_ids`` id keeps its id in ``token_ids`` but its text stays out of ``text``
unless ``include_stop_str_in_output``, whatever ``skip_special_tokens`` says; the outputs
seen step by step (``on_output``) end with the same text. Oracle: the tokenizer's decode of the ids without (or with) the last
one."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", device="cpu", num_kv_blocks=64)


def test_a_stop_token_text_is_left_out(llm):
    tokenizer = llm.get_tokenizer()
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.token_ids[3]
    cut = free.token_ids[:free.token_ids.index(stop) + 1]
    for include in (False, True):
        for skip in (True, False):
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                    stop_token_ids=[stop], skip_special_tokens=skip,
                                    include_stop_str_in_output=include)
            out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
            assert (out.token_ids, out.finish_reason, out.stop_reason) == (cut, "stop", stop)
            shown = cut if include else cut[:-1]
            assert out.text == tokenizer.decode(shown, skip_special_tokens=skip)
            seen: list[str] = []
            llm.generate(PROMPT, params, use_tqdm=False,
                         on_output=lambda i, o, seen=seen: seen.append(o.outputs[0].text))
            assert seen[-1] == out.text


def test_the_eos_text_is_left_out_with_special_tokens(llm):
    """``skip_special_tokens=False`` keeps special tokens inside the text, not the EOS that
    ended it (a prompt and seed where the tiny model reaches EOS)."""
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=64, skip_special_tokens=False,
                            logit_bias={eos: 4.0})
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert out.text == tokenizer.decode(out.token_ids[:-1], skip_special_tokens=False)
    assert not out.text.endswith(tokenizer.eos_token)
