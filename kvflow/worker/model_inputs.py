"""Turns a SchedulerOutput into the model's input tensors for one step (no per-token loops).

A function of each step's SchedulerOutput, rebuilt every step (not a persistent batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.sched_output import SchedulerOutput


@dataclass
class ModelInputs:
    """One step's flattened batch.

    Attributes:
        input_ids: int64 [num_tokens]; positions: int64 [num_tokens].
        attn_metadata: slot mapping, block table and lengths for attention, one per KV-cache
            group (the groups differ only in slot mapping and block table).
        logits_indices: int64 [num_sampling_reqs]; the last token of each request that samples.
        sampling_rows: the ScheduledRequest index of each sampling row.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: list[AttentionMetadata]
    logits_indices: torch.Tensor
    sampling_rows: list[int]


def build_model_inputs(sched: SchedulerOutput, block_size: int,
                       stager: InputStager) -> ModelInputs:
    """Flatten the scheduled requests into token-major tensors on the stager's device."""
    reqs = sched.scheduled
    query_lens = np.fromiter((r.num_scheduled_tokens for r in reqs), np.int64, len(reqs))
    computed = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, len(reqs))
    query_start = np.zeros(len(reqs) + 1, np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    seq_lens = computed + query_lens
    # Position of every token: its request's computed count plus its offset in the chunk.
    req_of_token = np.repeat(np.arange(len(reqs)), query_lens)
    positions = computed[req_of_token] + np.arange(num_tokens) - query_start[:-1][req_of_token]
    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in reqs), np.int64, num_tokens)
    sampling_rows = [i for i, r in enumerate(reqs) if r.do_sample]
    logits_indices = query_start[1:][sampling_rows] - 1
    # One block table and slot mapping per KV-cache group.
    groups = [_block_table_and_slots([r.block_ids[g] for r in reqs], req_of_token, positions,
                                     block_size)
              for g in range(len(reqs[0].block_ids))]
    i64, i32 = stager.stage([input_ids, positions, logits_indices, *(s for _, s in groups)],
                            [query_start, seq_lens, *(table for table, _ in groups)])
    input_ids_t, positions_t, logits_t = i64[:3]
    query_start_t, seq_lens_t = i32[:2]
    attn_metadata = [
        AttentionMetadata(slot_mapping=slots, query_start_loc=query_start_t,
                          seq_lens=seq_lens_t, block_table=table,
                          max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
                          num_actual_tokens=num_tokens)
        for slots, table in zip(i64[3:], i32[2:])]
    return ModelInputs(input_ids_t, positions_t, attn_metadata, logits_t, sampling_rows)


class InputStager:
    """Moves a step's integer arrays to the device in two transfers (int64 and int32).

    On CUDA the arrays are packed into persistent pinned host buffers and copied with
    ``non_blocking=True``; an event recorded after the copies guards the buffers, so the next
    step only overwrites them once the previous transfer has finished. On CPU the packed arrays
    are used as they are (no copy, no buffer reuse).

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
        else:
            np_dtype = np.int64 if dtype == torch.int64 else np.int32
            flat = torch.from_numpy(np.concatenate([a.ravel() for a in arrays]).astype(np_dtype))
        views, offset = [], 0
        for a, n in zip(arrays, sizes):
            views.append(flat[offset:offset + n].view(a.shape))
            offset += n
        return views


def _block_table_and_slots(block_ids: list[list[int]], req_of_token: np.ndarray,
                           positions: np.ndarray, block_size: int
                           ) -> tuple[np.ndarray, np.ndarray]:
    """Padded block table [num_reqs, max_blocks] and the slot of every token [num_tokens]."""
    block_table = np.zeros((len(block_ids), max(len(b) for b in block_ids)), np.int64)
    for i, ids in enumerate(block_ids):
        block_table[i, :len(ids)] = ids
    slot_mapping = (block_table[req_of_token, positions // block_size] * block_size
                    + positions % block_size)
    return block_table, slot_mapping
