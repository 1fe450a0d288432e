"""build_model_inputs: flattened positions, slot mapping, block tables and logits indices of
the scheduled rows of an InputBatch, against hand-computed values, through both staging paths
(CPU arrays and the reused-buffer path CUDA takes, exercised here with a plain host buffer
standing in for pinned memory)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from kvflow.sampling_params import SamplingParams
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.model_inputs import InputStager, build_model_inputs
from kvflow.worker.request_state import RequestState

BLOCK_SIZE = 4
FULL = FullAttentionSpec(BLOCK_SIZE, 1, 8, torch.float32)


def _batch(specs=(FULL,)) -> InputBatch:
    return InputBatch(8, specs)


def _add(batch, rid, tokens, computed, block_ids):
    state = RequestState(rid, tokens, SamplingParams(), None)
    batch.add_request(state, [], block_ids, computed)


def _three_rows() -> tuple[InputBatch, np.ndarray]:
    batch = _batch()
    _add(batch, "a", [11, 12, 13, 14, 15], 0, ([7],))  # prefill chunk of 3 from position 0
    _add(batch, "b", [1, 2, 3, 4, 5, 21], 5, ([3, 9],))  # decode at position 5 (block 9)
    _add(batch, "c", [1, 2, 3, 31, 32], 3, ([4, 5],))  # chunk at positions 3, 4 (2 blocks)
    return batch, np.array([3, 1, 2])


def _check(inputs) -> None:
    (meta,) = inputs.attn_metadata  # one KV-cache group
    assert inputs.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert inputs.positions.tolist() == [0, 1, 2, 5, 3, 4]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 19, 20]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.seq_lens.tolist() == [3, 6, 5]
    assert meta.block_table.tolist() == [[7, 0], [3, 9], [4, 5]]
    assert meta.block_table.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert inputs.logits_indices.tolist() == [3, 5]
    assert inputs.sample_rows.tolist() == [1, 2]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (3, 6, 6)
    assert inputs.pending_token_index.numel() == 0


def test_cpu_staging():
    batch, num = _three_rows()
    _check(build_model_inputs(batch, num, BLOCK_SIZE, InputStager(torch.device("cpu"))))


def _fake_pinned_stager(monkeypatch) -> InputStager:
    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("E", (), {
        "record": lambda self: None, "synchronize": lambda self: None})())
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    stager = InputStager(torch.device("cpu"))
    stager.pinned = True
    return stager


def test_reused_buffer_staging(monkeypatch):
    stager = _fake_pinned_stager(monkeypatch)
    batch, num = _three_rows()
    _check(build_model_inputs(batch, num, BLOCK_SIZE, stager))
    buffers = dict(stager._host)
    _check(build_model_inputs(batch, num, BLOCK_SIZE, stager))  # second step reuses them
    assert all(stager._host[k] is v for k, v in buffers.items())


@pytest.mark.parametrize("n", [1, 40])
def test_buffer_grows(monkeypatch, n):
    stager = _fake_pinned_stager(monkeypatch)
    batch = _batch()
    for i in range(3):
        _add(batch, str(i), [i] * n, 0, (list(range(1, n // 4 + 2)),))
    inputs = build_model_inputs(batch, np.array([n] * 3), BLOCK_SIZE, stager)
    assert inputs.input_ids.tolist() == [i for i in range(3) for _ in range(n)]
    assert inputs.logits_indices.tolist() == [n - 1, 2 * n - 1, 3 * n - 1]


def test_unscheduled_rows_are_left_out():
    batch, _ = _three_rows()
    inputs = build_model_inputs(batch, np.array([0, 1, 0]), BLOCK_SIZE,
                                InputStager(torch.device("cpu")))
    (meta,) = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [21] and inputs.positions.tolist() == [5]
    assert meta.block_table.tolist() == [[3, 9]] and inputs.sample_rows.tolist() == [1]


def test_one_metadata_per_kv_cache_group():
    """Two KV-cache groups: each gets its own block table and slot mapping; the sliding
    group's blocks wholly before the window are the null block, as the KV-cache manager's
    table has them; the rest of the layout is shared."""
    batch = _batch((FULL, SlidingWindowSpec(BLOCK_SIZE, 1, 8, torch.float32, window=2)))
    _add(batch, "a", [1, 2, 3, 4, 5, 6, 5, 6], 6, ([2, 8], [6, 3]))
    inputs = build_model_inputs(batch, np.array([2]), BLOCK_SIZE,
                                InputStager(torch.device("cpu")))
    full, local = inputs.attn_metadata
    # window 2 at position 6: keys 5.. -> block 0 (positions 0-3) is released
    assert full.block_table.tolist() == [[2, 8]] and local.block_table.tolist() == [[0, 3]]
    assert full.slot_mapping.tolist() == [8 * 4 + 2, 8 * 4 + 3]  # positions 6, 7
    assert local.slot_mapping.tolist() == [3 * 4 + 2, 3 * 4 + 3]
    for meta in (full, local):
        assert meta.query_start_loc.tolist() == [0, 2] and meta.seq_lens.tolist() == [8]


def test_pending_tokens_are_pointed_at():
    """A row whose last token is still on the device (async scheduling) tells the runner
    which input token to take from which entry of the previous sampled tensor."""
    batch, _ = _three_rows()
    batch.add_pending_tokens(np.array([1, 2]))  # b and c each sampled one token
    batch.num_computed_tokens[1:3] = [6, 5]
    inputs = build_model_inputs(batch, np.array([0, 1, 1]), BLOCK_SIZE,
                                InputStager(torch.device("cpu")))
    assert inputs.pending_token_index.tolist() == [0, 1]
    assert inputs.pending_sample_index.tolist() == [0, 1]
    assert inputs.positions.tolist() == [6, 5]
