"""What the model runner returns to the scheduler after a step (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field

# (top token ids, their logprobs, the sampled token's logprob, its rank)
TokenLogprobs = tuple[list[int], list[float], float, int]


@dataclass
class SampledToken:
    """One sampled token and, when asked for, its logprob info.

    Attributes:
        token_id: the sampled token.
        logprobs: log-softmax of the raw logits (before temperature) for the top-k tokens and
            the sampled one, when the request asked for logprobs; else None.
    """

    token_id: int
    logprobs: TokenLogprobs | None = None


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
class ModelRunnerOutput:
    """One step's results.

    Attributes:
        sampled: request id -> its sampled token, for the requests that sampled.
        prompt_logprobs: request id -> the prompt logprobs the step computed, for requests that
            asked for them.
    """

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
