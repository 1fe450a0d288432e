"""Where each replica's prompt tokens came from, as vLLM 0.32 exports it (``/metrics``,
counters in tokens, labels ``model_name`` and ``engine``, names with kvflow's ``kvflow:``
prefix; ``vllm/v1/metrics/loggers.py``):

* ``prompt_tokens_by_source`` (label ``source``): the prompt tokens of the requests whose
  prefill completed, ``local_compute`` (computed), ``local_cache_hit`` (the local prefix
  cache) or ``external_kv_transfer`` (loaded by the KV connector, ``--kv-transfer-config``);
* ``prompt_tokens_cached``: of those, the cached ones (local + external);
* ``prompt_tokens_cached_by_source`` (label ``source``): prefix-cache hit tokens by the tier
  that supplied them, counted at admission: ``device`` (the engine's own KV cache, the
  ``prefix_cache_hits``), ``external_unspecified`` (the KV connector's; kvflow's
  SharedStorageConnector names no tier, as vLLM's example connector names none), and
  ``host``, ``disk`` and ``p2p`` at 0 (kvflow has no connector of those tiers);
* ``external_prefix_cache_queries`` / ``external_prefix_cache_hits``: with a KV connector,
  the tokens after each first admission's local hit (asked of it) and those it supplied.

Every series exists (at 0) from the replica's first report on, as vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from kvflow.engine_outputs import EngineStats

# vLLM's PromptTokenStats.ALL_SOURCES and CacheHitSource values, in vLLM's order
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


class PromptSourceMetrics:
    """The counters above on ``registry``, advanced from each replica's ``EngineStats``.

    Args:
        registry: the server's registry.
        model_name: value of the ``model_name`` label.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        per_engine, by_source = ("model_name", "engine"), ("model_name", "engine", "source")
        self.by_source = Counter("kvflow:prompt_tokens_by_source",
                                 "Number of prompt tokens by source.", by_source,
                                 registry=registry)
        self.cached = Counter("kvflow:prompt_tokens_cached",
                              "Number of cached prompt tokens (local + external).",
                              per_engine, registry=registry)
        self.cached_by_source = Counter(
            "kvflow:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (the "
            "engine's KV cache), host, disk, p2p or external_unspecified (the KV connector's). "
            "Counted at admission; sums to prefix_cache_hits + external_prefix_cache_hits.",
            by_source, registry=registry)
        self.external_queries = Counter(
            "kvflow:external_prefix_cache_queries",
            "External prefix cache queries from the KV connector, in terms of number of "
            "queried tokens.", per_engine, registry=registry)
        self.external_hits = Counter(
            "kvflow:external_prefix_cache_hits",
            "External prefix cache hits from the KV connector, in terms of number of cached "
            "tokens.", per_engine, registry=registry)

    def record(self, now: EngineStats, before: EngineStats, engine: str) -> None:
        """Advance replica ``engine``'s counters by what its cumulative counts grew from
        ``before`` to ``now`` (a replaced core's ``before`` is a fresh ``EngineStats``)."""
        name, p, q = self.model_name, now.prompt_tokens, before.prompt_tokens
        grown = [
            (self.by_source.labels(name, engine, "local_compute"),
             p.local_compute - q.local_compute),
            (self.by_source.labels(name, engine, "local_cache_hit"),
             p.local_cache_hit - q.local_cache_hit),
            (self.by_source.labels(name, engine, "external_kv_transfer"),
             p.external_kv_transfer - q.external_kv_transfer),
            (self.cached.labels(name, engine),
             p.local_cache_hit + p.external_kv_transfer
             - q.local_cache_hit - q.external_kv_transfer),
            (self.cached_by_source.labels(name, engine, "device"),
             now.prefix_cache_hits - before.prefix_cache_hits),
            (self.cached_by_source.labels(name, engine, "external_unspecified"),
             p.external_hits - q.external_hits),
            (self.external_queries.labels(name, engine),
             p.external_queries - q.external_queries),
            (self.external_hits.labels(name, engine), p.external_hits - q.external_hits)]
        for source in ("host", "p2p", "disk"):  # no connector of these tiers: always 0
            self.cached_by_source.labels(name, engine, source)
        for series, delta in grown:
            if delta > 0:
                series.inc(delta)
