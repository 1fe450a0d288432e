"""The fair policy's waiting queue: deficit round robin of tokens over clients.

Deficit round robin (Shreedhar & Varghese, "Efficient fair queuing using deficit round robin",
SIGCOMM 1995): every flow has a FIFO and a deficit counter; flows with waiting work are visited
in a ring; a visit adds a quantum to the flow's deficit, and the flow sends packets while its
deficit covers the next packet's size, paying for each. Over any interval each backlogged flow
gets a share proportional to its quantum, and an empty flow loses its credit.

Here a flow is one (priority class, client) pair; the client is the request's ``client_id``
(the OpenAI ``user`` field or an API-key digest). A packet is a request's admission, of size
the tokens its prefill computes (its prompt, and on readmission after preemption its
outputs, less what the prefix cache holds: ``cached_tokens``); the admission prepays them, and
every token the request computes afterwards beyond that prepayment (decode tokens, the draft
tokens a decode verifies) is charged to its flow too (``charge``), so a client with long
outputs pays for them with later admissions: the share is of tokens computed, prompt and
output (samples of an ``n > 1`` request that hit their siblings' prompt blocks pay for the
tokens they compute, not the prompt again). A flow that empties keeps a
negative deficit (debt) but not a positive one, until its last request leaves the scheduler:
a client with nothing waiting or running is forgotten, debt included (``close``), so the state
is bounded by the clients with requests, and work a client did while nobody else waited is
not held against it later. Priority classes weigh the quantum: the
classes with waiting requests, ranked by priority value (lower first), get ``quantum``,
``quantum / 2``, ``quantum / 4``, ... per visit, so an urgent class is served more often but
a lower class always progresses (no starvation: every visit adds a positive quantum, so every
flow's deficit eventually covers its head request). Within a flow, requests go by arrival.

A request DRR serves that does not fit (too few free KV blocks, or, with whole prompts, the
step's token budget) would hold every other client up behind it, as a FIFO head does (vLLM's
rule under FCFS and priority: the queue waits for the head). Here it is *reserved* and passed
over, keeping its flow's credit, and the requests DRR serves after it are admitted while they
fit (backfilling, as EASY backfilling in batch job schedulers: Lifka, "The ANL/IBM SP
scheduling system", JSSPP 1995), but only into the blocks that were free when it was
reserved (``backfill_blocks``): the blocks freed after that are kept for it, and it is
offered first at every admission round until it is admitted. So it waits at most until its
own blocks, plus at most those backfilled, have been freed by the running requests (never
starved), while the others use the blocks it could not. Once the backfill blocks are spent,
or a second request does not fit either, the queue waits for it, as a FIFO does. One request
is reserved at a time, until it is admitted or aborted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from kvflow.core.sched_policy import SchedulingPolicy, WaitingQueue
from kvflow.request import Request

Flow = tuple[int, str]  # (priority, client_id)
# Tokens of credit per visit of a top-class flow: about one typical prompt, so clients take
# turns admission by admission (a larger quantum admits a burst of short prompts per turn).
DRR_QUANTUM_TOKENS = 256


class FairWaitingQueue(WaitingQueue):
    """Deficit round robin over (priority, client) flows (see the module docstring).

    Args:
        policy: the fair policy (its key orders requests within a flow).
        quantum: tokens added to a top-class flow's deficit per visit (the step budget).
        cached_tokens: the tokens of a request the prefix cache holds now (the KV cache
            manager's ``peek_computed_tokens``; default: none), which its admission does not
            compute.
    """

    def __init__(self, policy: SchedulingPolicy, quantum: int,
                 cached_tokens: Callable[[Request], int] | None = None) -> None:
        super().__init__(policy)
        self.quantum = quantum
        self._cached_tokens = cached_tokens or (lambda request: 0)
        self._prepaid: dict[str, int] = {}  # request id -> admission tokens not yet computed
        self._flows: dict[Flow, list[tuple[tuple, int, Request]]] = {}
        self._ring: deque[Flow] = deque()
        self.deficit: dict[Flow, float] = {}
        self._num_open: dict[Flow, int] = {}  # requests in the scheduler (waiting or running)
        self._chosen: Request | None = None
        self._size = 0
        self.reserved: Request | None = None  # served but did not fit: the others backfill
        self.backfill_blocks = 0  # KV blocks the others may still take past it

    @staticmethod
    def flow_of(request: Request) -> Flow:
        return (request.priority, request.client_id)

    def add(self, request: Request) -> None:
        flow = self.flow_of(request)
        heap = self._flows.get(flow)
        if heap is None:
            heap = self._flows[flow] = []
            self._ring.append(flow)
            self.deficit.setdefault(flow, 0.0)
        heapq.heappush(heap, (self._policy.key(request), next(self._counter), request))
        self._size += 1
        self._chosen = None  # a new flow may change nothing, but keep peek honest

    def peek(self) -> Request:
        """The request served next (the same until it is popped or removed): the reserved
        one while it is queued (DRR served it already), else the one deficit round robin
        serves."""
        if self._chosen is None:
            self._chosen = self._queued_reserved() or self._choose()
        return self._chosen

    def _queued_reserved(self) -> Request | None:
        """The reserved request if it is in the queue now (not passed over this round)."""
        reserved = self.reserved
        if reserved is None:
            return None
        heap = self._flows.get(self.flow_of(reserved), ())
        return reserved if any(entry[2] is reserved for entry in heap) else None

    def _choose(self) -> Request:
        weights, costs = self._class_weights(), {}
        while True:
            flow = self._ring[0]
            head = self._flows[flow][0][2]
            cost = costs.get(flow)
            if cost is None:
                cost = costs[flow] = self._cost(head)
            if self.deficit[flow] >= cost:
                return head
            self.deficit[flow] += self.quantum * weights[flow[0]]
            self._ring.rotate(-1)

    def _class_weights(self) -> dict[int, float]:
        """Priority value -> quantum share: 1, 1/2, 1/4, ... by rank among waiting classes."""
        classes = sorted({flow[0] for flow in self._ring})
        return {p: 0.5 ** rank for rank, p in enumerate(classes)}

    def _cost(self, request: Request) -> int:
        """Tokens the request's admission computes: its tokens less those already computed
        (a swapped-out request's) or in the prefix cache (at least one)."""
        done = max(request.num_computed_tokens, self._cached_tokens(request))
        return max(1, request.num_tokens - done)

    def pop(self) -> Request:
        """Admit the request deficit round robin serves next: its flow prepays its
        admission's tokens (``_cost``, as the prefix cache stands now), less what an earlier
        admission of it prepaid and never computed (it was preempted mid-prefill)."""
        request = self.peek()
        flow = self.flow_of(request)
        heap = self._flows[flow]
        if heap[0][2] is request:
            heapq.heappop(heap)
        else:  # the reserved request, behind a readmission of its flow that came since
            heap.remove(next(entry for entry in heap if entry[2] is request))
            heapq.heapify(heap)
        cost = self._cost(request)
        self.deficit[flow] -= cost - self._prepaid.get(request.request_id, 0)
        self._prepaid[request.request_id] = cost
        self._size -= 1
        self._chosen = None
        if not self._flows[flow]:
            self._retire(flow)
        return request

    def _retire(self, flow: Flow, keep_credit: bool = False) -> None:
        """An empty flow leaves the ring and loses its credit (not its debt), unless
        ``keep_credit`` (its request was only passed over and comes back)."""
        del self._flows[flow]
        self._ring.remove(flow)
        if self.deficit[flow] >= 0 and not keep_credit:
            del self.deficit[flow]

    def reserve(self, request: Request, num_free_blocks: int) -> bool:
        """``request``, the one DRR serves, does not fit now (``num_free_blocks`` free).
        With nothing reserved it is reserved, the others may backfill the blocks free now,
        and admission passes over it (``pass_over``: its flow keeps its credit); returns
        whether to pass it over (the reserved one again: yes; another one: no, the queue
        waits for the reserved one)."""
        if self.reserved is None:
            self.reserved, self.backfill_blocks = request, num_free_blocks
        return request is self.reserved

    def backfill_limit(self, request: Request) -> int | None:
        """The KV blocks ``request``'s admission may take now: any free ones (None) for the
        reserved request or with none reserved, else what is left of ``backfill_blocks``."""
        if self.reserved is None or request is self.reserved:
            return None
        return self.backfill_blocks

    def admitted(self, request: Request, num_blocks: int) -> None:
        """``request`` was admitted, taking ``num_blocks`` free KV blocks: the reserved one
        ends its reservation; another one spends backfill blocks."""
        if request is self.reserved:
            self.reserved = None
        elif self.reserved is not None:
            self.backfill_blocks -= num_blocks

    def pass_over(self) -> Request:
        """Take the request served next (``peek``) out for this admission round (it is not
        ready: grammar compiling, no adapter slot, past its TTFT target; or it is the
        reserved one and does not fit yet), without charging its flow: it is added back
        after the round, and its flow keeps the credit it had (a flow charged for requests
        it could not run lost its share)."""
        request = self.peek()
        self.remove(request, keep_credit=True)
        return request

    def remove(self, request: Request, keep_credit: bool = False) -> bool:
        """Remove a request (abort; ``keep_credit``: see ``pass_over``); returns whether it
        was queued."""
        if request is self.reserved and not keep_credit:
            self.reserved = None  # aborted while reserved
        flow = self.flow_of(request)
        heap = self._flows.get(flow, [])
        for i, entry in enumerate(heap):
            if entry[2] is request:
                heap.pop(i)
                heapq.heapify(heap)
                self._size -= 1
                if self._chosen is request:
                    self._chosen = None
                if not heap:
                    self._retire(flow, keep_credit)
                return True
        return False

    def open(self, request: Request) -> None:
        """A request entered the scheduler: its flow counts one more open request (``close``
        forgets the flow's deficit when the count returns to zero)."""
        flow = self.flow_of(request)
        self._num_open[flow] = self._num_open.get(flow, 0) + 1

    def close(self, request: Request) -> None:
        """A request left the scheduler; its flow's last one: the flow's deficit (debt) is
        forgotten."""
        flow = self.flow_of(request)
        unused = self._prepaid.pop(request.request_id, 0)  # aborted mid-prefill
        if unused and flow in self.deficit:
            self.deficit[flow] += unused
        left = self._num_open.get(flow, 0) - 1
        if left > 0:
            self._num_open[flow] = left
            return
        self._num_open.pop(flow, None)
        if flow not in self._flows:
            self.deficit.pop(flow, None)

    def charge(self, num_scheduled_tokens: dict[str, int], requests: dict[str, Request],
               drafts: dict[str, list[int]] | None = None) -> None:
        """Charge every token the step computes to its request's flow, the draft tokens a
        decode verifies (speculative decoding, ``drafts``) included, less what its admission
        prepaid (``pop``): its prefill's chunks use the prepayment up, its decodes are
        charged. ``drafts`` is accepted for the interface (the draft tokens are in
        ``num_scheduled_tokens``)."""
        deficit, prepaid = self.deficit, self._prepaid
        for rid, n in num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None:
                continue
            paid = prepaid.get(rid, 0)
            if paid:
                used = min(n, paid)
                prepaid[rid] = paid - used
                n -= used
            if n:
                flow = (request.priority, request.client_id)
                deficit[flow] = deficit.get(flow, 0.0) - n

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self):
        return (entry[2] for entry in sorted(itertools.chain.from_iterable(
            self._flows.values())))
