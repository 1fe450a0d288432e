"""``Request.kv_steady_until``: the KV cache manager's promise that a plain decode's slot needs
no new block and fills no block to index, which lets the scheduler skip
``try_allocate_slots`` for it.

The oracles are hand-counted block boundaries (block size 4) and the fake driver
(tests/core/conftest.py), whose mirror of the block tables is built from the scheduler's
messages alone and whose simulated KV cache must read back every request's own tokens: a
skipped allocation that was needed shows up as a wrong read, and outputs must equal greedy
decoding of the fake model.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.config import SpeculativeConfig
from kvflow.request import Request, RequestStatus
from kvflow.spec_decode.speculator import Speculator
from tests.core.test_async_schedule import run_async

WRONG = 7  # never sampled by the fake model (its tokens are >= 100)


def _count_allocations(sched) -> list:
    """The computed count of each request at every ``try_allocate_slots`` call from now on
    (as ``(computed, num_new_tokens)``), in order."""
    calls, real = [], sched.kv.try_allocate_slots

    def counted(request, num_new_tokens, *args):
        calls.append((request.num_computed_tokens, num_new_tokens))
        return real(request, num_new_tokens, *args)

    sched.kv.try_allocate_slots = counted
    return calls


def _record_outputs(sched) -> list:
    """Every SchedulerOutput ``sched.schedule`` returns from now on, in order."""
    outs, schedule = [], sched.schedule

    def recorded(*args, **kwargs):
        outs.append(schedule(*args, **kwargs))
        return outs[-1]

    sched.schedule = recorded
    return outs


# (position computed, kv_steady_until after that step), hand-computed for block size 4: with
# prefix caching a call is due when a block fills (to index it: positions 7, 11, 15) and when
# one starts (to allocate: 8, 12, 16); without it only when one starts. Freed at the end: 0.
PROMISES = {
    True: [(6, 7), (7, 8), (8, 11), (9, 11), (10, 11), (11, 12), (12, 15), (13, 15), (14, 15),
           (15, 16), (16, 19), (17, 19), (18, 0)],
    False: [(6, 8), (7, 8), (8, 12), (9, 12), (10, 12), (11, 12), (12, 16), (13, 16),
            (14, 16), (15, 16), (16, 20), (17, 20), (18, 0)],
}


@pytest.mark.parametrize("caching", [True, False])
def test_decode_gets_blocks_exactly_at_block_boundaries(make_scheduler, make_driver,
                                                        make_request, oracle, caching):
    """A 6-token prompt decoding 14 tokens: new block ids come with the steps whose token
    starts a block (positions 8, 12, 16), never otherwise; the promise is what the table and
    the indexed blocks allow; with prefix caching the full blocks are indexed as they fill
    (a later request with the same 17 tokens hits all 4 full blocks)."""
    sched = make_scheduler(num_blocks=100, enable_prefix_caching=caching)
    driver = make_driver(sched)
    outs = _record_outputs(sched)
    prompt = [11, 12, 13, 14, 15, 16]
    driver.add(make_request("a", prompt, max_tokens=14))
    request = sched.requests["a"]
    new_blocks_at, promises = [], []
    while sched.has_unfinished_requests():
        computed = request.num_computed_tokens
        driver.step()
        if computed >= len(prompt):  # a decode step (it computed position ``computed``)
            if "a" in outs[-1].scheduled_cached_reqs.new_block_ids:
                new_blocks_at.append(computed)
            promises.append((computed, request.kv_steady_until))
    assert new_blocks_at == [8, 12, 16]
    assert promises == PROMISES[caching]
    tokens = prompt + oracle(prompt, 14)
    assert driver.results["a"].output_token_ids == tokens[len(prompt):]
    if caching:
        probe = make_request("probe", tokens[:17], max_tokens=1)
        assert sched.kv.get_computed_blocks(probe)[1] == 16


# The decode positions at which the KV manager is called, hand-counted from PROMISES: after
# the prefill's call (6 tokens), only where the promise ran out.
CALLED_AT = {True: [7, 8, 11, 12, 15, 16], False: [8, 12, 16]}


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_calls_the_kv_manager_only_where_the_promise_ends(
        make_scheduler, make_driver, make_request, oracle, caching, async_scheduling):
    """The same request as above, lock-step and with async scheduling (each decode's token
    a placeholder still out): the KV manager is called for the prefill and at the
    hand-counted positions only (was, under async scheduling: at every decode step), and
    the tokens are greedy decoding's (the fake runner reads every slot back; blocks leaked
    fail the fixture)."""
    sched = make_scheduler(num_blocks=100, enable_prefix_caching=caching,
                           async_scheduling=async_scheduling)
    driver = make_driver(sched)
    calls = _count_allocations(sched)
    prompt = [11, 12, 13, 14, 15, 16]
    driver.add(make_request("a", prompt, max_tokens=14))
    seen = run_async(driver) if async_scheduling else driver.run() and None
    assert calls == [(0, 6)] + [(c, 1) for c in CALLED_AT[caching]]
    assert driver.results["a"].output_token_ids == oracle(prompt, 14)
    if async_scheduling:
        assert seen["overlaps"] == 13  # each of its 13 decodes was scheduled with a token out


def test_preempted_request_resumes_with_whole_tables(make_scheduler, make_driver, make_request,
                                                    oracle):
    """Two requests in 7 usable blocks: B (newest) is preempted at step 5 (its blocks freed,
    its promise 0) and readmitted at step 12 with its whole table (13 tokens: 4 blocks, the
    first 2 prefix hits); both outputs match greedy decoding."""
    sched = make_scheduler(num_blocks=8, max_model_len=24)
    driver = make_driver(sched)
    outs = _record_outputs(sched)
    prompts = {"A": list(range(10, 18)), "B": list(range(20, 28))}
    for rid, prompt in prompts.items():
        driver.add(make_request(rid, prompt, max_tokens=12))
    b = sched.requests["B"]
    for _ in range(6):
        driver.step()
    assert outs[5].preempted_ids == ["B"]
    assert b.kv_steady_until == 0 and sched.kv.get_block_ids("B") == ([],)
    while sched.has_unfinished_requests():
        driver.step()
    resumed = [i for i, out in enumerate(outs) if "B" in out.scheduled_cached_reqs.resumed_req_ids]
    assert resumed == [12]
    cached = outs[12].scheduled_cached_reqs
    assert cached.num_computed_tokens[cached.req_ids.index("B")] == 8
    assert [len(ids) for ids in cached.new_block_ids["B"]] == [4]
    for rid, prompt in prompts.items():
        assert driver.results[rid].output_token_ids == oracle(prompt, 12)


class WrongOnceSpeculator(Speculator):
    """Proposes wrong drafts for a request once, at its first decode, then none: the rejected
    drafts' blocks are freed and every later step is a plain decode."""

    def __init__(self, k: int) -> None:
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                           adaptive=False), 4000)
        self.done: set[str] = set()

    def _candidate_drafts(self, request: Request, room: int) -> np.ndarray:
        if request.request_id in self.done:
            return np.zeros(0, np.int64)
        self.done.add(request.request_id)
        return np.full(room, WRONG, np.int64)


@pytest.mark.parametrize("caching", [True, False])
def test_plain_decodes_after_rejected_drafts_allocate_again(make_scheduler, make_driver,
                                                            make_request, oracle, caching):
    """8 wrong drafts after a 5-token prompt take positions up to 13 (4 blocks); rejecting
    them frees the 2 blocks past position 7 (the promise drops to 0), and the plain decodes
    that follow must get blocks again at positions 8 and 12 (a promise kept from before the
    cut would skip them: without prefix caching it said 16 tokens)."""
    sched = make_scheduler(num_blocks=100, enable_prefix_caching=caching)
    sched.speculator = WrongOnceSpeculator(8)
    driver = make_driver(sched)
    outs = _record_outputs(sched)
    prompt = [1, 2, 3, 4, 5]
    driver.add(make_request("a", prompt, max_tokens=12))
    request = sched.requests["a"]
    driver.step()  # prefill: 2 blocks
    driver.step()
    assert outs[1].scheduled_spec_decode_tokens == {"a": [WRONG] * 8}
    assert len(outs[1].scheduled_cached_reqs.new_block_ids["a"][0]) == 2  # blocks 2 and 3
    assert sched.kv.num_held_blocks("a") == [2] and request.kv_steady_until == 0
    new_block_at = []
    while sched.has_unfinished_requests():
        computed = request.num_computed_tokens
        driver.step()
        if "a" in outs[-1].scheduled_cached_reqs.new_block_ids:
            new_block_at.append(computed)
    assert outs[2].truncated_block_tables == {"a": 2}
    assert new_block_at == [8, 12]
    assert driver.results["a"].output_token_ids == oracle(prompt, 12)
    assert request.status == RequestStatus.FINISHED_LENGTH
