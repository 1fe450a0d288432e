"""Scheduling policies: the order of the waiting queue and who is preempted first.

A policy is a sort key. The waiting queue pops the smallest key first, the running list is kept
sorted by the same key, and when KV blocks run out the request with the *largest* key (the newest
under FCFS, the least urgent under priority) is preempted first.

The fair policy keeps the key (priority, then arrival) for the running list and preemption, but
its waiting queue (``core/fair_queue.py``) admits by deficit round robin over clients instead
of by key, so no client's backlog holds the others up.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvflow.request import Request


class SchedulingPolicy(ABC):
    """Defines the order in which requests are admitted and (in reverse) preempted."""

    name = "abstract"

    @abstractmethod
    def key(self, request: Request) -> tuple:
        """Smaller keys are served first and preempted last."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival time, then insertion order."""

    name = "fcfs"

    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first; ties by arrival time (vLLM's convention)."""

    name = "priority"

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


class FairPolicy(PriorityPolicy):
    """Token share per client by deficit round robin (``core/fair_queue.py``); the running
    list and preemption follow (priority, arrival) like the priority policy."""

    name = "fair"


def make_policy(name: str) -> SchedulingPolicy:
    """Raises ValueError for an unknown policy name."""
    policies = {p.name: p for p in (FCFSPolicy, PriorityPolicy, FairPolicy)}
    if name not in policies:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()


def make_waiting_queue(policy: SchedulingPolicy,
                       cached_tokens: Callable[[Request], int] | None = None) -> WaitingQueue:
    """The waiting queue of ``policy``: deficit round robin over clients for ``fair`` (a
    request's admission costs its tokens less ``cached_tokens(request)``, those the prefix
    cache holds), else a heap ordered by the policy key."""
    if policy.name == "fair":
        from kvflow.core.fair_queue import DRR_QUANTUM_TOKENS, FairWaitingQueue

        return FairWaitingQueue(policy, DRR_QUANTUM_TOKENS, cached_tokens)
    return WaitingQueue(policy)


class WaitingQueue:
    """A heap of waiting requests ordered by the policy key (then insertion order).

    A head that does not fit (KV blocks, token budget) blocks the queue until it does, as
    vLLM's scheduler does under both of its policies: ``reserve`` says not to pass it over.
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()

    def reserve(self, request: Request, num_free_blocks: int) -> bool:
        """``request``, the head, does not fit now (``num_free_blocks`` free): whether
        admission passes over it (the fair queue's backfilling); here never, it blocks."""
        return False

    def backfill_limit(self, request: Request) -> int | None:
        """The KV blocks ``request``'s admission may take now (None: any that are free)."""
        return None

    def admitted(self, request: Request, num_blocks: int) -> None:
        """``request`` was admitted, taking ``num_blocks`` free KV blocks."""

    def charge(self, num_scheduled_tokens: dict[str, int], requests: dict[str, Request],
               drafts: dict[str, list[int]] | None = None) -> None:
        """Account a step's tokens (``drafts``: the draft tokens each decode verifies) to
        their senders (only the fair queue uses this)."""

    def open(self, request: Request) -> None:
        """A request entered the scheduler (only the fair queue keeps count)."""

    def close(self, request: Request) -> None:
        """A request left the scheduler: finished or aborted (see ``open``)."""

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._policy.key(request), next(self._counter), request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def pass_over(self) -> Request:
        """Take the head out for this admission round only, unadmitted (the caller puts it
        back with ``add``); nothing is charged for it."""
        return self.pop()

    def remove(self, request: Request) -> bool:
        """Remove a request (abort); returns whether it was queued."""
        for i, entry in enumerate(self._heap):
            if entry[2] is request:
                self._heap.pop(i)
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return (entry[2] for entry in sorted(self._heap))
