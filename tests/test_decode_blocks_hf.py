"""Decoding across KV-block boundaries, with preemptions, end to end (tiny random Llama,
block size 4): the scheduler skips the KV manager for a decode whose slot is in a block the
request holds (``Request.kv_steady_until``) and the runner reuses the rows it looked up last
step (``InputBatch.rows_of``), so every boundary crossed, every block freed by a preemption
and every readmission must still reach the runner. Oracle: HF transformers' greedy
continuations (EOS ignored); a pool of 11 usable blocks for 4 requests needing 7 each forces
preemptions (checked)."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from tests.test_prefix_cache_copies import hf_greedy

PROMPTS = [[5, 9, 13, 17, 21], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42], [50, 51, 52, 53, 54, 55]]
MAX_TOKENS = 20


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_decodes_across_blocks_and_preemptions_match_hf(tiny_llama, caching):
    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=12,
              enable_prefix_caching=caching, max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(tiny_llama, prompt, MAX_TOKENS)
