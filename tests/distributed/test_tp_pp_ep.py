"""Tensor, pipeline and expert parallelism over worker processes (gloo on CPU) give the greedy
tokens of the one-process engine (itself checked against HF transformers in
tests/models/test_parity.py), and each rank holds what it should: its KV heads (replicated when
there are fewer than ranks), its layers' KV tensors, its experts.

Each case starts 2 worker processes (about 10-15 s on 2 busy cores).
"""

from __future__ import annotations

import pytest

from kvflow import LLM
from tests.distributed.conftest import (
    GREEDY,
    PROMPTS,
    SLOW,
    assert_same_greedy,
    greedy_run,
    shutdown_and_check,
)


@pytest.mark.parametrize("model, kwargs, kv_heads_per_rank", [
    ("llama_mqa", {"tensor_parallel_size": 2}, 1),  # 1 KV head replicated on both ranks
    # 4 heads / 2 KV heads split 2+2 / 1+1; experts placed 2 + 2; layer 1 a dense TP MLP
    # (TP + EP in the default run: test_deepseek_parallel.py's DeepSeek-V3)
    pytest.param("qwen2_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}, 1,
                 marks=SLOW),
], ids=["tp2-one-kv-head", "tp2-ep-qwen2-moe"])
def test_tensor_and_expert_parallel_greedy_equals_one_process(
        tiny_model_factory, single_process_greedy, model, kwargs, kv_heads_per_rank):
    got, llm = greedy_run(tiny_model_factory(model).path, shutdown=False, **kwargs)
    try:
        assert_same_greedy(single_process_greedy(model), got)
        spec = llm.engine.core.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        assert spec.num_kv_heads == kv_heads_per_rank
    finally:
        shutdown_and_check(llm)  # the workers exit by themselves, status 0


def test_pipeline_parallel_greedy_equals_one_process(tiny_model_factory,
                                                     single_process_greedy):
    """Gemma 3 (a sliding-window and a global layer: two KV-cache groups, tied embeddings)
    over 2 stages: each stage holds one layer (and reports only its KV spec); the engine
    sends a second micro-batch before the first one's tokens are back (both stages busy) and
    still produces the one-process tokens."""
    llm = LLM(model=tiny_model_factory("gemma3").path, dtype="float32", num_kv_blocks=96,
              max_num_batched_tokens=32, pipeline_parallel_size=2)
    core, depths = llm.engine.core, []
    send = core.executor.execute_model_async

    def recording_send(sched, bitmask=None):
        depths.append(len(core.batch_queue))  # steps already in flight when this one goes
        return send(sched, bitmask)

    core.executor.execute_model_async = recording_send
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        per_rank = core.executor.collective_rpc("get_kv_cache_spec")
    finally:
        llm.shutdown()
    got = [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)) for o in outs]
    assert_same_greedy(single_process_greedy("gemma3"), got)
    assert [list(specs) for specs in per_rank] == [["model.layers.0.self_attn.attn"],
                                                  ["model.layers.1.self_attn.attn"]]
    assert max(depths) == 1 and depths.count(1) >= len(depths) // 3
