"""Prompt logprobs: the log-probability the model gives each prompt token after the tokens
before it, computed from the hidden states of the step that computed those tokens.

The hidden row of prompt position ``p`` predicts the token at ``p + 1``, so a chunk that
computes positions ``[c, c + n)`` yields the logprobs of prompt tokens ``c + 1 .. c + n``
(only those inside the prompt; the row of the last prompt token is the sampling row). Logits
are made ``ROWS_PER_PASS`` rows at a time, so a 2048-token chunk of a 150k-vocabulary model
never holds its whole ``[tokens, vocab]`` logits at once. Logprobs are the raw log-softmax
of the model's logits (a prompt token is not sampled: no sampling setting applies), or the
logits themselves under ``--logprobs-mode raw_logits`` / ``processed_logits`` (vLLM's
documented meaning of the flag for prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvflow.runner_output import PromptLogprobsChunk, TokenLogprobs

if TYPE_CHECKING:
    from kvflow.worker.input_batch import InputBatch
    from kvflow.worker.model_inputs import ModelInputs
    from kvflow.worker.request_state import RequestState

ROWS_PER_PASS = 256


def token_logprobs(logprobs: torch.Tensor, targets: torch.Tensor,
                   num_top: int) -> list[TokenLogprobs]:
    """Per row: (top ``num_top`` ids, their logprobs, the target's logprob, its rank).

    Args:
        logprobs: float32 [R, vocab] log-softmax rows.
        targets: int64 [R], the token whose logprob each row reports.
        num_top: how many top tokens per row (0: none).

    Returns:
        R tuples; rank 1 is the most likely token (ties counted in the target's favour).
    """
    target_lp = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > target_lp).sum(dim=1) + 1
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=1)
        tops = list(zip(top_ids.tolist(), top_lp.tolist()))
    else:
        tops = [([], [])] * logprobs.shape[0]
    return [(ids, lps, lp, rank) for (ids, lps), lp, rank
            in zip(tops, target_lp[:, 0].tolist(), ranks.tolist())]


@dataclass
class PromptLogprobsRequest:
    """One scheduled request that asked for prompt logprobs.

    Attributes:
        req_id: the request.
        num_top: top tokens per position (the request's ``prompt_logprobs``).
        prompt_token_ids: its prompt.
        num_computed_tokens: tokens cached before the step; the step computes the next
            ``num_scheduled_tokens``, whose hidden rows start at row ``first_row``.
    """

    req_id: str
    num_top: int
    prompt_token_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    first_row: int


def prompt_logprobs_requests(batch: InputBatch, inputs: ModelInputs,
                             requests: dict[str, RequestState]) -> list[PromptLogprobsRequest]:
    """The scheduled requests that asked for prompt logprobs, with their hidden rows."""
    out = []
    position = {row: k for k, row in enumerate(inputs.rows.tolist())}
    for rid, num_top in batch.prompt_logprobs.items():
        k = position.get(batch.req_id_to_index[rid])
        if k is not None:
            start = int(inputs.query_start[k])
            out.append(PromptLogprobsRequest(
                rid, num_top, requests[rid].prompt_token_ids,
                int(batch.num_computed_tokens[inputs.rows[k]]),
                int(inputs.query_start[k + 1]) - start, start))
    return out


def compute_prompt_logprobs(reqs: list[PromptLogprobsRequest], hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            raw_logits: bool = False) -> dict[str, PromptLogprobsChunk]:
    """Prompt logprobs of the step's requests that asked for them.

    Args:
        reqs: those requests.
        hidden: [num_tokens, hidden_size] the step's final hidden states.
        compute_logits: the model's LM head (hidden rows -> float32 logits).
        raw_logits: report the logits (float32) instead of their log-softmax.

    Returns:
        request id -> the chunk of prompt logprobs this step yields (requests whose chunk
        holds no prompt token with a predecessor in it are left out).
    """
    out: dict[str, PromptLogprobsChunk] = {}
    for r in reqs:
        start = r.num_computed_tokens
        last = min(start + r.num_scheduled_tokens, len(r.prompt_token_ids) - 1)
        if last <= start:
            continue
        rows = torch.arange(r.first_row, r.first_row + last - start)
        targets = torch.tensor(r.prompt_token_ids[start + 1:last + 1])
        entries: list[TokenLogprobs] = []
        for s in range(0, rows.numel(), ROWS_PER_PASS):
            logits = compute_logits(hidden[rows[s:s + ROWS_PER_PASS].to(hidden.device)])
            lps = logits.float() if raw_logits else torch.log_softmax(logits.float(), dim=-1)
            entries += token_logprobs(lps, targets[s:s + ROWS_PER_PASS].to(lps.device),
                                      r.num_top)
        out[r.req_id] = PromptLogprobsChunk(start + 1, entries)
    return out
