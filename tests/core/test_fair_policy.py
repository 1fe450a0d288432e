"""The fair policy: deficit round robin of tokens over clients (core/fair_queue.py).

Oracles: DRR orders computed by hand from Shreedhar & Varghese's rule; token shares and waiting
times in fake-clock simulations against the FCFS and priority policies on the same arrivals.
"""

from __future__ import annotations

import numpy as np

from kvflow.config import SpeculativeConfig
from kvflow.core.fair_queue import FairWaitingQueue
from kvflow.core.sched_policy import make_policy, make_waiting_queue
from kvflow.request import Request
from kvflow.sampling_params import SamplingParams
from kvflow.spec_decode.speculator import Speculator
from tests.core.sim import FakeClock, SimRequest, assert_idle, make_sim_scheduler, simulate


def req(rid: str, client: str, tokens: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(2, 2 + tokens)), SamplingParams(max_tokens=4),
                   arrival_time=arrival, priority=priority, client_id=client)


def drain(queue) -> list[str]:
    order = []
    while queue:
        order.append(queue.pop().request_id)
    return order


def test_fair_queue_is_made_for_the_fair_policy():
    assert isinstance(make_waiting_queue(make_policy("fair")), FairWaitingQueue)
    assert not isinstance(make_waiting_queue(make_policy("fcfs")), FairWaitingQueue)


def test_equal_costs_alternate_between_clients():
    """Quantum = cost: one request per visit, clients alternate (A arrived first)."""
    q = FairWaitingQueue(make_policy("fair"), quantum=6)
    for i in range(6):
        q.add(req(f"a{i}", "A", 6, arrival=i))
    for i in range(3):
        q.add(req(f"b{i}", "B", 6, arrival=10 + i))
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]


def test_a_large_request_waits_until_its_deficit_covers_it():
    """DRR by hand, quantum 10: A's 6-token requests fit a visit's credit, B's 15-token one
    needs two visits: A0 (10-6=4 left), A1 after A's next visit (14-6=8), A2 (8-6=2), then
    B0 on its second visit (20 >= 15)."""
    q = FairWaitingQueue(make_policy("fair"), quantum=10)
    for i in range(3):
        q.add(req(f"a{i}", "A", 6, arrival=i))
    q.add(req("b0", "B", 15, arrival=0.5))
    assert drain(q) == ["a0", "a1", "a2", "b0"]


def test_short_requests_get_several_admissions_per_turn_at_the_default_quantum():
    """The README's rule with the engine's quantum (256 tokens): a client at the head of the
    ring is admitted while its deficit covers its next request, then gets 256 and goes to the
    back. By hand: A (seven 50-token prompts) 0 -> 256; B (two 300-token ones) 0 -> 256;
    A admits a0..a4 in one turn (256 - 5 x 50 = 6 left, < 50); A 6 -> 262; B 256 < 300 ->
    512; A admits a5, a6 (162 left, its flow empties and the credit goes); B admits b0
    (512 - 300 = 212 < 300) and b1 on its next visit (212 + 256 = 468, 168 left, which goes
    with its flow)."""
    q = make_waiting_queue(make_policy("fair"))
    assert q.quantum == 256
    for i in range(7):
        q.add(req(f"a{i}", "A", 50, arrival=i))
    for i in range(2):
        q.add(req(f"b{i}", "B", 300, arrival=10 + i))
    first_turn = [q.pop().request_id for _ in range(5)]
    assert first_turn == ["a0", "a1", "a2", "a3", "a4"]
    assert q.deficit[(0, "A")] == 6 and q.deficit[(0, "B")] == 256
    assert drain(q) == ["a5", "a6", "b0", "b1"]
    assert q.deficit == {}  # both flows emptied in credit (A 162, B 168): credit goes


def test_priority_classes_get_halving_quanta():
    """Class 0 gets the quantum, class 1 half of it: two class-0 admissions per class-1 one,
    never none."""
    q = FairWaitingQueue(make_policy("fair"), quantum=6)
    for i in range(6):
        q.add(req(f"x{i}", "X", 6, priority=0, arrival=10 + i))
    for i in range(3):
        q.add(req(f"y{i}", "Y", 6, priority=1, arrival=i))
    assert drain(q) == ["x0", "x1", "y0", "x2", "x3", "y1", "x4", "x5", "y2"]


def test_decode_tokens_are_charged_to_the_client():
    """A client whose running requests decoded 12 tokens owes them: B is served twice first."""
    q = FairWaitingQueue(make_policy("fair"), quantum=6)
    running = req("a-running", "A", 6)
    for i in range(2):
        q.add(req(f"a{i}", "A", 6, arrival=i))
        q.add(req(f"b{i}", "B", 6, arrival=10 + i))
    for _ in range(12):
        q.charge({"a-running": 1}, {"a-running": running})
    assert drain(q) == ["b0", "b1", "a0", "a1"]


class _WrongDrafts(Speculator):
    """Three drafts per decode, all wrong (every one is computed, then rejected)."""

    def __init__(self) -> None:
        super().__init__(SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                           adaptive=False), 4000)

    def _candidate_drafts(self, request: Request, room: int):
        return np.full(room, 7, np.int64)


def test_draft_tokens_are_charged_to_the_client(make_scheduler, make_driver):
    """With speculative decoding a decode computes 1 + 3 tokens: after the prefill (paid at
    admission) and two decodes, A owes 2 x 4 = 8 tokens (decodes with drafts were charged
    nothing, so long outputs cost no admissions)."""
    sched = make_scheduler(policy="fair")
    sched.speculator = _WrongDrafts()
    drv = make_driver(sched)
    drv.add(Request("x", [11, 12, 13, 14], SamplingParams(max_tokens=20, ignore_eos=True),
                    client_id="A"))
    steps = [drv.step().num_scheduled for _ in range(3)]
    assert steps == [{"x": 4}, {"x": 4}, {"x": 4}]  # the prompt, then 1 + 3 drafts twice
    assert sched.waiting.deficit == {(0, "A"): -8.0}


def _computed_by_step(records) -> list[int]:
    return [sum(r.num_scheduled.values()) for r in records]


def test_a_client_pays_the_tokens_its_requests_compute(make_scheduler, make_driver):
    """Hand count (block size 4; one client with a request left waiting, so its flow keeps
    the one visit's quantum of credit it got): two samples of one 10-token prompt admitted in
    one step compute 10 + 2 tokens (the second hits the first's 2 full blocks, 8 tokens),
    then 1 each per decode; the flow owes what the driver saw computed (it was charged
    10 + 10 for the prompts before). A 9-token prompt over an 8-token budget computes 8 + 1,
    the 1 being its prefill's last chunk, then 1 per decode (the chunk was charged again as a
    decode before)."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sched = make_scheduler(policy="fair", max_num_seqs=2)
    drv = make_driver(sched)
    for i in range(3):
        drv.add(Request(f"x-{i}", list(range(11, 21)), params, parent_id="x",
                        sample_index=i, client_id="A"))
    records = [drv.step() for _ in range(3)]
    assert records[0].num_scheduled == {"x-0": 10, "x-1": 2}
    assert _computed_by_step(records) == [12, 2, 2]
    quantum = sched.waiting.quantum
    assert sched.waiting.deficit == {(0, "A"): quantum - 16}

    sched = make_scheduler(policy="fair", max_num_batched_tokens=8, max_num_seqs=1)
    drv = make_driver(sched)
    for rid in ("y", "z"):
        drv.add(Request(rid, list(range(30, 39)), params, client_id="B"))
    records = [drv.step() for _ in range(3)]
    assert _computed_by_step(records) == [8, 1, 1]
    assert sched.waiting.deficit == {(0, "B"): quantum - 10}


def test_a_prefill_cut_short_is_paid_only_for_what_it_computed():
    """Hand count, quantum 100, one client with a second request waiting (its flow keeps its
    credit): a 20-token prompt prepays 20 at admission (80); its first 8-token chunk uses the
    prepayment (80); preempted (recompute) and readmitted, it prepays 20 again less the 12
    it never computed (72: 8 computed + 20 prepaid so far); aborted after one more 8-token
    chunk, the 12 prepaid and never computed come back (84 = 100 - the 16 tokens computed).
    The old charge took 20 per admission and nothing back (60)."""
    q = FairWaitingQueue(make_policy("fair"), quantum=100)
    x, y = req("x", "A", 20), req("y", "A", 20, arrival=1)
    for r in (x, y):
        q.open(r)
        q.add(r)
    assert q.pop() is x and q.deficit[(0, "A")] == 80
    x.num_computed_tokens = 8
    q.charge({"x": 8}, {"x": x})
    assert q.deficit[(0, "A")] == 80
    x.num_computed_tokens = 0  # preempted: its KV freed
    q.add(x)
    assert q.pop() is x and q.deficit[(0, "A")] == 72  # 80 - (20 - 12)
    x.num_computed_tokens = 8
    q.charge({"x": 8}, {"x": x})
    q.close(x)  # aborted mid-prefill
    assert q.deficit[(0, "A")] == 84  # 100 - 8 - 8: y is still waiting, unpaid
    assert q._prepaid == {}


def test_remove_and_peek_stay_consistent():
    q = FairWaitingQueue(make_policy("fair"), quantum=6)
    a, b = req("a", "A", 6), req("b", "B", 6, arrival=1)
    q.add(a)
    q.add(b)
    assert q.peek() is a
    assert q.remove(a) and len(q) == 1
    assert q.peek() is b and [r.request_id for r in q] == ["b"]
    assert q.pop() is b and not q


class _Compiling:
    """A structured-output state whose grammar is still compiling (never ready here)."""

    is_ready = False


def _admission_order(make_scheduler, make_driver, with_compiling: bool) -> list[str]:
    """A's a1..a5 and B's b0..b5 (200-token prompts, one admission per step of 200 tokens);
    A's first request a0 (same cost) is passed over every step when ``with_compiling``."""
    sched = make_scheduler(num_blocks=2000, max_num_batched_tokens=200, policy="fair")
    drv = make_driver(sched)

    def add(rid: str, client: str, base: int, arrival: float, compiling: bool = False) -> None:
        r = Request(rid, list(range(base, base + 200)),
                    SamplingParams(max_tokens=1, ignore_eos=True), arrival_time=arrival,
                    client_id=client)
        r.structured_output = _Compiling() if compiling else None
        drv.add(r)

    if with_compiling:
        add("a0", "A", 10, 0.0, compiling=True)
    for i in range(1, 6):
        add(f"a{i}", "A", 1000 * i, i)
    for i in range(6):
        add(f"b{i}", "B", 100_000 + 1000 * i, i + 0.5)
    order = []
    for _ in range(8):
        order += [rid for rid, n in drv.step().num_scheduled.items() if n > 1]
    return order


def test_a_passed_over_request_costs_its_client_nothing(make_scheduler, make_driver):
    """A request admission passes over (grammar compiling; also: past its TTFT target, no
    adapter slot) is put back uncharged: its client's other requests are admitted in the
    order they would be without it (it had been charged its prompt on every step, and A got
    2 of the first 8 admissions)."""
    alone = _admission_order(make_scheduler, make_driver, with_compiling=False)
    assert alone[:4] == ["a1", "b0", "a2", "b1"]
    assert _admission_order(make_scheduler, make_driver, with_compiling=True) == alone


def test_a_client_with_nothing_left_is_forgotten(make_scheduler, make_driver):
    """A decodes 150 tokens alone (nobody else waits), then A and B send 3 prompts each at
    once: they alternate from the start, A first, as DRR from empty flows does (A's debt of
    ~150 tokens had put B first), and no per-client state outlives the requests (it had
    grown by one entry per client ever seen)."""
    sched = make_scheduler(num_blocks=2000, max_num_batched_tokens=200, policy="fair")
    drv = make_driver(sched)

    def add(rid: str, client: str, base: int, size: int, max_tokens: int) -> None:
        drv.add(Request(rid, list(range(base, base + size)),
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        arrival_time=float(len(drv.results)), client_id=client))

    add("x", "A", 5000, 4, 150)
    drv.run()
    for i in range(3):
        add(f"a{i}", "A", 1000 * (i + 1), 200, 1)
        add(f"b{i}", "B", 100_000 + 1000 * i, 200, 1)
    steps = len(drv.steps)
    drv.run()
    order = [rid for step in drv.steps[steps:] for rid in step.num_scheduled]
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert sched.waiting.deficit == {}


# ---- simulations --------------------------------------------------------------------------------
def run(workload, **config):
    clock = FakeClock()
    sched = make_sim_scheduler(clock, max_num_seqs=8, max_num_batched_tokens=256, **config)
    res = simulate(workload, clock, sched)
    assert_idle(sched)
    return res


def tokens_until(res, client: str, t_end: float) -> int:
    return sum(n for t, n in res.tokens_by_client.get(client, []) if t <= t_end)


def test_backlogged_clients_share_tokens_equally():
    """A sends 40 requests with 64-token outputs, then B 40 with 8-token outputs, all at once.
    Under fair, while both are backlogged (until B's last request starts) each gets half of
    the tokens computed (within 20%), though A's requests are 8x longer; under FCFS B gets
    none until A's backlog is gone."""
    work = [SimRequest(f"a{i}", 0.0, 64, 64, client="A") for i in range(40)]
    work += [SimRequest(f"b{i}", 0.0001, 64, 8, client="B") for i in range(40)]
    fair = run(work, policy="fair")
    end = max(fair.timelines[f"b{i}"].first_token for i in range(40))
    a, b = tokens_until(fair, "A", end), tokens_until(fair, "B", end)
    assert 0.8 <= a / b <= 1.25, (a, b)
    fcfs = run(work, policy="fcfs")
    first_b = min(fcfs.timelines[f"b{i}"].first_token for i in range(40))
    assert first_b > max(fcfs.timelines[f"a{i}"].first_token for i in range(33))


def test_a_light_client_is_not_starved_by_a_flood():
    """A floods 120 requests at t=0; B sends one every 0.25 s. Under fair each of B's
    requests gets the next free slot of the 8 (A's requests free one every ~8 steps of
    ~40 ms: at most ~2 such intervals); under FCFS they wait behind the whole flood."""
    work = [SimRequest(f"a{i}", 0.0, 128, 64, client="A") for i in range(120)]
    work += [SimRequest(f"b{i}", 0.25 * (i + 1), 128, 16, client="B") for i in range(10)]
    fair = run(work, policy="fair")
    fcfs = run(work, policy="fcfs")
    fair_b = [fair.timelines[f"b{i}"].ttft for i in range(10)]
    fcfs_b = [fcfs.timelines[f"b{i}"].ttft for i in range(10)]
    assert max(fair_b) < 1.0, fair_b
    assert min(fcfs_b) > 2.0, fcfs_b


def test_lower_priority_class_progresses_under_fair():
    """Class 0 floods 60 requests; class 1 sends 30 at the same time. Under the priority
    policy class 1 starts only when class 0's backlog is admitted; under fair it gets about
    a third of the tokens meanwhile (quanta 1 : 1/2) and finishes requests."""
    work = [SimRequest(f"hi{i}", 0.0, 64, 32, client="H", priority=0) for i in range(60)]
    work += [SimRequest(f"lo{i}", 0.0, 64, 32, client="L", priority=1) for i in range(30)]
    strict = run(work, policy="priority")
    last_hi_start = max(strict.timelines[f"hi{i}"].first_token for i in range(60))
    assert min(strict.timelines[f"lo{i}"].first_token for i in range(30)) >= last_hi_start
    fair = run(work, policy="fair")
    end = max(fair.timelines[f"hi{i}"].first_token for i in range(60))
    hi, lo = tokens_until(fair, "H", end), tokens_until(fair, "L", end)
    assert 0.2 <= lo / (hi + lo) <= 0.45, (hi, lo)
    assert sum(fair.timelines[f"lo{i}"].last_token <= end for i in range(30)) >= 5
