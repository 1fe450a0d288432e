"""Rejection sampling for speculative decoding: draft tokens in, the target's tokens out.

Leviathan, Kalman and Matias 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating Large Language Model Decoding with
Speculative Sampling", Algorithm 2). A request verifies draft tokens ``d_1..d_k``; ``d_i`` was
drawn from the proposer's distribution ``q_i`` (a point mass for n-gram proposals). One forward
pass of the target gives ``p_0..p_k``, ``p_i`` being the target's distribution for the token
after ``d_1..d_i`` - exactly the distribution plain decoding would sample there: logit bias,
penalties over the history including ``d_1..d_i``, ``min_tokens`` bans, the grammar's mask after
``d_1..d_i``, temperature, top-k / top-p / min-p. Then, for ``i = 1..k`` in order:

* accept ``d_i`` with probability ``min(1, p_{i-1}(d_i) / q_i(d_i))``;
* at the first rejection emit one token drawn from the residual
  ``r(x) = max(0, p_{i-1}(x) - q_i(x)) / sum_y max(0, p_{i-1}(y) - q_i(y))`` and stop;
* when all ``k`` are accepted, emit a bonus token drawn from ``p_k``.

Why the output is distributed exactly as the target's. At one position, with ``p`` and ``q``
the two distributions, a token ``x`` is emitted either as the accepted draft or by the residual:

    P(x) = q(x) min(1, p(x) / q(x)) + P(reject) r(x)
         = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) max(0, p(x) - q(x)) / Z,

where ``Z = sum_y max(0, p(y) - q(y)) = 1 - sum_y min(p(y), q(y))``, so the second term is
``max(0, p(x) - q(x))`` and ``P(x) = min(p, q) + max(0, p - q) = p(x)``. An accepted ``d_i``
is therefore a sample of ``p_{i-1}``, the next position's ``p_i`` is the target's distribution
given it, and by induction the emitted sequence is a sample of the target, token by token.
For an n-gram draft (``q = 1`` on ``d``) this is: accept with probability ``p(d)``, else draw
from ``p`` with ``d`` removed.

Greedy rows (temperature 0): ``p`` is the point mass on the argmax of the processed logits, so
``d_i`` is accepted exactly when it equals that argmax, and the residual is that argmax: the
tokens are greedy decoding's, whatever the proposer did.

Draws: ``k`` uniforms, then one exponential vector for the final token (the exponential race
``argmax(w / E)``, ``E ~ Exp(1)``, draws index ``x`` with probability ``w(x) / sum w``, so the
residual needs no normalization), all from the engine's generator.

Seeded rows (a seeded request at temperature > 0) are verified like greedy rows, with the
token plain seeded sampling draws in place of the argmax: row ``i``'s token is
``t_i = argmax(p_i / E_i)``, ``E_i`` the exponential vector of the request's seed and the
output position row ``i`` predicts (``layers/seeded_noise.py``: a pure function of the two,
the numbers the plain sampler uses there). ``d_i`` is accepted iff ``d_i = t_{i-1}``, and the
token after the accepted drafts is that row's ``t``. The emitted tokens are then exactly the
tokens plain seeded sampling gives (each ``t_i`` is that position's plain draw once the
drafts before it are the plain tokens), however many drafts were proposed, cut or verified,
and whatever ``q`` was: the output is a function of the prompt, the parameters and the seed.
Its distribution is the target's because plain sampling's is: ``E_i`` is independent of the
earlier positions' vectors, so ``t_i`` given the tokens before it is a draw of ``p_i``. Such a
row draws no uniforms and no residual, and ``q`` only decides how often drafts are accepted
(a draft model draws its seeded drafts with the same ``E_i``, ``draft_choice.py``, so a ``q``
close to ``p`` proposes ``t_i`` itself; an n-gram draft ``d`` is accepted with probability
``p(d)``, as by the rule above).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvflow.layers.sampler import apply_top_k_top_p_min_p, scale_by_temperature
from kvflow.layers.seeded_noise import seeded_exponentials


@dataclass
class SpecLayout:
    """Where each request's rows lie in a verification step's logits.

    Request ``r`` verifies ``num_drafts[r]`` tokens and owns the ``num_drafts[r] + 1``
    consecutive logits rows from ``first_row[r]``: row ``first_row[r] + i`` is the target's
    prediction after its first ``i`` drafts.

    Attributes:
        first_row: int64 [R].
        num_drafts: int64 [R] (``k_r``; 0 for a request without drafts).
        draft_token_ids: int64 [R, K] (``K = max k_r``; entries past ``k_r`` are ignored).
        draft_probs: float32 [R, K, V], the proposer's distribution of each draft token, or
            None for point masses (n-gram proposals, greedy drafts of greedy requests).
        seeded: request index -> (seed, output position its first row predicts: tokens it
            generated before this step) for seeded requests at temperature > 0.
    """

    first_row: torch.Tensor
    num_drafts: torch.Tensor
    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None
    seeded: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class RejectionOutput:
    """token_ids: int64 [R, K + 1], request ``r``'s emitted tokens in its first
    ``num_emitted[r]`` entries (its accepted drafts, then one target token), -1 after;
    num_emitted: int64 [R] (``1 + accepted drafts``)."""

    token_ids: torch.Tensor
    num_emitted: torch.Tensor


def rejection_sample(logits: torch.Tensor, temperature: torch.Tensor,
                     top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                     min_p: torch.Tensor | None, layout: SpecLayout,
                     generator: torch.Generator) -> RejectionOutput:
    """Verify every request's drafts and draw its tokens (module docstring: the rule).

    Args:
        logits: float32 [N, V], N = sum(k_r + 1): the processed target logits (bias,
            penalties, bans and grammar masks applied; no temperature yet).
        temperature: float32 [N] per row (0 = greedy); top_k / top_p / min_p: [N] or None.
        layout: the rows and drafts of each request.
        generator: the draws of random rows that are not seeded.

    Returns:
        The emitted tokens of every request.
    """
    num_reqs, k_max = layout.draft_token_ids.shape
    device = logits.device
    first_row = layout.first_row
    positions = torch.arange(k_max, device=device)
    # row checked for draft i: the target's prediction after drafts 0..i-1
    draft_rows = (first_row.unsqueeze(1) + positions).clamp(max=logits.shape[0] - 1)
    drafts = layout.draft_token_ids.clamp(min=0)
    # exact rows: each position has one token (greedy: the argmax; seeded: its seeded draw)
    exact = temperature[first_row] == 0
    choice = logits.argmax(dim=-1)
    probs = None
    all_exact = bool(exact.all())
    if not all_exact:
        probs = _target_probs(logits, temperature, top_k, top_p, min_p)
        if layout.seeded:
            exact = _seeded_choices(probs, layout, choice, exact)
            all_exact = bool(exact.all())
    accept = drafts == choice[draft_rows]  # the exact rule
    if not all_exact:
        uniforms = torch.rand((num_reqs, k_max), generator=generator, device=device)
        p_draft = probs[draft_rows, drafts]
        q_draft = torch.ones_like(p_draft) if layout.draft_probs is None else \
            layout.draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        # accept with probability min(1, p/q): u < p / q  <=>  u * q < p  (q > 0)
        accept = torch.where(exact.unsqueeze(1), accept, uniforms * q_draft < p_draft)
    accept &= positions < layout.num_drafts.unsqueeze(1)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    final_row = first_row + num_accepted
    final = choice[final_row]
    if not all_exact:
        sampled = _sample_final(probs, final_row, num_accepted, drafts, layout, generator)
        final = torch.where(exact, final, sampled)
    token_ids = torch.full((num_reqs, k_max + 1), -1, dtype=torch.int64, device=device)
    token_ids[:, :k_max] = torch.where(positions < num_accepted.unsqueeze(1), drafts, -1)
    token_ids.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return RejectionOutput(token_ids, num_accepted + 1)


def _target_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """float32 [N, V]: softmax of the temperature-scaled logits within top-k / top-p / min-p
    (greedy rows are scaled by 1; their probabilities are not used)."""
    scaled = scale_by_temperature(logits, temperature)
    return torch.softmax(apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p), dim=-1)


def _sample_final(probs: torch.Tensor, final_row: torch.Tensor, num_accepted: torch.Tensor,
                  drafts: torch.Tensor, layout: SpecLayout,
                  generator: torch.Generator) -> torch.Tensor:
    """One token per request from its final row: the residual ``max(0, p - q)`` after a
    rejection, ``p`` itself (the bonus token) after full acceptance; int64 [R]."""
    num_reqs = final_row.shape[0]
    weights = probs[final_row]  # [R, V]
    rejected = num_accepted < layout.num_drafts
    if bool(rejected.any()):
        at = num_accepted.clamp(max=drafts.shape[1] - 1)
        rows = torch.arange(num_reqs, device=probs.device)
        if layout.draft_probs is None:  # q = point mass on the rejected draft
            q = torch.zeros_like(weights)
            q[rows, drafts[rows, at]] = 1.0
        else:
            q = layout.draft_probs[rows, at]
        residual = (weights - q).clamp(min=0)
        # a rejection implies p(d) < q(d), hence sum(residual) > 0; keep p if rounding ate it
        usable = rejected & (residual.sum(dim=1) > 0)
        weights = torch.where(usable.unsqueeze(1), residual, weights)
    noise = torch.empty(weights.shape, device=probs.device).exponential_(generator=generator)
    return (weights / noise).argmax(dim=-1)


def _seeded_choices(probs: torch.Tensor, layout: SpecLayout, choice: torch.Tensor,
                    exact: torch.Tensor) -> torch.Tensor:
    """Write into ``choice`` (int64 [N], in place) each seeded request's token at each of its
    ``num_drafts + 1`` rows, ``argmax(p / E)`` with ``E`` its seed's exponential vector for
    the output position the row predicts (the plain sampler's draw there; module docstring),
    and return ``exact`` (bool [R]) with the seeded requests set."""
    first = layout.first_row.tolist()
    counts = layout.num_drafts.tolist()
    rows, noise = [], []
    for r, (seed, position) in layout.seeded.items():
        rows.extend(range(first[r], first[r] + counts[r] + 1))
        noise.append(seeded_exponentials(seed, position, counts[r] + 1, probs.shape[1],
                                         probs.device))
    index = torch.tensor(rows, dtype=torch.int64, device=probs.device)
    choice[index] = (probs[index] / torch.cat(noise)).argmax(dim=-1)
    seeded = torch.zeros_like(exact)
    seeded[list(layout.seeded)] = True
    return exact | seeded
