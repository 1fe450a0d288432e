"""The step-cost model and the adaptive draft lengths, on hand-computed numbers."""

from __future__ import annotations

import numpy as np

from kvflow.spec_decode.cost_model import StepTimes, acceptance_estimate, choose_draft_lengths


def times(points: dict[int, float]) -> StepTimes:
    t = StepTimes(smoothing=1.0)
    for count, seconds in points.items():
        t.observe(count, seconds)
    return t


def test_step_times_interpolate_hold_and_extrapolate():
    t = times({4: 1.0, 16: 2.0})
    assert t.predict(np.array([1, 4, 16])).tolist() == [1.0, 1.0, 2.0]  # held below
    mid = float(t.predict(np.array([10]))[0])  # linear between the measured counts
    assert abs(mid - 1.5) < 1e-9
    # above: the last segment's slope per count, (2 - 1) / (16 - 4) per token
    assert abs(float(t.predict(np.array([28]))[0]) - (2.0 + 12 / 12)) < 1e-9
    assert StepTimes().predict(np.array([3])) is None
    assert t.is_measured(4) and t.is_measured(16) and not t.is_measured(64)


def test_observations_are_averaged_and_go_stale():
    t = StepTimes(smoothing=0.5, stale_after=2)
    t.observe(1, 1.0)
    t.observe(1, 3.0)
    assert float(t.predict(np.array([1]))[0]) == 2.0
    t.observe(64, 5.0)
    t.observe(64, 5.0)
    t.observe(64, 5.0)
    assert not t.is_measured(1) and t.is_measured(64)


def test_stale_bins_are_left_out_of_predictions():
    """Steps of 4 tokens measured at 3 s under load, then only 1-token steps (1 s) for more
    than stale_after observations: the 4-token bin is stale and left out, so 4 tokens predict
    1 s (held from the fresh bin) until a 4-token step is measured again; with every bin
    stale, all of them count."""
    t = StepTimes(smoothing=1.0, stale_after=3)
    t.observe(4, 3.0)
    t.observe(1, 1.0)
    assert t.predict(np.array([4]))[0] == 3.0  # still fresh
    for _ in range(3):
        t.observe(1, 1.0)
    assert t.predict(np.array([1, 4])).tolist() == [1.0, 1.0]
    t.observe(4, 2.0)
    assert t.predict(np.array([4]))[0] == 2.0
    old = StepTimes(smoothing=1.0, stale_after=1)
    old.observe(1, 1.0)
    old.observe(4, 3.0)
    assert old.predict(np.array([1, 4])).tolist() == [3.0, 3.0]  # only bin 4 is fresh
    old.num_observations += 5  # none fresh: every measured bin counts
    assert old.predict(np.array([1, 4])).tolist() == [1.0, 3.0]


def test_acceptance_estimate_is_the_geometric_mle_with_a_prior():
    # 6 accepted before 2 rejections: 6 / 8; no record: the prior
    est = acceptance_estimate(np.array([6.0, 0.0]), np.array([2.0, 0.0]), prior=0.5,
                              prior_weight=0.0001)
    assert abs(est[0] - 0.75) < 1e-3
    assert acceptance_estimate(np.array([0.0]), np.array([0.0]), prior=0.3)[0] == 0.3


def test_flat_costs_take_every_draft():
    """A step of 1 or 5 tokens costs the same (CPU batch 1): all drafts pay."""
    lengths = choose_draft_lengths(np.array([0.5]), np.array([4]), 1, times({1: 1.0, 6: 1.0}))
    assert lengths.tolist() == [4]


def test_linear_costs_take_drafts_only_while_they_pay():
    """Cost = tokens (compute-bound). One request with alpha = 0.8: k drafts give
    1 + 0.8 + ... + 0.8^k tokens for 1 + k token-costs; the best is k = 0 (1 token per unit),
    since 1 + 0.8 = 1.8 < 2. With base 32 tokens (32 decodes) the same holds."""
    linear = times({1: 1.0, 2: 2.0, 64: 64.0})
    assert choose_draft_lengths(np.array([0.8]), np.array([4]), 1, linear).tolist() == [0]
    # a fixed per-step overhead makes a few drafts pay: cost = 10 + tokens
    overhead = times({1: 11.0, 2: 12.0, 64: 74.0})
    # k drafts: (1 + sum 0.9^i) / (11 + k): k=0 .0909, 1 .1583, 2 .2258, ... all 4 pay
    got = choose_draft_lengths(np.array([0.9]), np.array([4]), 1, overhead)
    assert got.tolist() == [4]


def test_batch_choice_prefers_high_acceptance_requests():
    """Two requests, cost = 4 + tokens: each draft costs 1; request 0 (alpha 0.9) gains
    0.9, 0.81, ... per draft, request 1 (alpha 0.2) 0.2, 0.04. The tokens/second ratio,
    from base (2 tokens / 6 s = .333): adding 0.9 -> 2.9/7 = .414, 0.81 -> 3.71/8 = .464,
    0.729 -> 4.439/9 = .493, 0.656 -> 5.095/10 = .5095, then 0.2 -> 5.295/11 = .481:
    request 0 takes all 4, request 1 none."""
    cost = times({1: 5.0, 2: 6.0, 64: 68.0})
    got = choose_draft_lengths(np.array([0.9, 0.2]), np.array([4, 4]), 2, cost)
    assert got.tolist() == [4, 0]


def test_draft_model_passes_are_charged():
    """Flat target cost 1 s, a draft pass 0.3 s: k drafts of alpha 0.5 give
    (1 + 0.5 + .25 + ...) / (1 + 0.3 k): k=1 1.5/1.3 = 1.154, k=2 1.75/1.6 = 1.094 -> 1."""
    flat = times({1: 1.0, 8: 1.0})
    draft = times({1: 0.3})
    got = choose_draft_lengths(np.array([0.5]), np.array([4]), 1, flat, draft)
    assert got.tolist() == [1]


def test_no_speculation_below_the_margin():
    """Flat target cost 1 s, a measured draft pass 0.45 s, alpha 0.5: k=1 gives 1.5 tokens in
    1.45 s (1.034x the plain 1 token/s), k=2 1.75 / 1.9 (0.92x). A 3.4% predicted gain is
    inside the 5% margin: no drafts; with no margin, k=1."""
    flat, draft = times({1: 1.0, 8: 1.0}), times({1: 0.45})
    args = (np.array([0.5]), np.array([4]), 1, flat, draft)
    assert choose_draft_lengths(*args).tolist() == [0]
    assert choose_draft_lengths(*args, min_gain=0.0).tolist() == [1]


def test_an_unmeasured_draft_model_is_charged_the_seed_ratio():
    """No draft pass measured (an engine that did not time its draft): a pass costs
    seed_ratio x a target step of as many tokens (flat 1 s here), never nothing. Alpha 0.5:
    at ratio 0.32, k=1 gives 1.5 / 1.32 = 1.14x, k=2 1.75 / 1.64 = 1.07x: k=1. At ratio 1
    (the default: as costly as the target) k=1 gives 1.5 / 2: none."""
    flat = times({1: 1.0, 8: 1.0})
    args = (np.array([0.5]), np.array([4]), 1, flat, StepTimes())
    assert choose_draft_lengths(*args, seed_ratio=0.32).tolist() == [1]
    assert choose_draft_lengths(*args, seed_ratio=1.0).tolist() == [0]


# The AMX Xeon's shape (docs/benchmarks.md, issue 17), in round numbers: a target step 0.25 s
# for 1-8 tokens, 0.8 s for 32, +0.05 s per 32 tokens above (its bf16 GEMMs on AMX); the INT8
# draft's passes timed at start-up over 1, 2, 4, 8 requests (compute-bound: 37.5 ms per
# request from 4 to 8, extrapolated: 1.2 s at 32).
AMX_TARGET = {1: 0.25, 8: 0.25, 32: 0.8, 64: 0.85}
AMX_DRAFT = {1: 0.04, 2: 0.075, 4: 0.15, 8: 0.30}


def test_timed_draft_passes_give_k4_at_batch_1():
    """Batch 1, alpha 0.75: k drafts give 1 + 0.75 + ... + 0.75^k tokens in 0.25 + 0.04 k s:
    k=0 4.0/s, k=1 1.75/0.29 = 6.03, k=2 2.3125/0.33 = 7.01, k=3 2.734/0.37 = 7.39,
    k=4 3.051/0.41 = 7.44: K=4."""
    got = choose_draft_lengths(np.array([0.75]), np.array([4]), 1, times(AMX_TARGET),
                               times(AMX_DRAFT))
    assert got.tolist() == [4]


def test_timed_draft_passes_stop_speculation_at_batch_32():
    """Batch 32, alpha 0.75, K <= 4. Plain: 32 tokens / 0.8 s = 40/s. The best prefixes draft
    first drafts for n requests: 32 + 0.75 n tokens in target(32 + n) + draft(n) s; n=1:
    32.75 / (0.8016 + 0.04) = 38.9/s, and each further request adds 0.75 tokens for >= 37.5 ms
    (0.0016 + 0.0375 s): below 40/s, so no drafts. The weight-bytes seed (0.149 x a target
    step, what the engine used before timing its draft) said a pass over 32 costs 0.119 s: all
    32 first drafts 56 / (0.85 + 0.119) = 57.8/s, second drafts (+18 tokens, target(96) 0.9 s,
    2 passes) 74 / 1.138 = 65.0/s, third 87.5 / 1.307 = 66.9/s, fourth 97.6 / 1.476 = 66.1/s:
    K=3 for every request, the 0.61x run."""
    args = (np.full(32, 0.75), np.full(32, 4), 32, times(AMX_TARGET))
    assert choose_draft_lengths(*args, times(AMX_DRAFT)).tolist() == [0] * 32
    seeded = choose_draft_lengths(*args, StepTimes(), seed_ratio=0.149)
    assert seeded.tolist() == [3] * 32


def test_a_lagging_draft_cache_is_charged_its_catch_up():
    """Target: 1 s for 1..8 tokens; draft passes measured at 0.2 s for 1..8 requests and 1 s
    for 512, +0.8/504 s per token beyond. Alpha 0.8, no catch-up: k=4 gives 3.36 tokens in
    1.8 s. With 1000 draft tokens to catch up first, the first pass computes 1001 tokens:
    draft(1001) - draft(1) = 1 + 489 x 0.8 / 504 - 0.2 = 1.576 s more: 3.36 / 3.376 s, below
    1 token/s."""
    target, draft = times({1: 1.0, 8: 1.0}), times({1: 0.2, 8: 0.2, 512: 1.0})
    args = (np.array([0.8]), np.array([4]), 1, target, draft)
    assert choose_draft_lengths(*args, catch_up_tokens=np.array([0.0])).tolist() == [4]
    assert choose_draft_lengths(*args, catch_up_tokens=np.array([1000.0])).tolist() == [0]
    # 100 tokens: draft(101) - draft(1) = 0.8 x 93 / 504 = 0.148 s more: 3.36 / 1.948 s, k=4
    assert choose_draft_lengths(*args, catch_up_tokens=np.array([100.0])).tolist() == [4]


def test_catch_up_counts_the_context_past_the_last_verification():
    """The speculator's catch-up tokens: a request verified at 40 computed tokens and now at
    43 tokens lags 43 - 2 - 40 = 1 token (a steady pass covers 2); preempted since, its draft
    K/V is gone: 41; spread over its steps left (max_tokens 100, 33 generated: 67 tokens at
    (1 - 0.5^5) / 0.5 = 1.9375 tokens per step = 34.6 steps)."""
    from kvflow.config import SpeculativeConfig
    from kvflow.request import Request
    from kvflow.sampling_params import SamplingParams
    from kvflow.spec_decode.speculator import Speculator

    spec = Speculator(SpeculativeConfig(method="draft_model", model="m"), 4000)
    request = Request("a", list(range(10)), SamplingParams(max_tokens=100))
    for token in range(100, 133):
        request.append_output_token(token)
    request.num_computed_tokens = 40
    spec.record(request, 4, 2)
    steps = 67 / ((1 - 0.5 ** 5) / 0.5)
    got = spec._catch_up_tokens([request], np.array([0.5]))
    assert abs(got[0] - 1 / steps) < 1e-9
    request.num_preemptions += 1
    got = spec._catch_up_tokens([request], np.array([0.5]))
    assert abs(got[0] - 41 / steps) < 1e-9
