"""What the scheduler tells about arriving requests: admission control's verdict (refuse a
request whose predicted time to first token exceeds its TTFT target), that TTFT forecast, and
how long an idle engine's first step still waits for more arrivals (``idle_batch_window_ms``).

Functions of the ``Scheduler`` they are handed (``kvflow/core/scheduler.py`` owns the state
they read; they change nothing).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvflow.request import Request

if TYPE_CHECKING:
    from kvflow.core.scheduler import Scheduler

__all__ = ["admission_verdict", "batch_wait_s", "ttft_outlook"]


def admission_verdict(sched: Scheduler, request: Request) -> float | None:
    """Admission control: None to queue ``request``, else the seconds after which to
    retry, because its predicted time to first token exceeds its TTFT target. Accepts
    while the step-time model is still learning, when the request has no TTFT target,
    and on an idle engine (nothing running or waiting): there no request is delayed by
    it and none would be served sooner, and the forecast is then a pure extrapolation of
    one lone prefill, where the fitted model errs most (it refused lone requests a warm
    server answered well within target)."""
    if not sched.running and not sched.waiting:
        return None
    slo = sched.planner.targets_of(request)
    outlook = None if slo.ttft_s is None else ttft_outlook(sched, request)
    if outlook is None or outlook <= slo.ttft_s:
        return None
    # past the forecast's horizon: by one target from now the queue ahead has moved on
    late_by = slo.ttft_s if outlook == math.inf else outlook - slo.ttft_s
    return float(max(1, math.ceil(late_by)))


def ttft_outlook(sched: Scheduler, request: Request) -> float | None:
    """Predicted seconds from ``request``'s arrival to its first token if it were queued
    now (see ``SLOPlanner.ttft_outlook``); None when no prediction can be made."""
    key, peek = sched.policy.key(request), sched.kv.peek_computed_tokens
    ahead = [(r, r.num_tokens - peek(r)) for r in sched.waiting
             if sched.policy.name == "fair" or sched.policy.key(r) <= key]
    return sched.planner.ttft_outlook(request, request.num_tokens - peek(request),
                                     sched.running, ahead, sched.clock())


def batch_wait_s(sched: Scheduler) -> float:
    """Seconds the next step should still wait for more arrivals (0.0: step now).

    Only an idle engine's first step waits (``idle_batch_window_ms``): while nothing is
    running, the waiting requests fit in one step's ``max_num_batched_tokens`` and
    ``max_num_seqs`` with room to spare (prompt tokens counted before prefix-cache
    hits), and the window, counted from the first waiting
    request's arrival on this scheduler's clock, is still open. A lone request therefore
    waits the window and no longer; a burst's first step takes what arrived meanwhile
    instead of only its first requests. A busy engine never waits.
    """
    window_s = sched.config.idle_batch_window_ms / 1e3
    if not window_s or sched.running or not sched.waiting or sched._idle_arrival is None:
        return 0.0
    if len(sched.waiting) >= sched.config.max_num_seqs:
        return 0.0
    # tokens before prefix-cache hits (cheap; an overestimate only ends the wait sooner)
    pending = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    if pending >= sched.config.max_num_batched_tokens:
        return 0.0
    return max(0.0, sched._idle_arrival + window_s - sched.clock())
