"""Qwen2-VL over 2 worker processes (gloo on CPU): tensor parallelism (the decoder's heads and
MLP split, the vision tower replicated) and pipeline parallelism (the first stage runs the
encoder and merges the image rows; every stage computes the M-RoPE positions). Oracle:
transformers' greedy tokens for prompts with 0, 1 and 2 images. About 15-40 s per case on 2
busy cores: TP=2 runs in the default suite, PP=2 and DP=2 (two engine-core replicas, each
with its own encoder cache) with scripts/test_distributed_slow.sh
(``KVFLOW_TEST_DISTRIBUTED_SLOW=1``)."""

from __future__ import annotations

import os

import pytest

from kvflow import LLM
from tests.multimodal.test_qwen2_vl_offline import MAX_TOKENS, cases, greedy, hf_generate

_SLOW = [pytest.mark.distributed_slow,
         pytest.mark.skipif(os.environ.get("KVFLOW_TEST_DISTRIBUTED_SLOW") != "1",
                            reason="slow: run scripts/test_distributed_slow.sh")]


@pytest.mark.parametrize("kwargs", [
    {"tensor_parallel_size": 2},
    pytest.param({"pipeline_parallel_size": 2}, marks=_SLOW),
    pytest.param({"data_parallel_size": 2}, marks=_SLOW)], ids=["tp2", "pp2", "dp2"])
def test_parallel_greedy_tokens_equal_transformers(tiny_qwen2_vl, kwargs):
    llm = LLM(tiny_qwen2_vl.path, dtype="float32", num_kv_blocks=128, block_size=16,
              max_num_batched_tokens=64, **kwargs)
    try:
        prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases()]
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    for (text, images), out in zip(cases(), outs):
        assert out.outputs[0].token_ids == hf_generate(tiny_qwen2_vl, text, images, MAX_TOKENS)
