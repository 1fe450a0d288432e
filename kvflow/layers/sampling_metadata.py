"""What the sampler reads for a batch besides the logits (``SamplingMetadata``, with its
``PenaltyMetadata``): built by the worker (``worker/sampling_inputs.py``) each step, read by
``layers/sampler.py`` and speculative decoding's verification."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PenaltyMetadata:
    """Penalty settings for the R rows of a batch that use any penalty.

    Attributes:
        rows: int64 [R], the batch rows concerned.
        prompt_token_ids / output_token_ids: int64 [R, L], each row's prompt / generated ids,
            right-padded with -1.
        presence / frequency / repetition: float32 [R] (0, 0 and 1 disable each).
    """

    rows: torch.Tensor
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor

    @classmethod
    def build(cls, rows: list[int], prompts: list[list[int]], outputs: list[list[int]],
              params: list, device: torch.device) -> PenaltyMetadata:
        """Pack per-row token lists and SamplingParams (one per row) into tensors."""
        def floats(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                                device=device)

        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   _pad(prompts, device), _pad(outputs, device),
                   floats("presence_penalty"), floats("frequency_penalty"),
                   floats("repetition_penalty"))


def _pad(token_lists: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(1, max(len(t) for t in token_lists))
    out = torch.full((len(token_lists), width), -1, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        out[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return out.to(device)


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step (row = one request that samples).

    Attributes:
        temperature: float32 [B]; 0 = greedy.
        top_k: int64 [B] (0 = off) or None when no row uses it; likewise top_p, min_p (float32).
        seeded: row -> (seed, output position: tokens the request generated before this
            one) for seeded random rows (``layers/seeded_noise.py``).
        banned_token_ids: row -> token ids masked this step (EOS/stop ids during min_tokens).
        num_logprobs: row -> number of top logprobs requested.
        logprob_token_ids: row -> the token ids whose logprobs it reports in place of its
            top ones (``SamplingParams.logprob_token_ids``; its ``num_logprobs`` is their
            count).
        penalties: presence / frequency / repetition penalties of the rows that use them.
        logit_bias: (rows int64 [K], token ids int64 [K], biases float32 [K]) for every
            (row, token) pair with a bias, or None.
        allowed_token_ids: (rows int64 [R], positions int64 [K] in ``rows``, token ids int64
            [K]): each of the R rows may sample only its listed tokens; None: no row limited.
        forced_token_ids: row -> the one token it must take (a thinking budget's end
            marker, ``kvflow.thinking_budget``): every other logit is -inf, after every other
            setting (vLLM forces it after the penalties, over everything).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeded: dict[int, tuple[int, int]] = field(default_factory=dict)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    penalties: PenaltyMetadata | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    forced_token_ids: dict[int, int] = field(default_factory=dict)
    # Structured output: (batch rows [R], token bitmask int32 [R, ceil(V / 32)]) of the
    # constrained rows only, or None.
    grammar: tuple[list[int], torch.Tensor] | None = None

    # Known on the host when the metadata is built: testing the tensor would sync the device.
    all_greedy: bool | None = None

    def __post_init__(self) -> None:
        if self.all_greedy is None:
            self.all_greedy = bool((self.temperature == 0).all())
