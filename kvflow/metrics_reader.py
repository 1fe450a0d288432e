"""A snapshot of a Prometheus registry as vLLM's ``vllm.v1.metrics.reader`` gives it
(``LLM.get_metrics``): one ``Counter``, ``Gauge``, ``Histogram`` or ``Vector`` per series.

The names are vLLM's where vLLM 0.32 has the metric (``VLLM_NAMES``): kvflow's ``kvflow:``
prefix (``/metrics``) becomes ``vllm:``, so a script that looks for
``vllm:num_requests_running`` or ``vllm:prompt_tokens`` finds it; kvflow's own metrics
(free and usable KV blocks, weight bytes, the step-time model, ...) keep ``kvflow:``. A
counter's name has no ``_total`` (vLLM's reader takes prometheus_client's name, which drops
it); its value is the ``_total`` sample, as an int.
``vllm:spec_decode_num_accepted_tokens_per_pos`` is one ``Vector`` per replica (its
``position`` label turned into the list index), as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

KVFLOW_PREFIX, VLLM_PREFIX = "kvflow:", "vllm:"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# vLLM 0.32's metric names (vllm/v1/metrics/loggers.py; counters without their _total): a
# kvflow metric of one of these names is reported as vLLM's
VLLM_NAMES = frozenset((
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason",
    "kv_cache_usage_perc", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
    "external_prefix_cache_queries", "external_prefix_cache_hits", "mm_cache_queries",
    "mm_cache_hits", "prompt_tokens", "prompt_tokens_by_source", "prompt_tokens_cached",
    "prompt_tokens_cached_by_source", "generation_tokens", "iteration_tokens_total",
    "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_time_per_output_token_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_inference_time_seconds",
    "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
    "request_params_n", "request_params_max_tokens", "request_num_preemptions",
    "request_prefill_kv_computed_tokens", "lora_requests_info", "engine_sleep_state",
    "cache_config_info", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
    "kv_block_reuse_gap_seconds", "corrupted_requests", "admission_rejections",
    "watermark_requests", "num_requests_kv_fetch_by_stage"))


@dataclass
class Metric:
    """One series: its vLLM name and labels (``model_name``, ``engine``, ...)."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """Integer counters by position (speculative decoding's accepted tokens per position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations by bucket: ``buckets`` maps each upper bound (``le``, as Prometheus
    writes it, ``"+Inf"`` included) to the cumulative count; ``count`` and ``sum`` are of
    every observation."""

    count: int
    sum: float
    buckets: dict[str, int]


def vllm_name(name: str) -> str:
    """``kvflow:x`` as vLLM names it (``vllm:x``) where ``x`` is one of ``VLLM_NAMES``;
    another name unchanged."""
    base = name[len(KVFLOW_PREFIX):] if name.startswith(KVFLOW_PREFIX) else None
    return VLLM_PREFIX + base if base in VLLM_NAMES else name


def metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``vllm:`` and ``kvflow:`` series of ``registry`` (names by :func:`vllm_name`), as
    vLLM's ``get_metrics_snapshot`` reads its own registry.

    Raises:
        ValueError: for a metric type other than counter, gauge and histogram.
    """
    collected: list[Metric] = []
    for family in registry.collect():
        name = vllm_name(family.name)
        if not name.startswith((VLLM_PREFIX, KVFLOW_PREFIX)):
            continue
        if family.type == "gauge":
            collected += [Gauge(name, dict(s.labels), s.value) for s in _samples(family, "")]
        elif family.type == "counter":
            samples = _samples(family, "_total")
            if name == PER_POSITION:
                collected += _vectors(name, samples)
            else:
                collected += [Counter(name, dict(s.labels), int(s.value)) for s in samples]
        elif family.type == "histogram":
            collected += _histograms(name, family)
        else:
            raise ValueError(f"metric {family.name}: type {family.type!r} is not read")
    return collected


def _samples(family: Any, suffix: str) -> list[Any]:
    return [s for s in family.samples if s.name == family.name + suffix]


def _key(labels: dict[str, str], without: str | None = None) -> frozenset[tuple[str, str]]:
    return frozenset((k, v) for k, v in labels.items() if k != without)


def _histograms(name: str, family: Any) -> list[Histogram]:
    """One Histogram per label set of ``family`` (its ``le`` label becomes a bucket key)."""
    buckets: dict[frozenset, dict[str, int]] = {}
    for s in _samples(family, "_bucket"):
        buckets.setdefault(_key(s.labels, "le"), {})[s.labels["le"]] = int(s.value)
    counts = {_key(s.labels): int(s.value) for s in _samples(family, "_count")}
    sums = {_key(s.labels): s.value for s in _samples(family, "_sum")}
    return [Histogram(name, dict(key), counts[key], sums[key], by_le)
            for key, by_le in buckets.items()]


def _vectors(name: str, samples: list[Any]) -> list[Vector]:
    """One Vector per label set other than ``position``, indexed by position (0 where a
    position has no series)."""
    by_key: dict[frozenset, dict[int, int]] = {}
    for s in samples:
        by_key.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = \
            int(s.value)
    size = 1 + max((p for values in by_key.values() for p in values), default=0)
    return [Vector(name, dict(key), [values.get(p, 0) for p in range(size)])
            for key, values in by_key.items()]
