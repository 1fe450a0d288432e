"""The fair policy's backfilling (core/fair_queue.py): a request deficit round robin serves
that does not fit the free KV blocks is reserved and passed over; the other clients' requests
that fit are admitted into the blocks that were free then, the blocks freed after are kept
for it, and it is offered first until it is admitted. FCFS and priority keep vLLM's rule (a
head that does not fit holds the queue).

Oracle: admission steps worked out by hand (block size 4, 16 usable blocks; a request holds
ceil((prompt + max_tokens - 1) / 4) blocks, all taken at admission here; one with
max_tokens=4 admitted at step s samples its tokens at steps s..s+3 and frees its blocks
before step s+4).
"""

from __future__ import annotations

from kvflow.core.fair_queue import FairWaitingQueue
from kvflow.core.sched_policy import make_policy, make_waiting_queue
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams

NUM_BLOCKS = 17  # 16 usable (one null block)


def _admissions(make_scheduler, make_driver, policy: str, steps: int = 10
                ) -> dict[int, list[str]]:
    """Client C's c0 (37 tokens, 10 blocks) runs from step 1; then client A's a0 (29 tokens:
    8 blocks, over the 6 free) and client B's b0..b5 (9 tokens: 3 blocks each) wait. Returns
    step -> the requests admitted there (their first scheduled step)."""
    sched = make_scheduler(num_blocks=NUM_BLOCKS, policy=policy)
    drv = make_driver(sched)
    assert sched.kv.num_free_blocks == 16

    def add(rid: str, client: str, base: int, size: int, arrival: float) -> None:
        drv.add(Request(rid, list(range(base, base + size)),
                        SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=arrival,
                        client_id=client))

    add("c0", "C", 1000, 37, 0.0)
    admitted: dict[int, list[str]] = {1: list(drv.step().num_scheduled)}
    add("a0", "A", 2000, 29, 1.0)
    for i in range(6):
        add(f"b{i}", "B", 3000 + 100 * i, 9, 2.0 + i)
    seen = set(admitted[1])
    for step in range(2, steps + 1):
        new = [rid for rid in drv.step().num_scheduled if rid not in seen]
        seen.update(new)
        if new:
            admitted[step] = new
    return admitted


def test_other_clients_backfill_the_blocks_a_large_request_cannot_use(make_scheduler,
                                                                      make_driver):
    """By hand: step 2, DRR serves A first (it arrived first): a0 needs 8 blocks, 6 are free:
    reserved (6 backfill blocks), passed over; b0 and b1 take 3 + 3 of them; b2 would need
    3 more backfill blocks (0 left): the queue waits. Steps 3-4: a0 still does not fit (0
    free). Step 5: c0 freed its 10: a0 first (8, 2 free left); b2 does not fit (3 > 2):
    reserved. Step 6: b0 and b1 freed 6 (8 free): b2, then b3 (2 left); b4 does not fit:
    reserved. Step 9: a0 (8) and b2, b3 (6) freed: b4, b5.
    Was: a0 held every client up, as a FIFO head does (the FCFS schedule below: nothing
    admitted at steps 2-4, b0 and b1 at step 5)."""
    assert _admissions(make_scheduler, make_driver, "fair") == {
        1: ["c0"], 2: ["b0", "b1"], 5: ["a0"], 6: ["b2", "b3"], 9: ["b4", "b5"]}


def test_fcfs_keeps_the_head_of_line_rule(make_scheduler, make_driver):
    """vLLM's rule: a0, the head, does not fit until c0 leaves (step 5), and the requests
    behind it wait: a0, b0, b1 at step 5 (8 + 3 + 3 of 16 blocks), b2..b5 when those three
    end (step 9: 12 of 16). The fair policy's a0 came no later (step 5): the blocks c0 freed
    were kept for it."""
    assert _admissions(make_scheduler, make_driver, "fcfs") == {
        1: ["c0"], 5: ["a0", "b0", "b1"], 9: ["b2", "b3", "b4", "b5"]}


def _req(rid: str, client: str, tokens: int, arrival: float) -> Request:
    return Request(rid, list(range(2, 2 + tokens)), SamplingParams(max_tokens=4),
                   arrival_time=arrival, client_id=client)


def test_the_reservation_is_offered_first_spent_and_ended_by_an_abort():
    """The queue's side, by hand: a (A) reserved with 5 free blocks; b (B) may take those 5;
    after the round a is offered first though DRR would serve B (A went to the back of the
    ring when passed over); b1 taking 2 blocks leaves 3; aborting a ends the reservation."""
    q = FairWaitingQueue(make_policy("fair"), quantum=256)
    a, b0, b1 = _req("a", "A", 32, 0.0), _req("b0", "B", 8, 1.0), _req("b1", "B", 8, 2.0)
    for r in (a, b0, b1):
        q.open(r)
        q.add(r)
    assert q.peek() is a and q.backfill_limit(a) is None
    assert q.reserve(a, 5) and q.pass_over() is a
    assert q.peek() is b0 and q.backfill_limit(b0) == 5
    assert not q.reserve(b0, 5)  # a second one that does not fit: the queue waits
    q.add(a)  # the round ends
    assert q.peek() is a and q.reserve(a, 5) and q.pass_over() is a
    assert q.pop() is b0
    q.admitted(b0, 2)
    q.add(a)
    assert q.backfill_limit(b1) == 3 and q.peek() is a
    assert q.remove(a) and q.reserved is None  # aborted
    assert q.peek() is b1 and q.backfill_limit(b1) is None
    q.admitted(b1, 2)  # nothing reserved: nothing to spend
    assert q.backfill_blocks == 3


def test_fcfs_and_priority_queues_never_pass_over_a_head_that_does_not_fit():
    for policy in ("fcfs", "priority"):
        q = make_waiting_queue(make_policy(policy))
        a = _req("a", "A", 32, 0.0)
        q.add(a)
        assert not q.reserve(a, 5) and q.backfill_limit(a) is None
