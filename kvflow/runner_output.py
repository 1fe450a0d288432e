"""What the model runner returns to the scheduler after a step (pure data)."""

from __future__ import annotations

from dataclasses import dataclass

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
