"""A fresh engine's first steps run cold, and the TTFT forecast must not learn from them
(fake clock, tests/core/sim.py).

The machine: the CPU-like step of test_slo_feedback.py with +-30% noise, whose first three
steps take 1.8x (what two recordings of SmolLM2 on the CPU showed for a fresh engine's first
whole-prompt prefills, ``benchmarks/slo_record_steps.py``). The workload: a chat (four shared
system prompts of 250-450 tokens, then a user turn of 20-300 tokens), so after the first four
requests every prompt hits the prefix cache and the only whole prompts the model ever measured
are the cold ones. A warm server then forecast a lone whole prompt at 1.5x its real time and
refused requests it could serve (the real run: docs/benchmarks.md, "Goodput of SLA mode after
the feedback fix").

Oracles: the machine's own step time for the lone prompt (``cpu_step_time``, noise-free);
the same runs on a machine without cold steps.
"""

from __future__ import annotations

import random

import pytest

from kvflow.core import slo_planner
from kvflow.core.step_time_model import StepFeatures, chunk_context_tokens
from tests.core.sim import (
    FakeClock,
    SimRequest,
    assert_idle,
    make_sim_scheduler,
    simulate,
    to_request,
)
from tests.core.test_slo_feedback import cpu_step_time

SLO = {"ttft_ms": 2000.0, "tpot_ms": 80.0}
CONFIG = {"target_ttft_ms": 2000.0, "target_tpot_ms": 80.0}
COLD_FACTOR = 1.8  # SmolLM2 on the CPU, first three steps of a fresh engine: 1.6-1.9x


def machine(seed: int, cold_steps: int = 3):
    """``cpu_step_time`` x uniform [0.7, 1.3]; the first ``cold_steps`` steps x COLD_FACTOR."""
    rng, count = random.Random(seed), [0]

    def step(f: StepFeatures) -> float:
        count[0] += 1
        cold = COLD_FACTOR if count[0] <= cold_steps else 1.0
        return cpu_step_time(f) * cold * rng.uniform(0.7, 1.3)
    return step


def chat(rate: float, n: int, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    systems = [rng.randint(250, 450) for _ in range(4)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        system = systems[i % 4]
        out.append(SimRequest(f"r{i}", t, system + rng.randint(20, 300), rng.randint(32, 128),
                              prefix=f"system{i % 4}", prefix_len=system, **SLO))
    return out


def serve_then_forecast_lone(rate: float, seed: int, cold_steps: int = 3):
    """Serve a chat at ``rate`` with admission control, then idle 5 s; returns (requests
    refused, forecast TTFT of a lone 550-token prompt, its noise-free step time)."""
    clock, step = FakeClock(), machine(seed, cold_steps)
    sched = make_sim_scheduler(clock, **CONFIG)
    result = simulate(chat(rate, 40, seed), clock, sched, step,
                      lambda r: sched.admission_verdict(r) is None)
    assert_idle(sched)
    refused = sum(t.rejected for t in result.timelines.values())
    clock.now += 5.0
    lone = to_request(SimRequest("lone", clock.now, 550, 2, **SLO))
    forecast = sched.ttft_outlook(lone)
    return refused, forecast, cpu_step_time(StepFeatures(550, 0, chunk_context_tokens(0, 550)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lone_prompt_forecast_is_not_inflated_by_the_cold_first_steps(seed):
    """At most 1.25x the machine's time for it (the fit and its bias carry the noise of the
    steps); with the cold steps learnt (COLD_STEPS = 0) it was 1.70x, 1.52x and 1.21x in
    these seeds (after: 1.13x, 0.66x, 1.09x).
    (It can err low: in seed 1 the fit put the whole prefill cost on the context term, which
    chunks after a cached system prompt cannot tell from the per-token term, and forecast
    0.66x; a known limit of the four-term model, see docs/benchmarks.md.)"""
    _, forecast, true = serve_then_forecast_lone(4.0, seed)
    assert forecast <= 1.25 * true, (forecast, true)


def test_cold_steps_cause_no_extra_refusals():
    """At a rate the machine serves (4 req/s, below its capacity for this chat), admission
    control refuses no more requests than on the same machine without cold steps (with the
    cold steps learnt it refused 9, 2 and 0 of 40 in these seeds against 1, 1 and 0)."""
    for seed in (0, 1, 2):
        cold, _, _ = serve_then_forecast_lone(4.0, seed)
        warm, _, _ = serve_then_forecast_lone(4.0, seed, cold_steps=0)
        assert cold <= warm, (seed, cold, warm)


def test_the_first_cold_steps_are_not_learnt():
    """The planner feeds its model from the (COLD_STEPS + 1)-th step on."""
    clock = FakeClock()
    sched = make_sim_scheduler(clock, **CONFIG)
    simulate([SimRequest("a", 0.0, 100, 12, **SLO)], clock, sched, lambda f: 0.05)
    assert sched.planner.model.num_observed == 12 - slo_planner.COLD_STEPS
