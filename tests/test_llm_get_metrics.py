"""vLLM 0.32's ``LLM.get_metrics()`` (``LLM(disable_log_stats=False)``) on the tiny Llama, the
values hand-computed from a controlled workload:

- request A: 5 prompt tokens, greedy, 3 tokens; request B: 7 prompt tokens, n=2, 4 tokens each.
  Prompt tokens 5 + 7 + 7 = 19 (per sample, vLLM's rule and the server's), generated
  3 + 4 + 4 = 11, three samples finished by ``length``; inter-token latencies 11 - 3 = 8;
  TTFT, e2e, prompt and generation length per sample (3; sums 19 and 11);
- prefix cache (block size 4): queries 5 + 7 + 7 = 19 prompt tokens, B's second sample hits
  B's one full block: 4 (vLLM's prompt tokens by source: 15 computed, 4 local hits, 4 cached);
- idle after the call: nothing running or waiting, no KV block in use;
- a second call adds to the counters; a request aborted (its caller raised) counts once as
  ``abort``.

Names and classes are vLLM's reader's (``vllm:`` prefix, counters without ``_total``) for the
metrics vLLM 0.32 has; kvflow's own keep ``kvflow:`` (idle: every usable KV block free).
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.metrics_reader import Counter, Gauge, Histogram, Metric

A = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
B = SamplingParams(temperature=0.5, n=2, max_tokens=4, ignore_eos=True, seed=1)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


def find(metrics: list[Metric], name: str, **labels: str) -> Metric:
    (metric,) = [m for m in metrics if m.name == name and labels.items() <= m.labels.items()]
    return metric


@pytest.fixture
def llm(tiny_llama):
    return LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
               disable_log_stats=False)


def test_counts_of_a_known_workload(llm, tiny_llama):
    llm.generate(PROMPTS, [A, B], use_tqdm=False)
    metrics = llm.get_metrics()
    assert all(m.labels["model_name"] == tiny_llama.path for m in metrics)
    names = {m.name for m in metrics}
    assert {"vllm:num_requests_running", "vllm:prompt_tokens", "vllm:request_success",
            "vllm:e2e_request_latency_seconds"} <= names
    # kvflow's own metrics (vLLM 0.32 has none of these names) keep their prefix
    assert {"kvflow:kv_cache_free_blocks", "kvflow:model_weight_bytes"} <= names
    assert not {"vllm:kv_cache_free_blocks", "vllm:model_weight_bytes"} & names
    free = find(metrics, "kvflow:kv_cache_free_blocks", engine="0").value
    assert free == find(metrics, "kvflow:kv_cache_usable_blocks", engine="0").value > 0  # idle
    counters = {m.name: m.value for m in metrics if isinstance(m, Counter)
                and "finished_reason" not in m.labels}
    assert (counters["vllm:prompt_tokens"], counters["vllm:generation_tokens"]) == (19, 11)
    assert (counters["vllm:prefix_cache_queries"], counters["vllm:prefix_cache_hits"]) == (19, 4)
    assert counters["vllm:num_preemptions"] == 0
    # per sample too: B's second sample's prompt is 4 cached + 3 computed tokens
    by_source = {m.labels["source"]: m.value for m in metrics
                 if m.name == "vllm:prompt_tokens_by_source"}
    assert by_source == {"local_compute": 19 - 4, "local_cache_hit": 4, "external_kv_transfer": 0}
    assert find(metrics, "vllm:prompt_tokens_cached").value == 4
    success = {m.labels["finished_reason"]: m.value for m in metrics
               if m.name == "vllm:request_success"}
    assert success == {"stop": 0, "length": 3, "abort": 0, "repetition": 0}
    for name, count, total in (("vllm:time_to_first_token_seconds", 3, None),
                               ("vllm:inter_token_latency_seconds", 8, None),
                               ("vllm:e2e_request_latency_seconds", 3, None),
                               ("vllm:request_prompt_tokens", 3, 19.0),
                               ("vllm:request_generation_tokens", 3, 11.0)):
        hist = find(metrics, name)
        assert isinstance(hist, Histogram) and hist.count == count == hist.buckets["+Inf"]
        assert total is None or hist.sum == total
    max_tokens = find(metrics, "vllm:request_params_max_tokens")  # per sample
    assert (max_tokens.count, max_tokens.sum) == (3, 3.0 + 4 + 4)
    assert find(metrics, "vllm:request_params_n").sum == 1 + 2  # per request
    assert find(metrics, "vllm:request_generation_tokens").buckets["2.0"] == 0
    assert find(metrics, "vllm:request_generation_tokens").buckets["5.0"] == 3
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        gauge = find(metrics, name, engine="0")
        assert isinstance(gauge, Gauge) and gauge.value == 0.0


def test_counters_add_up_and_an_abort_counts_once(llm):
    llm.generate(PROMPTS[0], A, use_tqdm=False)
    llm.generate(PROMPTS[0], A, use_tqdm=False)

    def stop(i, out):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1], A, use_tqdm=False, on_output=stop)
    metrics = llm.get_metrics()
    assert find(metrics, "vllm:prompt_tokens").value == 5 + 5 + 7
    assert find(metrics, "vllm:generation_tokens").value == 3 + 3 + 1
    success = {m.labels["finished_reason"]: m.value for m in metrics
               if m.name == "vllm:request_success"}
    assert success == {"stop": 0, "length": 2, "abort": 1, "repetition": 0}
    assert find(metrics, "vllm:prefix_cache_hits").value == 4  # the second run's full block
    assert find(metrics, "vllm:num_requests_running").value == 0


def test_enqueued_requests_are_counted(llm):
    llm.enqueue(PROMPTS, [A, B])
    llm.wait_for_completion(use_tqdm=False)
    assert find(llm.get_metrics(), "vllm:generation_tokens").value == 11


def test_refused_without_the_flag(tiny_llama):
    llm = LLM(model=tiny_llama.path, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"disable_log_stats=False"):
        llm.get_metrics()
