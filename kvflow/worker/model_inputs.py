"""Builds one step's model inputs from the persistent input batch (no per-token loops).

The batch rows a step schedules are gathered in row order; positions, input ids, the slot
mapping and one block table per KV-cache group come from numpy fancy indexing of the batch's
columns, and ``InputStager`` moves them to the device in two transfers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.kv_cache_interface import SlidingWindowSpec
from kvflow.layers.rotary import LongPromptRope
from kvflow.worker.input_batch import InputBatch


@dataclass
class ModelInputs:
    """One step's flattened batch.

    Attributes:
        input_ids: int64 [num_tokens]; positions: int64 [num_tokens], the rows of the model's
            RoPE table (the token positions, but for a LongRoPE model's long prompts, see
            :class:`~kvflow.layers.rotary.LongPromptRope`).
        attn_metadata: slot mapping, block table and lengths for attention, one per KV-cache
            group (the groups differ only in slot mapping and block table).
        logits_indices: int64 [num_sampling_reqs]; the last token of each request that samples.
        sample_rows: int64 [num_sampling_reqs]; the batch row of each request that samples.
        pending_token_index / pending_sample_index: int64 [P] each: input token
            ``pending_token_index[i]`` is entry ``pending_sample_index[i]`` of the previous
            step's sampled tensor (a token still on the device; async scheduling).
        rows / query_start: int64 [R] the scheduled batch rows in batch order and int64
            [R + 1] their first token (host arrays).
        samples_every_token: every token is the last of its request and samples (an
            all-decode step): ``logits_indices`` is ``arange(num_tokens)``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]
    logits_indices: torch.Tensor
    sample_rows: np.ndarray
    pending_token_index: torch.Tensor
    pending_sample_index: torch.Tensor
    rows: np.ndarray
    query_start: np.ndarray
    samples_every_token: bool = False


def build_model_inputs(batch: InputBatch, num_scheduled: np.ndarray, block_size: int,
                       stager: InputStager, num_computed: np.ndarray | None = None,
                       long_prompt_rope: LongPromptRope | None = None) -> ModelInputs:
    """Flatten the scheduled rows into token-major tensors on the stager's device.

    Args:
        batch: the persistent batch (its ``num_computed_tokens`` already set for this step).
        num_scheduled: int64 [batch.num_reqs]; tokens each row computes this step (0: none).
        block_size: tokens per KV block.
        stager: moves the arrays to the device.
        num_computed: int64 [batch.num_reqs], where each row's tokens start instead of
            ``batch.num_computed_tokens`` (a speculative-decoding draft model's passes).
        long_prompt_rope: the model's LongRoPE rows for long prompts (None: the positions
            are the table rows).
    """
    rows = np.flatnonzero(num_scheduled)
    index = batch.index(rows)  # a slice when every row is scheduled
    query_lens = num_scheduled[index]
    computed = (batch.num_computed_tokens if num_computed is None else num_computed)[index]
    query_start = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    seq_lens = computed + query_lens
    req_of_token, positions = _token_positions(computed, query_lens, query_start, num_tokens)
    input_ids = batch.token_ids[rows[req_of_token], positions]
    sampling = np.flatnonzero(seq_lens >= batch.num_tokens[index])  # reaches the row's end
    logits_indices = query_start[1:][sampling] - 1
    pending = np.flatnonzero(batch.pending_sample[index] >= 0)
    if num_computed is not None and len(pending):  # only those whose pending token is computed
        last = batch.num_tokens[rows[pending]] - 1
        pending = pending[(last >= computed[pending]) & (last < seq_lens[pending])]
    pending_tokens, pending_samples = pending, pending  # none (lock-step): both empty
    if len(pending):  # (each numpy call costs microseconds, on empty arrays too)
        pending_tokens = query_start[pending] + batch.num_tokens[rows[pending]] - 1 - \
            computed[pending]
        pending_samples = batch.pending_sample[rows[pending]]
    groups = [_block_table_and_slots(batch, g, index, req_of_token, positions, block_size)
              for g in range(len(batch.kv_cache_specs))]
    rope_rows = positions if long_prompt_rope is None else \
        long_prompt_rope.table_rows(positions, batch.num_prompt_tokens[rows[req_of_token]])
    i64, i32 = stager.stage(
        [input_ids, rope_rows, logits_indices, pending_tokens, pending_samples,
         *(s for _, s in groups)],
        [query_start, seq_lens, *(table for table, _ in groups)])
    query_start_t, seq_lens_t = i32[:2]
    attn_metadata = [
        AttentionMetadata(slot_mapping=slots, query_start_loc=query_start_t,
                          seq_lens=seq_lens_t, block_table=table,
                          max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
                          num_actual_tokens=num_tokens)
        for slots, table in zip(i64[5:], i32[2:])]
    return ModelInputs(i64[0], i64[1], attn_metadata, i64[2], rows[sampling], i64[3], i64[4],
                       rows, query_start, len(sampling) == num_tokens)


class InputStager:
    """Moves a step's integer arrays to the device in two transfers (int64 and int32).

    On CUDA the arrays are packed into persistent pinned host buffers and copied with
    ``non_blocking=True``; an event recorded after the copies guards the buffers, so the next
    step only overwrites them once the previous transfer has finished. On CPU each array
    becomes a tensor sharing its memory (the arrays are fresh each step: no copy, no packing).

    Args:
        device: where the model runs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._copied = None  # CUDA event after the last transfer

    def stage(self, int64_arrays: list[np.ndarray],
              int32_arrays: list[np.ndarray]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Returns the arrays as device tensors (same shapes), int64 and int32 respectively."""
        if self._copied is not None:
            self._copied.synchronize()
        out64 = self._stage(int64_arrays, torch.int64)
        out32 = self._stage(int32_arrays, torch.int32)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out64, out32

    def _stage(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self.pinned:
            host = self._host.get(dtype)
            if host is None or host.numel() < total:
                host = torch.empty(max(total, 2 * (host.numel() if host is not None else 0)),
                                   dtype=dtype, pin_memory=True)
                self._host[dtype] = host
            flat = host[:total]
            np.concatenate([a.ravel() for a in arrays], out=flat.numpy(), casting="unsafe")
            flat = flat.to(self.device, non_blocking=True)
        else:  # CPU: the arrays themselves, no packing
            np_dtype = np.int64 if dtype == torch.int64 else np.int32
            return [torch.from_numpy(np.ascontiguousarray(a, np_dtype)) for a in arrays]
        views, offset = [], 0
        for a, n in zip(arrays, sizes):
            views.append(flat[offset:offset + n].view(a.shape))
            offset += n
        return views


def _token_positions(computed: np.ndarray, query_lens: np.ndarray, query_start: np.ndarray,
                     num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(request index, position) of every token [num_tokens] each: a token's position is its
    request's computed count plus its offset in the request's chunk."""
    if num_tokens == len(query_lens):  # all decodes: one token per request
        return np.arange(num_tokens), computed.copy()
    req_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    return req_of_token, \
        computed[req_of_token] + np.arange(num_tokens) - query_start[:-1][req_of_token]


def _block_table_and_slots(batch: InputBatch, group: int, rows: np.ndarray | slice,
                           req_of_token: np.ndarray, positions: np.ndarray, block_size: int
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Group ``group``'s block table of ``rows`` [R, max_blocks] (int32, padded with the null
    block 0) and the slot of every token [num_tokens] (int64). In a sliding-window group the
    blocks before the window of the row's first query are the null block, as in the
    scheduler's tables (the KV-cache manager released them)."""
    width = int(batch.num_blocks[group][rows].max())
    table = batch.block_tables[group][rows, :width]  # entries past a row's blocks are 0
    if isinstance(rows, slice):  # a view of the batch: copy (the step owns its arrays)
        table = table.copy()
    spec = batch.kv_cache_specs[group]
    if isinstance(spec, SlidingWindowSpec):
        first = spec.first_needed_blocks(batch.num_computed_tokens[rows])
        table[np.arange(width) < first[:, None]] = 0
    block_index, offset = np.divmod(positions, block_size)
    slot_mapping = table[req_of_token, block_index].astype(np.int64) * block_size + offset
    return table, slot_mapping
