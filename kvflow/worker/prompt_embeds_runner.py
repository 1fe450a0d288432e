"""The model runner's part for prompts given as embeddings (``enable_prompt_embeds``).

A request whose prompt came as embedding rows holds placeholder token ids (0) for its prompt
in the input batch. On a step that computes any of those positions (a whole prompt, a chunk
of it under chunked prefill, or all of it again after a preemption), the step's tokens are
embedded with the model's lookup as usual and each such position's row is then overwritten
with the request's own embedding row; the model runs on those ``inputs_embeds``. Positions
past the prompt (generated tokens) keep the lookup. Steps without such positions pass no
``inputs_embeds`` at all (the usual path, graphs included).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.request_state import RequestState

# (step token index of the first position, request id, first prompt position, end position)
Span = tuple[int, str, int, int]


def prompt_embed_spans(inputs: ModelInputs, batch: InputBatch) -> list[Span]:
    """The step's runs of prompt positions given as embeddings: one per scheduled row of
    such a request whose computed tokens have not yet covered its prompt (empty: none)."""
    rows = inputs.rows
    if len(rows) == 0 or not batch.prompt_is_embeds[rows].any():
        return []
    spans = []
    for k in np.flatnonzero(batch.prompt_is_embeds[rows]).tolist():
        row = int(rows[k])
        start = int(batch.num_computed_tokens[row])
        q0, q1 = int(inputs.query_start[k]), int(inputs.query_start[k + 1])
        end = min(start + q1 - q0, int(batch.num_prompt_tokens[row]))
        if start < end:
            spans.append((q0, batch.req_ids[row], start, end))
    return spans


def merge_prompt_embeds(embed_input_ids: Callable[[torch.Tensor], torch.Tensor],
                        inputs: ModelInputs, spans: list[Span],
                        states: dict[str, RequestState]) -> torch.Tensor:
    """[T, hidden] inputs of the step (model dtype): ``embed_input_ids(inputs.input_ids)``
    with the rows of ``spans`` (from :func:`prompt_embed_spans`, non-empty) replaced by the
    requests' prompt embeddings, cast to the model's dtype (each request's rows are cast once
    and kept cast)."""
    embeds = embed_input_ids(inputs.input_ids)
    dst, src = [], []
    for first, rid, start, end in spans:
        state = states[rid]
        if state.prompt_embeds.dtype != embeds.dtype or \
                state.prompt_embeds.device != embeds.device:
            state.prompt_embeds = state.prompt_embeds.to(embeds.device, embeds.dtype)
        dst.append(torch.arange(first, first + end - start))
        src.append(state.prompt_embeds[start:end])
    index = torch.cat(dst).to(embeds.device)
    embeds.index_copy_(0, index, torch.cat(src))
    return embeds
