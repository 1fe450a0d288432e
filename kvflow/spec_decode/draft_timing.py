"""A draft model's pass timed at start-up, so the cost model knows it before serving.

Why: the adaptive draft lengths (``cost_model.py``) need a draft pass's seconds for every
number of drafting requests. A draft's weight bytes over the target's say that cost for a
memory-bound pass only: on the AMX Xeon an INT8 0.5B draft pass over 32 requests took 1.28 s
where its weight bytes said ~0.12 s (its weight-only kernel is compute-bound at 32 rows, while
the bf16 target runs on AMX), so the engine drafted at batch 32 until it had measured that,
and the run lost a third of its throughput (docs/benchmarks.md, issue 17). So the engine times
the draft once, after its KV cache is allocated: a warm-up pass of one request, then passes
of 1, 2, 4, 8 requests and more (one decode token each, a one-block context), each size twice
(the faster counts: a pass another process interrupted is no measure of the draft, and a cost
taken too high is never corrected, since a draft that never drafts is never measured again).
The sizes up to 8 are timed whatever they cost (about 0.5 s for an INT8 0.5B draft; one size
alone would extrapolate flat); larger ones while the next, predicted along the last two, fits
in ``budget_s`` (about a second). ``StepTimes`` extrapolates above the largest along the same
line. Wall time, as the passes the engine later measures, on the faster of the draft's thread
counts (``DraftThreads``: the engine's and 1, each timed on one request first; on the loaded
2-core machine a tiny model's pass took ~10 ms on 2 threads, ~2 ms on 1).

The dummy requests write the draft's K/V into blocks ``1..rows`` of the pool; nothing reads it
later (a request's draft K/V is recomputed before it is read: ``num_draft_computed`` starts at
0), and the target's K/V is not touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvflow.kv_cache_interface import KVCacheConfig
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.draft_threads import DraftThreads
from kvflow.worker.input_batch import InputBatch, RequestState
from kvflow.worker.model_inputs import InputStager

# Start-up time spent timing the draft (seconds); the pass that would cross it is not run.
BUDGET_S = 1.0
# Sizes up to this many requests are timed whatever the budget: the cost model extrapolates
# above the largest along the last two, and a single size would say a pass over 32 requests
# costs what one over 1 does (on a loaded machine the budget went to the first size alone).
MIN_ROWS = 8
# Passes timed per size; the fastest counts (a pass another process interrupted is no
# measure of the draft, and a cost taken too high is never corrected: no drafts, no passes).
REPEATS = 2


def doubling_rows(run: Callable[[int], float], max_rows: int, budget_s: float = BUDGET_S,
                  repeats: int = REPEATS, min_rows: int = MIN_ROWS) -> list[tuple[int, float]]:
    """Time ``run(rows)`` (returns seconds) at 1, 2, 4, ... rows up to ``max_rows`` (the last
    capped to it), ``repeats`` times each, after one untimed warm-up at 1 row; a size's
    seconds are its fastest pass. Past ``min_rows`` it stops before a size whose predicted
    passes (``repeats`` x the line through the last two sizes, never below the last) would
    take the total, the warm-up included, past ``budget_s``. Returns ``[(rows, seconds),
    ...]`` in order (empty for ``max_rows < 1``)."""
    if max_rows < 1:
        return []
    spent = run(1)  # the first pass pays one-time costs (kernel set-up, first touches)
    out: list[tuple[int, float]] = []
    rows = 1
    while True:
        passes = [run(rows) for _ in range(repeats)]
        spent += sum(passes)
        out.append((rows, min(passes)))
        if rows >= max_rows:
            return out
        nxt = min(2 * rows, max_rows)
        predicted = out[-1][1]
        if len(out) >= 2:
            (r0, s0), (r1, s1) = out[-2], out[-1]
            predicted = max(s1, s1 + (s1 - s0) / (r1 - r0) * (nxt - r1))
        if nxt > min_rows and spent + repeats * predicted > budget_s:
            return out
        rows = nxt


def time_draft_passes(drafter: Any, kv_cache_config: KVCacheConfig, block_size: int,
                      stager: InputStager, max_rows: int,
                      synchronize: Callable[[], None] = lambda: None,
                      budget_s: float = BUDGET_S) -> list[tuple[int, float]]:
    """Time the draft model's passes (module docstring): ``[(requests, seconds), ...]``.

    With several candidate thread counts (``drafter.threads``) each first runs a warm-up and
    ``REPEATS`` passes of one request; the fastest count's time seeds ``DraftThreads`` (so the
    first proposals run on it) and the sizes are timed on it.

    Args:
        drafter: the ``DraftModel``, its KV tensors bound (``bind_kv_cache``).
        kv_cache_config: the pool's config (one group; blocks ``1..max_rows`` are written).
        block_size: tokens per block: each dummy request's context is one block.
        stager: the runner's input stager.
        max_rows: most requests in a pass (``max_num_seqs``, at most ``num_blocks - 1``).
        synchronize: waits for the device (a pass's time is its completion's).
        budget_s: seconds to spend, warm-ups included.
    """
    max_rows = min(max_rows, kv_cache_config.num_blocks - 1)
    if max_rows < 1:
        return []
    batch = _dummy_batch(kv_cache_config, block_size, max_rows)
    computed = np.full(max_rows, block_size - 1, np.int64)

    @torch.inference_mode()
    def run(rows: int) -> float:
        query = np.zeros(max_rows, np.int64)
        query[:rows] = 1
        started = time.perf_counter()
        drafter.run_pass(batch, query, computed, block_size, stager, None, np.arange(rows))
        synchronize()
        return time.perf_counter() - started

    started, threads = time.perf_counter(), drafter.threads
    best = _fastest_thread_count(threads, run)
    with threads.running(best):
        return doubling_rows(run, max_rows, budget_s - (time.perf_counter() - started))


def _dummy_batch(kv_cache_config: KVCacheConfig, block_size: int, max_rows: int) -> InputBatch:
    """``max_rows`` dummy requests of one block of context each (request i on block i + 1 of
    every group), ``block_size - 1`` tokens computed."""
    groups = kv_cache_config.kv_cache_groups
    batch = InputBatch(max_rows, [g.kv_cache_spec for g in groups])
    for i in range(max_rows):
        state = RequestState(f"draft-timing-{i}", [0] * block_size, SamplingParams(), None)
        batch.add_request(state, [], tuple([i + 1] for _ in groups), block_size - 1)
    return batch


def _fastest_thread_count(threads: DraftThreads, run: Callable[[int], float]) -> int:
    """The candidate thread count of ``threads`` (the drafter's) whose
    one-request pass is fastest (best of ``REPEATS`` after one warm-up), each count's time
    seeding ``threads``; the only candidate, untimed, when there is one."""
    best = threads.candidates[0]
    if len(threads.candidates) > 1:
        one_row = {}
        with threads.running(best):
            run(1)  # warm-up (once: the weights are the same for every count)
        for count in threads.candidates:
            with threads.running(count):
                one_row[count] = min(run(1) for _ in range(REPEATS))
            threads.seed(count, one_row[count])
        best = min(one_row, key=one_row.get)
    return best
