"""Steps that never complete (the model raised or was interrupted): ``Scheduler.fail_steps``
aborts their requests and keeps the K/V they did not write out of the prefix cache.

Oracles: ``FakeDriver``'s simulated KV cache (a hit on a block no step wrote reads the wrong
tokens) and ``default_sample``'s tokens for the requests that go on.
"""

from __future__ import annotations

import pytest

from kvflow.core.kv_swap import SwapManager


class StepFailed(Exception):
    pass


def test_two_failed_steps_in_flight_leave_no_hit(make_scheduler, make_driver, make_request,
                                                 oracle):
    """Two chunks of a's prompt scheduled (async scheduling keeps two steps in flight), both
    lost: b, the same prompt afterwards, finds nothing cached and computes it all."""
    sched = make_scheduler(max_num_batched_tokens=16)
    drv = make_driver(sched)
    prompt = list(range(2, 42))
    drv.add(make_request("a", prompt, max_tokens=2))
    steps = []
    for _ in range(2):
        steps.append(sched.schedule())
        drv.prepare(steps[-1])  # the runner got it
    assert [out.num_scheduled_tokens for out in steps] == [{"a": 16}, {"a": 16}]
    sched.fail_steps(steps)
    assert not sched.requests
    drv.add(make_request("b", prompt, max_tokens=3))
    res = drv.run()
    assert res["b"].num_cached_tokens == 0
    assert res["b"].output_token_ids == oracle(prompt, 3)


def test_a_request_preempted_by_a_later_failed_step_leaves_no_hit(make_scheduler, make_driver,
                                                                  make_request, oracle):
    """Two steps in flight: the first computes a's tokens 7..13 (its blocks 1 and 2 indexed,
    never written), the second preempts a (its 5th block does not fit the 7 usable), freeing
    those blocks before the failure is known; b, a's prompt afterwards, must not hit them."""
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=8)
    drv = make_driver(sched)
    prompt = list(range(2, 20))  # 18 tokens
    drv.add(make_request("o", list(range(100, 108)), max_tokens=20, ignore_eos=True))
    drv.add(make_request("a", prompt, max_tokens=2, ignore_eos=True))
    assert [drv.step().num_scheduled for _ in range(2)] == [{"o": 8}, {"o": 1, "a": 7}]
    steps = []
    for _ in range(2):
        steps.append(sched.schedule())
        drv.prepare(steps[-1])
    assert steps[0].num_scheduled_tokens == {"o": 1, "a": 7} and steps[1].preempted_ids == ["a"]
    sched.fail_steps(steps)
    drv.add(make_request("b", prompt, max_tokens=3, ignore_eos=True))
    res = drv.run()
    assert res["b"].num_cached_tokens == 0
    assert res["b"].output_token_ids == oracle(prompt, 3)


def test_a_swap_out_in_a_failed_step_is_recomputed(make_scheduler, make_driver, make_request,
                                                   oracle):
    """v (300 computed tokens: swapped rather than recomputed) is preempted by the step in
    which a needs a block; that step fails, so v's blocks were never copied to the host: v
    is recomputed from its tokens (its output is the oracle's; reading back host blocks
    nobody wrote would not be) and the host pool is free again."""
    sched = make_scheduler(num_blocks=181, max_num_batched_tokens=1024)
    sched.swap = SwapManager(sched.kv, 200, 64, sched.planner.model)
    drv = make_driver(sched)
    prompts = {"a": list(range(2, 402)), "v": list(range(1000, 1300))}
    drv.add(make_request("a", prompts["a"], max_tokens=40, ignore_eos=True))
    drv.add(make_request("v", prompts["v"], max_tokens=40, ignore_eos=True))
    execute, failed = drv.execute, []

    def execute_unless_preempting(out):
        if out.preempted_ids and not failed:
            drv.prepare(out)
            failed.append(out)
            raise StepFailed
        return execute(out)

    drv.execute = execute_unless_preempting
    with pytest.raises(StepFailed):
        while sched.has_unfinished_requests():
            drv.step()
    assert failed[0].preempted_ids == ["v"] and failed[0].blocks_to_swap_out
    sched.fail_steps(failed)
    assert "a" not in sched.requests and sched.requests["v"].num_computed_tokens == 0
    assert not sched.swap.holds(sched.requests["v"])
    res = drv.run()
    assert res["v"].output_token_ids == oracle(prompts["v"], 40)
    sched.swap.release_read_blocks()
    assert sched.swap.host.num_free_blocks == 200 and sched.swap.num_swapped_in == 0
