"""The persistent input batch and the per-step diffs that feed it.

Row bookkeeping (condensing on removal, widening, pending tokens, penalty arrays) is checked
against hand-computed values. The protocol test drives a real Scheduler (two KV-cache groups,
one with a sliding window, prefix caching, a pool small enough to preempt) and an InputBatch
fed only the scheduler's messages; every step, the batch's model inputs must equal inputs
built with plain Python from the scheduler's own full state (every request's tokens and block
tables): the oracle the diffs must reproduce.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.kv_cache_interface import FullAttentionSpec
from kvflow.request import Request
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sampling_params import SamplingParams
from kvflow.sched_output import SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.input_batch_diffs import apply_scheduler_output, num_scheduled_per_row
from kvflow.worker.model_inputs import InputStager, build_model_inputs
from kvflow.worker.request_state import RequestState
from tests.core.fake_kv import fake_kv_cache_config

BS = 4
FULL = FullAttentionSpec(BS, 1, 8, torch.float32)


def _state(rid: str, prompt: list[int], **params) -> RequestState:
    return RequestState(rid, prompt, SamplingParams(**params), 2)


# ---- rows -------------------------------------------------------------------------------------
def test_removing_a_row_moves_the_last_one_into_it():
    batch = InputBatch(4, [FULL])
    batch.add_request(_state("a", [1, 2, 3], temperature=0.5), [], ([5],), 0)
    batch.add_request(_state("b", [4, 5], top_k=3, logprobs=2), [9], ([6, 7],), 2)
    batch.add_request(_state("c", [6], top_p=0.5, min_tokens=4), [8, 8], ([1],), 1)
    assert batch.remove_request("a") and not batch.remove_request("a")
    assert batch.req_ids == ["c", "b"] and batch.req_id_to_index == {"c": 0, "b": 1}
    assert batch.token_ids[0, :3].tolist() == [6, 8, 8] and batch.num_tokens[:2].tolist() == [3, 3]
    assert batch.num_prompt_tokens[:2].tolist() == [1, 2]
    assert batch.num_computed_tokens[:2].tolist() == [1, 2]
    assert batch.block_tables[0][:2, :3].tolist() == [[1, 0, 0], [6, 7, 0]]  # no stale 5
    assert batch.top_p[0] == 0.5 and batch.top_k[1] == 3 and batch.temperature[0] == 1.0
    assert batch.min_tokens_banned == {"c": [2]} and batch.num_logprobs == {"b": 2}
    batch.remove_request("b")
    assert batch.num_logprobs == {} and batch.req_ids == ["c"]


def test_columns_widen_when_a_row_grows():
    batch = InputBatch(2, [FULL])
    batch.add_request(_state("a", [7] * 10), [], ([1],), 0)
    batch.write_tokens(0, 10, list(range(200)))
    for g_ids in ([2] * 40, [3] * 2):
        batch.append_block_ids(0, 0, g_ids)
    assert batch.num_tokens[0] == 210 and batch.token_ids[0, 209] == 199
    assert batch.num_blocks[0][0] == 43 and batch.block_tables[0][0, 41:44].tolist() == [3, 3, 0]


def test_pending_tokens_are_filled_in_their_rows():
    batch = InputBatch(4, [FULL])
    for rid in "abc":
        batch.add_request(_state(rid, [1, 2]), [], ([1],), 2)
    batch.add_pending_tokens(np.array([0, 2]))  # a and c sampled (entries 0 and 1)
    assert batch.num_tokens[:3].tolist() == [3, 2, 3]
    batch.remove_request("a")  # c moves to row 0; a's pending token is dropped with it
    batch.fill_pending_tokens(np.array([40, 41]))
    assert batch.req_ids == ["c", "b"] and batch.token_ids[0, :3].tolist() == [1, 2, 41]
    assert (batch.pending_sample[:2] == -1).all()


def test_rows_of_follows_rows_moved_between_equal_lookups():
    """``rows_of`` keeps its last answer only while no row moved: the same ids asked again
    after a removal condensed the rows get the new rows (hand-computed), and the per-step
    updates that use it write each request's own row."""
    batch = InputBatch(4, [FULL])
    for rid in "abcd":
        batch.add_request(_state(rid, [1, 2, 3]), [], ([1],), 1)
    ids = ["d", "b", "c"]
    first = batch.rows_of(ids)
    assert first.tolist() == [3, 1, 2] and batch.rows_of(list(ids)) is first  # kept
    assert not first.flags.writeable
    assert batch.rows_of(["b", "d", "c"]).tolist() == [1, 3, 2]  # other ids: looked up
    assert batch.rows_of(ids).tolist() == [3, 1, 2]
    batch.remove_request("a")  # d moves from row 3 to row 0
    assert batch.rows_of(ids).tolist() == [0, 1, 2]
    with pytest.raises(KeyError):
        batch.rows_of(["a"])
    sched = SchedulerOutput(num_scheduled_tokens={"d": 1, "b": 1, "c": 1})
    sched.scheduled_cached_reqs.req_ids = ids
    sched.scheduled_cached_reqs.num_computed_tokens = [7, 5, 6]
    for _ in range(2):  # the second step's lookups are the kept ones
        apply_scheduler_output(batch, sched, {})
        assert batch.num_computed_tokens[:3].tolist() == [7, 5, 6]  # rows d, b, c
        assert num_scheduled_per_row(batch, sched).tolist() == [1, 1, 1]
    batch.remove_request("b")  # d stays at row 0, c moves to row 1
    sched.num_scheduled_tokens = {"c": 2}
    sched.scheduled_cached_reqs.req_ids, sched.scheduled_cached_reqs.num_computed_tokens = \
        ["c"], [9]
    apply_scheduler_output(batch, sched, {})
    assert batch.num_computed_tokens[:2].tolist() == [7, 9]
    assert num_scheduled_per_row(batch, sched).tolist() == [0, 2]


def test_prompt_and_output_ids_are_padded():
    batch = InputBatch(2, [FULL])
    batch.add_request(_state("a", [5, 6, 7]), [8], ([1],), 0)
    batch.add_request(_state("b", [9]), [10, 11, 12], ([1],), 0)
    prompt, output = batch.prompt_and_output_ids(np.array([0, 1]))
    assert prompt.tolist() == [[5, 6, 7], [9, -1, -1]]
    assert output.tolist() == [[8, -1, -1], [10, 11, 12]]


def test_a_full_batch_refuses_another_row():
    batch = InputBatch(1, [FULL])
    batch.add_request(_state("a", [1]), [], ([1],), 0)
    with pytest.raises(ValueError, match="at most 1"):
        batch.add_request(_state("b", [1]), [], ([1],), 0)
    roomy = InputBatch(2, [FULL])
    roomy.add_request(_state("a", [1]), [], ([1],), 0)
    with pytest.raises(ValueError, match="already"):
        roomy.add_request(_state("a", [1]), [], ([1],), 0)


# ---- the protocol -----------------------------------------------------------------------------
def _reference_inputs(sched: Scheduler, sched_out: SchedulerOutput, computed_before: dict,
                      order: list[str]) -> dict:
    """Model inputs from the scheduler's full state, with plain Python (the oracle)."""
    kv, ref = sched.kv, {"ids": [], "pos": [], "slots": [], "tables": [], "sample": []}
    groups = kv.kv_cache_config.kv_cache_groups
    for rid in order:
        request, n = sched.requests[rid], sched_out.num_scheduled_tokens[rid]
        start = computed_before[rid]
        ref["ids"] += request.all_token_ids[start:start + n]
        ref["pos"] += list(range(start, start + n))
        tables = kv.get_block_ids(rid)
        ref["tables"].append(tables)
        ref["slots"].append([[tables[g][p // BS] * BS + p % BS for p in range(start, start + n)]
                             for g in range(len(groups))])
        ref["sample"].append(start + n == request.num_tokens)
    return ref


def _check_inputs(batch: InputBatch, sched: Scheduler, sched_out: SchedulerOutput,
                  computed_before: dict) -> np.ndarray:
    inputs = build_model_inputs(batch, num_scheduled_per_row(batch, sched_out), BS,
                                InputStager(torch.device("cpu")))
    order = [rid for rid in batch.req_ids if rid in sched_out.num_scheduled_tokens]
    ref = _reference_inputs(sched, sched_out, computed_before, order)
    assert inputs.input_ids.tolist() == ref["ids"]
    assert inputs.positions.tolist() == ref["pos"]
    for g, meta in enumerate(inputs.attn_metadata):
        assert meta.slot_mapping.tolist() == [s for slots in ref["slots"] for s in slots[g]]
        width = meta.block_table.shape[1]
        assert meta.block_table.tolist() == [t[g] + [0] * (width - len(t[g]))
                                             for t in ref["tables"]]
    rows = [batch.req_id_to_index[rid] for rid, s in zip(order, ref["sample"]) if s]
    assert inputs.sample_rows.tolist() == rows
    return inputs.sample_rows


def _sample(rid: str, n: int) -> int:
    """A deterministic stand-in for the model."""
    return 3 + (int(rid) * 31 + n * 7) % 97


@pytest.mark.parametrize("send_token_ids", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_diffs_rebuild_the_scheduler_state(seed, send_token_ids):
    rng = random.Random(seed)
    kv = KVCacheManager(fake_kv_cache_config(26, BS, (None, 6)), enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6), kv, 60,
                      send_token_ids=send_token_ids)
    batch = InputBatch(6, [g.kv_cache_spec for g in kv.kv_cache_config.kv_cache_groups])
    states: dict[str, RequestState] = {}
    shared = [rng.randrange(3, 90) for _ in range(9)]
    for i in range(14):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(3, 90)
                                                   for _ in range(rng.randrange(1, 20))]
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 12),
                                                                 ignore_eos=True)))
    steps = 0
    while sched.has_unfinished_requests():
        computed_before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        sched_out = sched.schedule()
        for new in sched_out.scheduled_new_reqs:
            states[new.req_id] = RequestState(new.req_id, new.prompt_token_ids,
                                              new.sampling_params, new.eos_token_id)
        for rid in sched_out.finished_ids:
            states.pop(rid, None)
        apply_scheduler_output(batch, sched_out, states)
        computed_before.update({n.req_id: n.num_computed_tokens
                                for n in sched_out.scheduled_new_reqs})
        computed_before.update(zip(sched_out.scheduled_cached_reqs.req_ids,
                                   sched_out.scheduled_cached_reqs.num_computed_tokens))
        rows = _check_inputs(batch, sched, sched_out, computed_before) \
            if not sched_out.is_empty else np.array([], np.int64)
        req_ids = [batch.req_ids[r] for r in rows]
        tokens = [_sample(rid, sched.requests[rid].num_tokens) for rid in req_ids]
        batch.add_pending_tokens(rows)
        batch.fill_pending_tokens(np.array(tokens, np.int64))
        sched.update_from_output(sched_out, ModelRunnerOutput(req_ids, [[t] for t in tokens]))
        steps += 1
        assert steps < 500
    assert sched.num_preemptions > 0  # the pool is small enough to preempt


def test_scheduler_output_crosses_a_process_boundary_with_msgspec():
    """The step message is plain data: msgpack round trip, field for field."""
    kv = KVCacheManager(fake_kv_cache_config(20, BS, (None, 6)), True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), kv, 40)
    sched.add_request(Request("a", list(range(3, 12)), SamplingParams(max_tokens=3, seed=1,
                                                                      logit_bias={5: 1.0})))
    first = sched.schedule()
    sched.update_from_output(first, ModelRunnerOutput(["a"], [[7]]))
    second = sched.schedule()
    for out in (first, second):
        wire = msgspec.msgpack.encode(out)
        back = msgspec.msgpack.decode(wire, type=SchedulerOutput)
        assert back == out


def test_seeds_are_taken_modulo_2_to_the_64_with_all_their_bits():
    """A request's seed is kept as given (-1 is no seed, as in vLLM; greedy requests have
    none) and its numbers come from all 64 bits (SplitMix64 of the seed, layers/seeded_noise):
    5 and 5 + 2**32 draw different numbers on CPU, where torch's generator seeded with the
    seed itself kept only its low 32 bits and drew the same; -2 and 2**64 - 2 are one seed."""
    from kvflow.layers.seeded_noise import fill_exponential
    from kvflow.worker.request_state import request_seed

    def draws(seed: int) -> torch.Tensor:
        kept = request_seed(SamplingParams(temperature=1.0, seed=seed))
        assert kept == seed
        return fill_exponential(torch.empty(8), kept, 0)

    assert request_seed(SamplingParams(temperature=0.0, seed=5)) is None
    assert request_seed(SamplingParams(temperature=1.0, seed=-1)) is None
    assert not torch.equal(draws(5), draws(5 + 2**32))
    assert torch.equal(draws(-2), fill_exponential(torch.empty(8), 2**64 - 2, 0))
    assert not torch.equal(draws(5), draws(6))
