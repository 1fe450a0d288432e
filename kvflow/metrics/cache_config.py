"""vLLM 0.32's ``cache_config_info`` gauge (``/metrics``: ``kvflow:cache_config_info``): an
info metric, one series per replica set to 1, whose labels are the KV cache's settings as
vLLM's ``CacheConfig.metrics_info()`` names and writes them (``str(value)``), plus
``engine``. kvflow adds its ``model_name`` label, as on every series.

Only vLLM's labels kvflow has a value for are exported: ``block_size``, ``cache_dtype``,
``enable_prefix_caching`` (as the engine resolved it), ``prefix_caching_hash_algo``,
``num_gpu_blocks`` (the KV pool's blocks, the null block included, as vLLM counts them, on a
CPU engine too), ``num_gpu_blocks_override`` (``--num-kv-blocks``) and
``kv_cache_memory_bytes`` (``--kv-cache-memory``, in bytes); ``"None"`` where unset, as
vLLM writes it. vLLM's others (``gpu_memory_utilization``, ``swap_space``, ``sliding_window``,
the Mamba and KV-offloading settings, ...) have no kvflow counterpart or no single value here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvflow.config import CacheConfig
from kvflow.config.options import parse_bytes


def cache_config_labels(cache_config: CacheConfig, num_blocks: int,
                        enable_prefix_caching: bool) -> dict[str, str]:
    """The labels of one replica's series.

    Args:
        cache_config: the engine's ``CacheConfig`` (as given).
        num_blocks: the KV pool's blocks (``EngineReady.num_blocks``).
        enable_prefix_caching: whether the engine reuses prefixes (its resolution of
            ``cache_config.enable_prefix_caching``, None there meaning "where it can").
    """
    memory = cache_config.kv_cache_memory
    return {"block_size": str(cache_config.block_size),
            "cache_dtype": cache_config.kv_cache_dtype,
            "enable_prefix_caching": str(enable_prefix_caching),
            "prefix_caching_hash_algo": cache_config.prefix_caching_hash_algo,
            "num_gpu_blocks": str(num_blocks),
            "num_gpu_blocks_override": str(cache_config.num_kv_blocks),
            "kv_cache_memory_bytes": str(None if memory is None else parse_bytes(memory))}


class CacheConfigInfo:
    """The gauge, made on ``registry`` with the first replica's labels.

    Args:
        registry: the server's registry.
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name
        self.gauge: Gauge | None = None
        self._series: dict[int, tuple[str, ...]] = {}  # replica -> its label values

    def set(self, engine_index: int, cache_config: CacheConfig, num_blocks: int,
            enable_prefix_caching: bool) -> None:
        """Replica ``engine_index`` is ready, with these settings (see
        :func:`cache_config_labels`): its series, replacing the one it had (a replaced core
        may have another pool size)."""
        labels = cache_config_labels(cache_config, num_blocks, enable_prefix_caching)
        if self.gauge is None:
            self.gauge = Gauge("kvflow:cache_config_info",
                               "Information of the LLMEngine CacheConfig",
                               ("model_name", *labels, "engine"), registry=self.registry)
        values = (self.model_name, *labels.values(), str(engine_index))
        old = self._series.get(engine_index)
        if old is not None and old != values:
            self.gauge.remove(*old)
        self.gauge.labels(*values).set(1)
        self._series[engine_index] = values
