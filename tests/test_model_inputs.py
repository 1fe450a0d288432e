"""build_model_inputs: flattened positions, slot mapping, block tables and logits indices
against hand-computed values, through both staging paths (CPU arrays and the reused-buffer
path CUDA takes, exercised here with a plain host buffer standing in for pinned memory)."""

from __future__ import annotations

import pytest
import torch

from kvflow.sampling_params import SamplingParams
from kvflow.sched_output import ScheduledRequest, SchedulerOutput
from kvflow.worker.model_inputs import InputStager, build_model_inputs


def _req(rid, token_ids, computed, block_ids, do_sample):
    return ScheduledRequest(rid, token_ids, computed, (block_ids,), do_sample, SamplingParams(),
                            [], None)


SCHED = SchedulerOutput(scheduled=[
    _req("a", [11, 12, 13], 0, [7], False),          # prefill chunk of 3 from position 0
    _req("b", [21], 5, [3, 9], True),                # decode at position 5 (block 9, offset 1)
    _req("c", [31, 32], 3, [4, 5], True),            # chunk at positions 3, 4 crossing blocks
])
BLOCK_SIZE = 4


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
    assert inputs.sampling_rows == [1, 2]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_actual_tokens) == (3, 6, 6)


def test_cpu_staging():
    _check(build_model_inputs(SCHED, BLOCK_SIZE, InputStager(torch.device("cpu"))))


def test_reused_buffer_staging(monkeypatch):
    class _Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    stager = InputStager(torch.device("cpu"))
    stager.pinned = True
    _check(build_model_inputs(SCHED, BLOCK_SIZE, stager))
    buffers = dict(stager._host)
    _check(build_model_inputs(SCHED, BLOCK_SIZE, stager))  # second step reuses the buffers
    assert all(stager._host[k] is v for k, v in buffers.items())


@pytest.mark.parametrize("n", [1, 40])
def test_buffer_grows(monkeypatch, n):
    real_empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", lambda: type("E", (), {
        "record": lambda self: None, "synchronize": lambda self: None})())
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: real_empty(*a, **k))
    stager = InputStager(torch.device("cpu"))
    stager.pinned = True
    sched = SchedulerOutput(scheduled=[_req(str(i), [i] * n, 0, list(range(1, n // 4 + 2)),
                                            True) for i in range(3)])
    inputs = build_model_inputs(sched, BLOCK_SIZE, stager)
    assert inputs.input_ids.tolist() == [i for i in range(3) for _ in range(n)]
    assert inputs.logits_indices.tolist() == [n - 1, 2 * n - 1, 3 * n - 1]


def test_one_metadata_per_kv_cache_group():
    """Two KV-cache groups: each gets its own block table and slot mapping (group 1's leading
    entry released to the null block), the rest of the layout is shared."""
    sched = SchedulerOutput(scheduled=[
        ScheduledRequest("a", [5, 6], 6, ([2, 8], [0, 3]), True, SamplingParams(), [], None)])
    inputs = build_model_inputs(sched, BLOCK_SIZE, InputStager(torch.device("cpu")))
    full, local = inputs.attn_metadata
    assert full.block_table.tolist() == [[2, 8]] and local.block_table.tolist() == [[0, 3]]
    assert full.slot_mapping.tolist() == [8 * 4 + 2, 8 * 4 + 3]  # positions 6, 7
    assert local.slot_mapping.tolist() == [3 * 4 + 2, 3 * 4 + 3]
    for meta in (full, local):
        assert meta.query_start_loc.tolist() == [0, 2] and meta.seq_lens.tolist() == [8]
