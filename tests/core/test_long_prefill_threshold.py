"""``long_prefill_token_threshold`` (vLLM's): while more than one request is unfinished, no
request computes more than the threshold in one step; a lone request takes the whole budget.

Per-step tables are hand-computed from the rule (vLLM 0.32's ``Scheduler.schedule`` caps
``num_new_tokens`` the same way for running and waiting requests); outputs are compared with
``default_sample``'s oracle.
"""

from __future__ import annotations

import random

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core.step_time_model import StepFeatures, chunk_context_tokens
from tests.core.sim import (
    FakeClock,
    SimRequest,
    assert_idle,
    make_sim_scheduler,
    simulate,
    synthetic_step_time,
)


def _table(driver) -> list[dict[str, int]]:
    return [step.num_scheduled for step in driver.steps]


def test_long_prompt_leaves_room_for_a_short_one(make_scheduler, make_driver, make_request,
                                                 oracle):
    """Budget 16, threshold 6: a's 20-token prompt goes 6 tokens a step next to b, which is
    admitted at once and decodes every step (without the threshold a takes all 16 tokens of
    the first step and b waits for the second)."""
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    drv = make_driver(sched)
    prompts = {"a": list(range(2, 22)), "b": [5, 6, 7]}
    drv.add(make_request("a", prompts["a"], max_tokens=2))
    drv.add(make_request("b", prompts["b"], max_tokens=4))
    res = drv.run()
    assert _table(drv) == [
        {"a": 6, "b": 3},  # b's prompt whole (3 <= 6): its first token
        {"a": 6, "b": 1},
        {"a": 6, "b": 1},
        {"a": 2, "b": 1},  # a's prompt done (6 + 6 + 6 + 2 = 20): its first token; b ends
        {"a": 1},  # alone: no cap (a decode anyway)
    ]
    assert res["a"].output_token_ids == oracle(prompts["a"], 2)
    assert res["b"].output_token_ids == oracle(prompts["b"], 4)


def test_a_lone_request_takes_the_whole_budget(make_scheduler, make_driver, make_request,
                                               oracle):
    """Alone, a 40-token prompt takes 16 tokens (the budget); beside b it takes 6; alone
    again (b finished), the 12 left at once."""
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    drv = make_driver(sched)
    prompt = list(range(2, 42))
    drv.add(make_request("a", prompt, max_tokens=1))
    drv.step()
    drv.add(make_request("b", [5, 6, 7], max_tokens=2))
    res = drv.run()
    assert _table(drv) == [{"a": 16}, {"a": 6, "b": 3}, {"a": 6, "b": 1}, {"a": 12}]
    assert res["a"].output_token_ids == oracle(prompt, 1)
    assert res["b"].output_token_ids == oracle([5, 6, 7], 2)


def test_no_request_exceeds_the_threshold_beside_others(make_scheduler, make_driver,
                                                        make_request, oracle):
    """Random arrivals, small pools (preemption), both policies: while more than one request
    is unfinished at a step's start, no request computes more than the threshold in it, and
    every output is the oracle's."""
    num_preempting = sum(_random_run(make_scheduler, make_driver, make_request, oracle, seed)
                         for seed in range(12))
    assert num_preempting >= 4  # the runs do exercise preemption


def _random_run(make_scheduler, make_driver, make_request, oracle, seed: int) -> bool:
    """One random run (see the test above); returns whether it preempted."""
    rng = random.Random(seed)
    threshold = rng.randint(1, 6)
    sched = make_scheduler(num_blocks=rng.randint(9, 14), max_model_len=32,
                           max_num_batched_tokens=rng.randint(4, 24),
                           policy=rng.choice(["fcfs", "priority"]),
                           long_prefill_token_threshold=threshold)
    drv = make_driver(sched)
    prompts = {}
    for step in range(400):
        if step < 30 and rng.random() < 0.3:
            prompt = [rng.randint(2, 9) for _ in range(rng.randint(1, 18))]
            rid = f"r{step}"
            prompts[rid] = (prompt, min(rng.randint(1, 10), 32 - len(prompt)))
            drv.add(make_request(rid, prompt, max_tokens=prompts[rid][1],
                                 priority=rng.randint(0, 1)))
        if step >= 30 and not sched.has_unfinished_requests():
            break
        crowded = len(sched.requests) > 1
        record = drv.step()
        if crowded:
            assert max(record.num_scheduled.values(), default=0) <= threshold
    assert not sched.has_unfinished_requests()
    for rid, (prompt, num_out) in prompts.items():
        assert drv.results[rid].output_token_ids == oracle(prompt, num_out), (seed, rid)
    return sched.num_preemptions > 0


def test_threshold_is_checked(make_scheduler):
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold=-1 must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold=33 cannot be greater "
                                         r"than max_model_len \(32\)"):
        make_scheduler(max_model_len=32, long_prefill_token_threshold=33)
    make_scheduler(max_model_len=32, long_prefill_token_threshold=32)  # at most: accepted


def test_ttft_forecast_replays_the_threshold():
    """Admission control's forecast replays the scheduler's rule, the threshold included: a
    512-token prompt arriving beside a decoding request is forecast (at arrival) to get its
    first token when the fake-clock run gives it, 8 chunks of 64 later (the forecast
    without the threshold said one 512-token chunk: about half the time)."""
    clock = FakeClock()
    sched = make_sim_scheduler(clock, target_ttft_ms=10_000.0, long_prefill_token_threshold=64)
    rng = random.Random(0)
    warmup = [SimRequest(f"w{i}", 0.05 * i, rng.randint(50, 400), rng.randint(5, 20),
                         ttft_ms=10_000.0) for i in range(10)]
    workload = [*warmup, SimRequest("bg", 3.0, 32, 300, ttft_ms=10_000.0),
                SimRequest("long", 3.5, 512, 2, ttft_ms=10_000.0)]
    forecasts = {}

    def admit(request) -> bool:
        forecasts[request.request_id] = sched.ttft_outlook(request)
        return True

    result = simulate(workload, clock, sched, synthetic_step_time, admit)
    assert_idle(sched)
    actual = result.timelines["long"].ttft
    step = synthetic_step_time(StepFeatures(64, 1, chunk_context_tokens(448, 64) + 300))
    assert actual > 8 * step * 0.9  # the run did split it into 8 chunks beside bg's decodes
    assert abs(forecasts["long"] - actual) <= step, (forecasts["long"], actual, step)
