"""Several steps in flight (pipeline parallelism): the scheduler never schedules a request
whose sampled token is still out, pipelines a long prompt's chunks, never preempts a request
in flight, and the outputs equal the lock-step oracle.

The driver plays a pipeline of ``depth`` stages: it schedules up to ``depth`` micro-batches
before executing (FakeDriver's KV-checking execute, in send order) and folding back the oldest.
"""

from __future__ import annotations

from collections import deque

import pytest

from kvflow.request import RequestStatus


def run_pipelined(drv, depth: int, max_num_reqs=None, max_steps: int = 5000) -> dict:
    """Drive ``drv.scheduler`` with up to ``depth`` steps in flight. Returns what was seen:
    ``depths`` (steps in flight when each step was sent) and ``overlaps`` (requests sent
    again while an earlier step of theirs was in flight)."""
    sched, queue = drv.scheduler, deque()
    sched.track_in_flight = True  # as the engine core sets it for a pipeline
    seen = {"depths": [], "overlaps": 0}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not queue:
            return seen
        if len(queue) < depth:
            out = sched.schedule(max_num_reqs=max_num_reqs)
            scheduled = drv.prepare(out)  # checks the diffs against the scheduler's state
            _check_against_in_flight(out, scheduled, queue, seen)
            if not out.is_empty:
                seen["depths"].append(len(queue))
                queue.append((out, scheduled))
                if len(queue) < depth:
                    continue
        assert queue, "no progress: scheduler is stuck"
        _fold_in(drv, queue.popleft()[0])
    raise AssertionError("not finished")


def _check_against_in_flight(out, scheduled, queue, seen) -> None:
    """Nothing that samples in a step in flight is scheduled again; nothing in flight is
    preempted."""
    in_flight = {s.request_id for _, q in queue for s in q}
    sampling = {s.request_id for _, q in queue for s in q if s.do_sample}
    again = {s.request_id for s in scheduled} & in_flight
    assert not again & sampling, f"scheduled while its token is out: {again & sampling}"
    assert not set(out.preempted_ids) & in_flight, "preempted a request in flight"
    seen["overlaps"] += len(again)


def _fold_in(drv, out) -> None:
    sampled = drv.execute(out)
    for o in drv.scheduler.update_from_output(out, sampled):
        drv.history[o.request_id].extend(o.new_token_ids)
        res = drv.results[o.request_id]
        res.output_token_ids.extend(o.new_token_ids)
        res.finish_reason = o.finish_reason
    drv.check_ref_counts()


def test_decodes_split_into_micro_batches(make_scheduler, make_driver, make_request, oracle):
    sched = make_scheduler(max_num_batched_tokens=64)
    drv = make_driver(sched)
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] for i in range(6)}
    for rid, prompt in prompts.items():
        drv.add(make_request(rid, prompt, max_tokens=8))
    seen = run_pipelined(drv, depth=2, max_num_reqs=3)
    assert seen["depths"].count(1) >= 6  # a second micro-batch went out while one was busy
    for rid, prompt in prompts.items():
        assert drv.results[rid].output_token_ids == oracle(prompt, 8)


def test_long_prompt_chunks_are_pipelined(make_scheduler, make_driver, make_request, oracle):
    """A 40-token prompt with a 16-token budget: chunk 2 goes out while chunk 1 is in
    flight (it needs no sampled token), and the result equals the oracle."""
    sched = make_scheduler(max_num_batched_tokens=16)
    drv = make_driver(sched)
    prompt = list(range(2, 42))
    drv.add(make_request("a", prompt, max_tokens=4))
    seen = run_pipelined(drv, depth=2)
    assert seen["overlaps"] >= 2 and drv.results["a"].output_token_ids == oracle(prompt, 4)


@pytest.mark.parametrize("num_blocks", [12, 16])
def test_tight_pool_never_preempts_a_request_in_flight(make_scheduler, make_driver,
                                                       make_request, oracle, num_blocks):
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=32)
    drv = make_driver(sched)
    prompts = {f"r{i}": list(range(3 * i + 2, 3 * i + 11)) for i in range(5)}
    for rid, prompt in prompts.items():
        drv.add(make_request(rid, prompt, max_tokens=10))
    run_pipelined(drv, depth=2, max_num_reqs=3)
    assert sched.num_preemptions > 0  # the pool was tight enough to matter
    for rid, prompt in prompts.items():
        assert drv.results[rid].output_token_ids == oracle(prompt, 10)
    assert not sched.in_flight


def test_abort_while_in_flight_drops_the_late_result(make_scheduler, make_driver,
                                                     make_request):
    sched = make_scheduler()
    drv = make_driver(sched)
    sched.track_in_flight = True
    drv.add(make_request("a", [5, 6, 7], max_tokens=4))
    out = sched.schedule()
    drv.abort(["a"])  # its step is still out: its blocks are freed now
    assert sched.update_from_output(out, drv.execute(out)) == []
    assert not sched.in_flight and not sched.has_unfinished_requests()
    assert drv.results["a"].finish_reason == RequestStatus.FINISHED_ABORTED.value
