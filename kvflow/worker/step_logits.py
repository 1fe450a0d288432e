"""The last pipeline stage's step after the forward pass: the logits of the rows that sample
(all of a verified request's last k + 1 positions under speculative decoding) and the prompt
logprobs, or an embedding model's pooled outputs; sampling them is ``step_sampling``'s job."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.sched_output import SchedulerOutput
from kvflow.spec_decode.verification import draft_probs_tensor, plan_verification
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.pooling import PoolingState
from kvflow.worker.prompt_logprobs import compute_prompt_logprobs, prompt_logprobs_requests
from kvflow.worker.request_state import RequestState
from kvflow.worker.step_sampling import LaunchedStep


def launch_logits(model: torch.nn.Module, pooling: PoolingState | None, batch: InputBatch,
                  requests: dict[str, RequestState], sched: SchedulerOutput,
                  inputs: ModelInputs, hidden: torch.Tensor, spec_tokens: Any,
                  proposal: Any, raw_logits: bool = False) -> LaunchedStep:
    """The launched step from the final hidden states ``hidden`` [T, hidden]: the sampling
    rows' logits [rows, vocab] (``model.compute_logits``; under speculative decoding every
    verified position's, planned by ``spec_decode/verification.py``, with a draft model's
    ``proposal`` probabilities and timings) and prompt logprobs; an embedding model's pooled
    outputs instead. ``raw_logits``: prompt logprobs report the logits themselves
    (``--logprobs-mode raw_logits`` / ``processed_logits``)."""
    if pooling is not None:  # an embedding model: pool, sample nothing
        params = {rid: requests[rid].pooling_params for rid in sched.num_scheduled_tokens}
        pooled = pooling.step(batch, inputs.rows, inputs.query_start, hidden, params)
        return LaunchedStep(inputs.sample_rows[:0], None, {}, pooled=pooled)
    spec = plan_verification(batch, inputs, spec_tokens) if spec_tokens else None
    if spec is not None and proposal is not None:
        spec.draft_probs = draft_probs_tensor(spec, batch, proposal.probs)
        spec.draft_time_s, spec.draft_pass_s = proposal.seconds, proposal.pass_seconds
    if spec is not None:
        logits = model.compute_logits(
            hidden[torch.from_numpy(spec.logits_indices).to(hidden.device)])
    else:
        logits = model.compute_logits(
            hidden if inputs.samples_every_token else hidden[inputs.logits_indices]) \
            if len(inputs.sample_rows) else None
    prompt_logprobs = compute_prompt_logprobs(
        prompt_logprobs_requests(batch, inputs, requests), hidden, model.compute_logits,
        raw_logits) \
        if batch.prompt_logprobs else {}
    return LaunchedStep(inputs.sample_rows, logits, prompt_logprobs, spec)
