"""The model runner's multimodal part: the encoder cache, image embeddings merged at the
placeholders, and M-RoPE positions.

Each step, before the forward pass: drop the encoder-cache entries the scheduler freed, run
the vision encoder once over every image the scheduler scheduled (all in one call), then build
the step's input embeddings (token embeddings, with each image's rows written over its
placeholder tokens that the step computes; a chunk may hold part of an image) and, for M-RoPE
models, the ``[3, num_tokens]`` positions from each request's position ids (computed once,
when the request arrives: they depend on its image grids). The cache is keyed by image
identifier, so an image shared by several requests is encoded once while it stays cached;
what stays cached is the scheduler's decision (``core/encoder_cache_manager.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvflow.sched_output import SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.request_state import RequestState


class MultiModalRunner:
    """Encoder cache and multimodal inputs for one vision-language model.

    Args:
        model: a model with ``embed_multimodal``, ``embed_input_ids`` and, when
            ``uses_mrope``, ``get_mrope_input_positions``.
        runs_encoder: whether this rank embeds tokens (the first pipeline stage).
    """

    def __init__(self, model: Any, runs_encoder: bool = True) -> None:
        self.model = model
        self.runs_encoder = runs_encoder
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoded = 0  # images run through the encoder (for tests and benchmarks)

    def add_request(self, state: RequestState) -> None:
        """Compute a new request's M-RoPE position ids (kept on its state)."""
        if self.uses_mrope and state.mm_features:
            state.mrope_positions, state.mrope_delta = self.model.get_mrope_input_positions(
                state.prompt_token_ids, state.mm_features)

    def run_encoders(self, sched: SchedulerOutput, states: dict[str, RequestState]) -> None:
        """Apply the step's cache drops, then encode the images it scheduled."""
        for identifier in sched.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        if not self.runs_encoder or not sched.scheduled_encoder_inputs:
            return
        todo = {}
        for rid, indices in sched.scheduled_encoder_inputs.items():
            for i in indices:
                f = states[rid].mm_features[i]
                todo.setdefault(f.identifier, f)
        features = list(todo.values())
        sizes = {}  # the original image sizes, for a model that needs them (LLaVA-NeXT)
        if any(f.image_size is not None for f in features):
            sizes["image_sizes"] = [None if f.image_size is None else tuple(f.image_size)
                                    for f in features]
        outputs = self.model.embed_multimodal([f.pixel_values() for f in features],
                                              [tuple(f.grid_thw) for f in features], **sizes)
        for f, rows in zip(features, outputs):
            self.encoder_cache[f.identifier] = rows
        self.num_encoded += len(features)

    def inputs_embeds(self, inputs: ModelInputs, batch: InputBatch,
                      states: dict[str, RequestState]) -> torch.Tensor | None:
        """[T, hidden] embeddings of the step's tokens with image rows merged in (None on a
        pipeline stage that does not embed)."""
        if not self.runs_encoder:
            return None
        embeds = self.model.embed_input_ids(inputs.input_ids)
        dst, src = [], []
        for k, row in enumerate(inputs.rows.tolist()):
            state = states.get(batch.req_ids[row])
            if state is None or not state.mm_features:
                continue
            start, end = int(batch.num_computed_tokens[row]), \
                int(batch.num_computed_tokens[row] + inputs.query_start[k + 1]
                    - inputs.query_start[k])
            for f in state.mm_features:
                lo, hi = max(f.offset, start), min(f.end, end)
                if lo < hi:
                    first = int(inputs.query_start[k]) + lo - start
                    dst.append(torch.arange(first, first + hi - lo))
                    src.append(self.encoder_cache[f.identifier][lo - f.offset:hi - f.offset])
        if dst:
            index = torch.cat(dst).to(embeds.device)
            embeds.index_copy_(0, index, torch.cat(src).to(embeds.dtype))
        return embeds

    def positions(self, inputs: ModelInputs, batch: InputBatch,
                  states: dict[str, RequestState]) -> torch.Tensor:
        """int64 [3, T] M-RoPE positions of the step's tokens: a request's prompt position
        ids, then ``position + delta`` for generated tokens; text-only requests repeat their
        positions on all three axes."""
        num_tokens = int(inputs.query_start[-1])
        out = np.empty((3, num_tokens), np.int64)
        for k, row in enumerate(inputs.rows.tolist()):
            q0, q1 = int(inputs.query_start[k]), int(inputs.query_start[k + 1])
            start = int(batch.num_computed_tokens[row])
            pos = np.arange(start, start + q1 - q0)
            state = states.get(batch.req_ids[row])
            if state is None or state.mrope_positions is None:
                out[:, q0:q1] = pos
                continue
            prompt = state.mrope_positions
            in_prompt = min(q1 - q0, max(0, prompt.shape[1] - start))
            out[:, q0:q0 + in_prompt] = prompt[:, start:start + in_prompt]
            out[:, q0 + in_prompt:q1] = pos[in_prompt:] + state.mrope_delta
        return torch.from_numpy(out).to(inputs.input_ids.device)
