"""What the engine core reports after a step (pure data, msgspec-encodable).

``EngineCoreOutput`` carries one request's new tokens to the output processor (in-process for
``LLM``, over ZMQ for the server); ``EngineStats`` the scheduler and KV-cache state to the
metrics.
"""

from __future__ import annotations

import msgspec

from kvflow.runner_output import TokenLogprobs


class EngineCoreOutput(msgspec.Struct):
    """New tokens of one request after a step, and how it finished (if it did). A msgspec
    Struct (built in C: about half the construction time of a slotted dataclass, and the
    scheduler builds one per request per step; benchmarks/host_overhead.py).

    Attributes:
        new_token_ids: tokens appended this step (empty when the grammar cut the output).
        new_logprobs: one entry per new token when logprobs were asked for.
        finish_reason: "stop", "length" or "abort" once finished, else None.
        stop_reason: the stop token id (or string, set later by the output processor).
        num_cached_tokens: prompt tokens found in the prefix cache at first scheduling.
        prompt_logprobs: with the first token of a request that asked for them: one entry per
            prompt token (None for the first).
        num_draft_tokens / num_accepted_tokens: speculative decoding: draft tokens this step
            verified for the request and how many of them it accepted (0 / 0 without).
        pooling_output: an embedding request's pooled vector (with its finish).
        error: why the request could not run (with finish_reason "abort"; e.g. its grammar
            did not compile in time): the client's error, a 400 over HTTP. None otherwise.
        retry_after_s: with ``error``, when the server was too busy rather than the request
            bad (grammar compiles saturated): seconds after which a retry may succeed; the
            API answers 429 with ``Retry-After``. None otherwise.
        error_field: with ``error``, the part of the request at fault, as
            ``kvflow.core.request_errors.RequestError.field`` names it (``"lora_request"``,
            ``"structured_outputs"``, ...; the server names the matching request field);
            None when unknown.
        internal_error: with ``error``, the core failed on the request through no fault
            of it (an unexpected exception while queueing it): the server answers 500,
            ``AsyncLLM`` raises ``RequestFailed``; the engine serves on. False otherwise.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    pooling_output: list[float] | None = None
    error: str | None = None
    retry_after_s: float | None = None
    error_field: str | None = None
    internal_error: bool = False


class FinishedRequestStats(msgspec.Struct, array_like=True):
    """vLLM's phases of one request (sample) that finished in the engine (stop or length;
    not one the client aborted), on the engine core's clock (seconds).

    Attributes:
        queue_time_s: queued in the core -> first scheduled.
        prefill_time_s: first scheduled -> first token (preemptions included).
        decode_time_s: first token -> last token.
        inference_time_s: first scheduled -> last token.
        num_preemptions: times it was preempted.
        num_prefill_computed_tokens: prompt tokens computed (not prefix-cache hits).
    """

    queue_time_s: float
    prefill_time_s: float
    decode_time_s: float
    inference_time_s: float
    num_preemptions: int
    num_prefill_computed_tokens: int


class PromptTokenStats(msgspec.Struct, array_like=True):
    """Where one engine's prompt tokens came from, cumulative since start-up (tokens): vLLM
    0.32's ``prompt_tokens_by_source`` and ``external_prefix_cache_*`` counts.

    Attributes:
        local_compute / local_cache_hit / external_kv_transfer: the prompt tokens of the
            requests whose prefill completed (each request once, with its first token, as
            vLLM counts them), split as at its first admission: computed, found in the local
            prefix cache, loaded by the KV connector. The three sum to those prompts' tokens.
        external_queries / external_hits: with a KV connector (``--kv-transfer-config``),
            at each request's first admission: the tokens after its local prefix-cache hit
            (asked of the connector) / those the connector supplied.
    """

    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    external_queries: int = 0
    external_hits: int = 0


class EngineStats(msgspec.Struct):
    """Scheduler and KV-cache state after a step. Counters are cumulative since start-up.

    Attributes:
        num_running / num_waiting: requests (samples) in the running list / waiting queue.
        kv_cache_usage: fraction of usable KV blocks referenced by requests, in [0, 1].
        num_free_blocks / num_usable_blocks: KV blocks free now / all blocks but the null one.
        num_preemptions: requests preempted (recomputed later).
        prefix_cache_queries / prefix_cache_hits: tokens looked up / found in the prefix cache.
        weight_bytes: bytes the model's weights occupy (as stored: quantized, packed).
        kv_cache_bytes_per_token: KV-cache bytes one token occupies across all layers
            (scales included for a quantized cache).
        encoder_cache_queries / encoder_cache_hits: images whose embeddings a request needed
            / found already in the encoder cache (vision-language models).
        encoder_inputs: images run through the vision encoder.
        spec_decode_num_drafts / spec_decode_num_draft_tokens /
            spec_decode_num_accepted_tokens: speculative decoding: verification steps of a
            request that carried drafts, draft tokens verified, draft tokens accepted.
        spec_decode_num_accepted_tokens_per_pos: accepted drafts by position in their step
            (index 0 = the first draft token).
        step_time_predictions: steps whose duration the step-time model predicted before
            they ran (cumulative).
        step_time_abs_error_s / step_time_rel_error: the model's mean |predicted - measured|
            step time (seconds) and that error relative to the measured time, over its recent
            window.
        iteration_tokens: tokens of each step since the previous stats (vLLM's
            ``iteration_tokens_total``: generated tokens plus the computed prompt tokens of the
            requests whose prefill completed; ``Scheduler.iteration_tokens``), oldest first.
            Not cumulative: each step is in one stats message only.
        running_lora_adapters / waiting_lora_adapters: with LoRA enabled, the names of the
            adapters of the running / waiting requests, sorted, each once (empty without).
        finished_requests: the requests that finished since the previous stats
            (``Scheduler.take_finished_stats``), not cumulative.
        prompt_tokens: where the prompt tokens came from (cumulative; a copy of the
            scheduler's ``prompt_token_stats``).
        num_waiting_deferred: of ``num_waiting``, the requests admission passed over for a
            transient constraint (vLLM's ``deferred`` waiting reason: no free LoRA slot,
            grammar still compiling, a sampled token still out) and has not admitted since.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_usable_blocks: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    weight_bytes: int = 0
    kv_cache_bytes_per_token: int = 0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_inputs: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    step_time_predictions: int = 0
    step_time_abs_error_s: float = 0.0
    step_time_rel_error: float = 0.0
    iteration_tokens: list[int] = msgspec.field(default_factory=list)
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = msgspec.field(default_factory=list)
    prompt_tokens: PromptTokenStats = msgspec.field(default_factory=PromptTokenStats)
    num_waiting_deferred: int = 0
