"""Admission control's forecast: when would a new request get its first token?

The forecast replays the SLO planner's rule (``core/slo_planner.py``) on copies of the running
requests and the waiting requests ahead of the new one, with the step-time model as the clock:
each simulated step decodes every running request, gives prefill chunks what the step's
``StepBudget`` allows (the earliest TPOT deadline, the token budget), admits through the same
gate, and lasts the model's predicted time; a running request leaves after its ``max_tokens``
(EOS cannot be foreseen, so the forecast errs late, never early); a waiting request ahead that
passes its own TTFT target is passed over, as the scheduler does. It stops when the new request
samples its first token, or at the horizon (then the answer is infinity). Future arrivals are
not foreseen (under FCFS they queue behind it anyway).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvflow.config import SchedulerConfig
from kvflow.core.slo_planner import RequestSLO, StepBudget, plan_step
from kvflow.core.step_time_model import StepTimeModel
from kvflow.request import Request

MAX_FORECAST_STEPS = 2000


@dataclass
class _Twin:
    """A request as the forecast moves it along."""

    request_id: str
    num_tokens: int  # async scheduling's token in flight included
    num_computed_tokens: int
    tokens_left: int  # output tokens still to generate
    num_output_placeholders: int = 0  # folded into num_tokens (``plan_step`` reads it)


def _twin(request: Request, computed: int | None = None) -> _Twin:
    """A running request as it is (a token of a step in flight counted in: async
    scheduling), or a waiting one with ``computed`` prefix-cache hits."""
    pending = request.num_output_placeholders
    left = (request.sampling_params.max_tokens or 1) - request.num_output_tokens - pending
    return _Twin(request.request_id, request.num_tokens + pending,
                 request.num_computed_tokens if computed is None else computed, max(1, left))


def forecast_first_token(model: StepTimeModel, config: SchedulerConfig,
                         running: list[Request], waiting_ahead: list[tuple[Request, int]],
                         request: Request, num_to_compute: int,
                         slos: dict[str, RequestSLO], slo: RequestSLO, now: float,
                         horizon_s: float) -> float:
    """Seconds from ``now`` until ``request`` samples its first token (inf beyond
    ``horizon_s``).

    Args:
        model: the ready step-time model.
        config: token budget and sequence cap.
        running / waiting_ahead: the running requests (policy order) and the waiting ones
            that would be admitted before ``request``, each with its tokens not in the prefix
            cache.
        num_to_compute: the tokens of ``request`` not in the prefix cache.
        slos / slo: the tracked requests' targets and timelines, and ``request``'s own.
    """
    live = [_twin(r) for r in running]
    queue = [_twin(r, r.num_tokens - n) for r, n in waiting_ahead]
    queue.append(_twin(request, request.num_tokens - num_to_compute))
    slos = {r.request_id: dataclasses.replace(slos[r.request_id])
            for r in [*running, *(w for w, _ in waiting_ahead)] if r.request_id in slos}
    slos[request.request_id] = dataclasses.replace(slo)
    t = now
    for _ in range(MAX_FORECAST_STEPS):
        if t - now > horizon_s:
            return math.inf
        queue[:-1] = [w for w in queue[:-1] if not _is_late(slos.get(w.request_id), t)]
        budget = plan_step(model, live, slos, t)
        step = _schedule(live, queue, budget, slos, config)
        t += max(model.predict_raw(budget.prefill_tokens, budget.num_decodes,
                                   budget.context_tokens), 1e-6)
        if _advance(step, live, slos, t, request.request_id):
            return t - now
    return math.inf


def _is_late(slo: RequestSLO | None, t: float) -> bool:
    """Past its TTFT target without a token: the scheduler admits it after the others."""
    return slo is not None and slo.ttft_s is not None and slo.first_token_time is None \
        and t > slo.arrival_time + slo.ttft_s


def _schedule(live: list[_Twin], queue: list[_Twin], budget: StepBudget,
              slos: dict[str, RequestSLO], config: SchedulerConfig) -> list[tuple[_Twin, int]]:
    """One simulated step: decodes, prefill chunks within the budget (each within
    ``long_prefill_token_threshold`` while more than one request is in play), admissions."""
    left, step = config.max_num_batched_tokens, []
    threshold = config.long_prefill_token_threshold
    chunk_cap = threshold if threshold and len(live) + len(queue) > 1 else left
    for twin in live:
        n = min(twin.num_tokens - twin.num_computed_tokens, left, chunk_cap)
        if n > 1:
            n = budget.take_prefill(twin.num_computed_tokens, n)
        if n > 0:
            step.append((twin, n))
            left -= n
    while queue and left > 0 and len(live) < config.max_num_seqs:
        twin = queue[0]
        slo = slos.get(twin.request_id)
        if not budget.may_admit(twin, None if slo is None else slo.tpot_s):
            break
        n = min(twin.num_tokens - twin.num_computed_tokens, left, chunk_cap)
        n = budget.take_prefill(twin.num_computed_tokens, n) if n > 1 else n
        if n <= 0:
            break
        live.append(queue.pop(0))
        step.append((twin, n))
        left -= n
    return step


def _advance(step: list[tuple[_Twin, int]], live: list[_Twin], slos: dict[str, RequestSLO],
             t: float, target_id: str) -> bool:
    """Apply a simulated step ending at ``t``; True once ``target_id`` sampled."""
    for twin, n in step:
        twin.num_computed_tokens += n
        if twin.num_computed_tokens < twin.num_tokens:
            continue
        if twin.request_id == target_id:
            return True
        slo = slos.get(twin.request_id)
        if slo is not None:
            if slo.first_token_time is None:
                slo.first_token_time = t
            else:
                slo.num_after_first += 1
        twin.num_tokens += 1
        twin.tokens_left -= 1
        if twin.tokens_left <= 0:
            live.remove(twin)
    return False
