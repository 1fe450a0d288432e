"""A step's scheduler diffs applied to the runner's persistent input batch.

The scheduler sends each request whole once and then only what changed (see
``kvflow/sched_output.py``); :func:`apply_scheduler_output` applies those changes to the
rows of an :class:`~kvflow.worker.input_batch.InputBatch` in place: finished and preempted
rows dropped, new and resumed requests given rows, the others' computed counts, appended
blocks and sent tokens written. :func:`num_scheduled_per_row` lays the step's token counts
out by row.
"""

from __future__ import annotations

import numpy as np

from kvflow.sched_output import CachedRequestData, SchedulerOutput
from kvflow.worker.input_batch import InputBatch
from kvflow.worker.request_state import RequestState


def apply_scheduler_output(batch: InputBatch, sched: SchedulerOutput,
                           states: dict[str, RequestState]) -> None:
    """Apply a step's changes to ``batch``: drop finished and preempted rows, add rows for new
    and resumed requests (``states`` holds them), and update the others in place (computed
    counts, appended blocks, tokens sent). Ids without a row are ignored.

    Raises:
        KeyError: for a cached request that has neither a row nor a state.
    """
    _remove_rows(batch, sched, states)
    for new in sched.scheduled_new_reqs:
        batch.add_request(states[new.req_id], [], new.block_ids, new.num_computed_tokens)
    for rid, num_blocks in sched.truncated_block_tables.items():
        if (row := batch.req_id_to_index.get(rid)) is not None:
            batch.truncate_block_ids(row, num_blocks)
    cached = sched.scheduled_cached_reqs
    if cached.resumed_req_ids:
        _add_resumed_rows(batch, sched, states)
    _append_cached_blocks(batch, cached)
    if cached.new_token_ids:
        _write_cached_tokens(batch, cached)
    batch.num_computed_tokens[batch.rows_of(cached.req_ids)] = cached.num_computed_tokens


def _remove_rows(batch: InputBatch, sched: SchedulerOutput,
                 states: dict[str, RequestState]) -> None:
    """Drop the finished and preempted requests' rows; a preempted request's state keeps how
    many positions have a draft model's K/V (``draft_kv_tokens``: a swap-in restores them)."""
    # sorted: a set's order follows the process's string hashing, which differs between
    # worker processes, and the order of removals decides which row moves where; every
    # rank must lay out the same rows (TP all-reduces and PP stages pair rows by index)
    for rid in sorted(sched.finished_ids):
        batch.remove_request(rid)
    for rid in sched.preempted_ids:
        if (row := batch.req_id_to_index.get(rid)) is not None and rid in states:
            states[rid].draft_kv_tokens = int(batch.num_draft_computed[row])
        batch.remove_request(rid)


def _add_resumed_rows(batch: InputBatch, sched: SchedulerOutput,
                      states: dict[str, RequestState]) -> None:
    """Give each resumed request a row again: its whole block tables and generated tokens
    come with it; one swapped back in also gets its draft model's K/V count back."""
    cached = sched.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    swapped_in = {d for _, d in sched.blocks_to_swap_in}  # blocks of swapped-in requests
    for i, rid in enumerate(cached.req_ids):
        if rid in resumed:
            batch.remove_request(rid)  # still there if its preemption step failed
            block_ids, computed = cached.new_block_ids[rid], cached.num_computed_tokens[i]
            row = batch.add_request(states[rid], cached.new_token_ids[rid], block_ids, computed)
            if swapped_in and not swapped_in.isdisjoint(block_ids[0]):  # its draft K/V too
                batch.num_draft_computed[row] = min(states[rid].draft_kv_tokens, computed)


def _append_cached_blocks(batch: InputBatch, cached: CachedRequestData) -> None:
    """Append the blocks each running (not resumed) request got this step to its tables."""
    index = batch.req_id_to_index
    for rid, block_ids in cached.new_block_ids.items():
        if rid not in cached.resumed_req_ids:
            for g, ids in enumerate(block_ids):
                batch.append_block_ids(index[rid], g, ids)


def _write_cached_tokens(batch: InputBatch, cached: CachedRequestData) -> None:
    """Write the tokens the scheduler sent for running (not resumed) requests, at their
    computed positions on."""
    index = batch.req_id_to_index
    position = {rid: i for i, rid in enumerate(cached.req_ids)}
    for rid, tokens in cached.new_token_ids.items():
        if rid not in cached.resumed_req_ids:
            batch.write_tokens(index[rid], cached.num_computed_tokens[position[rid]], tokens)


def num_scheduled_per_row(batch: InputBatch, sched: SchedulerOutput) -> np.ndarray:
    """Tokens each of ``batch``'s rows computes in ``sched`` (int64 [num_reqs], 0 = not
    scheduled).

    Raises:
        KeyError: for a scheduled request without a row.
    """
    num = np.zeros(batch.num_reqs, np.int64)
    num[batch.rows_of(list(sched.num_scheduled_tokens))] = \
        list(sched.num_scheduled_tokens.values())
    return num
