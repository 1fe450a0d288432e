"""DeepSeek (MLA + DeepSeekMoE) over 2 worker processes (gloo on CPU) gives the greedy tokens
of the one-process engine (itself checked against transformers in tests/models/test_deepseek.py).

Tensor parallelism splits the 4 heads 2 + 2 (q / kv_b / o projections) while every rank caches
the whole latent (one vector of 32 + 8 values per token: MLA's cache is not split by heads);
expert parallelism places the 8 routed experts 4 + 4 and routes over all 8 with the correction
bias. Pipeline parallelism puts the dense layer on stage 0 and the MoE layer on stage 1 (in
scripts/test_distributed_slow.sh; PP runs by default in test_tp_pp_ep.py's Gemma 3 case).
"""

from __future__ import annotations

import torch

from kvflow.kv_cache_interface import MLAAttentionSpec
from tests.distributed.conftest import assert_same_greedy, greedy_run, slow


def test_tp2_ep2_deepseek_v3(tiny_model_factory, single_process_greedy):
    got, llm = greedy_run(tiny_model_factory("deepseek_v3").path, shutdown=False,
                          tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        assert_same_greedy(single_process_greedy("deepseek_v3"), got)
        spec = llm.engine.core.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        assert spec == MLAAttentionSpec(16, 1, 40, torch.float32)
    finally:
        llm.shutdown()


@slow
def test_pp2_deepseek_v2(tiny_model_factory, single_process_greedy):
    got, llm = greedy_run(tiny_model_factory("deepseek_v2").path, shutdown=False,
                          pipeline_parallel_size=2)
    try:
        assert_same_greedy(single_process_greedy("deepseek_v2"), got)
        per_rank = llm.engine.core.executor.collective_rpc("get_kv_cache_spec")
        assert [list(specs) for specs in per_rank] == [["model.layers.0.self_attn.attn"],
                                                      ["model.layers.1.self_attn.attn"]]
    finally:
        llm.shutdown()
