"""Turns a SchedulerOutput into the model's input tensors for one step (no per-token loops)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvflow.attention.backend import AttentionMetadata
from kvflow.core.scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    """One step's flattened batch.

    Attributes:
        input_ids: int64 [num_tokens]; positions: int64 [num_tokens].
        attn_meta: slot mapping, block tables and lengths for attention.
        logits_indices: int64 [num_sampling_reqs]; the last token of each request that samples.
        sampling_rows: the ScheduledRequest index of each sampling row.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_rows: list[int]


def build_model_inputs(sched: SchedulerOutput, block_size: int,
                       device: torch.device) -> ModelInputs:
    """Flatten the scheduled requests into token-major tensors on ``device``."""
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
    max_blocks = max(len(r.block_ids) for r in reqs)
    block_table = np.zeros((len(reqs), max_blocks), np.int64)
    for i, r in enumerate(reqs):
        block_table[i, :len(r.block_ids)] = r.block_ids
    slot_mapping = (block_table[req_of_token, positions // block_size] * block_size
                    + positions % block_size)
    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in reqs), np.int64, num_tokens)
    sampling_rows = [i for i, r in enumerate(reqs) if r.do_sample]
    logits_indices = query_start[1:][sampling_rows] - 1

    def to(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(x).to(device=device, dtype=dtype, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=to(slot_mapping, torch.int64),
        query_start_loc=to(query_start, torch.int32),
        seq_lens=to(seq_lens, torch.int32),
        block_table=to(block_table, torch.int32),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        num_actual_tokens=num_tokens,
    )
    return ModelInputs(to(input_ids, torch.int64), to(positions, torch.int64), meta,
                       to(logits_indices, torch.int64), sampling_rows)
