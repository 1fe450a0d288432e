"""Speculative decoding in the scheduler: drafts are more tokens of the same step, rejected
ones are rolled back, and nothing leaks.

The fake driver (tests/core/conftest.py) plays a greedy target and checks every step's KV
reads; the oracle is plain greedy decoding of the same deterministic "model", so any draft
handling error (a lost or duplicated token, a stale block, a wrong computed count) shows up as
output different from the oracle, a wrong KV read, or a leaked block.
"""

from __future__ import annotations

import pytest

from kvflow.config import SpeculativeConfig
from kvflow.request import Request
from kvflow.spec_decode.cost_model import StepTimes
from kvflow.spec_decode.speculator import Speculator
from tests.core.conftest import default_sample

WRONG = 7  # never sampled by the fake model (its tokens are >= 100)


class OracleSpeculator(Speculator):
    """Proposes the fake model's true next tokens, with one deliberate error at a position
    that varies with the request's length (sometimes none), so steps accept 0..K drafts."""

    def __init__(self, k: int, max_model_len: int, wrong_every: int = 3, **kw) -> None:
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                           adaptive=False, **kw), max_model_len)
        self.wrong_every = wrong_every
        self.proposed: list[tuple[str, int, int]] = []  # (request, num_tokens, drafts)

    def _candidate_drafts(self, request: Request, room: int):
        import numpy as np

        history, out = list(request.all_token_ids), []
        for _ in range(room):
            out.append(default_sample(history))
            history.append(out[-1])
        wrong_at = len(request.all_token_ids) % (room + self.wrong_every)
        if wrong_at < room:
            out[wrong_at] = WRONG
        self.proposed.append((request.request_id, request.num_tokens, room))
        return np.array(out, np.int64)


class WrongSpeculator(Speculator):
    """Every draft is wrong: every step rejects all of them."""

    def _candidate_drafts(self, request: Request, room: int):
        import numpy as np

        return np.full(room, WRONG, np.int64)


def _run(make_scheduler, make_driver, make_request, speculator, prompts, max_tokens=20,
         **sched_kw):
    sched = make_scheduler(**sched_kw)
    sched.speculator = speculator
    driver = make_driver(sched)
    for i, prompt in enumerate(prompts):
        driver.add(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    return driver.run(), driver


PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], list(range(30, 47)), [51]]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_output_equals_oracle_whatever_is_accepted(make_scheduler, make_driver,
                                                          make_request, oracle, k):
    spec = OracleSpeculator(k, 4000)
    results, driver = _run(make_scheduler, make_driver, make_request, spec, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        assert results[f"r{i}"].output_token_ids == oracle(prompt, 20)
        assert results[f"r{i}"].finish_reason == "length"
    # both outcomes happened: full acceptance (bonus token) and rejections
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.num_accepted_per_pos[k - 1] > 0
    # fewer steps than tokens: speculation paid off in steps
    assert len(driver.steps) < 20 + 3


def test_counts_reach_outputs_and_requests(make_scheduler, make_driver, make_request):
    spec = OracleSpeculator(3, 4000)
    sched = make_scheduler()
    sched.speculator = spec
    driver = make_driver(sched)
    driver.add(make_request("a", [1, 2, 3, 4], max_tokens=12))
    drafted = accepted = 0
    while sched.has_unfinished_requests():
        for out in driver.step().outputs:
            drafted += out.num_draft_tokens
            accepted += out.num_accepted_tokens
            assert out.num_accepted_tokens <= out.num_draft_tokens
            assert len(out.new_token_ids) <= out.num_accepted_tokens + 1
    assert (drafted, accepted) == (spec.num_draft_tokens, spec.num_accepted_tokens)
    # after the prefill step, a step computing more than one token carried drafts
    assert spec.num_drafts == sum(1 for s in driver.steps[1:] if s.num_scheduled["a"] > 1)


def test_rejected_drafts_roll_back_and_free_whole_blocks(make_scheduler, make_driver,
                                                         make_request, oracle):
    sched = make_scheduler(num_blocks=50, block_size=4)
    sched.speculator = WrongSpeculator(SpeculativeConfig(method="ngram", num_speculative_tokens=6,
                                                         adaptive=False), 4000)
    driver = make_driver(sched)
    driver.add(make_request("a", [1, 2, 3, 4, 5], max_tokens=10))
    driver.step()  # prefill: samples the first token (6 tokens known, 5 computed)
    request = sched.requests["a"]
    free_before = sched.kv.num_free_blocks
    sched_out = sched.schedule()
    # 1 catch-up token + 6 drafts: positions 5..11 need blocks 1 and 2 (block size 4)
    assert sched_out.num_scheduled_tokens["a"] == 7
    assert sched_out.scheduled_spec_decode_tokens["a"] == [WRONG] * 6
    assert sched.kv.num_free_blocks == free_before - 1
    runner_output = driver.execute(sched_out)
    assert runner_output.sampled_token_ids == [oracle([1, 2, 3, 4, 5], 2)[1:]]
    for out in sched.update_from_output(sched_out, runner_output):
        driver.history[out.request_id].extend(out.new_token_ids)
    # all 6 rejected: computed back to the last accepted position, 7 tokens known, and the
    # block that held only rejected drafts (positions 8..11) is free again
    assert (request.num_computed_tokens, request.num_tokens) == (6, 7)
    assert sched.kv.num_free_blocks == free_before
    assert sched.kv.num_held_blocks("a") == [2]
    nxt = sched.schedule()
    assert nxt.truncated_block_tables == {"a": 2}
    driver.execute(nxt)  # the driver's mirror applies the cut and checks it
    sched.finish_requests(["a"], request.status.FINISHED_ABORTED)


def test_budget_cuts_drafts_short(make_scheduler, make_driver, make_request, oracle):
    spec = OracleSpeculator(4, 4000, wrong_every=100)
    results, driver = _run(make_scheduler, make_driver, make_request, spec,
                           [[1, 2, 3], [4, 5, 6], [7, 8, 9]], max_tokens=15,
                           max_num_batched_tokens=7)
    for i, prompt in enumerate([[1, 2, 3], [4, 5, 6], [7, 8, 9]]):
        assert results[f"r{i}"].output_token_ids == oracle(prompt, 15)
    assert all(s.total <= 7 for s in driver.steps)
    # some step scheduled a request's drafts only in part (the budget ran out)
    partial = [s for s in driver.steps if 1 < sum(s.num_scheduled.values()) == 7]
    assert partial


def test_drafts_stop_at_max_tokens_and_max_model_len(make_scheduler, make_driver,
                                                     make_request, oracle):
    spec = OracleSpeculator(8, 4000, wrong_every=1000)
    results, _ = _run(make_scheduler, make_driver, make_request, spec, [[1, 2]], max_tokens=5)
    assert results["r0"].output_token_ids == oracle([1, 2], 5)
    # at 3 known tokens (1 output) room is max_tokens - 1 output - 1 bonus = 3
    assert all(room <= 5 - (n - 2) - 1 for _, n, room in spec.proposed)
    spec = OracleSpeculator(8, 12, wrong_every=1000)
    results, _ = _run(make_scheduler, make_driver, make_request, spec, [[1, 2, 3]],
                      max_tokens=100, max_model_len=12)
    assert results["r0"].output_token_ids == oracle([1, 2, 3], 9)
    assert results["r0"].finish_reason == "length"
    assert all(n + room <= 11 for _, n, room in spec.proposed)


def test_preemption_and_prefix_caching_with_drafts(make_scheduler, make_driver, make_request,
                                                   oracle):
    """A pool too small for all requests forces preemptions while drafts are in flight;
    shared prompts hit the prefix cache. Outputs stay the oracle's, nothing leaks (the
    fixture checks the pool after the test)."""
    shared = list(range(200, 213))
    prompts = [shared + [i] for i in range(6)]
    spec = OracleSpeculator(4, 4000)
    results, driver = _run(make_scheduler, make_driver, make_request, spec, prompts,
                           max_tokens=24, num_blocks=24, block_size=4)
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"].output_token_ids == oracle(prompt, 24)
    assert any(s.preempted for s in driver.steps)
    assert any(r.num_cached_tokens > 0 for r in results.values())
    assert spec.num_accepted_tokens > 0


def test_abort_between_schedule_and_update(make_scheduler, make_driver, make_request, oracle):
    spec = OracleSpeculator(4, 4000)
    sched = make_scheduler(num_blocks=40)
    sched.speculator = spec
    driver = make_driver(sched)
    driver.add(make_request("a", [1, 2, 3], max_tokens=30))
    driver.add(make_request("b", [4, 5, 6], max_tokens=30))
    for _ in range(3):
        driver.step()
    sched_out = sched.schedule()
    assert "a" in sched_out.scheduled_spec_decode_tokens
    runner_output = driver.execute(sched_out)
    driver.abort(["a"])  # e.g. the client went away mid-step
    outputs = sched.update_from_output(sched_out, runner_output)
    assert [o.request_id for o in outputs] == ["b"]
    driver.history["b"].extend(outputs[0].new_token_ids)
    driver.results["b"].output_token_ids.extend(outputs[0].new_token_ids)
    assert sched.kv.num_held_blocks("a") == [0]
    results = driver.run()
    assert results["b"].output_token_ids == oracle([4, 5, 6], 30)


def test_ngram_proposer_through_the_scheduler(make_scheduler, make_driver, make_request):
    """The real n-gram proposer: the scripted "model" mostly copies its prompt, with a few
    departures, so some guesses are accepted and some rejected."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    script = [5, 6, 7, 8, 40, 9, 10, 11, 12, 5, 6, 41, 7, 8, 9, 10, 11, 12, 5, 6]
    sched = make_scheduler()
    sched.speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                    prompt_lookup_min=1, adaptive=False), 4000)
    driver = make_driver(sched, {"r0": script})
    driver.add(make_request("r0", prompt, max_tokens=len(script)))
    results = driver.run()
    assert results["r0"].output_token_ids == script
    spec = sched.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert len(driver.steps) < len(script)


class MixedSpeculator(OracleSpeculator):
    """Request "good" gets the true next tokens, every other request wrong ones."""

    def _candidate_drafts(self, request: Request, room: int):
        import numpy as np

        if request.request_id == "good":
            return super()._candidate_drafts(request, room)
        return np.full(room, WRONG, np.int64)


def _timed_run(make_scheduler, make_driver, make_request, spec, prompts, step_seconds,
               max_tokens=30, pass_seconds=None):
    """Run with an adaptive speculator fed a synthetic measured step time per step
    (``step_seconds(tokens in the step)``); returns results and each step's drafts. With
    ``pass_seconds`` (a draft model), each step's drafts also cost ``max(k)`` passes of
    ``pass_seconds(requests drafting)`` on top of the target's step."""
    sched = make_scheduler()
    sched.speculator = spec
    driver = make_driver(sched)
    execute, drafts_per_step = driver.execute, []

    def timed_execute(sched_out):
        out = execute(sched_out)
        drafts = sched_out.scheduled_spec_decode_tokens
        seconds = step_seconds(sched_out.total_num_scheduled_tokens)
        if pass_seconds is not None:
            passes = max((len(d) for d in drafts.values()), default=0)
            out.draft_pass_s = pass_seconds(len(drafts)) if drafts else 0.0
            out.draft_time_s = passes * out.draft_pass_s
            seconds += out.draft_time_s
        spec.observe_step(sched_out, out, seconds)
        drafts_per_step.append({r: len(d) for r, d in drafts.items()})
        return out

    driver.execute = timed_execute
    for rid, prompt in prompts.items():
        driver.add(make_request(rid, prompt, max_tokens=max_tokens))
    return driver.run(), drafts_per_step


def _adaptive(k: int) -> OracleSpeculator:
    spec = OracleSpeculator(k, 4000, wrong_every=1000)
    spec.config.adaptive = True
    return spec


def test_adaptive_lengths_take_drafts_when_steps_cost_the_same(make_scheduler, make_driver,
                                                               make_request, oracle):
    """A step costs 1 s whatever its size (memory-bound decoding): after the first measured
    decode step every step speculates the full K, and the output is the oracle's."""
    spec = _adaptive(4)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7]}
    results, drafts = _timed_run(make_scheduler, make_driver, make_request, spec, prompts,
                                 lambda tokens: 1.0)
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == oracle(prompt, 30)
    assert not drafts[1]  # the first decode step measures the plain step size first
    assert all(d.get("a") == 4 for d in drafts[2:5])
    assert len(drafts) < 30 // 2


def test_adaptive_lengths_stop_when_verification_costs_more(make_scheduler, make_driver,
                                                            make_request, oracle):
    """A step costs its token count (compute-bound): a draft token costs a full token and is
    accepted with probability < 1, so once the step sizes with drafts are measured, no step
    speculates (the decision comes from the measured times: a flat cost took drafts above)."""
    spec = _adaptive(4)
    prompts = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(4)}
    results, drafts = _timed_run(make_scheduler, make_driver, make_request, spec, prompts,
                                 lambda tokens: float(tokens))
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == oracle(prompt, 30)
    assert not any(drafts[len(drafts) // 2:])
    assert len(drafts) >= 30


def test_adaptive_lengths_follow_each_requests_acceptance(make_scheduler, make_driver,
                                                          make_request, oracle):
    """Cost 4 s + 1 s per token: drafts pay only for a request that accepts them. The
    request whose drafts are always wrong gets a few while its estimate is shrunk toward the
    engine-wide rate, then none (K=4 every step would be ~150 wasted drafts); the other
    gets the full K."""
    spec = MixedSpeculator(4, 4000, wrong_every=1000)
    spec.config.adaptive = True
    prompts = {"good": [1, 2, 3], "bad": [4, 5, 6]}
    results, drafts = _timed_run(make_scheduler, make_driver, make_request, spec, prompts,
                                 lambda tokens: 4.0 + tokens, max_tokens=40)
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == oracle(prompt, 40)
    bad = [d.get("bad", 0) for d in drafts]
    assert 0 < sum(bad) <= 8 and not any(bad[-10:])
    good = [d["good"] for d in drafts if "good" in d]
    assert sum(good) >= 20 and good.count(4) >= len(good) // 2



def _run_mixed(make_scheduler, make_driver, make_request, speculator, requests, **sched_kw):
    """``requests``: (prompt, max_tokens) pairs, ids r0, r1, ..."""
    sched = make_scheduler(**sched_kw)
    sched.speculator = speculator
    driver = make_driver(sched)
    for i, (prompt, max_tokens) in enumerate(requests):
        driver.add(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    return driver.run(), driver


def test_drafts_never_preempt(make_scheduler, make_driver, make_request, oracle):
    """A pool that holds every request's plain decoding (r0 finishes early and frees its
    blocks for the others' growth) but not their drafts on top: a request whose drafts find
    no free block decodes without them, and no request is preempted for drafts (before, the
    drafts' blocks were taken by preempting the running tail)."""
    requests = [(list(range(60, 72)), 2)] + [([10 * i + 1, 10 * i + 2, 10 * i + 3], 13)
                                              for i in range(1, 4)]
    kw = {"num_blocks": 15, "block_size": 4}
    _, plain_driver = _run_mixed(make_scheduler, make_driver, make_request, None, requests,
                                 **kw)
    assert not any(s.preempted for s in plain_driver.steps)  # plain decoding fits
    spec = WrongSpeculator(SpeculativeConfig(method="ngram", num_speculative_tokens=12,
                                             adaptive=False), 4000)
    results, driver = _run_mixed(make_scheduler, make_driver, make_request, spec, requests,
                                 **kw)
    for i, (prompt, max_tokens) in enumerate(requests):
        assert results[f"r{i}"].output_token_ids == oracle(prompt, max_tokens)
    assert not any(s.preempted for s in driver.steps)
    assert spec.num_draft_tokens > 0  # drafts ran where they fitted


def _draft_model_run(make_scheduler, make_driver, make_request, spec, prompts, step_seconds,
                     pass_seconds, max_tokens=30):
    """``_timed_run`` for a draft model whose passes cost ``pass_seconds(requests drafting)``."""
    return _timed_run(make_scheduler, make_driver, make_request, spec, prompts, step_seconds,
                      max_tokens, pass_seconds)


def _draft_model_speculator(k: int, draft_cost_ratio: float) -> OracleSpeculator:
    spec = _adaptive(k)
    spec.uses_draft_model, spec.draft_cost_ratio = True, draft_cost_ratio
    spec.draft_times = StepTimes()
    return spec


def test_a_draft_model_that_cannot_pay_never_drafts(make_scheduler, make_driver,
                                                    make_request, oracle):
    """Self-drafting at batch 8 (a target step costs 0.5 s whatever its tokens, a draft pass
    as much, the weight-bytes seed 1.0): k drafts cost k target steps for fewer tokens, so no
    step drafts, not even once to measure the draft (before, an unmeasured draft counted as
    free: the first decode steps drafted K=4 for every request)."""
    spec = _draft_model_speculator(4, 1.0)
    prompts = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(8)}
    results, drafts = _draft_model_run(make_scheduler, make_driver, make_request, spec,
                                       prompts, lambda tokens: 0.5, lambda rows: 0.5)
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == oracle(prompt, 30)
    assert not any(drafts) and spec.num_draft_tokens == 0


def test_a_cheap_draft_model_drafts(make_scheduler, make_driver, make_request, oracle):
    """The same batch on a memory-bound target (0.5 s a step whatever its tokens) with a
    draft pass at 0.1 s (seeded 0.2 from its weight bytes): drafts pay, and are taken from
    the first measured decode step on."""
    spec = _draft_model_speculator(4, 0.2)
    prompts = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(8)}
    results, drafts = _draft_model_run(make_scheduler, make_driver, make_request, spec,
                                       prompts, lambda tokens: 0.5, lambda rows: 0.1)
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == oracle(prompt, 30)
    assert not drafts[1] and all(drafts[2:4])
    assert len(drafts) < 30 // 2
