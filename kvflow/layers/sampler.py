"""Token sampling for a batch: logit bias, penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds.

Random rows use the exponential-race form of categorical sampling: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. draws the index with probability proportional to ``p``. A seeded request's
``E`` for its output token ``p`` is a pure function of its seed and ``p``
(``layers/seeded_noise.py``), so its tokens depend neither on what else is in the batch nor
on how many drafts speculative decoding verified for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvflow.kernels.argmax import argmax_rows
from kvflow.layers.sampling_metadata import PenaltyMetadata, SamplingMetadata
from kvflow.layers.seeded_noise import fill_exponential
from kvflow.runner_output import TokenLogprobs


@dataclass
class SamplerOutput:
    """sampled: int64 [B]. For rows that asked for logprobs (``num_logprobs``: row -> k),
    ``logprobs_tensors`` holds (top ids int64 [B, K], their logprobs float32 [B, K], the
    sampled token's logprob float32 [B], its rank int64 [B]); they stay on the device until
    ``logprobs_lists`` copies them (one host sync)."""

    sampled: torch.Tensor
    logprobs_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_logprobs: dict[int, int] = field(default_factory=dict)

    def logprobs_lists(self) -> dict[int, TokenLogprobs]:
        """row -> (top token ids, their logprobs, sampled token's logprob, its rank)."""
        if self.logprobs_tensors is None:
            return {}
        top_ids, top_lp, sampled_lp, ranks = (t.tolist() for t in self.logprobs_tensors)
        return {row: (top_ids[row][:k], top_lp[row][:k], sampled_lp[row], ranks[row])
                for row, k in self.num_logprobs.items()}

    @property
    def logprobs(self) -> dict[int, TokenLogprobs]:
        return self.logprobs_lists()


class CustomLogitsProcessors(Protocol):
    """A step's custom logits processors (``worker/logits_procs.StepLogitsProcessors``)."""

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        """``logits`` [B, vocab] float32 after the argmax-invariant processors or the
        others."""
        ...


class Sampler:
    """Samples one token per row of ``logits`` [B, vocab] float32; ``logprobs_mode``: what
    a row's logprobs report (vLLM's ``--logprobs-mode``, see ``logprob_values``)."""

    def __init__(self, generator: torch.Generator,
                 logprobs_mode: str = "raw_logprobs") -> None:
        self.generator = generator  # for unseeded random rows
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 custom: CustomLogitsProcessors | None = None) -> SamplerOutput:
        """Sample ``logits`` [B, vocab] float32 (edited in place) with ``meta``'s settings;
        ``custom``: the engine's custom logits processors bound to this step's rows
        (``worker/logits_procs.py``), None without any."""
        keep_raw = bool(meta.num_logprobs) and self.logprobs_mode.startswith("raw")
        logits, raw = self.process_logits(logits, meta, custom, keep_raw)
        sampled = argmax_rows(logits)  # logits.argmax(dim=-1), native on CPU
        masked = None
        if not meta.all_greedy:
            random, masked = self._sample_random(logits, meta, custom)
            sampled = torch.where(meta.temperature == 0, sampled, random)
        values = logprob_values(self.logprobs_mode, raw, logits, meta, masked) \
            if meta.num_logprobs else None
        return SamplerOutput(sampled, self.gather_logprobs(values, sampled, meta),
                             dict(meta.num_logprobs))

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata,
                       custom: CustomLogitsProcessors | None = None,
                       keep_raw: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything before temperature on ``logits`` [B, V] float32 (in place; returned,
        a new tensor if a custom processor made one): the grammar's mask first (vLLM applies
        it before its sampler, so its raw logprobs see it), then logit bias, the custom
        processors that may change the argmax (``custom``; after the bias and before the
        penalties, as vLLM v1 runs them), penalties, allowed token ids, banned ids
        (min_tokens, bad words), then the forced tokens (thinking budgets). Returns (processed logits, a copy of them taken after the
        grammar's mask when ``keep_raw``, else None): the raw logprobs modes read the copy."""
        if meta.grammar is not None:
            apply_token_bitmask_fast(logits, *meta.grammar)
        raw = logits.clone() if keep_raw else None
        if meta.logit_bias is not None:
            rows, token_ids, biases = meta.logit_bias
            logits.index_put_((rows, token_ids), biases, accumulate=True)
        if custom is not None:
            logits = custom.apply(logits, argmax_invariant=False)
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        if meta.allowed_token_ids is not None:
            apply_allowed_token_ids(logits, *meta.allowed_token_ids)
        for row, token_ids in meta.banned_token_ids.items():
            logits[row, token_ids] = float("-inf")
        if meta.forced_token_ids:
            force_tokens(logits, meta.forced_token_ids)
        return logits, raw

    def _sample_random(self, logits: torch.Tensor, meta: SamplingMetadata,
                       custom: CustomLogitsProcessors | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampled ids int64 [B], the masked temperature-scaled logits [B, V] they were
        drawn from, shifted as ``scale_by_temperature`` shifts them)."""
        logits = scale_by_temperature(logits, meta.temperature)
        min_p = meta.min_p
        if custom is not None:  # argmax-invariant processors: after temperature and min-p
            # (vLLM's built-in argmax-invariant processor, run before the custom ones)
            logits = custom.apply(apply_min_p(logits, min_p), argmax_invariant=True)
            min_p = None
        logits = apply_top_k_top_p_min_p(logits, meta.top_k, meta.top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, (seed, position) in meta.seeded.items():
            fill_exponential(noise[row], seed, position)
        return (probs / noise).argmax(dim=-1), logits

    @staticmethod
    def gather_logprobs(raw: torch.Tensor | None, sampled: torch.Tensor,
                        meta: SamplingMetadata) -> tuple[torch.Tensor, ...] | None:
        """(top ids [B, K], top values [B, K], ``sampled``'s value [B], its rank [B]) from
        ``raw`` [B, V], the values the logprobs mode reports (``logprob_values``; K: the most
        logprobs a row asked for), or None. A row with ``logprob_token_ids`` holds its listed
        ids and their values in place of its top ones (vLLM's
        ``gather_specific_token_logprobs``)."""
        if raw is None:
            return None
        k_max = max(meta.num_logprobs.values())
        top_lp, top_ids = raw.topk(max(k_max, 1), dim=-1)
        for row, listed in meta.logprob_token_ids.items():
            ids = torch.tensor(listed, dtype=torch.int64, device=raw.device)
            top_ids[row, :len(listed)] = ids
            top_lp[row, :len(listed)] = raw[row, ids]
        sampled_lp = raw.gather(1, sampled.unsqueeze(1)).squeeze(1)
        ranks = (raw > sampled_lp.unsqueeze(1)).sum(dim=1) + 1
        return top_ids, top_lp, sampled_lp, ranks


def logprob_values(mode: str, raw: torch.Tensor | None, processed: torch.Tensor,
                   meta: SamplingMetadata, masked: torch.Tensor | None = None) -> torch.Tensor:
    """The values a step's logprobs report, per vLLM's ``--logprobs-mode`` (vLLM v1's
    sampler: raw values are taken before its logits processors, processed ones from what it
    samples).

    Args:
        mode: raw_logprobs / raw_logits (``raw``'s log-softmax / ``raw`` itself),
            processed_logprobs / processed_logits (the log-softmax of / the logits a row
            samples from: a greedy row's ``processed``, a random row's ``processed`` divided
            by its temperature, then min-p, top-k and top-p masked to -inf; custom
            argmax-invariant processors as ``masked`` holds them).
        raw: float32 [B, V], the logits before processing (``process_logits``' copy); read
            by the raw modes only.
        processed: float32 [B, V], ``process_logits``' result.
        meta: the step's settings (temperature, top_k, top_p, min_p).
        masked: float32 [B, V], the sampler's masked logits shifted by each row's largest
            ``processed`` logit (``Sampler._sample_random``), or None to compute them here
            (speculative verification).

    Returns:
        float32 [B, V].
    """
    if mode.startswith("raw"):
        source = raw
    elif meta.all_greedy:
        source = processed
    else:
        if masked is None:
            masked = apply_top_k_top_p_min_p(scale_by_temperature(processed, meta.temperature),
                                              meta.top_k, meta.top_p, meta.min_p)
        if mode == "processed_logits":  # undo scale_by_temperature's shift: logits / T
            peak = processed.amax(dim=-1, keepdim=True)
            peak = torch.where(torch.isfinite(peak), peak, 0.0)
            scale = torch.where(meta.temperature == 0, 1.0, meta.temperature).unsqueeze(1)
            masked = masked + peak / scale
        source = torch.where((meta.temperature == 0).unsqueeze(1), processed, masked)
    return torch.log_softmax(source, dim=-1) if mode.endswith("logprobs") else source


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens a grammar forbids, for ``rows`` only
    (plain torch; the reference for ``apply_token_bitmask_fast``).

    logits: float32 [B, V]; rows: R batch rows; bitmask: int32 [R, ceil(V / 32)] where bit
    ``j`` of word ``w`` allows token ``32 * w + j`` (xgrammar's layout). Other rows are
    untouched.
    """
    vocab = logits.shape[1]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_fast(logits: torch.Tensor, rows: list[int],
                             bitmask: torch.Tensor) -> None:
    """``apply_token_bitmask`` through xgrammar's kernel (C++ on CPU, Triton/CUDA on GPU;
    4.5x faster than the torch version on CPU at batch 32 x 49,152) when xgrammar is
    installed and the logits are float32; otherwise the torch version."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        apply_token_bitmask_inplace = None
    if apply_token_bitmask_inplace is None or logits.dtype != torch.float32:
        apply_token_bitmask(logits, rows, bitmask)
        return
    # xgrammar indexes logits and bitmask with the same row numbers: widen to [B, W].
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32,
                      device=logits.device)
    full[rows] = bitmask
    apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1], indices=rows)


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                            token_ids: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of ``rows`` (int64 [R]) of ``logits`` [B, V] but
    those of the row's allowed tokens: ``token_ids[j]`` (int64 [K]) is allowed in row
    ``rows[positions[j]]``. Other rows are untouched."""
    blocked = torch.ones((rows.shape[0], logits.shape[1]), dtype=torch.bool,
                         device=logits.device)
    blocked[positions, token_ids] = False
    logits[rows] = logits[rows].masked_fill(blocked, float("-inf"))


def force_tokens(logits: torch.Tensor, forced: dict[int, int]) -> None:
    """Make row ``r`` of ``logits`` [B, V] (in place) a point mass on token ``forced[r]``:
    that logit 0, every other one -inf, so greedy, random and rejection sampling all take
    it (a draft other than it has target probability 0)."""
    rows = torch.tensor(list(forced), dtype=torch.int64, device=logits.device)
    tokens = torch.tensor(list(forced.values()), dtype=torch.int64, device=logits.device)
    logits[rows] = float("-inf")
    logits[rows, tokens] = 0.0


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> None:
    """Apply repetition, frequency and presence penalties in place to ``pen.rows`` of ``logits``
    [B, V] float32, with OpenAI / vLLM semantics:

    * repetition (CTRL, Keskar et al. 2019): for tokens seen in the prompt or the output, a
      positive logit is divided by the penalty and a negative one multiplied by it;
    * frequency: ``logit -= frequency * count`` (count of the token in the output);
    * presence: ``logit -= presence * (count > 0)``.
    """
    vocab = logits.shape[1]
    sub = logits[pen.rows]
    # Padding (-1) goes to an extra column vocab, dropped after the scatter.
    outputs = torch.where(pen.output_token_ids < 0, vocab, pen.output_token_ids)
    prompts = torch.where(pen.prompt_token_ids < 0, vocab, pen.prompt_token_ids)
    counts = torch.zeros(sub.shape[0], vocab + 1, dtype=sub.dtype, device=sub.device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=sub.dtype))
    counts = counts[:, :vocab]
    in_prompt = torch.zeros(sub.shape[0], vocab + 1, dtype=torch.bool, device=sub.device)
    in_prompt.scatter_(1, prompts, True)
    seen = in_prompt[:, :vocab] | (counts > 0)
    # A penalty outside float32's normal range (1e-300 is 0, 1e308 inf) would divide by 0
    # or make 0 * inf: the row went NaN. Clamped, and a positive quotient kept finite, the
    # row keeps the penalty's limit (seen positive logits outweigh all others as it -> 0).
    finfo = torch.finfo(sub.dtype)
    rep = pen.repetition.clamp(min=finfo.tiny, max=finfo.max).unsqueeze(1)
    sub = torch.where(seen, torch.where(sub > 0, (sub / rep).clamp(max=finfo.max),
                                        sub * rep), sub)
    sub = sub - pen.frequency.unsqueeze(1) * counts - pen.presence.unsqueeze(1) * (counts > 0)
    logits[pen.rows] = sub


def scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] float32 divided by each row's ``temperature`` [B] float32 (0 reads
    as 1: a greedy row's scaled logits go unused) after each row's largest finite logit is
    subtracted: the same softmax, top-k, top-p and min-p, but no overflow. The plain quotient
    overflowed for a vanishing temperature (1e-45, float32's smallest subnormal: the logits
    became inf and the row's probabilities NaN); shifted, the largest logit maps to 0 and
    every other to a finite number or -inf, the greedy limit. Returns a new tensor."""
    scale = torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)  # a fully masked row stays as it was
    return (logits - peak) / scale


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the tokens of each row of ``logits`` [B, V] float32 (temperature
    applied) whose probability is below ``min_p`` [B] float32 times the row's largest; a new
    tensor, or ``logits`` itself when ``min_p`` is None."""
    if min_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                            top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus (top-p) / min-p set.

    top-k keeps every token whose logit is at least the k-th largest: tokens tied with the
    k-th all stay (HF's TopKLogitsWarper and vLLM keep them; cutting at exactly k kept
    whichever of them the sort put first, so a tied token could never be sampled). top-p
    follows Holtzman et al. 2019: keep the smallest set of most likely tokens whose mass
    reaches top_p (always at least one). min-p keeps tokens with p >= min_p * max p.
    logits: [B, V] float32 (temperature already applied); returns a new tensor.
    """
    logits = apply_min_p(logits, min_p)
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1], the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        # a token goes when the tokens above it hold top_p: when its mass and the mass below
        # it (summed from the least likely up, as HF's TopPLogitsWarper and vLLM sum) is at
        # most 1 - top_p. ``cumsum - probs`` from the top reached 1.0 in float32 within a
        # large vocabulary, dropping the tail of a row with top_p 1 (off) batched with one
        # that uses top-p.
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_from = probs.flip(-1).cumsum(dim=-1).flip(-1)
        drop = mass_from <= 1 - top_p.unsqueeze(1)
        drop[:, 0] = False  # the most likely token stays even where top_p is 0 in float32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
