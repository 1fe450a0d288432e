"""vLLM's ``cache_salt`` offline (a dict prompt's key): with prefix caching on, a prompt hits
the blocks of an earlier prompt only when both carry the same salt (or neither does). The
hits (``RequestOutput.metrics.num_cached_tokens``) are computed by hand from the block size:
a prompt of ``L`` tokens seen before hits ``(L - 1) // BLOCK_SIZE * BLOCK_SIZE`` tokens (its
whole blocks, never its last token); one never seen with its salt hits 0. Every output
equals HF transformers' greedy continuation, salted or not. Bad salts: ValueError naming
``cache_salt``."""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.beam_search import BeamSearchParams

BLOCK_SIZE = 4
PROMPT_LEN = 14
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory("llama").path, dtype="float32", num_kv_blocks=64,
               block_size=BLOCK_SIZE, enable_prefix_caching=True)


def hf_greedy(tiny, prompt: list[int]) -> list[int]:
    """HF transformers' greedy continuation of ``prompt`` (EOS ignored)."""
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                     max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                     eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_only_the_same_salt_hits(llm, tiny_model_factory, assert_no_leaks):
    tiny = tiny_model_factory("llama")
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(2, tiny.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seen = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE  # 12: three whole blocks
    salts_and_hits = [("alice", 0), ("alice", seen), ("bob", 0), (None, 0), (None, seen),
                      ("bob", seen), ("carol", 0)]
    expected = hf_greedy(tiny, prompt)
    for salt, hits in salts_and_hits:  # one at a time: each sees the earlier ones' blocks
        p = {"prompt_token_ids": prompt} if salt is None else \
            {"prompt_token_ids": prompt, "cache_salt": salt}
        (out,) = llm.generate([p], params, use_tqdm=False)
        assert out.metrics.num_cached_tokens == hits, (salt, hits)
        assert out.num_cached_tokens == hits  # where vLLM's RequestOutput has it
        assert out.outputs[0].token_ids == expected, salt
    assert_no_leaks(llm)


@pytest.mark.parametrize("salt", ["", 5, b"x"])
def test_bad_salt_is_refused(llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [5, 6, 7], "cache_salt": salt},
                     SamplingParams(max_tokens=1), use_tqdm=False)


def test_beam_search_steps_carry_the_salt(llm, tiny_model_factory, assert_no_leaks):
    """Every step request of a salted search is salted: afterwards the prompt's blocks hit
    for that salt only, and the beams are the unsalted search's."""
    tiny = tiny_model_factory("llama")
    gen = torch.Generator().manual_seed(12)
    prompt = torch.randint(2, tiny.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    beam = BeamSearchParams(beam_width=2, max_tokens=3)
    (salted,) = llm.beam_search({"prompt_token_ids": prompt, "cache_salt": "dora"}, beam)
    params = SamplingParams(temperature=0, max_tokens=1)
    seen = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE  # 12: three whole blocks
    for p, hits in [(prompt, 0), ({"prompt_token_ids": prompt, "cache_salt": "dora"}, seen)]:
        (out,) = llm.generate([p], params, use_tqdm=False)
        assert out.metrics.num_cached_tokens == hits
    (plain,) = llm.beam_search(prompt, beam)
    assert [s.tokens for s in salted.sequences] == [s.tokens for s in plain.sequences]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.beam_search({"prompt_token_ids": prompt, "cache_salt": ""}, beam)
    assert_no_leaks(llm)
