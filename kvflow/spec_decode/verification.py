"""The model runner's side of speculative decoding.

A step that verifies draft tokens differs from a plain step in three places:

1. before the inputs are built, each request's drafts are written after its tokens in the
   persistent batch (``place_drafts``; a draft model proposes them first), so the ordinary
   input gathering feeds them to the model at positions ``num_tokens .. num_tokens + k - 1``;
2. a request verifying ``k`` drafts needs the logits of its last ``k + 1`` positions, not one
   (``plan_verification``);
3. sampling goes through the rejection sampler (``verify``): every sampling row is processed
   as plain sampling would process it had the drafts before it been generated (penalties,
   ``min_tokens``, the grammar's row), then the accepted drafts and one more token per request
   are appended to the batch and returned.

Every sampling row of such a step takes path 3 (a row without drafts is a request verifying
zero tokens: its one token is drawn from ``p_0``, as plain sampling would).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.layers.sampler import Sampler, logprob_values
from kvflow.runner_output import ModelRunnerOutput, TokenLogprobs
from kvflow.sched_output import GrammarBitmask
from kvflow.spec_decode.rejection_sampler import SpecLayout, rejection_sample
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.sampling_inputs import SamplingInputs


@dataclass
class SpecStep:
    """One verification step's layout (host arrays unless noted).

    Attributes:
        sample_rows: int64 [S], the batch rows that sample, increasing (as the inputs list
            them).
        num_drafts: int64 [S], draft tokens each verifies (``k``, 0 for none).
        first_row: int64 [S], each one's first logits row; its rows are consecutive.
        logits_indices: int64 [N] (N = sum(k + 1)), the hidden-state rows to take logits of.
        expanded_rows / num_extra: int64 [N], each logits row's batch row, and how many of
            that request's drafts precede the position it predicts.
        draft_token_ids: int64 [S, K], K = max k (padding past k).
        draft_probs: float32 [S, K, V] on the device: the draft model's distribution of each
            draft (random requests), or None (point masses).
        draft_time_s: seconds the draft model took to propose them.
        draft_pass_s: seconds of one steady draft pass (``DraftProposal.pass_seconds``).
    """

    sample_rows: np.ndarray
    num_drafts: np.ndarray
    first_row: np.ndarray
    logits_indices: np.ndarray
    expanded_rows: np.ndarray
    num_extra: np.ndarray
    draft_token_ids: np.ndarray
    draft_probs: torch.Tensor | None = None
    draft_time_s: float = 0.0
    draft_pass_s: float = 0.0


def place_drafts(batch: InputBatch, spec_tokens: dict[str, list[int]]) -> None:
    """Write each request's draft tokens after its known tokens (ids of -1 must have been
    replaced by a draft model's proposals).

    Raises:
        ValueError: for a placeholder (-1) left in place.
    """
    for rid, tokens in spec_tokens.items():
        if tokens and min(tokens) < 0:
            raise ValueError(f"request {rid!r} has unfilled draft tokens (no draft model in "
                             "this runner)")
        batch.write_draft_tokens(batch.req_id_to_index[rid], tokens)


def plan_verification(batch: InputBatch, inputs: ModelInputs,
                      spec_tokens: dict[str, list[int]]) -> SpecStep:
    """The logits rows and drafts of a step whose inputs were built with drafts in place."""
    sample_rows = inputs.sample_rows
    num_drafts = np.zeros(len(sample_rows), np.int64)
    draft_lists: list[list[int]] = [[] for _ in sample_rows]
    for rid, tokens in spec_tokens.items():
        s = int(np.searchsorted(sample_rows, batch.req_id_to_index[rid]))
        num_drafts[s], draft_lists[s] = len(tokens), tokens
    k_max = int(num_drafts.max(initial=0))
    drafts = np.zeros((len(sample_rows), k_max), np.int64)
    for s, tokens in enumerate(draft_lists):
        drafts[s, :len(tokens)] = tokens
    # the last token of each sampling row's chunk, in the step's flat token order
    end = inputs.query_start[np.searchsorted(inputs.rows, sample_rows) + 1] - 1
    per_req = num_drafts + 1
    first_row = np.zeros(len(sample_rows), np.int64)
    np.cumsum(per_req[:-1], out=first_row[1:])
    req = np.repeat(np.arange(len(sample_rows)), per_req)
    num_extra = np.arange(int(per_req.sum())) - first_row[req]
    logits_indices = (end - num_drafts)[req] + num_extra
    return SpecStep(sample_rows, num_drafts, first_row, logits_indices, sample_rows[req],
                    num_extra, drafts)


def verify(step: SpecStep, logits: torch.Tensor, batch: InputBatch,
           sampling_inputs: SamplingInputs, sampler: Sampler,
           grammar: GrammarBitmask | None) -> ModelRunnerOutput:
    """Rejection-sample every request of ``step`` (kvflow/spec_decode/rejection_sampler.py),
    append its tokens to the batch and return them (waits for the device).

    Args:
        step: the layout from ``plan_verification``.
        logits: float32 [N, V], the target's logits of ``step.logits_indices``.
        batch: the persistent batch (drafts in place).
        sampling_inputs / sampler: the runner's (settings and the unseeded rows' generator).
        grammar: the bitmask rows of constrained requests (k + 1 each), or None.
    """
    meta = sampling_inputs.build(batch, step.expanded_rows, grammar, step.num_extra)
    mode = sampler.logprobs_mode
    logits, raw = sampler.process_logits(logits, meta,
                                         keep_raw=bool(meta.num_logprobs) and
                                         mode.startswith("raw"))
    values = logprob_values(mode, raw, logits, meta) if meta.num_logprobs else None
    device = logits.device
    layout = SpecLayout(torch.from_numpy(step.first_row).to(device),
                        torch.from_numpy(step.num_drafts).to(device),
                        torch.from_numpy(step.draft_token_ids).to(device), step.draft_probs,
                        _seeded(batch, step.sample_rows))
    out = rejection_sample(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p,
                           layout, sampler.generator)
    token_ids = out.token_ids.cpu().numpy()
    num_new = out.num_emitted.cpu().numpy()
    batch.accept_tokens(step.sample_rows, num_new,
                        token_ids[np.arange(len(num_new)), num_new - 1])
    req_ids = [batch.req_ids[r] for r in step.sample_rows.tolist()]
    tokens = [row[:n].tolist() for row, n in zip(token_ids, num_new)]
    logprobs = _logprobs(values, token_ids, step, meta, req_ids, num_new) \
        if values is not None else {}
    return ModelRunnerOutput(req_ids, tokens, logprobs, draft_time_s=step.draft_time_s,
                             draft_pass_s=step.draft_pass_s)


def _seeded(batch: InputBatch, sample_rows: np.ndarray) -> dict[int, tuple[int, int]]:
    """Request index in the step -> (its seed, tokens it generated so far: the output
    position its first row predicts), for seeded random requests (``SpecLayout.seeded``)."""
    if not batch.seeds:
        return {}
    out = {}
    for s, row in enumerate(sample_rows.tolist()):
        seed = batch.seeds.get(batch.req_ids[row])
        if seed is not None and batch.temperature[row] > 0:
            out[s] = (seed, int(batch.num_tokens[row] - batch.num_prompt_tokens[row]))
    return out


def _logprobs(raw: torch.Tensor, token_ids: np.ndarray, step: SpecStep, meta,
              req_ids: list[str], num_new: np.ndarray) -> dict[str, list[TokenLogprobs]]:
    """Per request that asked: the ``raw`` entry (the logprobs mode's values, float32
    [N, V]) of each emitted token, at the row that predicted it."""
    req = np.repeat(np.arange(len(num_new)), step.num_drafts + 1)
    emitted = np.maximum(token_ids[req, step.num_extra], 0)
    tensors = Sampler.gather_logprobs(raw, torch.from_numpy(emitted).to(raw.device), meta)
    top_ids, top_lp, lp, ranks = (t.tolist() for t in tensors)
    out: dict[str, list[TokenLogprobs]] = {}
    for row, k in meta.num_logprobs.items():
        s = int(req[row])
        if step.num_extra[row] < num_new[s]:
            out.setdefault(req_ids[s], []).append(
                (top_ids[row][:k], top_lp[row][:k], lp[row], ranks[row]))
    return out


def draft_probs_tensor(step: SpecStep, batch: InputBatch,
                       probs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The proposer's distributions for the rejection sampler: float32 [S, K, V], request
    ``s``'s sampled drafts' ``q`` rows from ``probs`` (request id -> [k, V]) and a point mass
    on each other draft; None when no request's drafts were sampled (all point masses)."""
    if not probs:
        return None
    first = next(iter(probs.values()))
    num_reqs, k_max = step.draft_token_ids.shape
    out = torch.zeros((num_reqs, k_max, first.shape[-1]), dtype=torch.float32,
                      device=first.device)
    s, i = np.nonzero(np.arange(k_max) < step.num_drafts[:, None])
    out[torch.from_numpy(s), torch.from_numpy(i),
        torch.from_numpy(step.draft_token_ids[s, i])] = 1.0
    for j, row in enumerate(step.sample_rows.tolist()):
        q = probs.get(batch.req_ids[row])
        if q is not None:
            out[j, :q.shape[0]] = q
    return out
