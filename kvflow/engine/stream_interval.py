"""vLLM's ``--stream-interval N`` (``SchedulerConfig.stream_interval``): a stream's delta
outputs are held and joined until one of its samples has N new tokens; its first output, any
output that finishes a sample, and its last are passed on at once (vLLM's
``RequestState.make_request_output``). Applied to the streams only, after the metrics saw
every step's output, so TTFT / ITL stay per engine step."""

from __future__ import annotations

from kvflow.outputs import CompletionOutput, RequestOutput


def join_deltas(held: RequestOutput, new: RequestOutput) -> RequestOutput:
    """One delta output holding ``held``'s and then ``new``'s: per sample the texts, token
    ids and logprobs one after the other, ``new``'s finish, cumulative logprob and metrics;
    the prompt logprobs of whichever carries them (the first output)."""
    samples = {c.index: c for c in held.outputs}
    for c in new.outputs:
        before = samples.get(c.index)
        if before is None:
            samples[c.index] = c
            continue
        logprobs = None if before.logprobs is None and c.logprobs is None else \
            (before.logprobs or []) + (c.logprobs or [])
        samples[c.index] = CompletionOutput(c.index, before.text + c.text,
                                            before.token_ids + c.token_ids,
                                            c.cumulative_logprob, logprobs, c.finish_reason,
                                            c.stop_reason)
    prompt_logprobs = held.prompt_logprobs if held.prompt_logprobs is not None else \
        new.prompt_logprobs
    return RequestOutput(new.request_id, new.prompt, new.prompt_token_ids,
                         [samples[i] for i in sorted(samples)], new.finished, new.metrics,
                         prompt_logprobs)


class StreamInterval:
    """Holds back the delta outputs of streams under ``interval`` tokens (1: none held), or
    under a request's own larger interval (vLLM 0.32's per-request ``stream_interval``:
    :meth:`open`).

    Args:
        interval: vLLM's ``stream_interval``, tokens per streamed output.
    """

    def __init__(self, interval: int = 1) -> None:
        self.interval = interval
        self._held: dict[str, RequestOutput] = {}
        self._sent: set[str] = set()  # requests whose first output went out
        self._own: dict[str, int] = {}  # requests with an interval above ``interval``

    def open(self, request_id: str, interval: int | None) -> None:
        """Give a request its own ``interval`` (``SamplingParams.stream_interval``; None:
        the engine's); one below the engine's is raised to it, as vLLM clamps it."""
        if interval is not None and interval > self.interval:
            self._own[request_id] = interval

    def take(self, output: RequestOutput) -> RequestOutput | None:
        """``output`` joined to what was held of its request, to pass on now; None while it
        is held (the next call of its request returns it joined)."""
        if not isinstance(output, RequestOutput):
            return output  # an embedding's one output
        rid = output.request_id
        interval = self._own.get(rid, self.interval)
        if interval <= 1:
            return output
        held = self._held.pop(rid, None)
        joined = output if held is None else join_deltas(held, output)
        due = output.finished or rid not in self._sent or any(
            c.finished or len(c.token_ids) >= interval for c in joined.outputs)
        if not due:
            self._held[rid] = joined
            return None
        if output.finished:
            self.forget(rid)
        else:
            self._sent.add(rid)
        return joined

    def forget(self, request_id: str) -> None:
        """Drop what is held of a request that ended otherwise (aborted, refused, failed),
        and its own interval."""
        self._held.pop(request_id, None)
        self._sent.discard(request_id)
        self._own.pop(request_id, None)
