"""A step's input preparation on the runner: the scheduler's changes applied to the request
states and the persistent input batch, the step's LoRA mapping, the previous step's tokens
still on the device written into the inputs, and which final hidden states are read."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvflow.core.request_errors import LORA_REQUEST, MULTI_MODAL_DATA
from kvflow.lora.layers import LoRAMapping
from kvflow.lora.manager import LoRAManager
from kvflow.sched_output import NewRequestData, SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.input_batch_diffs import apply_scheduler_output
from kvflow.worker.mm_runner import MultiModalRunner
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.pooling import PoolingState
from kvflow.worker.request_failures import Failures, is_request_fault, request_failure
from kvflow.worker.request_state import RequestState, request_seed
from kvflow.worker.step_sampling import PendingOutput


def update_states(sched: SchedulerOutput, requests: dict[str, RequestState], batch: InputBatch,
                  device: torch.device, pooling: PoolingState | None,
                  lora_manager: LoRAManager | None, mm_runner: MultiModalRunner | None,
                  failures: Failures | None = None) -> None:
    """Apply the step's changes to the request states (``requests``, in place: finished ones
    dropped, new ones added with their seed, adapter, images and prompt embeddings) and
    the input batch. ``failures``: where a new request whose adapter cannot be read again
    (removed meanwhile, its folder changed), whose images' M-RoPE positions cannot be
    computed, or whose image fails in the encoder is recorded (``worker/request_failures.py``;
    it then runs without them, its results dropped); None: such a failure is raised."""
    for rid in sched.finished_ids:
        requests.pop(rid, None)
    if pooling is not None:
        for rid in (*sched.finished_ids, *sched.preempted_ids):
            pooling.drop(rid)
    for new in sched.scheduled_new_reqs:
        lora = _request_lora(lora_manager, new, failures)
        state = requests[new.req_id] = RequestState(
            new.req_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id,
            request_seed(new.sampling_params), new.mm_features,
            lora_request=None if lora is None else new.lora_request, lora=lora,
            pooling_params=new.pooling_params,
            prompt_embeds=None if new.prompt_embeds is None else new.prompt_embeds.tensor())
        if mm_runner is not None:
            _add_mm_request(mm_runner, state, failures)
    if mm_runner is not None:  # encoder-cache drops, then this step's images
        mm_runner.run_encoders(sched, requests, failures)
    apply_scheduler_output(batch, sched, requests)


def _request_lora(lora_manager: LoRAManager | None, new: NewRequestData,
                  failures: Failures | None) -> Any:
    """A new request's loaded adapter (None without one, or when it cannot be loaded and
    ``failures`` records why)."""
    if new.lora_request is None:
        return None
    try:
        return lora_manager.request_adapter(new.lora_request)
    except Exception as e:
        if failures is None or not is_request_fault(e):
            raise
        failures[new.req_id] = request_failure(
            new.req_id, f"LoRA adapter {new.lora_request.lora_name!r}", e, LORA_REQUEST)
        return None


def _add_mm_request(mm_runner: MultiModalRunner, state: RequestState,
                    failures: Failures | None) -> None:
    """``mm_runner.add_request(state)``; a failure is recorded in ``failures`` (the request
    then runs on text positions, its results dropped) unless it is None."""
    try:
        mm_runner.add_request(state)
    except Exception as e:
        if failures is None or not is_request_fault(e):
            raise
        failures.setdefault(state.req_id, request_failure(
            state.req_id, "its images' M-RoPE positions", e, MULTI_MODAL_DATA))


def step_lora_mapping(lora_manager: LoRAManager | None, batch: InputBatch,
                      requests: dict[str, RequestState],
                      inputs: ModelInputs) -> LoRAMapping | None:
    """The step's tokens -> adapter slots (None: no LoRA in this step)."""
    if lora_manager is None:
        return None
    row_ids = batch.lora_ids[:batch.num_reqs]
    if not row_ids.any():
        return None
    adapters = {int(batch.lora_ids[row]): requests[rid].lora
                for row, rid in enumerate(batch.req_ids) if batch.lora_ids[row]}
    token_rows = np.repeat(inputs.rows, np.diff(inputs.query_start))
    return lora_manager.step_mapping(row_ids, token_rows, adapters)


def fill_pending(inputs: ModelInputs, pending: PendingOutput) -> None:
    """Write the previous step's sampled tokens still on the device into the inputs."""
    inputs.input_ids[inputs.pending_token_index] = \
        pending.output.sampled[inputs.pending_sample_index]


def hidden_rows(inputs: ModelInputs, batch: InputBatch, pooling: PoolingState | None,
                spec_tokens: Any) -> torch.Tensor | None:
    """The step's tokens whose final hidden states are read (a context-parallel token split
    gathers only those): the sampling rows; None (all) for prompt logprobs, pooling or draft
    verification."""
    if pooling is not None or batch.prompt_logprobs or spec_tokens:
        return None
    return inputs.logits_indices
