"""A step's input preparation on the runner: the scheduler's changes applied to the request
states and the persistent input batch, the step's LoRA mapping, the previous step's tokens
still on the device written into the inputs, and which final hidden states are read."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvflow.lora.layers import LoRAMapping
from kvflow.lora.manager import LoRAManager
from kvflow.sched_output import SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.mm_runner import MultiModalRunner
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.pooling import PoolingState
from kvflow.worker.request_state import RequestState, request_generator
from kvflow.worker.step_sampling import PendingOutput


def update_states(sched: SchedulerOutput, requests: dict[str, RequestState], batch: InputBatch,
                  device: torch.device, pooling: PoolingState | None,
                  lora_manager: LoRAManager | None, mm_runner: MultiModalRunner | None) -> None:
    """Apply the step's changes to the request states (``requests``, in place: finished ones
    dropped, new ones added with their generator, adapter, images and prompt embeddings) and
    the input batch."""
    for rid in sched.finished_ids:
        requests.pop(rid, None)
    if pooling is not None:
        for rid in (*sched.finished_ids, *sched.preempted_ids):
            pooling.drop(rid)
    for new in sched.scheduled_new_reqs:
        lora = None if new.lora_request is None else lora_manager.add_lora(new.lora_request)
        state = requests[new.req_id] = RequestState(
            new.req_id, new.prompt_token_ids, new.sampling_params, new.eos_token_id,
            request_generator(new.sampling_params, device), new.mm_features,
            lora_request=new.lora_request, lora=lora,
            pooling_params=new.pooling_params,
            prompt_embeds=None if new.prompt_embeds is None else new.prompt_embeds.tensor())
        if mm_runner is not None:
            mm_runner.add_request(state)
    if mm_runner is not None:  # encoder-cache drops, then this step's images
        mm_runner.run_encoders(sched, requests)
    batch.apply_scheduler_output(sched, requests)


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
