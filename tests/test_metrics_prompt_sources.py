"""vLLM 0.32's prompt-token sources in ``LLM.get_metrics()`` (the server's /metrics ones,
``kvflow/metrics/prompt_sources.py``) on the tiny Llama, block size 4, hand-counted:

- a prompt of 14 tokens, then the same prompt again: the second finds its first
  ``(14 - 1) // 4 = 3`` blocks (12 tokens; never the last token) in the prefix cache. By
  source: computed 14 + 2, local cache hits 12, none loaded; cached 12, all ``device`` (=
  ``prefix_cache_hits``); the three sources sum to ``prompt_tokens`` (28);
- with SharedStorageConnector (``kv_transfer_config``): a producer stores the prompt's 3
  whole blocks, a fresh consumer loads them (12 tokens ``external_kv_transfer``, queried 14,
  hit 12, ``external_unspecified``); run again, the consumer's own prefix cache has them
  (12 ``local_cache_hit``, ``device``) and the connector is asked for the 2 tokens after
  them and supplies none.
"""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.metrics_reader import Counter, Metric

BLOCK_SIZE = 4
PROMPT = list(range(100, 114))  # 14 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def counters(metrics: list[Metric]) -> dict[tuple[str, str], int]:
    """Every counter of replica 0 (and the model-wide ones) by (name, its source or reason
    label, "" without)."""
    return {(m.name, m.labels.get("source", m.labels.get("reason", ""))): m.value
            for m in metrics if isinstance(m, Counter) and m.labels.get("engine", "0") == "0"}


def sources(c: dict[tuple[str, str], int]) -> tuple[int, int, int]:
    return tuple(c["vllm:prompt_tokens_by_source", s]
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))


def cached_by_tier(c: dict[tuple[str, str], int]) -> dict[str, int]:
    return {s: c["vllm:prompt_tokens_cached_by_source", s]
            for s in ("device", "host", "p2p", "disk", "external_unspecified")}


def _llm(tiny, **kwargs) -> LLM:
    return LLM(model=tiny.path, dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE,
               disable_log_stats=False, **kwargs)


def test_a_prefix_cache_hit_counts_as_cached_local_tokens(tiny_llama):
    llm = _llm(tiny_llama)
    c = counters(llm.get_metrics())  # every series exists from start-up, at 0
    assert sources(c) == (0, 0, 0) and c["vllm:prompt_tokens_cached", ""] == 0
    assert set(cached_by_tier(c).values()) == {0}
    assert c["vllm:external_prefix_cache_queries", ""] == 0  # no connector
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    llm.generate([PROMPT], GREEDY, use_tqdm=False)  # its first 3 blocks cached
    c = counters(llm.get_metrics())
    assert sources(c) == (14 + 2, 12, 0)
    assert sum(sources(c)) == c["vllm:prompt_tokens", ""] == 28
    assert c["vllm:prompt_tokens_cached", ""] == 12 == c["vllm:prefix_cache_hits", ""]
    assert cached_by_tier(c) == {"device": 12, "host": 0, "p2p": 0, "disk": 0,
                                 "external_unspecified": 0}
    assert (c["vllm:external_prefix_cache_queries", ""],
            c["vllm:external_prefix_cache_hits", ""]) == (0, 0)


@pytest.fixture
def storage(tmp_path):
    return {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}


def test_blocks_a_kv_connector_loads_count_as_external(tiny_llama, storage):
    producer = _llm(tiny_llama, kv_transfer_config=storage)
    producer.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    c = counters(producer.get_metrics())  # nothing stored yet when it looked
    assert (c["vllm:external_prefix_cache_queries", ""],
            c["vllm:external_prefix_cache_hits", ""]) == (14, 0)
    consumer = _llm(tiny_llama, kv_transfer_config=storage)
    consumer.generate([PROMPT], GREEDY, use_tqdm=False)  # 12 tokens loaded
    c = counters(consumer.get_metrics())
    assert sources(c) == (2, 0, 12)
    assert c["vllm:prompt_tokens_cached", ""] == 12
    assert (c["vllm:external_prefix_cache_queries", ""],
            c["vllm:external_prefix_cache_hits", ""]) == (14, 12)
    assert cached_by_tier(c) == {"device": 0, "host": 0, "p2p": 0, "disk": 0,
                                 "external_unspecified": 12}
    consumer.generate([PROMPT], GREEDY, use_tqdm=False)  # now in its own prefix cache
    c = counters(consumer.get_metrics())
    assert sources(c) == (2 + 2, 12, 12)
    assert sum(sources(c)) == c["vllm:prompt_tokens", ""] == 28
    assert c["vllm:prompt_tokens_cached", ""] == 24
    assert (c["vllm:external_prefix_cache_queries", ""],
            c["vllm:external_prefix_cache_hits", ""]) == (14 + 2, 12)
    assert cached_by_tier(c)["device"] == 12 == c["vllm:prefix_cache_hits", ""]
    assert cached_by_tier(c)["external_unspecified"] == 12
