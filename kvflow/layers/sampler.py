"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Random rows use the exponential-race form of categorical sampling: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. draws the index with probability proportional to ``p``. A seeded request
draws its ``E`` from its own generator, once per sampled token, so its tokens do not depend on
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step (row = one request that samples).

    Attributes:
        temperature: float32 [B]; 0 = greedy.
        top_k: int64 [B] (0 = off) or None when no row uses it; likewise top_p, min_p (float32).
        generators: row -> torch.Generator for seeded rows.
        banned_token_ids: row -> token ids masked this step (EOS/stop ids during min_tokens).
        num_logprobs: row -> number of top logprobs requested.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    num_logprobs: dict[int, int] = field(default_factory=dict)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


@dataclass
class SamplerOutput:
    """sampled: int64 [B]; logprobs: row -> (top token ids, their logprobs, sampled token's
    logprob, sampled token's rank), for rows that asked."""

    sampled: torch.Tensor
    logprobs: dict[int, tuple[list[int], list[float], float, int]]


class Sampler:
    """Samples one token per row of ``logits`` [B, vocab] float32."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for unseeded random rows

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        for row, token_ids in meta.banned_token_ids.items():
            logits[row, token_ids] = float("-inf")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.num_logprobs else None
        sampled = logits.argmax(dim=-1)
        if not meta.all_greedy:
            random = self._sample_random(logits, meta)
            sampled = torch.where(meta.temperature == 0, sampled, random)
        return SamplerOutput(sampled, self._gather_logprobs(raw_logprobs, sampled, meta))

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
        logits = apply_top_k_top_p_min_p(logits / temperature.unsqueeze(1), meta.top_k,
                                         meta.top_p, meta.min_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in meta.generators.items():
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor | None, sampled: torch.Tensor,
                         meta: SamplingMetadata) -> dict:
        if raw is None:
            return {}
        k_max = max(meta.num_logprobs.values())
        top_lp, top_ids = raw.topk(max(k_max, 1), dim=-1)
        sampled_lp = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
        ranks = (raw > sampled_lp.unsqueeze(1)).sum(dim=1) + 1
        out = {}
        top_ids, top_lp = top_ids.tolist(), top_lp.tolist()
        sampled_lp, ranks = sampled_lp.tolist(), ranks.tolist()
        for row, k in meta.num_logprobs.items():
            out[row] = (top_ids[row][:k], top_lp[row][:k], sampled_lp[row], ranks[row])
        return out


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                            top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus (top-p) / min-p set.

    top-p follows Holtzman et al. 2019: keep the smallest set of most likely tokens whose mass
    reaches top_p (always at least one). min-p keeps tokens with p >= min_p * max p.
    logits: [B, V] float32 (temperature already applied); returns a new tensor.
    """
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1),
                                                  float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
