"""Scheduling policies: the order of the waiting queue and who is preempted first.

A policy is a sort key. The waiting queue pops the smallest key first, the running list is kept
sorted by the same key, and when KV blocks run out the request with the *largest* key (the newest
under FCFS, the least urgent under priority) is preempted first.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod

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


def make_policy(name: str) -> SchedulingPolicy:
    """Raises ValueError for an unknown policy name."""
    policies = {p.name: p for p in (FCFSPolicy, PriorityPolicy)}
    if name not in policies:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(policies)}")
    return policies[name]()


class WaitingQueue:
    """A heap of waiting requests ordered by the policy key (then insertion order)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._heap: list[tuple[tuple, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._policy.key(request), next(self._counter), request))

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

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
