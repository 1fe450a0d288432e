"""The scheduler's and KV-cache manager's counters (what /metrics reports) against hand counts.

Oracles: the prompt lengths and prefix-cache hits worked out by hand for each workload.
"""

from __future__ import annotations

from kvflow.engine_outputs import PromptTokenStats


def test_prefix_queries_count_each_admission_once(make_scheduler, make_driver, make_request):
    """b waits at the head of the queue while a holds the pool (5 usable blocks of 4 tokens:
    a's 16-token prompt takes 4, its 17th token the 5th); looking b up on every step it does
    not fit is not a query. Truth: a's 16 prompt tokens + b's 8, no hit (no shared prefix)."""
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    drv = make_driver(sched)
    drv.add(make_request("a", list(range(2, 18)), max_tokens=3, ignore_eos=True))
    drv.add(make_request("b", list(range(50, 58)), max_tokens=2, ignore_eos=True))
    drv.run()
    assert sched.num_preemptions == 0
    assert [rid for step in drv.steps for rid in step.num_scheduled].count("b") == 2
    assert len(drv.steps) > 4  # b was looked up on the steps before it fitted
    assert (sched.kv.num_queries, sched.kv.num_hits) == (16 + 8, 0)


def test_prefix_hits_counted_at_admission(make_scheduler, make_driver, make_request):
    """c repeats a's first two blocks (8 tokens) and waits for room while b runs (7 usable
    blocks: b's 16-token prompt takes the 4 a never used, c needs 2 hits + 2 new with only
    a's third block free, which b's 17th token takes): one query of its 14 tokens with 8
    hits, however many steps it waited."""
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=64)
    drv = make_driver(sched)
    drv.add(make_request("a", list(range(2, 14)), max_tokens=1, ignore_eos=True))
    drv.run()
    drv.add(make_request("b", list(range(60, 76)), max_tokens=3, ignore_eos=True))
    drv.add(make_request("c", [*range(2, 10), *range(90, 96)], max_tokens=1, ignore_eos=True))
    drv.run()
    assert drv.steps[-1].num_scheduled == {"c": 6}  # admitted last, after waiting
    assert len(drv.steps) == 5  # a; b; b; b; then c
    assert drv.results["c"].num_cached_tokens == 8
    assert (sched.kv.num_queries, sched.kv.num_hits) == (12 + 16 + 14, 8)
    # vLLM's prompt tokens by source: computed 12 + 16 + 6, c's 8 local hits, none loaded
    assert sched.prompt_token_stats == PromptTokenStats(12 + 16 + 6, 8, 0)


def test_iteration_tokens_count_as_vllms(make_scheduler, make_driver, make_request):
    """vLLM's tokens per step: generated tokens, plus a request's computed prompt tokens (not
    its prefix-cache hits) in the step its prefill completes, whatever earlier chunks did.
    a: a 10-token prompt in chunks of 4 (budget 4): 0, 0, then 10 + its first token, then 1
    and 1 (3 tokens). b then repeats a's first 2 blocks (8 cached tokens) with 3 new ones:
    3 + 1, then 1. Taking the counts forgets them."""
    sched = make_scheduler(max_num_batched_tokens=4)
    drv = make_driver(sched)
    drv.add(make_request("a", list(range(2, 12)), max_tokens=3, ignore_eos=True))
    drv.run()
    assert sched.take_iteration_tokens() == [0, 0, 10 + 1, 1, 1]
    assert sched.take_iteration_tokens() == []
    drv.add(make_request("b", [*range(2, 10), 40, 41, 42], max_tokens=2, ignore_eos=True))
    drv.run()
    assert drv.results["b"].num_cached_tokens == 8
    assert sched.take_iteration_tokens() == [3 + 1, 1]


def test_finished_request_phases_as_vllms(make_scheduler, make_driver, make_request):
    """vLLM's phases on the scheduler's clock, each step at its own time: a (10-token prompt,
    3 tokens) and b (4-token prompt, 2 tokens) queued at t=1; budget 8 a step. t=2: a's first
    8 tokens; t=3: a's last 2 (its first token) and b's 4 (its first token); t=5: a's and b's
    second tokens (b done); t=6: a's third (done). a: queue 1, prefill 1, decode 3, inference
    4; b: queue 2, prefill 0, decode 2, inference 2; no preemption, no cached token."""
    sched = make_scheduler(max_num_batched_tokens=8)
    now = [1.0]
    sched.clock = lambda: now[0]
    drv = make_driver(sched)
    drv.add(make_request("a", list(range(2, 12)), max_tokens=3, ignore_eos=True))
    drv.add(make_request("b", list(range(20, 24)), max_tokens=2, ignore_eos=True))
    for t in (2.0, 3.0, 5.0, 6.0):
        now[0] = t
        drv.step()
    assert not sched.has_unfinished_requests()
    got = [(f.queue_time_s, f.prefill_time_s, f.decode_time_s, f.inference_time_s,
            f.num_preemptions, f.num_prefill_computed_tokens)
           for f in sched.take_finished_stats()]
    assert got == [(2.0, 0.0, 2.0, 2.0, 0, 4), (1.0, 1.0, 3.0, 4.0, 0, 10)]  # b, then a
    assert sched.take_finished_stats() == []


def test_finished_requests_count_their_preemptions(make_scheduler, make_driver, make_request):
    """5 usable blocks of 4 tokens for two 8-token prompts growing to 16 tokens each: b (the
    newest) is preempted, so the finished requests' preemption counts add up to the
    scheduler's, b's at least 1, a's 0; b's readmission finds its blocks cached, its
    computed prompt tokens are still those of its first admission (8), as are its prompt
    tokens by source."""
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    drv = make_driver(sched)
    drv.add(make_request("a", list(range(2, 10)), max_tokens=8, ignore_eos=True))
    drv.add(make_request("b", list(range(30, 38)), max_tokens=8, ignore_eos=True))
    drv.run()
    finish_order = [out.request_id for step in drv.steps for out in step.outputs
                    if out.finish_reason]
    finished = dict(zip(finish_order, sched.take_finished_stats(), strict=True))
    assert sched.num_preemptions > 0
    assert finished["a"].num_preemptions == 0
    assert finished["b"].num_preemptions == sched.num_preemptions
    assert [f.num_prefill_computed_tokens for f in finished.values()] == [8, 8]
    # by source, each prompt once as first admitted: b's readmission hits are not counted
    assert sched.prompt_token_stats == PromptTokenStats(local_compute=8 + 8)


def test_a_stop_string_finish_records_its_phases(make_scheduler, make_driver, make_request):
    """The API process matched a stop string and stops the sample (``FINISHED_STOPPED``):
    a finished request for vLLM's phase metrics, once it had a token; a client's abort
    (``FINISHED_ABORTED``), or a stop before any token, is not."""
    from kvflow.request import RequestStatus

    sched = make_scheduler()
    now = [1.0]
    sched.clock = lambda: now[0]
    drv = make_driver(sched)
    for rid in ("stopped", "aborted"):
        drv.add(make_request(rid, [2, 3, 4], max_tokens=8, ignore_eos=True))
    now[0] = 2.0
    drv.step()  # both prefilled: first tokens at t=2
    now[0] = 4.0
    drv.step()
    drv.add(make_request("unscheduled", [5, 6, 7], max_tokens=8, ignore_eos=True))
    now[0] = 5.0
    sched.finish_requests(["stopped", "unscheduled"], RequestStatus.FINISHED_STOPPED)
    sched.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)
    (stats,) = sched.take_finished_stats()
    assert (stats.queue_time_s, stats.prefill_time_s, stats.decode_time_s,
            stats.inference_time_s) == (1.0, 0.0, 2.0, 2.0)
