"""What the model runner returns to the scheduler after a step (pure data, msgspec-encodable)."""

from __future__ import annotations

from dataclasses import dataclass, field

# (top token ids, their logprobs, the sampled token's logprob, its rank)
TokenLogprobs = tuple[list[int], list[float], float, int]


@dataclass
class PromptLogprobsChunk:
    """Logprobs of the prompt tokens whose predecessors one step computed.

    Attributes:
        start: prompt position of the first entry's token (>= 1: token 0 has no logprob).
        entries: one per consecutive prompt position from ``start``: the top-k tokens and the
            prompt token's own logprob and rank, from the raw log-softmax.
    """

    start: int
    entries: list[TokenLogprobs]


@dataclass
class RequestFailure:
    """Why the runner could not run one request of a step, through a fault of that request
    alone (its image, its LoRA adapter, its logits processor): the scheduler ends that
    request with this error and the step's other requests go on.

    Attributes:
        message: what failed, naming the part of the request (e.g. the image's index).
        field: the part of the request at fault, as ``kvflow.core.request_errors`` names it
            (``"multi_modal_data"``, ...); None when unknown.
        internal: the failure was an unexpected exception (not a ValueError): the server
            answers 500, ``AsyncLLM`` raises ``RequestFailed``; False: the request's own
            error (400, ``RequestRefused``).
    """

    message: str
    field: str | None = None
    internal: bool = False


@dataclass
class ModelRunnerOutput:
    """One step's results: the tokens it sampled, one entry per request that sampled (in
    batch order), and the prompt logprobs it computed.

    Attributes:
        req_ids: the requests that sampled.
        sampled_token_ids: per request, its new tokens: one, or with speculative decoding the
            accepted draft tokens followed by one token sampled by the target (the token
            replacing the first rejected draft, or the bonus token when all were accepted).
        logprobs: request id -> one entry per new token (log-softmax of the raw logits,
            before temperature: the top-k tokens and the sampled one), for the requests that
            asked for logprobs.
        prompt_logprobs: request id -> the prompt logprobs the step computed, for requests that
            asked for them.
        draft_time_s: wall time (seconds) the step spent proposing draft tokens with a draft
            model (speculative decoding; its step-cost model reads it), else 0.
        draft_pass_s: seconds of one steady draft-model pass (one or two tokens per drafting
            request) this step, else 0: the step-cost model's draft cost per pass.
        pooler_output: request id -> the pooled vector of an embedding request whose prompt
            the step finished.
        kv_load_failures: request id -> the storage key of the first of its blocks the KV
            connector could not load this step (``kv_load_failure_policy="recompute"``; on
            any rank): the scheduler recomputes it from there and drops its sampled tokens.
        failed: request id -> why the step failed for that request alone
            (``worker/request_failures.py``): the scheduler ends it with that error, drops
            its sampled tokens and keeps the K/V the step wrote for it out of the prefix
            cache.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    draft_time_s: float = 0.0
    draft_pass_s: float = 0.0
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    kv_load_failures: dict[str, str] = field(default_factory=dict)
    failed: dict[str, RequestFailure] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids and not self.prompt_logprobs and not self.pooler_output \
            and not self.kv_load_failures and not self.failed
