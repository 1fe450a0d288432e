"""The per-request series of /metrics: ``RequestStatsTracker`` turns the stream of each
request's outputs, in the API process, into observations on ``ServerMetrics`` (TTFT,
inter-token latency, time per output token, end-to-end latency, lengths, token counters and
finished samples by reason; each of a request's ``n`` samples counted as a request, as vLLM
does)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.outputs import RequestOutput

if TYPE_CHECKING:
    from kvflow.metrics.server import ServerMetrics


@dataclass
class _RequestTimes:
    arrival_time: float
    num_prompt_tokens: int
    num_samples: int
    cumulative: bool = False  # outputs hold every token so far (CUMULATIVE / FINAL_ONLY)
    max_tokens: int | None = None  # its max_tokens parameter (None: not set)
    started: bool = False
    first_token_time: dict[int, float] = field(default_factory=dict)  # sample index -> time
    last_token_time: dict[int, float] = field(default_factory=dict)  # sample index -> time
    num_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


class RequestStatsTracker:
    """Turns the stream of delta RequestOutputs into per-request observations.

    Call ``start`` when a request is accepted, ``observe`` for each of its outputs and
    ``abort`` if it is cancelled. Times are ``time.monotonic()`` seconds.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._requests: dict[str, _RequestTimes] = {}

    def start(self, request_id: str, arrival_time: float, num_prompt_tokens: int,
              num_samples: int, cumulative: bool = False, max_tokens: int | None = None) -> None:
        """Open a request of ``num_samples`` samples. ``cumulative``: its outputs hold each
        sample's tokens so far (``RequestOutputKind`` CUMULATIVE or FINAL_ONLY), not the new
        ones alone (delta outputs, the default). ``max_tokens``: its parameter (None for
        none, a pooling request's)."""
        self._requests[request_id] = _RequestTimes(arrival_time, num_prompt_tokens, num_samples,
                                                   cumulative, max_tokens)

    def observe(self, output: RequestOutput, now: float) -> None:
        """Record one output of the request: a delta one (only the samples that changed, with
        their new tokens) or, for a request started ``cumulative``, every sample so far."""
        times = self._requests.get(output.request_id)
        if times is None:
            return
        pooled = not isinstance(output.outputs, list)
        if pooled:  # an embedding: its vector is its first output; finished, no tokens
            if not times.started:
                times.started = True
                self._first_output(times, now)
            self._observe_sample(times, 0, 0, "stop" if output.finished else None, now)
        for sample in output.outputs if isinstance(output.outputs, list) else ():
            num_new = len(sample.token_ids)
            if times.cumulative:  # never below 0: a counter cannot go down
                num_new = max(num_new - times.num_tokens.get(sample.index, 0), 0)
            self._observe_sample(times, sample.index, num_new, sample.finish_reason, now)
        if len(times.finished) == times.num_samples:  # vLLM's per-request (parent) series
            del self._requests[output.request_id]
            self.metrics.params_n.observe(times.num_samples)
            self.metrics.max_num_generation_tokens.observe(max(times.num_tokens.values(),
                                                               default=0))

    def _first_output(self, times: _RequestTimes, now: float) -> None:
        """A sample's first token: its TTFT and its prompt's tokens (vLLM counts both per
        sample: each of ``n`` samples is a request of its own there)."""
        self.metrics.ttft.observe(now - times.arrival_time)
        self.metrics.prompt_tokens.inc(times.num_prompt_tokens)

    def _observe_sample(self, times: _RequestTimes, index: int, num_new: int,
                        finish_reason: str | None, now: float) -> None:
        m = self.metrics
        if num_new:
            if index in times.last_token_time:
                m.itl.observe(now - times.last_token_time[index])
            else:
                self._first_output(times, now)
            times.first_token_time.setdefault(index, now)
            times.last_token_time[index] = now
            times.num_tokens[index] = times.num_tokens.get(index, 0) + num_new
            m.generation_tokens.inc(num_new)
        if finish_reason is not None and index not in times.finished:
            times.finished.add(index)
            num_tokens = times.num_tokens.get(index, 0)
            m.e2e.observe(now - times.arrival_time)
            m.prompt_len.observe(times.num_prompt_tokens)
            m.gen_len.observe(num_tokens)
            if times.max_tokens:
                m.params_max_tokens.observe(times.max_tokens)
            if num_tokens > 1:
                m.tpot.observe((times.last_token_time[index] - times.first_token_time[index])
                               / (num_tokens - 1))
            m.request_success.labels(m.model_name, finish_reason).inc()

    def forget(self, request_id: str) -> None:
        """Drop a request that never ran (refused by admission control, or by the engine core
        before scheduling it: the client got an error): nothing recorded."""
        self._requests.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Count the request's unfinished samples as finished with reason ``abort``."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        unfinished = times.num_samples - len(times.finished)
        if unfinished:
            self.metrics.request_success.labels(self.metrics.model_name, "abort").inc(unfinished)
