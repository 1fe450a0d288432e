"""Pipeline parallelism (2 stages, worker processes over gloo) feeds the step-time model that
service-level targets plan with: each micro-batch is timed from its scheduling to the fold of
its sampled tokens (its requests' token interval), with the features noted when it was
scheduled. Before, only the lock-step and async step variants timed their steps, so with
``pipeline_parallel_size`` > 1 the model never learnt: every step stayed in the warm-up budget
(one admission per step) under a TPOT target, admission control never forecast, and the
/metrics step-time series stayed empty.

One engine of 2 worker processes (about 10 s on 2 busy cores).
"""

from __future__ import annotations

import time

import pytest

from kvflow import LLM, SamplingParams
from kvflow.core.slo_planner import COLD_STEPS
from tests.distributed.conftest import shutdown_and_check


@pytest.mark.timeout(300)
def test_every_micro_batch_is_timed_from_its_scheduling_to_its_fold(tiny_llama):
    llm = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64,
              pipeline_parallel_size=2, target_tpot_ms=500)
    core = llm.engine.core
    planner = core.scheduler.planner
    sends: list[float] = []  # perf_counter at each non-empty micro-batch's send, in order
    observed: list[tuple[float, float]] = []  # (perf_counter when observed, seconds)
    send, observe = core.executor.execute_model_async, planner.model.observe

    results: list[float] = []  # perf_counter as each one's result came back, in fold order

    class ResultTimed:
        """The executor's future, noting when its result returned (the engine reads its
        clock for the fold only after that: program order, not a race)."""

        def __init__(self, future):
            self.future = future

        def __getattr__(self, name):
            return getattr(self.future, name)

        def result(self, *args, **kwargs):
            value = self.future.result(*args, **kwargs)
            results.append(time.perf_counter())
            return value

    def recording_send(sched, bitmask=None):
        if sched.is_empty:
            return send(sched, bitmask)
        sends.append(time.perf_counter())
        return ResultTimed(send(sched, bitmask))

    def recording_observe(features, seconds, predicted=None):
        observed.append((time.perf_counter(), seconds))
        return observe(features, seconds, predicted)

    core.executor.execute_model_async = recording_send
    planner.model.observe = recording_observe
    try:
        llm.generate([[5, 6, 7, 8 + i] for i in range(6)],
                     SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                     use_tqdm=False)
        assert len(sends) > planner.model.min_steps + COLD_STEPS
        # every micro-batch but the engine's cold first ones, in send order (one stream of
        # folds: the oldest first)
        assert len(observed) == len(sends) - COLD_STEPS
        assert len(results) == len(sends)
        for i, (seen_at, seconds) in enumerate(observed, start=COLD_STEPS):
            # scheduled after the previous micro-batch was sent and before its own send;
            # folded after its result came back and before it was observed (was: bounded
            # below by the observation's clock, which a deschedule between the fold and the
            # observation pushed 9 us past the step's own time in one CI run)
            assert results[i] - sends[i] <= seconds <= seen_at - sends[i - 1]
        assert planner.model.is_ready  # past the warm-up budget
    finally:
        shutdown_and_check(llm)
