"""Fake-clock serving simulations of the scheduler: no model, a synthetic step time.

``simulate`` feeds requests to a Scheduler at their arrival times, runs steps whose duration
is ``step_time(features)`` on a fake clock (the scheduler's own clock), "samples" a token for
every request whose step reaches its end, and records each request's arrival, first-token and
last-token times and tokens. The scheduler learns the step time from measured steps exactly
as in the engine (``Scheduler.record_step_time``).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.config import SchedulerConfig
from kvflow.core.kv_cache_manager import KVCacheManager
from kvflow.core.scheduler import Scheduler
from kvflow.core.slo_planner import step_features
from kvflow.core.step_time_model import StepFeatures
from kvflow.request import Request, RequestStatus
from kvflow.runner_output import ModelRunnerOutput
from kvflow.sampling_params import SamplingParams
from kvflow.sched_output import SchedulerOutput
from tests.core.fake_kv import fake_kv_cache_config


class FakeClock:
    """Seconds, advanced by the simulation only."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def synthetic_step_time(f: StepFeatures) -> float:
    """A CPU-like step: 8 ms fixed, 0.1 ms per prefill token, 0.6 ms per decode (its
    LM-head row and sampling), 0.1 us per attended key."""
    return 0.008 + 1e-4 * f.prefill_tokens + 6e-4 * f.decode_requests + 1e-7 * f.context_tokens


@dataclass
class SimRequest:
    """One request of a workload (times in seconds)."""

    rid: str
    arrival: float
    prompt_len: int
    max_tokens: int
    priority: int = 0
    client: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    prefix: str = ""  # requests naming the same prefix share their first ``prefix_len`` tokens
    prefix_len: int = 0


@dataclass
class Timeline:
    """What happened to one request."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    rejected: bool = False
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return math.inf if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2)."""
        if self.num_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_tokens - 1)


@dataclass
class SimResult:
    timelines: dict[str, Timeline]
    makespan: float
    steps: int
    tokens_by_client: dict[str, list[tuple[float, int]]]  # client -> (time, tokens) per step
    scheduler: Scheduler

    def output_throughput(self) -> float:
        return sum(t.num_tokens for t in self.timelines.values()) / self.makespan


def make_sim_scheduler(clock: FakeClock, num_blocks: int = 4000, block_size: int = 16,
                       **config) -> Scheduler:
    """A scheduler over a fake KV config, on ``clock``; ``config``: SchedulerConfig fields."""
    config.setdefault("max_num_batched_tokens", 2048)
    kv = KVCacheManager(fake_kv_cache_config(num_blocks, block_size), True)
    return Scheduler(SchedulerConfig(**config), kv, (num_blocks - 1) * block_size, clock=clock)


def to_request(r: SimRequest) -> Request:
    """Prompts are unique per request (no prefix-cache hits between requests: the first token
    after the shared prefix encodes the request id), except for their first ``prefix_len``
    tokens, which requests naming the same ``prefix`` share (a chat's system prompt)."""
    shared = [2 + (zlib.crc32(r.prefix.encode()) + i) % 1_000_000 for i in range(r.prefix_len)]
    prompt = shared + [2 + zlib.crc32(r.rid.encode()) % 1_000_000] + \
        [2 + i % 50_000 for i in range(1, r.prompt_len - r.prefix_len)]
    params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                            target_ttft_ms=r.ttft_ms, target_tpot_ms=r.tpot_ms)
    return Request(r.rid, prompt, params, eos_token_id=1, arrival_time=r.arrival,
                   priority=r.priority, client_id=r.client)


def simulate(workload: list[SimRequest], clock: FakeClock, scheduler: Scheduler,
             step_time: Callable[[StepFeatures], float] = synthetic_step_time,
             admission: Callable[[Request], bool] | None = None,
             max_steps: int = 200_000) -> SimResult:
    """Run ``workload`` to completion. ``admission(request) -> accept?`` is asked at each
    arrival (admission control); a refused request is recorded as rejected. A scheduler
    with ``async_scheduling`` runs as the engine runs it: step N + 1 is scheduled before
    step N's tokens are folded in (they come out when step N ends)."""
    pending = sorted(workload, key=lambda r: r.arrival)
    timelines = {r.rid: Timeline(r.arrival) for r in workload}
    clients = {r.rid: r.client for r in workload}
    tokens_by_client: dict[str, list[tuple[float, int]]] = {}
    in_flight: tuple[SchedulerOutput, list[str]] | None = None  # async: the step not folded
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival <= clock.now + 1e-12:
            sim = pending.pop(0)
            request = to_request(sim)
            if admission is not None and not admission(request):
                timelines[sim.rid].rejected = True
                continue
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests():
            if pending:
                clock.now = pending[0].arrival
            continue
        placeholders = {rid: r.num_output_placeholders for rid, r in scheduler.requests.items()}
        out = scheduler.schedule()
        sampled = _sampling(scheduler, out, placeholders)
        if in_flight is not None:  # async: the previous step ended at clock.now
            _fold(scheduler, *in_flight, timelines, clock.now)
            in_flight = None
        duration = step_time(step_features(out, scheduler.requests)) if not out.is_empty \
            else 0.001
        clock.now += duration
        per_client: dict[str, int] = {}
        for rid, n in out.num_scheduled_tokens.items():
            per_client[clients[rid]] = per_client.get(clients[rid], 0) + n
        for client, n in per_client.items():
            tokens_by_client.setdefault(client, []).append((clock.now, n))
        if scheduler.async_scheduling:
            in_flight = (out, sampled)
        else:
            _fold(scheduler, out, sampled, timelines, clock.now)
        scheduler.record_step_time(duration)
        steps += 1
        assert steps < max_steps, "simulation did not finish"
    return SimResult(timelines, clock.now, steps, tokens_by_client, scheduler)


def _sampling(scheduler: Scheduler, out: SchedulerOutput,
              placeholders: dict[str, int]) -> list[str]:
    """The requests step ``out`` samples: those caught up (lock-step), or whose token
    placeholders it raised (async: ``placeholders`` holds the counts before it)."""
    requests = scheduler.requests
    if scheduler.async_scheduling:
        return [rid for rid in out.num_scheduled_tokens
                if requests[rid].num_output_placeholders > placeholders.get(rid, 0)]
    return [rid for rid in out.num_scheduled_tokens
            if requests[rid].num_computed_tokens == requests[rid].num_tokens]


def _fold(scheduler: Scheduler, out: SchedulerOutput, sampled: list[str],
          timelines: dict[str, Timeline], now: float) -> None:
    """"Sample" a token for each of ``sampled`` and fold step ``out`` in at ``now``."""
    runner_output = ModelRunnerOutput()
    for rid in sampled:
        request = scheduler.requests.get(rid)
        if request is not None:
            runner_output.req_ids.append(rid)
            runner_output.sampled_token_ids.append([100 + request.num_tokens % 900])
    for output in scheduler.update_from_output(out, runner_output):
        tl = timelines[output.request_id]
        for _ in output.new_token_ids:
            tl.first_token = now if tl.first_token is None else tl.first_token
            tl.last_token = now
            tl.num_tokens += 1
            tl.token_times.append(now)


def assert_idle(scheduler: Scheduler) -> None:
    """Nothing left: no request, every KV block free."""
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting
    pool = scheduler.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_usable_blocks


def finish_all(scheduler: Scheduler) -> None:
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
