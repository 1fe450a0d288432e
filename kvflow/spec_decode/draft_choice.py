"""How a draft model (or EAGLE head) chooses each draft token from its logits, once its pass
has run (draft_model.py runs the passes).

Greedy requests draft the argmax (a point mass); sampled requests draw from
``q = softmax(draft logits / temperature)`` within the request's top-k / top-p / min-p, as the
target's ``p`` is, and ``q`` goes to the rejection sampler, which keeps the target's
distribution exactly whatever ``q`` is (Leviathan et al. 2023, arXiv 2211.17192;
kvflow/spec_decode/rejection_sampler.py): truncating ``q`` as ``p`` is only what makes drafts
likely to be accepted (a draft outside ``p``'s top-k has ``p = 0`` and is always rejected). A
draw is the Gumbel-max form ``argmax(q / E)``, ``E ~ Exp(1)``: from the engine's generator for
an unseeded request; for a seeded one ``E`` is the vector of its seed and the draft's output
position (``layers/seeded_noise.py``), the one the target's token there is drawn with, so a
draft distribution close to the target's proposes the very token verification accepts (the
coupled draw is accepted with probability ``P(argmax q/E = argmax p/E)``, at least
``(1 - d) / (1 + d)``, ``d`` the total variation distance between ``p`` and ``q``: Daliri et
al. 2024, "Coupling without Communication and Drafter-Invariant Speculative Decoding").

A constrained request (structured output) chooses within its grammar's bitmask row: draft 1
within the row the engine core hands the step, draft ``i`` within the row the core answers for
the drafts ``1..i-1`` (``DraftGrammar``, asked through :func:`later_grammar_rows`).

With a cut vocabulary (``DraftVocab`` / ``HeadVocab``: FR-Spec, EAGLE-3's ``d2t``) the logits'
columns are ``vocab.token_ids`` and ``q`` is zero outside them (draft_vocab.py: why that stays
exact).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvflow.layers.sampler import apply_top_k_top_p_min_p, scale_by_temperature
from kvflow.layers.seeded_noise import fill_exponential
from kvflow.sched_output import DraftGrammar, GrammarBitmask
from kvflow.worker.input_batch import InputBatch


def choose_drafts(batch: InputBatch, rows: np.ndarray, logits: torch.Tensor, i: int,
                  tokens: np.ndarray, probs: list[list[torch.Tensor]],
                  generator: torch.Generator, vocab: Any = None,
                  sub: np.ndarray | None = None) -> None:
    """Write draft ``i`` (0-based) of each batch row in ``rows`` into ``tokens[sub, i]``
    (int64 [drafting rows, k]; ``sub``: the rows' indices among the drafting rows, default
    all) from ``logits`` (float [len(rows), columns]): the argmax for greedy rows, else a
    draw from ``q`` (:func:`proposal_probs`; module docstring: the seeded requests' draws,
    else from ``generator``), whose float32 [V] row is appended to ``probs[sub]`` (mapped back
    to the full vocabulary through ``vocab.to_full`` when ``vocab``, a cut vocabulary, is
    given)."""
    sub = np.arange(len(rows)) if sub is None else sub
    if not len(rows):
        return
    choice = logits.float().argmax(dim=-1)
    sampled = np.flatnonzero(batch.temperature[rows] > 0)
    qs = proposal_probs(logits[torch.from_numpy(sampled).to(logits.device)], batch,
                        rows[sampled]) if len(sampled) else None
    seeded: dict[int, torch.Tensor] = {}  # j -> its token id
    for n, j in enumerate(sampled.tolist()):
        q = qs[n]
        full = q if vocab is None else vocab.to_full(q)
        seed = batch.seeds.get(batch.req_ids[rows[j]])
        if seed is None:  # Gumbel-max over the columns: a draw from q
            noise = torch.empty_like(q).exponential_(generator=generator)
            choice[j] = (q / noise).argmax()
        else:  # over the whole vocabulary, with the target's numbers at this position
            position = int(batch.num_tokens[rows[j]] - batch.num_prompt_tokens[rows[j]]) + i
            seeded[j] = (full / fill_exponential(torch.empty_like(full), seed,
                                                 position)).argmax()
        probs[int(sub[j])].append(full)
    if vocab is not None:  # columns -> token ids
        choice = vocab.token_ids[choice]
    for j, token_id in seeded.items():
        choice[j] = token_id
    tokens[sub, i] = choice.cpu().numpy()


def mask_drafts(batch: InputBatch, rows: np.ndarray, logits: torch.Tensor,
                grammar: GrammarBitmask, vocab: Any = None) -> None:
    """Set to -inf, in place, the logits (float32 [len(rows), columns], batch rows ``rows``;
    columns ``vocab.token_ids`` with a cut vocabulary) of the tokens a constrained row's
    grammar forbids as its next draft (``grammar``: one int32 bitmask row per constrained
    request, 32 tokens a word; other rows are left alone). A row whose columns hold no
    allowed token is left as it is (its draft is then rejected by the masked target)."""
    grammar_row = {rid: i for i, rid in enumerate(grammar.request_ids)}
    picked = [(j, grammar_row[batch.req_ids[r]]) for j, r in enumerate(rows.tolist())
              if batch.req_ids[r] in grammar_row]
    if not picked:
        return
    words = grammar.bitmask[[g for _, g in picked]].to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if vocab is not None:  # the logits' columns are the cut head's token ids
        allowed = allowed[:, vocab.token_ids]
    allowed = allowed[:, :logits.shape[1]]
    keep = allowed.any(dim=1)
    index = torch.tensor([j for j, _ in picked], device=logits.device)[keep]
    logits[index] = logits[index].masked_fill(~allowed[keep], float("-inf"))


def later_grammar_rows(batch: InputBatch, drafting: np.ndarray, num_drafts: np.ndarray,
                       tokens: np.ndarray, i: int, constrained: set[str],
                       draft_grammar: DraftGrammar | None) -> GrammarBitmask | None:
    """Draft ``i``'s (0-based) grammar rows: ``draft_grammar`` asked with the drafts so far
    (``tokens[j, :i]``) of the ``constrained`` rows drafting more than ``i`` tokens; None
    when there is none (the same on every TP rank: the counts come from the step)."""
    prefixes = {batch.req_ids[r]: tokens[j, :i].tolist() for j, r in enumerate(drafting.tolist())
                if num_drafts[r] > i and batch.req_ids[r] in constrained}
    return draft_grammar(prefixes) if prefixes else None


def proposal_probs(logits: torch.Tensor, batch: InputBatch, rows: np.ndarray) -> torch.Tensor:
    """The draft distributions ``q`` of sampled rows: float32 [len(rows), columns], the softmax
    of ``logits`` (the draft's, [len(rows), columns]) over each request's temperature within
    its top-k / top-p / min-p, as the rejection sampler forms the target's ``p``
    (``_target_probs``): a draft outside ``p``'s top-k / nucleus would always be rejected.
    Scaled by ``scale_by_temperature`` as ``p`` is: a vanishing temperature is the greedy
    limit, not a NaN row."""
    device = logits.device

    def column(values: np.ndarray, off: float) -> torch.Tensor | None:
        picked = values[rows]
        return None if (picked == off).all() else torch.from_numpy(picked).to(device)

    temperature = torch.from_numpy(batch.temperature[rows]).to(device)
    truncated = apply_top_k_top_p_min_p(scale_by_temperature(logits.float(), temperature),
                                        column(batch.top_k, 0), column(batch.top_p, 1.0),
                                        column(batch.min_p, 0.0))
    return torch.softmax(truncated, dim=-1)
