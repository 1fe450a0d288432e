"""vLLM 0.32's ``cache_config_info`` (``kvflow:cache_config_info`` on /metrics,
``vllm:cache_config_info`` in ``LLM.get_metrics()``): one series per replica, value 1, its
labels the KV cache's settings under vLLM's ``CacheConfig`` names, written as vLLM writes them
(``str(value)``; ``"None"`` unset); the engine's own resolution of prefix caching and its pool
size. Oracles: the arguments given, and the pool's usable blocks (+ the null block)."""

from __future__ import annotations

from kvflow import LLM
from kvflow.config import CacheConfig
from kvflow.metrics.server import ServerMetrics
from kvflow.metrics_reader import Gauge, Metric


def info(metrics: list[Metric]) -> dict[str, str]:
    (series,) = [m for m in metrics if m.name == "vllm:cache_config_info"]
    assert isinstance(series, Gauge) and series.value == 1
    return series.labels


def test_labels_of_an_offline_engine(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64, block_size=4,
              disable_log_stats=False)
    assert info(llm.get_metrics()) == {
        "model_name": tiny_llama.path, "engine": "0", "block_size": "4", "cache_dtype": "auto",
        "enable_prefix_caching": "True", "prefix_caching_hash_algo": "blake2b",
        "num_gpu_blocks": "64", "num_gpu_blocks_override": "64",
        "kv_cache_memory_bytes": "None"}


def test_a_memory_sized_pool_without_prefix_caching(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", kv_cache_memory="1MiB", block_size=8,
              enable_prefix_caching=False, prefix_caching_hash_algo="sha256",
              disable_log_stats=False)
    metrics = llm.get_metrics()
    labels = info(metrics)
    (usable,) = [m.value for m in metrics if m.name == "kvflow:kv_cache_usable_blocks"]
    assert labels["num_gpu_blocks"] == str(int(usable) + 1)  # the null block too, as vLLM's
    assert (labels["kv_cache_memory_bytes"], labels["num_gpu_blocks_override"]) == \
        (str(2**20), "None")
    assert (labels["block_size"], labels["enable_prefix_caching"],
            labels["prefix_caching_hash_algo"]) == ("8", "False", "sha256")


def test_a_replaced_replica_keeps_one_series():
    metrics = ServerMetrics("m")
    config = CacheConfig(block_size=16, kv_cache_dtype="fp8")
    metrics.cache_config_info.set(0, config, 100, True)
    metrics.cache_config_info.set(1, config, 100, True)
    metrics.cache_config_info.set(0, config, 90, True)  # a new core sized its pool anew
    series = sorted((s.labels["engine"], s.labels["num_gpu_blocks"], s.labels["cache_dtype"],
                     s.value) for family in metrics.registry.collect()
                    if family.name == "kvflow:cache_config_info" for s in family.samples)
    assert series == [("0", "90", "fp8_e4m3", 1.0), ("1", "100", "fp8_e4m3", 1.0)]
