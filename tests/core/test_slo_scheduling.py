"""SLO-aware scheduling in fake-clock simulations (tests/core/sim.py): no model, a synthetic
step time, the scheduler learning it from measured steps as in the engine.

Oracles: the synthetic step-time function's own coefficients; the best fixed token budget and
sequence cap found by sweeping them on the same workload; counterfactual reruns (a rejected
request forced in) for admission control; hand-set arrival orders for priority.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvflow.core.slo_planner import COLD_STEPS, MAX_STEP_TPOTS, PLAN_MARGIN
from kvflow.core.step_time_model import (
    StepFeatures,
    StepTimeModel,
    chunk_context_tokens,
    nonnegative_least_squares,
)
from tests.core.sim import (
    FakeClock,
    SimRequest,
    assert_idle,
    make_sim_scheduler,
    simulate,
    synthetic_step_time,
)

TPOT_MS = 40.0
TTFT_MS = 1000.0


def closed_workload(n: int = 48, seed: int = 0, tpot_ms: float | None = None
                    ) -> list[SimRequest]:
    """``n`` requests at t = 0: prompts of 64-256 tokens, 32-96 output tokens."""
    rng = random.Random(seed)
    return [SimRequest(f"r{i}", 0.0, rng.randint(64, 256), rng.randint(32, 96),
                       tpot_ms=tpot_ms) for i in range(n)]


def poisson_workload(rate: float, n: int, seed: int = 0, **slo) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(f"r{i}", t, rng.randint(64, 256), rng.randint(32, 96), **slo))
    return out


def noisy(seed: int):
    """The synthetic step time with +-10% noise (seeded)."""
    rng = random.Random(seed)
    return lambda f: synthetic_step_time(f) * rng.uniform(0.9, 1.1)


def run(workload, step_time=synthetic_step_time, admission=None, **config):
    clock = FakeClock()
    sched = make_sim_scheduler(clock, **config)
    verdict = None if admission is None else admission(sched)
    result = simulate(workload, clock, sched, step_time, verdict)
    assert_idle(sched)
    return result


def max_tpot(result) -> float:
    return max(t.tpot for t in result.timelines.values() if t.tpot is not None)


# ---- the step-time model ------------------------------------------------------------------------
def test_model_recovers_the_synthetic_coefficients():
    rng = np.random.default_rng(0)
    model = StepTimeModel(window=512, min_steps=16)
    truth = np.array([0.008, 1e-4, 6e-4, 1e-7])
    for _ in range(400):
        f = StepFeatures(int(rng.integers(0, 512)), int(rng.integers(0, 64)),
                         int(rng.integers(0, 200_000)))
        model.observe(f, synthetic_step_time(f) * rng.uniform(0.97, 1.03), model.predict(f))
    model.fit()
    np.testing.assert_allclose(model.coef, truth, rtol=0.1)
    assert model.mean_rel_error < 0.03  # the noise is +-3%
    assert model.num_predicted == 400 - 16


def test_sliding_window_fit_equals_least_squares_on_the_last_steps():
    """The running sums drop the steps that leave the window: after 3.5 windows of steps
    whose cost changed halfway, the coefficients equal numpy's least squares on exactly the
    last ``window`` steps (the oracle), not on all of them."""
    rng = np.random.default_rng(2)
    window = 64
    model = StepTimeModel(window=window, min_steps=16, refit_every=1)
    rows, times = [], []
    for i in range(224):
        f = StepFeatures(int(rng.integers(0, 512)), int(rng.integers(1, 64)),
                         int(rng.integers(0, 200_000)))
        t = synthetic_step_time(f) * (2.0 if i >= 112 else 1.0) * rng.uniform(0.97, 1.03)
        model.observe(f, t)
        rows.append(f.row())
        times.append(t)
    ref, *_ = np.linalg.lstsq(np.array(rows[-window:]), np.array(times[-window:]), rcond=None)
    assert (ref > 0).all()
    np.testing.assert_allclose(model.coef, ref, rtol=1e-6)


def test_nonnegative_fit_drops_a_negative_coefficient():
    """y = 2 + 3 x1 exactly, plus a column x2 anti-correlated with the residual noise: plain
    least squares gives x2 a negative weight; the fit keeps it at 0 and the rest exact."""
    rng = np.random.default_rng(1)
    x1 = rng.uniform(0, 10, 200)
    noise = rng.normal(0, 0.5, 200)
    x2 = np.clip(5 - noise * 4, 0, None)
    x = np.stack([np.ones(200), x1, x2], axis=1)
    y = 2 + 3 * x1 + noise
    ols, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert ols[2] < 0
    coef = nonnegative_least_squares(x, y)
    assert coef[2] == 0
    ref, *_ = np.linalg.lstsq(x[:, :2], y, rcond=None)  # the fit without the dropped column
    np.testing.assert_allclose(coef[:2], ref, rtol=1e-9)


def test_chunk_context_tokens_counts_causal_keys():
    # queries at positions 10, 11, 12 see 11, 12, 13 keys
    assert chunk_context_tokens(10, 3) == 11 + 12 + 13
    assert chunk_context_tokens(0, 1) == 1


# ---- TPOT ---------------------------------------------------------------------------------------
def test_tpot_target_held_with_throughput_near_the_best_fixed_budget():
    """Every request's mean TPOT stays under the target, and output throughput is within 10%
    of the best fixed (token budget, sequence cap) that also holds the target."""
    best = 0.0
    for budget in (64, 256, 2048):
        for max_seqs in (16, 24, 28, 32, 36, 40):
            res = run(closed_workload(), max_num_batched_tokens=budget, max_num_seqs=max_seqs)
            if max_tpot(res) <= TPOT_MS / 1e3:
                best = max(best, res.output_throughput())
    assert best > 0
    for seed in range(2):
        res = run(closed_workload(tpot_ms=TPOT_MS), noisy(seed), target_tpot_ms=TPOT_MS)
        assert max_tpot(res) <= TPOT_MS / 1e3
        assert res.output_throughput() >= 0.9 * best, (res.output_throughput(), best)
    fixed = run(closed_workload())  # the default fixed budget admits everything at once
    assert max_tpot(fixed) > 1.25 * TPOT_MS / 1e3


def test_tpot_target_held_under_async_scheduling():
    """Async scheduling schedules step N + 1 before step N's tokens are in: each decode's
    next token is then a placeholder (``num_output_placeholders``) that the planner must
    count as a decode. It counted none: every step looked decode-free, so its first
    prefill chunk went uncut. A 1500-token prompt arriving amid 8 decoding requests took
    one 275 ms step (a 40 ms target plans at most 0.9 x 3 targets, 108 ms: lock-step's
    longest gap) and the closed workload's worst mean TPOT was 41-44 ms."""
    for seed in range(2):
        res = run(closed_workload(tpot_ms=TPOT_MS), noisy(seed), target_tpot_ms=TPOT_MS,
                  async_scheduling=True)
        assert max_tpot(res) <= TPOT_MS / 1e3
    workload = [SimRequest(f"r{i}", 0.0, 64, 200, tpot_ms=TPOT_MS) for i in range(8)] + \
        [SimRequest("long", 1.0, 1500, 10, tpot_ms=TPOT_MS)]
    gaps = {}
    for mode in (False, True):
        res = run(workload, target_tpot_ms=TPOT_MS, async_scheduling=mode)
        gaps[mode] = max(b - a for t in res.timelines.values()
                         for a, b in zip(t.token_times, t.token_times[1:]))
    assert gaps[True] == pytest.approx(gaps[False])
    assert gaps[True] <= PLAN_MARGIN * MAX_STEP_TPOTS * TPOT_MS / 1e3 + 1e-9


def warmed(sched):
    """The model already fitted from earlier traffic (steps of varied sizes)."""
    rng = random.Random(3)
    for _ in range(64):
        f = StepFeatures(rng.randint(0, 512), rng.randint(0, 48), rng.randint(0, 100_000))
        sched.planner.model.observe(f, synthetic_step_time(f))


def test_per_request_tpot_target_is_honoured():
    """No engine-wide target: the one request that asks for 15 ms gets it (its neighbours
    keep the fixed budget's pace otherwise). The model is warm (the first steps of a cold
    engine admit one request per step and cannot promise a target)."""
    work = closed_workload(n=24)
    work[0].tpot_ms = 15.0
    clock = FakeClock()
    sched = make_sim_scheduler(clock)
    warmed(sched)
    res = simulate(work, clock, sched)
    assert res.timelines["r0"].tpot <= 0.015
    plain = run(closed_workload(n=24))
    assert plain.timelines["r0"].tpot > 0.015  # without the field it would not be met


# ---- TTFT and admission -------------------------------------------------------------------------
def good_count(result, slo_s=(TTFT_MS / 1e3, TPOT_MS / 1e3)) -> int:
    ttft, tpot = slo_s
    return sum(1 for t in result.timelines.values()
               if not t.rejected and t.ttft <= ttft and (t.tpot or 0) <= tpot)


def test_requests_past_their_ttft_go_after_those_that_can_still_meet_it():
    """Above capacity, FCFS serves requests that already missed their TTFT while new ones
    miss theirs too; with targets, late ones wait and the goodput is higher."""
    work = poisson_workload(25.0, 160, ttft_ms=TTFT_MS, tpot_ms=TPOT_MS)
    with_targets = good_count(run(work, target_ttft_ms=TTFT_MS, target_tpot_ms=TPOT_MS))
    plain = good_count(run(poisson_workload(25.0, 160)))
    assert with_targets >= 1.5 * max(plain, 1), (with_targets, plain)


def admission_by_verdict(forced: dict[str, bool] | None = None, record: dict | None = None):
    """The engine's admission control (``Scheduler.admission_verdict``), or a replay of
    ``forced`` decisions; ``record`` collects the decisions."""
    def make(sched):
        def admit(request) -> bool:
            rid = request.request_id
            ok = forced[rid] if forced is not None and rid in forced else \
                sched.admission_verdict(request) is None
            if record is not None:
                record[rid] = ok
            return ok
        return admit
    return make


def test_admission_control_rejects_only_what_cannot_meet_ttft():
    """Each rejected request, forced in with every other decision replayed, misses its
    TTFT or makes an accepted request miss an SLO; accepted requests meet their TTFT; the
    goodput beats the same run without admission control."""
    work = poisson_workload(25.0, 120, ttft_ms=TTFT_MS, tpot_ms=TPOT_MS)
    cfg = {"target_ttft_ms": TTFT_MS, "target_tpot_ms": TPOT_MS}
    decisions: dict[str, bool] = {}
    res = run(work, admission=admission_by_verdict(record=decisions), **cfg)
    rejected = [rid for rid, ok in decisions.items() if not ok]
    accepted = {rid for rid, ok in decisions.items() if ok}
    assert 5 <= len(rejected) <= len(work) // 2
    good = {rid for rid in accepted if res.timelines[rid].ttft <= TTFT_MS / 1e3
            and (res.timelines[rid].tpot or 0) <= TPOT_MS / 1e3}
    assert len(good) >= 0.95 * len(accepted)
    for rid in rejected[::3]:
        replay = dict(decisions)
        replay[rid] = True
        alt = run(work, admission=admission_by_verdict(replay), **cfg)
        alt_good = {r for r in accepted | {rid} if alt.timelines[r].ttft <= TTFT_MS / 1e3
                    and (alt.timelines[r].tpot or 0) <= TPOT_MS / 1e3}
        assert rid not in alt_good or good - alt_good, rid
    assert len(good) > 1.3 * good_count(run(work, **cfg))


def test_admission_control_under_async_scheduling_refuses_no_servable_request():
    """Below capacity (8 requests a second, 8 running at most) lock-step admission control
    refuses nothing and every request meets its TTFT; under async scheduling too. Its
    forecast took a decode whose token was in flight for one with nothing left to compute:
    such requests never finished in the forecast and held their running slots, so 11 of 80
    requests were refused (503), where every one can be served in time."""
    for mode in (False, True):
        decisions: dict[str, bool] = {}
        res = run(poisson_workload(8.0, 80, ttft_ms=TTFT_MS),
                  admission=admission_by_verdict(record=decisions), target_ttft_ms=TTFT_MS,
                  async_scheduling=mode, max_num_seqs=8)
        assert all(decisions.values()), (mode, sum(not ok for ok in decisions.values()))
        assert good_count(res) == 80, mode


def test_retry_after_is_given_in_whole_seconds():
    work = poisson_workload(40.0, 80, ttft_ms=TTFT_MS, tpot_ms=TPOT_MS)
    clock = FakeClock()
    sched = make_sim_scheduler(clock, target_ttft_ms=TTFT_MS, target_tpot_ms=TPOT_MS)
    verdicts = []

    def admit(request):
        verdict = sched.admission_verdict(request)
        verdicts.append(verdict)
        return verdict is None

    simulate(work, clock, sched, admission=admit)
    retry = [v for v in verdicts if v is not None]
    assert retry and all(v >= 1 and v == int(v) for v in retry)
    assert_idle(sched)


# ---- priority under targets ---------------------------------------------------------------------
def test_priority_order_kept_under_the_tpot_gate():
    """Twenty low-priority requests arrive first, then five urgent ones; the TPOT gate
    admits a few at a time: the urgent ones are admitted before every waiting low one."""
    work = [SimRequest(f"low{i}", 0.001 * i, 128, 64, priority=1) for i in range(20)]
    work += [SimRequest(f"high{i}", 0.05 + 0.001 * i, 128, 64, priority=0) for i in range(5)]
    res = run(work, policy="priority", target_tpot_ms=25.0, max_num_batched_tokens=512)
    first = {rid: t.first_token for rid, t in res.timelines.items()}
    high = max(first[f"high{i}"] for i in range(5))
    started_after = [rid for rid in first if rid.startswith("low") and first[rid] > high]
    assert len(started_after) >= 5  # the gate held them back; the urgent ones went first
    assert all(first[rid] > 0.05 for rid in started_after)
    assert max_tpot(res) <= 0.025


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_no_targets_no_change(policy):
    """Without targets the planner only learns: steps match a scheduler that never saw it
    (the fixed budget alone)."""
    work = closed_workload(n=16)
    res = run(work, policy=policy, max_num_batched_tokens=256)
    assert res.scheduler.planner.model.num_observed == res.steps - COLD_STEPS
    clock = FakeClock()
    sched = make_sim_scheduler(clock, policy=policy, max_num_batched_tokens=256)
    sched.planner.step_budget = lambda running, now: None
    again = simulate(work, clock, sched)
    assert {k: v.token_times for k, v in res.timelines.items()} == \
        {k: v.token_times for k, v in again.timelines.items()}


def test_unmeetable_targets_still_make_progress():
    """Targets no step can meet (1 us) must not stall the engine: a lone request is always
    admitted and a step without decodes always gets its prefill chunk."""
    work = [SimRequest(f"r{i}", 0.0, 200, 8, ttft_ms=0.001, tpot_ms=0.001) for i in range(4)]
    clock = FakeClock()
    sched = make_sim_scheduler(clock)
    warmed(sched)
    res = simulate(work, clock, sched)
    assert all(t.num_tokens == 8 for t in res.timelines.values())
    assert_idle(sched)
