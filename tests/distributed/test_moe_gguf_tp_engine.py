"""Tensor parallelism over a GGUF kept quantized (``--quantization gguf``): a Qwen3-MoE whose
every weight but the routers is Q8_0 (experts, attention, table) runs on two gloo ranks, each
holding its slice of the blocks (expert gate/up and q/k/v rows, expert down and o_proj
columns in whole blocks, vocabulary rows); greedy tokens and logprobs equal the one-rank run
and transformers running the file's rounded weights. Two engines and two worker processes take
~26 s on 2 cores: a distributed_slow case (scripts/test_distributed_slow.sh); the default run
keeps the layer-level TP=2 checks (tests/models/test_moe_gguf_tp.py,
tests/quant/test_gguf_kept.py)."""

from __future__ import annotations

import pytest

from kvflow import LLM
from tests.distributed.conftest import shutdown_and_check, slow
from tests.models.test_moe_gguf import Q, _rounded_oracle, _write
from tests.models.test_parity import _prompts, assert_matches_hf, greedy

pytest.importorskip("gguf")


@slow
def test_tp2_kept_moe_gguf_matches_one_rank_and_transformers(tiny_model_factory, tmp_path):
    tiny = tiny_model_factory("qwen3_moe_256")  # I = 256: 128 per rank, whole Q8_0 blocks
    path = _write(tiny, tmp_path / "q8.gguf", quantize=Q.Q8_0)
    prompts = _prompts([13, 22], tiny.vocab_size, seed=7)
    engine = {"model": path, "tokenizer": tiny.path, "dtype": "float32",
              "quantization": "gguf", "num_kv_blocks": 64, "block_size": 4,
              "max_num_batched_tokens": 16}
    one = LLM(**engine)
    single = one.generate(prompts, greedy(), use_tqdm=False)
    one.shutdown()
    llm = LLM(**engine, tensor_parallel_size=2)
    try:
        got = llm.generate(prompts, greedy(), use_tqdm=False)
    finally:
        shutdown_and_check(llm)
    oracle = _rounded_oracle(tiny, Q.Q8_0)
    for ref, out in zip(single, got):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for step, token in enumerate(out.outputs[0].token_ids):
            # fp32 sums split over two ranks: a few ulps of the logits apart
            assert out.outputs[0].logprobs[step][token].logprob == pytest.approx(
                ref.outputs[0].logprobs[step][token].logprob, abs=1e-4)
        assert_matches_hf(oracle, out)
