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

from kvflow.core.request_errors import MULTI_MODAL_DATA
from kvflow.inputs.multimodal import MultiModalFeature
from kvflow.sched_output import SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import ModelInputs
from kvflow.worker.request_failures import Failures, is_request_fault, request_failure
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

    def run_encoders(self, sched: SchedulerOutput, states: dict[str, RequestState],
                     failures: Failures | None = None) -> None:
        """Apply the step's cache drops, then encode the images it scheduled (all in one
        call). When that call raises, each image is encoded alone: an image that fails
        alone, or whose rows do not match its placeholder count, fails every request that
        holds it (recorded in ``failures``; without it, raised), the others are cached.

        Raises:
            Exception: what the encoder raised when no single image can be blamed (every
                image fails alone too), or running out of memory; ValueError for an image
                whose rows do not match its placeholders when ``failures`` is None.
        """
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
        try:
            encoded = self._encode(features)
        except Exception as error:
            if failures is None or not is_request_fault(error):
                raise
            encoded = self._encode_each(features, error)
        bad: dict[str, Exception] = {}
        for f, rows in zip(features, encoded):
            if isinstance(rows, Exception):
                bad[f.identifier] = rows
            elif rows.shape[0] != f.length:
                bad[f.identifier] = ValueError(
                    f"the vision encoder gave {rows.shape[0]} rows for an image of "
                    f"{f.length} placeholder tokens (grid_thw {tuple(f.grid_thw)})")
            else:
                self.encoder_cache[f.identifier] = rows
        self.num_encoded += len(features)
        if bad:
            if failures is None:
                raise next(iter(bad.values()))
            _fail_holders(bad, states, failures)

    def _encode(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """The encoder's rows of ``features``, in one call."""
        sizes = {}  # the original image sizes, for a model that needs them (LLaVA-NeXT)
        if any(f.image_size is not None for f in features):
            sizes["image_sizes"] = [None if f.image_size is None else tuple(f.image_size)
                                    for f in features]
        return self.model.embed_multimodal([f.pixel_values() for f in features],
                                           [tuple(f.grid_thw) for f in features], **sizes)

    def _encode_each(self, features: list[MultiModalFeature], error: Exception
                     ) -> list[torch.Tensor | Exception]:
        """Each image encoded alone after the batched call raised ``error``: its rows, or
        what it raised. Raises ``error`` when every image fails alone (nothing singles one
        out: the encoder's fault, or all of them are bad and the step has nothing else),
        unless there is only one image, which is then to blame."""
        out: list[torch.Tensor | Exception] = []
        for f in features:
            try:
                out.append(self._encode([f])[0])
            except Exception as alone:
                if not is_request_fault(alone):
                    raise
                out.append(alone)
        if len(features) > 1 and all(isinstance(o, Exception) for o in out):
            raise error
        return out

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
                if lo < hi and f.identifier in self.encoder_cache:  # else: failed
                    # (``run_encoders``): the request is dropped after the step
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


def _fail_holders(bad: dict[str, Exception], states: dict[str, RequestState],
                  failures: Failures) -> None:
    """Record the failure of every request holding an image of ``bad`` (identifier -> what
    encoding it alone raised), naming the image by its index in the request."""
    for rid, state in states.items():
        for i, f in enumerate(state.mm_features or ()):
            if f.identifier in bad and rid not in failures:
                failures[rid] = request_failure(rid, f"{f.modality} {i}", bad[f.identifier],
                                                MULTI_MODAL_DATA)
