"""vLLM 0.32's ``LLM`` methods over ``data_parallel_size=2`` (two engine-core processes):
``enqueue`` / ``wait_for_completion`` give the one-process greedy tokens, in queue order;
``get_world_size`` counts the replicas only with ``include_dp``; ``get_metrics`` has one
engine-state series per replica (``engine`` "0" and "1"), whose prefix-cache queries are the
prompts each replica ran (the balancer alternates them: 6 + 4 and 21 + 40 tokens,
tests/distributed/test_data_parallel_llm.py works it out; their prompt tokens by source sum
to the same), a ``cache_config_info`` series each, and per-request counters over
both (4 prompts x 10 tokens); ``apply_model`` and ``reset_mm_cache`` are refused, naming
data parallelism."""

from __future__ import annotations

import pytest

from kvflow import LLM
from tests.distributed.conftest import GREEDY, PROMPTS, assert_same_greedy


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=96,
              max_num_batched_tokens=32, data_parallel_size=2, disable_log_stats=False)
    yield llm
    llm.shutdown()


def test_enqueue_metrics_and_world_size_over_replicas(dp_llm, single_process_greedy):
    ids = dp_llm.enqueue(PROMPTS, GREEDY)
    outs = dp_llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert_same_greedy(single_process_greedy("llama"),
                       [list(zip(o.outputs[0].token_ids, o.outputs[0].logprobs))
                        for o in outs])
    assert (dp_llm.get_world_size(), dp_llm.get_world_size(include_dp=False)) == (2, 1)
    metrics = dp_llm.get_metrics()
    queries = {m.labels["engine"]: m.value for m in metrics
               if m.name == "vllm:prefix_cache_queries"}
    assert queries == {"0": 6 + 4, "1": 21 + 40}
    by_source = {e: sum(m.value for m in metrics if m.name == "vllm:prompt_tokens_by_source"
                        and m.labels["engine"] == e) for e in ("0", "1")}
    assert by_source == queries  # each replica's prompts, computed or cached
    blocks = {m.labels["engine"]: m.labels["num_gpu_blocks"] for m in metrics
              if m.name == "vllm:cache_config_info"}
    assert blocks == {"0": "96", "1": "96"}
    running = {m.labels["engine"]: m.value for m in metrics
               if m.name == "vllm:num_requests_running"}
    assert running == {"0": 0.0, "1": 0.0}
    (generated,) = [m.value for m in metrics if m.name == "vllm:generation_tokens"]
    assert generated == 4 * GREEDY.max_tokens


def test_in_process_calls_are_refused(dp_llm):
    with pytest.raises(ValueError, match="apply_model.*data_parallel_size"):
        dp_llm.apply_model(lambda model: 0)
    with pytest.raises(ValueError, match="reset_mm_cache.*data_parallel_size"):
        dp_llm.reset_mm_cache()
