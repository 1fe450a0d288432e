"""The server's open requests in the API process: each one's output stream, the ones without
output yet, and the bookkeeping kept in step with them (the output processor's detokenizer
state, the per-request metrics, the data-parallel balancer's queue depths).

``AsyncLLM`` opens a request here once it is encoded, then hands each message of the engine
cores to it; nothing here does I/O: what must go back to a core (aborts) is returned.
"""

from __future__ import annotations

import dataclasses
import time

from kvflow.engine.dp_balancer import DPLoadBalancer
from kvflow.engine.messages import AdmissionVerdicts, EngineOutputs
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.stream_interval import StreamInterval
from kvflow.engine.streams import AdmissionRejected, RequestStream, request_error
from kvflow.metrics.request_stats import RequestStatsTracker
from kvflow.metrics.server import ServerMetrics
from kvflow.outputs import RequestOutput
from kvflow.request import Request
from kvflow.sampling_params import RequestOutputKind


class OpenRequests:
    """The open requests, by user request id (a request's ``n`` samples share one stream).

    Args:
        output_processor: detokenizes and regroups the cores' outputs (delta mode).
        tracker: per-request timings for the metrics.
        balancer: which replica serves each request, and each replica's depth.
        metrics: the server's metrics (admission refusals are counted there).
        admission_control: whether streams wait for the core's admission verdict.
        stream_interval: vLLM's ``--stream-interval``: tokens per streamed output
            (:class:`~kvflow.engine.stream_interval.StreamInterval`; the metrics still see
            every step's output).
    """

    def __init__(self, output_processor: OutputProcessor, tracker: RequestStatsTracker,
                 balancer: DPLoadBalancer, metrics: ServerMetrics,
                 admission_control: bool, stream_interval: int = 1) -> None:
        self.output_processor, self.tracker = output_processor, tracker
        self.stream_interval = StreamInterval(stream_interval)
        self.balancer, self.metrics = balancer, metrics
        self.admission_control = admission_control
        self.streams: dict[str, RequestStream] = {}
        self.waiting: set[str] = set()  # accepted, no output yet
        # output_kind of the requests that asked for CUMULATIVE or FINAL_ONLY (others: DELTA)
        self.kinds: dict[str, RequestOutputKind] = {}

    def open(self, request_id: str, prompt: str | None, requests: list[Request],
             arrival: float, replica: int) -> RequestStream:
        """Register one user request's samples, sent to ``replica``; returns its stream,
        which yields what the request's ``SamplingParams.output_kind`` asks for (None:
        deltas)."""
        params = requests[0].sampling_params  # None for a pooling request
        kind = None if params is None else params.output_kind
        self.output_processor.add_request(prompt, requests,
                                          delta=kind in (None, RequestOutputKind.DELTA))
        if kind not in (None, RequestOutputKind.DELTA):
            self.kinds[request_id] = kind
        elif params is not None:
            self.stream_interval.open(request_id, params.stream_interval)
        self.balancer.assign(request_id, replica, len(requests))
        stream = RequestStream(request_id, self.admission_control)
        self.streams[request_id] = stream
        self.waiting.add(request_id)
        self.tracker.start(request_id, arrival, len(requests[0].prompt_token_ids),
                           len(requests), cumulative=request_id in self.kinds,
                           max_tokens=None if params is None else params.max_tokens)
        return stream

    def abort(self, request_id: str) -> tuple[list[str], int | None]:
        """Forget a request (no-op if it already finished); returns the ids of its samples
        still running and the replica they run on, for the caller to abort there."""
        sample_ids = self.output_processor.abort(request_id)
        self.stream_interval.forget(request_id)
        self.streams.pop(request_id, None)
        self.waiting.discard(request_id)
        self.kinds.pop(request_id, None)
        replica = self.balancer.replica_of(request_id)
        self.balancer.finish(request_id)
        if sample_ids:
            self.tracker.abort(request_id)
        return sample_ids, replica

    def cancel(self, request_id: str) -> tuple[list[str], int | None]:
        """:meth:`abort` a request for its caller (``AsyncLLM.abort``), ending its stream as
        vLLM's does: its last output finishes every unfinished sample with reason
        ``abort`` (``OutputProcessor.aborted_output``), and a pending admission is resolved,
        so that a task still reading the stream (or awaiting ``admitted``) ends instead of
        waiting forever. Returns what :meth:`abort` returns."""
        stream = self.streams.get(request_id)
        last = self.output_processor.aborted_output(request_id)
        sample_ids, replica = self.abort(request_id)
        if stream is not None and last is not None:
            stream.settle()
            stream.put(last)
        return sample_ids, replica

    def deliver(self, msg: EngineOutputs) -> tuple[list[str], list[str]]:
        """Detokenize a core's outputs and put them on their streams; returns, to stop on
        that core (freeing their KV blocks), the sample ids that stop strings finished and
        those of the requests the core refused (an output with ``error``: its stream ends
        with ``RequestRefused``, or ``RequestFailed`` for the core's own failure)."""
        refused = [eco for eco in msg.outputs if eco.error is not None]
        others = []
        for eco in refused:
            others += self._refuse(eco.request_id, request_error(
                eco.error, None, eco.retry_after_s, eco.error_field, eco.internal_error))
        outputs, stopped = self.output_processor.process(msg.outputs)
        now = time.monotonic()
        for out in outputs:
            self.tracker.observe(out, now)
            self.waiting.discard(out.request_id)
            if out.finished:
                self.balancer.finish(out.request_id)
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            kind = self.kinds.get(out.request_id)
            if kind is None:  # DELTA: --stream-interval may hold it (joined into a later one)
                out = self.stream_interval.take(out)
                if out is None:
                    continue
            if out.finished:
                stream.put(out)
                del self.streams[out.request_id]
                self.kinds.pop(out.request_id, None)
            elif kind is RequestOutputKind.CUMULATIVE:  # the samples are updated in place
                stream.put(_snapshot(out))
            elif kind is None:
                stream.put(out)
        return stopped, others

    def _refuse(self, sample_id: str, error: BaseException) -> list[str]:
        """End the user request of ``sample_id`` with ``error`` (``RequestRefused``, or
        ``RequestFailed``: ``streams.request_error``); returns its sample ids (to abort on
        the core: the others may still be waiting there). The client gets an error (400,
        429 when busy, 500 for the core's failure), so the metrics forget the request, as
        they do one admission control refuses: it is not a finished (aborted) request."""
        parent = self.output_processor.parent_of(sample_id)
        if parent is None:
            return []
        stream = self.streams.get(parent)
        self.tracker.forget(parent)
        sample_ids, _ = self.abort(parent)
        if stream is not None:
            error.request_id = parent
            stream.settle(error)
            stream.put(error)
        return [sid for sid in sample_ids if sid != sample_id]

    def settle(self, msg: AdmissionVerdicts) -> None:
        """Admission control's answers: resolve the accepted streams; drop the refused
        requests (their core queued none of their samples) and fail their streams (their
        ``admitted`` and their iteration alike: a caller reading the stream without awaiting
        ``admitted`` first gets the refusal too, instead of waiting forever)."""
        for request_id in msg.accepted:
            stream = self.streams.get(request_id)
            if stream is not None:
                stream.settle()
        for rejection in msg.rejected:
            stream = self.streams.pop(rejection.request_id, None)
            self.kinds.pop(rejection.request_id, None)
            self.stream_interval.forget(rejection.request_id)
            self.output_processor.abort(rejection.request_id)
            self.waiting.discard(rejection.request_id)
            self.balancer.finish(rejection.request_id)
            self.tracker.forget(rejection.request_id)
            self.metrics.rejected.inc()
            if stream is not None:
                error = AdmissionRejected(rejection.message, rejection.retry_after_s)
                stream.settle(error)
                stream.put(error)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End one request's stream with ``error`` (its replica is gone)."""
        self.output_processor.abort(request_id)
        self.stream_interval.forget(request_id)
        self.tracker.abort(request_id)
        self.waiting.discard(request_id)
        self.kinds.pop(request_id, None)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.settle(error)
            stream.put(error)

    def abort_all(self, error: BaseException) -> dict[int, list[str]]:
        """End every open request's stream with ``error`` and forget it; returns, per
        replica, the sample ids still running there (for the caller to abort on it, freeing
        their KV blocks)."""
        running: dict[int, list[str]] = {}
        for request_id, stream in list(self.streams.items()):
            sample_ids, replica = self.abort(request_id)
            if sample_ids and replica is not None:
                running.setdefault(replica, []).extend(sample_ids)
            stream.settle(error)
            stream.put(error)
        self.waiting.clear()
        return running

    def fail_all(self, error: BaseException) -> None:
        """End every open request's stream with ``error``."""
        for request_id in list(self.streams):
            self.balancer.finish(request_id)
            self.fail(request_id, error)
        self.waiting.clear()


def _snapshot(out: RequestOutput) -> RequestOutput:
    """``out`` with copies of its samples (a cumulative output's samples, text, token ids
    and logprobs are the output processor's own, updated in place by later steps)."""
    samples = [dataclasses.replace(c, token_ids=list(c.token_ids),
                                   logprobs=None if c.logprobs is None else list(c.logprobs))
               for c in out.outputs]
    return dataclasses.replace(out, outputs=samples,
                               metrics=dataclasses.replace(out.metrics))
