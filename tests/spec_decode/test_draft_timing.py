"""The draft model timed at start-up (``spec_decode/draft_timing.py``): which pass sizes the
budget allows (hand-computed, on a fake pass cost), and through the engine: the speculator's
draft costs are measured before the first step, over 1, 2, 4, ... requests, and the dummy
requests leave no trace (no block held, greedy output unchanged)."""

from __future__ import annotations

import numpy as np

from kvflow import LLM, SamplingParams
from kvflow.spec_decode.draft_timing import doubling_rows
from tests.spec_decode.test_ngram_engine import PROMPTS, _same_outputs


def _fake(cost):
    calls: list[int] = []

    def run(rows: int) -> float:
        calls.append(rows)
        return cost(rows)

    return run, calls


def test_doubling_stops_before_the_budget():
    """A pass costs 0.05 + 0.1 rows s, each size timed twice. Warm-up (1 row) 0.15 s; 1 row
    2 x 0.15 (0.45 spent); 2 rows predicted 2 x 0.15 (one point: never below the last) ->
    2 x 0.25 (0.95); 4 rows predicted 2 x (0.25 + 0.1 x 2) = 0.9: 1.85 <= 2.0 -> 2 x 0.45
    (1.85); 8 rows predicted 2 x (0.45 + 0.1 x 4) = 1.7: 3.55 > 2.0, not run."""
    run, calls = _fake(lambda rows: 0.05 + 0.1 * rows)
    got = doubling_rows(run, max_rows=256, budget_s=2.0, repeats=2, min_rows=1)
    assert [r for r, _ in got] == [1, 2, 4] and calls == [1, 1, 1, 2, 2, 4, 4]
    assert np.allclose([s for _, s in got], [0.15, 0.25, 0.45])


def test_sizes_to_min_rows_are_timed_whatever_the_budget():
    """No budget at all: still 1, 2, 4, 8 (min_rows 8), so the cost model has a slope to
    extrapolate along; 16 is not run."""
    run, calls = _fake(lambda rows: 0.05 + 0.1 * rows)
    assert [r for r, _ in doubling_rows(run, max_rows=256, budget_s=0.0)] == [1, 2, 4, 8]
    assert max(calls) == 8


def test_a_size_counts_its_fastest_pass():
    """Every other pass is interrupted (+1 s): each size's seconds are its fast pass."""
    run, calls = _fake(lambda rows: 0.01 * rows + (len(calls) % 2))
    got = doubling_rows(run, max_rows=4, budget_s=100.0, repeats=2)
    assert np.allclose([s for _, s in got], [0.01, 0.02, 0.04])


def test_doubling_caps_at_max_rows():
    run, calls = _fake(lambda rows: 0.001 * rows)
    assert [r for r, _ in doubling_rows(run, max_rows=12, budget_s=10.0)] == [1, 2, 4, 8, 12]
    run, calls = _fake(lambda rows: 0.001)
    assert doubling_rows(run, max_rows=0) == [] and calls == []
    assert [r for r, _ in doubling_rows(run, max_rows=1)] == [1]


def test_the_engine_times_its_draft_before_the_first_step(tiny_llama, assert_no_leaks):
    """A self-draft on the tiny model (passes of milliseconds, so every size fits the
    budget): the draft's cost is measured at 1, 2, 4, 8 requests (max_num_seqs 8) before any
    request; the dummy passes hold no block and leave greedy output as plain decoding's."""
    kw = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 96, "max_num_seqs": 8}
    spec = LLM(model=tiny_llama.path, speculative_config={
        "method": "draft_model", "model": tiny_llama.path, "num_speculative_tokens": 3},
        **kw)
    times = spec.engine.core.speculator.draft_times
    seen = np.flatnonzero(times.last_seen >= 0)
    assert times.counts[seen].tolist() == [1.0, 2.0, 4.0, 8.0]
    assert (times.seconds[seen] > 0).all() and times.seconds[seen].sum() < 1.0
    threads = spec.engine.core.executor.runner.drafter.threads  # both counts timed first
    assert len(threads.candidates) == 1 or None not in threads.seconds
    assert_no_leaks(spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=tiny_llama.path, **kw)
    _same_outputs(plain.generate(PROMPTS, params, use_tqdm=False),
                  spec.generate(PROMPTS, params, use_tqdm=False))
    assert_no_leaks(spec)
