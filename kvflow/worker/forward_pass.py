"""A step's forward pass on this rank's layers: the model's extra inputs (a multimodal model's
merged image rows and M-RoPE positions), the attention metadata bound for the pass, a
context-parallel token split, and the counters the worker reports (tokens, seconds)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.layer import AttentionContext
from kvflow.distributed.comm import IntermediateTensors
from kvflow.lora.layers import LoRAContext
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.mm_runner import MultiModalRunner
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.prompt_embeds_runner import Span, merge_prompt_embeds
from kvflow.worker.request_state import RequestState


@dataclass
class ForwardCounters:
    """What the forward passes did on this rank (statistics): ``dense_tokens`` the tokens run
    through the model, ``forward_s`` the seconds in the model's forward (on CUDA: launching
    it)."""

    dense_tokens: int = 0
    forward_s: float = 0.0


def model_extra_inputs(mm_runner: MultiModalRunner | None, inputs: ModelInputs,
                       batch: InputBatch, requests: dict[str, RequestState],
                       token_types: bool = False,
                       prompt_embeds: tuple[Any, list[Span]] | None = None
                       ) -> tuple[torch.Tensor, dict[str, Any]]:
    """The positions and extra keyword inputs of the model's forward: ``inputs.positions`` and
    none, or for a multimodal model ``inputs_embeds`` [T, hidden] with the image rows merged
    and, with M-RoPE, positions [3, T] (``worker/mm_runner.py``); with ``token_types`` (a
    BERT cross-encoder) ``token_type_ids`` [T] (:func:`token_type_ids`); with
    ``prompt_embeds`` (the model's ``embed_input_ids`` and the step's spans of prompt
    positions given as embeddings) ``inputs_embeds`` [T, hidden] with those rows written
    (``worker/prompt_embeds_runner.py``)."""
    positions, extra = inputs.positions, {}
    if token_types:
        extra["token_type_ids"] = token_type_ids(inputs, batch, requests)
    if prompt_embeds is not None:
        extra["inputs_embeds"] = merge_prompt_embeds(prompt_embeds[0], inputs,
                                                     prompt_embeds[1], requests)
    if mm_runner is not None:  # image rows merged; M-RoPE positions [3, T]
        extra["inputs_embeds"] = mm_runner.inputs_embeds(inputs, batch, requests)
        if mm_runner.uses_mrope:
            positions = mm_runner.positions(inputs, batch, requests)
    return positions, extra


def token_type_ids(inputs: ModelInputs, batch: InputBatch,
                   requests: dict[str, RequestState]) -> torch.Tensor:
    """int64 [T]: BERT's token type of each of the step's tokens, 1 from a scored pair's
    second segment on (``PoolingParams.second_segment_start``, compared with the token's
    position in its prompt), else 0. Encoders run whole prompts, so ``inputs.positions``
    are each token's index in its prompt."""
    starts = []
    for row in inputs.rows.tolist():
        state = requests.get(batch.req_ids[row])
        params = state.pooling_params if state is not None else None
        start = params.second_segment_start if params is not None else None
        starts.append(np.iinfo(np.int64).max if start is None else start)
    per_token = np.repeat(np.asarray(starts, dtype=np.int64), np.diff(inputs.query_start))
    positions = inputs.positions
    if per_token.shape[0] < positions.shape[0]:  # padding tokens after the step's own
        per_token = np.pad(per_token, (0, positions.shape[0] - per_token.shape[0]))
    return (positions >= torch.from_numpy(per_token).to(positions.device)).long()


def prepare_attention(attn_ctx: AttentionContext, metadata: list[AttentionMetadata],
                      block_size: int) -> None:
    """The backend's per-step preparation, once per KV-cache group."""
    for meta in metadata:
        attn_ctx.backend.prepare(meta, block_size)


def run_model(model: torch.nn.Module, attn_ctx: AttentionContext, cp_world_size: int,
              block_size: int, counters: ForwardCounters, inputs: ModelInputs,
              intermediate_tensors: IntermediateTensors | None, positions: torch.Tensor,
              extra: dict[str, Any], rows: torch.Tensor | None = None,
              lora_ctx: LoRAContext | None = None) -> torch.Tensor | IntermediateTensors:
    """One forward pass of ``model`` with the step's attention metadata bound: final hidden
    states [T, hidden] (last pipeline stage) or the tensors for the next stage. With
    ``cp_world_size`` > 1 a backend's token split (Ring Attention) runs this rank's share of a
    prefill's tokens and gathers the ``rows`` (int64 token indices; None: all) back; the
    step's LoRA mapping bound in ``lora_ctx`` then keeps only that share's tokens.
    ``counters`` gains the tokens run and the seconds the model took. A target returning aux
    hidden states (EAGLE-3's taps) returns ``(hidden, [T, hidden] each)``
    (``split_aux_hidden``)."""
    metadata = inputs.attn_metadata
    with attn_ctx.forward_context.bind(metadata):
        prepare_attention(attn_ctx, metadata, block_size)
        split = attn_ctx.backend.token_split(metadata[0]) if cp_world_size > 1 else None
        input_ids = inputs.input_ids
        if split is not None:  # Ring Attention: this rank's share of a prefill's tokens
            input_ids, positions = split.select(input_ids), split.select(positions, dim=-1)
            extra = {name: split.select(x) for name, x in extra.items()}
            if lora_ctx is not None:  # each token keeps its adapter
                lora_ctx.select(split.local)
        counters.dense_tokens += input_ids.shape[0]
        start = time.perf_counter()
        if intermediate_tensors is None:  # the first (or only) stage
            out = model(input_ids, positions, **extra)
        else:
            out = model(input_ids, positions, intermediate_tensors, **extra)
        counters.forward_s += time.perf_counter() - start
        if split is None:
            return out
        if isinstance(out, tuple):  # an EAGLE-3 target's taps gathered as its hidden states
            return split.gather(out[0], rows), [split.gather(t, rows) for t in out[1]]
        return split.gather(out, rows)


def split_aux_hidden(out: Any) -> tuple[Any, list[torch.Tensor] | None]:
    """A forward's output -> (final hidden states [T, H] or the tensors for the next stage,
    the aux hidden states [T, H] each of a target whose ``aux_hidden_state_layers`` are set
    (EAGLE-3's taps, ``models/llama.py``), else None)."""
    if isinstance(out, tuple):
        return out[0], list(out[1])
    return out, None
