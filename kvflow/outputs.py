"""User-facing results of a generation (the shape of vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log-probability (natural log) of one token, and its rank in the distribution (1 = top)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample index in [0, n).
        text: generated text (stop string cut unless asked otherwise).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs, when logprobs were requested.
        logprobs: per generated token, {token_id: Logprob} with the top-k and the sampled token.
        finish_reason: "stop" (EOS, stop token or stop string), "length" or "abort"; None while
            running.
        stop_reason: the stop string or stop token id that ended the sample, else None.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (seconds, time.monotonic) and derived latencies of one request, and its
    speculative-decoding counts (summed over its ``n`` samples; zeros without speculation).

    Attributes:
        num_drafts: verification steps that carried draft tokens.
        num_draft_tokens / num_accepted_tokens: draft tokens verified / accepted.
        num_cached_tokens: prompt tokens found in the prefix cache when the request was
            first scheduled (whole blocks, at most the prompt's length less one; for ``n``
            samples, the first output's sample); 0 before its first output.
    """

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (vLLM's draft acceptance rate), or None."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens produced per verification step, the target's own token included
        (``1 + accepted / drafts``), or None without drafts."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to last token (seconds)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class EmbeddingOutput:
    """The pooled vector of one prompt (float32 values; empty when the request was aborted).

    Attributes:
        embedding: ``hidden_size`` values (or ``dimensions``), L2-normalized when the model
            normalizes.
    """

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request (vLLM's ``EmbeddingRequestOutput`` shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool
    metrics: RequestMetrics


@dataclass
class PoolingOutput:
    """A pooling model's output for one prompt (vLLM's ``PoolingOutput``).

    Attributes:
        data: a float32 torch tensor [n]: the embedding (``hidden_size`` or ``dimensions``
            values) or the class probabilities (``num_labels``), as ``LLM.embed`` /
            ``LLM.classify`` give them as lists.
    """

    data: Any


@dataclass
class PoolingRequestOutput:
    """The result of one ``LLM.encode`` prompt (vLLM's ``PoolingRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    metrics: RequestMetrics


@dataclass
class ScoringOutput:
    """A cross-encoder's score of one text pair.

    Attributes:
        score: the logit after the model's activation (sentence-transformers'
            ``CrossEncoder.predict``: sigmoid for a one-label model, so in (0, 1)); for a
            model with ``num_labels`` > 1, the list of its ``num_labels`` values (no
            activation unless the model's config names one).
    """

    score: float | list[float]


@dataclass
class ScoringRequestOutput:
    """The result of one scored pair (vLLM's ``ScoringRequestOutput`` shape); the prompt is
    the pair's token ids (``prompt_token_ids``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool
    metrics: RequestMetrics


@dataclass
class ClassificationOutput:
    """A sequence classifier's class probabilities for one prompt.

    Attributes:
        probs: ``num_labels`` values, the softmax of the classification head's logits
            (float32 arithmetic; they sum to 1), in class-index order (``config.id2label``);
            for a one-label classifier, the sigmoid of its logit (vLLM's rule).
    """

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many classes the model tells apart (``len(probs)``)."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """The result of one classified prompt (vLLM's ``ClassificationRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool
    metrics: RequestMetrics


@dataclass
class RequestOutput:
    """All samples of one prompt.

    Attributes:
        prompt_logprobs: when ``SamplingParams.prompt_logprobs`` was set: per prompt token,
            {token_id: Logprob} with the prompt token and the top-k (None for the first
            token, which has no context); in delta mode only in the output that first has them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (``metrics.num_cached_tokens``), where
        vLLM's ``RequestOutput`` has them."""
        return self.metrics.num_cached_tokens


def token_rows(values: list[float], num_prompt_tokens: int) -> Any:
    """A per-token request's flattened output (``PoolingState._per_token``: row-major, the
    engine's outputs carry ``list[float]``) as a float32 torch tensor [num_prompt_tokens, D].

    Raises:
        ValueError: if ``len(values)`` is not a multiple of ``num_prompt_tokens``.
    """
    if num_prompt_tokens < 1 or len(values) % num_prompt_tokens:
        raise ValueError(f"{len(values)} per-token values do not split into "
                         f"{num_prompt_tokens} rows")
    import torch

    return torch.tensor(values, dtype=torch.float32).view(num_prompt_tokens, -1)
