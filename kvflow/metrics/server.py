"""Prometheus metrics of the server (``GET /metrics``), on a registry of their own.

Two sources feed them:

* per-request timings and lengths, observed in the API process as outputs arrive
  (``kvflow/metrics/request_stats.py``): TTFT, inter-token latency, time per output token (mean per
  sample), end-to-end latency, prompt and generation lengths, token counters and finished
  requests by ``finished_reason``. As in vLLM, where each of a request's ``n`` samples is a
  request of its own, all of them are per sample: a request with ``n=2`` has two TTFTs, its
  prompt counted twice in the prompt tokens, and two prompt and generation lengths (both
  observed when the sample finishes, so their counts match the finished samples);
* the engine core's scheduler and KV-cache state, reported with every output message
  (``ServerMetrics.record_engine_stats``): running/waiting requests (and the waiting ones by
  reason, vLLM's ``num_requests_waiting_by_reason``), KV usage and free blocks,
  weight bytes and KV bytes per token as gauges; preemptions and prefix-cache queries/hits (tokens) as counters;
  where the prompt tokens came from (vLLM's ``prompt_tokens_by_source``,
  ``prompt_tokens_cached``, ``..._cached_by_source`` and ``external_prefix_cache_*``,
  ``kvflow/metrics/prompt_sources.py``);
  the tokens of each engine step (vLLM's ``iteration_tokens_total`` histogram);
  the phases of each request the engine finishes (vLLM's queue / prefill / decode /
  inference times, preemptions and computed prompt tokens, histograms; a sample ended by a
  stop string too: the API stops it with ``AbortRequests(stopped=True)``, a client's abort is
  not one, as in vLLM);
  with LoRA enabled, the adapters running and waiting (vLLM's ``lora_requests_info``,
  ``kvflow/metrics/lora.py``);
  each replica's sleep state (vLLM's ``engine_sleep_state``, set by ``AsyncLLM``);
  speculative decoding's drafts, draft tokens and accepted tokens (in total and by position) as
  counters, and the acceptance rate and mean acceptance length since start-up as gauges
  (``kvflow/metrics/spec_decode.py``);
  the step-time model's mean absolute and relative error (gauges) and its predictions (counter);
* requests refused by admission control (``ServerMetrics.rejected``, counted by the API) and
  for overload (``ServerMetrics.overloaded``: ``--max-waiting-requests`` or
  ``--max-num-queued-reqs``, counted by the handler that refuses them; the latter also as
  vLLM's ``admission_rejections{reason="max_num_queued_reqs"}``);
* replicas lost while serving (``engine_cores_lost``, by replica and reason: failed, exited,
  unresponsive; counted by the output loop, ``kvflow/engine/output_loop.py``).

Names follow vLLM's with a ``kvflow:`` prefix; every series carries a ``model_name`` label,
and the engine-state series also an ``engine`` label: the data-parallel replica they describe
(``"0"`` with one replica; vLLM's convention, so ``sum by (model_name)`` aggregates the
replicas). The per-request series are observed in the API process over all replicas together.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvflow.engine_outputs import EngineStats
from kvflow.metrics.buckets import (
    DEFAULT_MAX_MODEL_LEN,
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    token_buckets,
)
from kvflow.metrics.cache_config import CacheConfigInfo
from kvflow.metrics.lora import LoraInfoMetrics
from kvflow.metrics.prompt_sources import PromptSourceMetrics
from kvflow.metrics.spec_decode import SpecDecodeMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "repetition")  # vLLM 0.32's four
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")  # vLLM 0.32's


class ServerMetrics:
    """All metric objects of one server.

    Args:
        model_name: value of the ``model_name`` label.
        max_model_len: the engine's context length (tokens): the last boundary of the
            prompt and generation length histograms (vLLM's); None: 50,000 until
            :meth:`set_max_model_len` gives it.
    """

    def __init__(self, model_name: str, max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._init_request_metrics()
        self._token_families: tuple[Histogram, ...] = ()
        self._token_buckets: tuple[int, ...] = ()
        self._init_token_histograms(max_model_len or DEFAULT_MAX_MODEL_LEN)
        self._init_engine_metrics()
        self.prompt_sources = PromptSourceMetrics(self.registry, model_name)
        self.cache_config_info = CacheConfigInfo(self.registry, model_name)  # set per replica
        self.lora_info: LoraInfoMetrics | None = None  # enable_lora_info makes it
        self._last_stats: dict[int, EngineStats] = {}  # per replica

    def _labelled(self, cls: type, name: str, doc: str, extra: tuple[str, ...] = (),
                  **kwargs) -> object:
        metric = cls(name, doc, ("model_name", *extra), registry=self.registry, **kwargs)
        return metric if extra else metric.labels(self.model_name)

    def _init_request_metrics(self) -> None:
        h = Histogram
        self.ttft = self._labelled(h, "kvflow:time_to_first_token_seconds",
                                   "Time to first token, per sample (s)",
                                   buckets=TTFT_BUCKETS)
        self.itl = self._labelled(h, "kvflow:inter_token_latency_seconds",
                                  "Time between consecutive output tokens (s)",
                                  buckets=ITL_BUCKETS)
        self.e2e = self._labelled(h, "kvflow:e2e_request_latency_seconds",
                                  "Arrival to last token (s)", buckets=REQUEST_LATENCY_BUCKETS)
        self.tpot = self._labelled(h, "kvflow:request_time_per_output_token_seconds",
                                   "Per finished sample of 2+ tokens: first to last token over "
                                   "the tokens after the first (s; the TPOT of "
                                   "--target-tpot-ms)", buckets=ITL_BUCKETS)
        self.prompt_tokens = self._labelled(Counter, "kvflow:prompt_tokens",
                                            "Prompt tokens of samples that started generating "
                                            "(a prompt once per sample)")
        self.params_n = self._labelled(h, "kvflow:request_params_n",
                                       "The n parameter per finished request",
                                       buckets=REQUEST_PARAMS_N_BUCKETS)
        self.generation_tokens = self._labelled(Counter, "kvflow:generation_tokens",
                                                "Generated tokens")
        self.request_success = self._labelled(Counter, "kvflow:request_success",
                                              "Finished samples by finish reason",
                                              extra=("finished_reason",))
        for reason in FINISH_REASONS:  # every series exists (at 0) from start-up
            self.request_success.labels(self.model_name, reason)

    def _init_phase_histograms(self) -> None:
        """vLLM's per-request phases, observed as the engine reports finished requests."""
        h, e = Histogram, ("engine",)
        self.queue_time, self.prefill_time, self.decode_time, self.inference_time = (
            self._labelled(h, f"kvflow:request_{phase}_time_seconds", doc, e,
                           buckets=REQUEST_LATENCY_BUCKETS) for phase, doc in (
                ("queue", "Queued in the engine until first scheduled (s)"),
                ("prefill", "First scheduled until the first token (s)"),
                ("decode", "First token until the last token (s)"),
                ("inference", "First scheduled until the last token (s)")))
        self.request_preemptions = self._labelled(
            h, "kvflow:request_num_preemptions", "Times a finished request was preempted", e,
            buckets=REQUEST_NUM_PREEMPTIONS_BUCKETS)

    def _init_token_histograms(self, max_model_len: int) -> None:
        """The prompt and generation length histograms, with vLLM's boundaries up to
        ``max_model_len`` (replacing the ones there were)."""
        for family in self._token_families:
            self.registry.unregister(family)
        buckets = token_buckets(max_model_len)
        per_sample, per_engine = ("model_name",), ("model_name", "engine")
        docs = (("kvflow:request_prompt_tokens", per_sample,
                 "Prompt length per finished sample (tokens)"),
                ("kvflow:request_generation_tokens", per_sample,
                 "Generated length per finished sample (tokens)"),
                ("kvflow:request_params_max_tokens", per_sample,
                 "The max_tokens parameter per finished sample that set it (tokens)"),
                ("kvflow:request_max_num_generation_tokens", per_sample,
                 "Per finished request: the longest of its samples (tokens)"),
                ("kvflow:request_prefill_kv_computed_tokens", per_engine,
                 ("Prompt tokens computed (not prefix-cache hits) per request finished in "
                  "the engine (tokens)")))
        families = tuple(Histogram(name, doc, labels, registry=self.registry, buckets=buckets)
                         for name, labels, doc in docs)
        self._token_families, self._token_buckets = families, buckets
        self.prompt_len, self.gen_len, self.params_max_tokens, \
            self.max_num_generation_tokens = (f.labels(self.model_name) for f in families[:4])
        self.prefill_kv_computed = families[4]

    def set_max_model_len(self, max_model_len: int) -> None:
        """The engine's context length (tokens), known once it started: the length
        histograms' boundaries go up to it, as vLLM's do. Call it before the first request
        (the histograms are made anew, without their observations, if it changes them)."""
        if token_buckets(max_model_len) != self._token_buckets:
            self._init_token_histograms(max_model_len)

    def enable_lora_info(self, max_loras: int) -> None:
        """LoRA serving is on (``--enable-lora``, ``max_loras`` adapters a step): export vLLM's
        ``lora_requests_info`` gauge, set by each engine report (``metrics/lora.py``)."""
        if self.lora_info is None:
            self.lora_info = LoraInfoMetrics(self.registry, self.model_name, max_loras)
        self.lora_info.max_loras = max_loras

    def _init_engine_metrics(self) -> None:
        """The per-replica series the engine core's reports set (``engine`` label), then the
        API's refusal counters; registered in this order, which ``/metrics`` keeps."""
        self._init_queue_gauges()
        self._init_kv_cache_gauges()
        self.iteration_tokens = self._labelled(
            Histogram, "kvflow:iteration_tokens_total",
            "Tokens per engine step: generated tokens plus the computed prompt tokens of the "
            "requests whose prefill completed in it (vLLM's)", ("engine",),
            buckets=ITERATION_TOKENS_BUCKETS)
        self._init_phase_histograms()
        self._init_cache_counters()
        self._init_step_time_metrics()
        self.sleep_state = self._labelled(
            Gauge, "kvflow:engine_sleep_state", "Engine sleep state (vLLM's): awake = 1 while "
            "awake; weights_offloaded = 1 asleep at level 1; discard_all = 1 asleep at level 2",
            ("engine", "sleep_state"))
        self._init_admission_metrics()
        self._init_engine_loss_metrics()
        self.spec_decode = SpecDecodeMetrics(self.registry, self.model_name)  # registered last

    def _init_queue_gauges(self) -> None:
        """The running and waiting samples of each replica (waiting also by reason)."""
        g, e = Gauge, ("engine",)
        self.num_running = self._labelled(g, "kvflow:num_requests_running",
                                          "Samples in the engine's running batch", e)
        self.num_waiting = self._labelled(g, "kvflow:num_requests_waiting",
                                          "Samples in the engine's waiting queue", e)
        self.num_waiting_by_reason = self._labelled(
            g, "kvflow:num_requests_waiting_by_reason", "Waiting samples by reason: capacity "
            "(waiting for room in the batch or the KV cache) or deferred (passed over for a "
            "transient constraint: no free LoRA slot, grammar compiling, a token still out); "
            "the two sum to num_requests_waiting", (*e, "reason"))

    def _init_kv_cache_gauges(self) -> None:
        """Each replica's KV-cache use (fraction, blocks) and sizes (bytes)."""
        g, e = Gauge, ("engine",)
        self.kv_usage = self._labelled(g, "kvflow:kv_cache_usage_perc",
                                       "Fraction of usable KV blocks in use (0-1)", e)
        self.kv_free_blocks = self._labelled(g, "kvflow:kv_cache_free_blocks",
                                             "KV blocks free (may still hold cached prefixes)",
                                             e)
        self.kv_usable_blocks = self._labelled(g, "kvflow:kv_cache_usable_blocks",
                                               "KV blocks the allocator manages", e)
        self.weight_bytes = self._labelled(g, "kvflow:model_weight_bytes",
                                           "Bytes of the model's weights as stored "
                                           "(quantized, packed)", e)
        self.kv_bytes_per_token = self._labelled(g, "kvflow:kv_cache_bytes_per_token",
                                                 "KV-cache bytes per token across all layers",
                                                 e)

    def _init_cache_counters(self) -> None:
        """Each replica's preemptions and its prefix-cache and encoder-cache counters."""
        c, e = Counter, ("engine",)
        self.preemptions = self._labelled(c, "kvflow:num_preemptions",
                                          "Requests preempted (recomputed or swapped out, "
                                          "resumed later)", e)
        self.prefix_queries = self._labelled(c, "kvflow:prefix_cache_queries",
                                             "Prompt tokens looked up in the prefix cache", e)
        self.prefix_hits = self._labelled(c, "kvflow:prefix_cache_hits",
                                          "Prompt tokens found in the prefix cache", e)
        self.encoder_queries = self._labelled(c, "kvflow:encoder_cache_queries",
                                              "Images whose embeddings a request needed "
                                              "(vision-language models)", e)
        self.encoder_hits = self._labelled(c, "kvflow:encoder_cache_hits",
                                           "Images found in the encoder cache (not encoded "
                                           "again)", e)
        self.encoder_inputs = self._labelled(c, "kvflow:encoder_inputs",
                                             "Images run through the vision encoder", e)

    def _init_step_time_metrics(self) -> None:
        """The scheduler's step-time model: its predictions (counter) and mean errors."""
        c, g, e = Counter, Gauge, ("engine",)
        self.step_time_predictions = self._labelled(
            c, "kvflow:step_time_model_predictions",
            "Steps whose duration the scheduler's step-time model predicted", e)
        self.step_time_abs_error = self._labelled(
            g, "kvflow:step_time_model_abs_error_seconds",
            "Mean |predicted - measured| step time over the model's recent window (s)", e)
        self.step_time_rel_error = self._labelled(
            g, "kvflow:step_time_model_rel_error",
            "Mean |predicted - measured| / measured step time over the recent window", e)

    def _init_admission_metrics(self) -> None:
        """Requests the API refused: admission control's (TTFT) and the queue limits'."""
        c = Counter
        self.rejected = self._labelled(c, "kvflow:requests_rejected",
                                       "Requests refused by admission control (503) because "
                                       "their predicted TTFT exceeded the target")
        self.overloaded = self._labelled(c, "kvflow:requests_overloaded",
                                         "Requests refused with 503 because "
                                         "--max-waiting-requests requests were waiting or "
                                         "--max-num-queued-reqs sequences were in flight")
        self.admission_rejections = self._labelled(
            c, "kvflow:admission_rejections", "Number of admission attempts rejected by a "
            "queue limit, by reason (vLLM's; max_num_queued_reqs: --max-num-queued-reqs; "
            "max_num_queued_tokens: kvflow has no such limit, always 0)", ("reason",))
        for reason in ADMISSION_REASONS:  # both series exist (at 0) from start-up, as vLLM's
            self.admission_rejections.labels(self.model_name, reason)

    def _init_engine_loss_metrics(self) -> None:
        """Engine-core replicas lost while serving, by reason."""
        c, e = Counter, ("engine",)
        self.engine_cores_lost = self._labelled(
            c, "kvflow:engine_cores_lost", "Engine-core replicas lost while serving, by "
            "reason: failed (reported a fatal error), exited (the process ended: killed, OOM), "
            "unresponsive (alive but sent no heartbeat and used no CPU for "
            "--engine-heartbeat-timeout seconds: "
            "stopped or frozen; it is killed); their open requests ended with an error",
            (*e, "reason"))

    def record_engine_stats(self, stats: EngineStats, engine_index: int = 0) -> None:
        """Set replica ``engine_index``'s gauges and advance its counters by what the core's
        totals grew."""
        engine = str(engine_index)
        for gauge, value in ((self.num_running, stats.num_running),
                             (self.num_waiting, stats.num_waiting),
                             (self.kv_usage, stats.kv_cache_usage),
                             (self.kv_free_blocks, stats.num_free_blocks),
                             (self.kv_usable_blocks, stats.num_usable_blocks),
                             (self.weight_bytes, stats.weight_bytes),
                             (self.kv_bytes_per_token, stats.kv_cache_bytes_per_token),
                             (self.step_time_abs_error, stats.step_time_abs_error_s),
                             (self.step_time_rel_error, stats.step_time_rel_error)):
            gauge.labels(self.model_name, engine).set(value)
        self._record_waiting_by_reason(engine, stats.num_waiting - stats.num_waiting_deferred,
                                       stats.num_waiting_deferred)
        steps = self.iteration_tokens.labels(self.model_name, engine)  # exists from the start
        for num_tokens in stats.iteration_tokens:
            steps.observe(num_tokens)
        self._record_finished(stats, engine)
        last = self._last_stats.get(engine_index, EngineStats())
        for counter, now, before in (
                (self.preemptions, stats.num_preemptions, last.num_preemptions),
                (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.encoder_queries, stats.encoder_cache_queries,
                 last.encoder_cache_queries),
                (self.encoder_hits, stats.encoder_cache_hits, last.encoder_cache_hits),
                (self.encoder_inputs, stats.encoder_inputs, last.encoder_inputs),
                (self.step_time_predictions, stats.step_time_predictions,
                 last.step_time_predictions)):
            series = counter.labels(self.model_name, engine)  # exists (at 0) from the start
            if now > before:
                series.inc(now - before)
        self.prompt_sources.record(stats, last, engine)
        if stats.spec_decode_num_drafts or stats.spec_decode_num_accepted_tokens_per_pos:
            # speculative decoding is on (a speculator reports every position from the start)
            self.spec_decode.record(stats, last, engine)
        if self.lora_info is not None:
            self.lora_info.record(stats)
        self._last_stats[engine_index] = stats

    def _record_waiting_by_reason(self, engine: str, capacity: int, deferred: int) -> None:
        for reason, value in (("capacity", capacity), ("deferred", deferred)):
            self.num_waiting_by_reason.labels(self.model_name, engine, reason).set(value)

    def record_admission_rejection(self, reason: str) -> None:
        """The API refused a request for a queue limit (503): ``reason`` is one of
        ``ADMISSION_REASONS`` (vLLM's ``admission_rejections``); also counted in
        ``requests_overloaded``."""
        self.admission_rejections.labels(self.model_name, reason).inc()
        self.overloaded.inc()

    def _record_finished(self, stats: EngineStats, engine: str) -> None:
        """The phases of the requests the engine reports finished (series exist from the
        replica's first report on)."""
        name = self.model_name
        times = [(h.labels(name, engine), field) for h, field in (
            (self.queue_time, "queue_time_s"), (self.prefill_time, "prefill_time_s"),
            (self.decode_time, "decode_time_s"), (self.inference_time, "inference_time_s"))]
        preemptions = self.request_preemptions.labels(name, engine)
        computed = self.prefill_kv_computed.labels(name, engine)
        for finished in stats.finished_requests:
            for series, field_name in times:
                series.observe(getattr(finished, field_name))
            preemptions.observe(finished.num_preemptions)
            computed.observe(finished.num_prefill_computed_tokens)

    def record_sleep_state(self, engine_index: int, level: int | None) -> None:
        """Replica ``engine_index`` is awake (``level`` None) or asleep at sleep ``level``
        (1: weights offloaded, 2: weights discarded): vLLM's three series of it, 0 or 1."""
        engine = str(engine_index)
        for state, value in (("awake", level is None), ("weights_offloaded", level == 1),
                             ("discard_all", level == 2)):
            self.sleep_state.labels(self.model_name, engine, state).set(int(value))

    def record_engine_lost(self, engine_index: int, reason: str) -> None:
        """Replica ``engine_index`` was lost while serving; ``reason``: "failed", "exited"
        or "unresponsive"."""
        self.engine_cores_lost.labels(self.model_name, str(engine_index), reason).inc()

    def reset_engine(self, engine_index: int) -> None:
        """Replica ``engine_index`` was replaced by a new core, whose totals start at zero:
        count its counters from there, and show its running and waiting requests as none."""
        self._last_stats.pop(engine_index, None)
        engine = str(engine_index)
        self.num_running.labels(self.model_name, engine).set(0)
        self.num_waiting.labels(self.model_name, engine).set(0)
        self._record_waiting_by_reason(engine, 0, 0)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
