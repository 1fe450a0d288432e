"""The SLO planner on a CPU-like, noisy machine (fake clock, tests/core/sim.py): a step whose
fixed cost dominates (weights read once per step), +-30% noise on every step, a machine that
slows down, and TPOT targets no batch can meet.

Oracles: the best fixed (token budget, sequence cap) found by sweeping them on the same
noisy step-time function; the default fixed budget's throughput; hand-computed schedules;
counterfactual reruns (a rejected request forced in) for admission control.
"""

from __future__ import annotations

import math
import random

import pytest

from kvflow.config import SchedulerConfig
from kvflow.core.slo_planner import (
    CATCH_UP_TOKENS,
    RequestSLO,
    SLOPlanner,
    is_lost,
    step_allowance,
)
from kvflow.core.step_time_model import StepFeatures, StepTimeModel
from tests.core.sim import FakeClock, SimRequest, assert_idle, make_sim_scheduler, simulate
from tests.core.test_slo_scheduling import admission_by_verdict, closed_workload


def cpu_step_time(f: StepFeatures) -> float:
    """A CPU-like step: 40 ms fixed (the weights read once), 0.25 ms per prefill token,
    1 ms per decode, 0.2 us per attended key."""
    return 0.040 + 2.5e-4 * f.prefill_tokens + 1e-3 * f.decode_requests \
        + 2e-7 * f.context_tokens


def noisy30(seed: int, base=cpu_step_time):
    """``base`` times a uniform factor in [0.7, 1.3], seeded."""
    rng = random.Random(seed)
    return lambda f: base(f) * rng.uniform(0.7, 1.3)


def warm(sched, seed: int = 3) -> None:
    """The model fitted from 64 earlier steps of varied sizes on the noisy CPU-like machine
    (the first steps of a cold engine admit one request per step)."""
    rng, step = random.Random(seed), noisy30(seed + 100)
    for _ in range(64):
        f = StepFeatures(rng.randint(0, 512), rng.randint(0, 48), rng.randint(0, 100_000))
        sched.planner.model.observe(f, step(f))


def run(workload, step_time, admission=None, warmed: bool = True, **config):
    clock = FakeClock()
    sched = make_sim_scheduler(clock, **config)
    if warmed:
        warm(sched)
    verdict = None if admission is None else admission(sched)
    result = simulate(workload, clock, sched, step_time, verdict)
    assert_idle(sched)
    return result


def tpots(result) -> list[float]:
    return [t.tpot for t in result.timelines.values() if t.tpot is not None]


def best_fixed_throughput(workload, step_time_of, tpot_s: float) -> float:
    """The best output throughput of a fixed (token budget, sequence cap) whose every request
    keeps its mean TPOT under ``tpot_s`` on the same noisy machine."""
    best = 0.0
    for budget in (128, 512, 2048):
        for max_seqs in (4, 6, 8, 10, 12, 14, 16, 20, 24):
            res = run(workload, step_time_of(), warmed=False, max_num_batched_tokens=budget,
                      max_num_seqs=max_seqs)
            if max(tpots(res)) <= tpot_s:
                best = max(best, res.output_throughput())
    return best


# ---- TPOT held, throughput kept ---------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_tpot_held_within_10pct_of_the_best_fixed_budget_under_30pct_noise(seed):
    """60 ms TPOT on a machine whose decode step is 41-88 ms for 1-48 requests, +-30% noise
    on every step: every request keeps its mean TPOT under 60 ms and the output throughput is
    within 10% of the best fixed budget and cap that also holds it. (The planner of 26e3b62
    reached 0.76x and 0.83x the best: a request behind its target stopped every prefill until
    it had caught up, and the model did not follow the measured steps.)"""
    tpot_ms = 60.0
    best = best_fixed_throughput(closed_workload(), lambda: noisy30(seed), tpot_ms / 1e3)
    assert best > 0
    res = run(closed_workload(tpot_ms=tpot_ms), noisy30(seed), target_tpot_ms=tpot_ms)
    assert max(tpots(res)) <= tpot_ms / 1e3
    assert res.output_throughput() >= 0.9 * best, (res.output_throughput(), best)


def test_unreachable_tpot_target_keeps_the_fixed_budget_throughput():
    """A 30 ms target on a machine whose decode step alone takes 41 ms: no batch meets it, so
    starving the batch helps no one; throughput stays within 10% of the fixed budget's
    (the planner of 26e3b62 ran one request at a time: 0.1x)."""
    fixed = run(closed_workload(), noisy30(0))
    sla = run(closed_workload(tpot_ms=30.0), noisy30(0), target_tpot_ms=30.0)
    assert min(tpots(fixed)) > 0.030  # the oracle: not even the fixed budget's best meets it
    assert sla.output_throughput() >= 0.9 * fixed.output_throughput(), \
        (sla.output_throughput(), fixed.output_throughput())


# ---- the model follows a machine that slows down -----------------------------------------------
def test_predictions_follow_a_slowdown_long_before_the_window_refits():
    """After 512 steps at speed 1 the machine takes twice as long (other processes on the
    cores): 48 steps later the predictions are within 15% of the new times, while the window's
    fit alone (``predict_fit``) still predicts about half of them."""
    rng = random.Random(0)
    model = StepTimeModel()
    for i in range(512 + 48):
        f = StepFeatures(rng.randint(0, 256), rng.randint(1, 32), rng.randint(0, 50_000))
        slow = 2.0 if i >= 512 else 1.0
        model.observe(f, cpu_step_time(f) * slow * rng.uniform(0.97, 1.03), model.predict(f))
    f = StepFeatures(128, 16, 20_000)
    assert model.predict(f) == pytest.approx(2.0 * cpu_step_time(f), rel=0.15)
    assert model.predict_fit(0 + 128, 16, 20_000) < 1.3 * cpu_step_time(f)


# ---- the schedule a request must keep ---------------------------------------------------------
def slo_at(first: float, k: int, max_tokens: int | None, tpot: float = 0.05) -> RequestSLO:
    return RequestSLO(None, tpot, 0.0, first_token_time=first, num_after_first=k,
                      max_tokens=max_tokens)


def test_step_allowance_spends_slack_and_pays_debt_back_over_the_catch_up_tokens():
    # ahead: first token at 0, 4 tokens since, now 0.1 s: next deadline 0.25 -> 0.15 s left
    assert step_allowance(slo_at(0.0, 4, 100), 0.1) == pytest.approx(0.15)
    # behind: now 0.41 s, the 4th token was due at 0.2 s (0.21 s of debt): the next 32
    # tokens are due by 0.2 + 32 * 0.05, so each step may take 0.05 - 0.21 / 32
    assert step_allowance(slo_at(0.0, 4, 100), 0.41) == \
        pytest.approx(0.05 - 0.21 / CATCH_UP_TOKENS)
    # 3 tokens left (8 - 1 - 4): the debt is repaid over those 3
    assert step_allowance(slo_at(0.0, 4, 8), 0.41) == pytest.approx(0.05 - 0.21 / 3)


def test_a_request_is_lost_only_when_decoding_alone_cannot_recover_it():
    model = StepTimeModel(min_steps=4, settle_steps=4)
    for n in range(1, 9):  # exactly 20 ms + 1 ms per decode, no prefill, no context
        model.observe(StepFeatures(0, n, 0), 0.020 + 0.001 * n)
    assert model.predict_fit(0, 1, 0) == pytest.approx(0.021)
    # 10 tokens left, target end 0 + (4 + 10) * 0.05 = 0.7 s; alone: now + 10 * 0.021
    assert not is_lost(slo_at(0.0, 4, 15), 0, model, 0.7 - 0.21 - 1e-6)
    assert is_lost(slo_at(0.0, 4, 15), 0, model, 0.7 - 0.21 + 1e-6)
    # a 15 ms target is below one decode step: lost from the first token
    assert is_lost(slo_at(0.0, 0, 100, tpot=0.015), 0, model, 0.0)


def test_a_lost_request_does_not_starve_the_others():
    """One request far behind its target (it cannot recover even decoding alone) and one on
    schedule: the step is planned for the one that can still be helped."""
    model = StepTimeModel(min_steps=4, settle_steps=4)
    for n in range(1, 9):
        model.observe(StepFeatures(0, n, 0), 0.020 + 0.001 * n)
    planner = SLOPlanner(SchedulerConfig(max_num_batched_tokens=512), model)
    planner.slos = {"lost": slo_at(0.0, 2, 6), "ok": slo_at(0.9, 0, 50)}
    planner._num_tpot = 2

    class Running:
        def __init__(self, rid):
            self.request_id, self.num_tokens, self.num_computed_tokens = rid, 10, 9
            self.num_output_placeholders = 0

    budget = planner.step_budget([Running("lost"), Running("ok")], now=1.0)
    # "ok": first token at 0.9, next due 0.95 -> allowance max(-0.05, (0.9 + 32*0.05 - 1)/32)
    ok = (0.9 + CATCH_UP_TOKENS * 0.05 - 1.0) / CATCH_UP_TOKENS
    assert budget.allowed_s == pytest.approx(0.9 * ok)


# ---- admission control on the noisy machine -----------------------------------------------------
TTFT_MS, TPOT_MS = 2000.0, 80.0


def poisson(rate: float, n: int, seed: int = 0, **slo) -> list[SimRequest]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(f"r{i}", t, rng.randint(64, 256), rng.randint(32, 96), **slo))
    return out


def good(result, ids) -> set[str]:
    return {rid for rid in ids if result.timelines[rid].ttft <= TTFT_MS / 1e3
            and (result.timelines[rid].tpot or 0) <= TPOT_MS / 1e3}


def test_admission_control_under_30pct_noise_rejects_only_what_cannot_meet_ttft():
    """Twice the machine's capacity, +-30% noise: at least 85% of the accepted requests meet
    their SLOs (the forecast errs near the target, both ways), each rejected request forced in
    (every other decision replayed) misses its TTFT or makes an accepted one miss, and the
    goodput is >= 1.3x the fixed budget's on the same arrivals. (The planner of 26e3b62
    rejected requests that, forced in, met their SLOs.)"""
    work = poisson(8.0, 100, ttft_ms=TTFT_MS, tpot_ms=TPOT_MS)
    cfg = {"target_ttft_ms": TTFT_MS, "target_tpot_ms": TPOT_MS}
    decisions: dict[str, bool] = {}
    res = run(work, noisy30(0), admission=admission_by_verdict(record=decisions), **cfg)
    accepted = {rid for rid, ok in decisions.items() if ok}
    rejected = [rid for rid, ok in decisions.items() if not ok]
    assert 5 <= len(rejected) <= len(work) - 10
    kept = good(res, accepted)
    assert len(kept) >= 0.85 * len(accepted), (len(kept), len(accepted))  # forecasts err
    for rid in rejected[::6]:
        replay = dict(decisions)
        replay[rid] = True
        alt = run(work, noisy30(0), admission=admission_by_verdict(replay), **cfg)
        alt_good = good(alt, accepted | {rid})
        assert rid not in alt_good or kept - alt_good, rid
    fixed = run(poisson(8.0, 100), noisy30(0), warmed=False)
    assert len(kept) >= 1.3 * max(1, len(good(fixed, fixed.timelines))), len(kept)
    assert math.isfinite(res.makespan)
