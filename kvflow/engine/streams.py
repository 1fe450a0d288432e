"""What a caller of ``AsyncLLM`` holds per request: its output stream, the error that ends it
when its engine core dies, and admission control's refusal."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvflow.outputs import CompletionOutput, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine-core process died or reported a fatal error; no request can proceed."""


class EngineShutdownError(EngineDeadError):
    """The engine is stopping on purpose (the server got SIGINT or SIGTERM): open requests
    were aborted and new ones are refused. An ``EngineDeadError``, so every caller that ends
    a request on a dead engine ends it the same way."""


class EngineSleepingError(EngineDeadError):
    """The engine is asleep (sleep mode), or a level-2 sleep dropped its weights and they
    were not reloaded: new requests are refused until ``wake_up`` (and ``reload_weights``).
    An ``EngineDeadError``, so every caller answers it as the engine being unavailable
    (the server: 503, code ``engine_sleeping``)."""


class AdmissionRejected(RuntimeError):
    """Admission control refused the request: its predicted time to first token exceeds its
    target.

    Args:
        message: why.
        retry_after_s: seconds after which a retry may be admitted.
    """

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestRefused(ValueError):
    """The engine core could not run the request, for a reason in the request itself (its
    structured-output grammar did not compile within the time limit, or failed to; its
    LoRA adapter could not be loaded; ...); the server answers 400 with the message, the
    offline ``LLM`` raises it. No sample of it is left running.

    Args:
        message: why (the core's ``EngineCoreOutput.error``).
        request_id: the refused request's id, where the raiser knows it.
        retry_after_s: set when the server was busy rather than the request bad (the
            core's ``EngineCoreOutput.retry_after_s``): the server answers 429 then.
        field: the part of the request at fault (the core's
            ``EngineCoreOutput.error_field``: ``"lora_request"``, ``"structured_outputs"``,
            ...; see ``kvflow.core.request_errors``), None when unknown.
    """

    def __init__(self, message: str, request_id: str | None = None,
                 retry_after_s: float | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.retry_after_s = retry_after_s
        self.field = field


class RequestFailed(RuntimeError):
    """The engine core failed on the request through no fault of the request (an unexpected
    exception while it queued it: the core's ``EngineCoreOutput.internal_error``); the
    engine serves on, the server answers 500. No sample of it is left running.

    Args:
        message: what failed (the core's ``EngineCoreOutput.error``).
        request_id: the failed request's id, where the raiser knows it.
    """

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def request_error(message: str, request_id: str | None = None,
                  retry_after_s: float | None = None, field: str | None = None,
                  internal: bool = False) -> RequestRefused | RequestFailed:
    """The exception that ends a request the core answered with an error: ``RequestFailed``
    when ``internal`` (the core's fault), else ``RequestRefused``."""
    if internal:
        return RequestFailed(message, request_id)
    return RequestRefused(message, request_id, retry_after_s, field)


class RequestStream:
    """Async iterator over one request's delta RequestOutputs; ends after the finished one.

    With admission control, ``admitted`` resolves when the engine core queued the request (or
    fails with ``AdmissionRejected`` / ``EngineDeadError``); await it (``AsyncLLM.admitted``)
    before answering.

    Raises:
        EngineDeadError: from iteration if the engine dies meanwhile.
        RequestRefused: from iteration if the engine core could not run the request.
        RequestFailed: from iteration if the engine core failed on the request.
    """

    def __init__(self, request_id: str, admission: bool = False) -> None:
        self.request_id = request_id
        # called with each output as the caller takes it (the server's --enable-log-outputs)
        self.observer: Callable[[RequestOutput], None] | None = None
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.admitted: asyncio.Future | None = \
            asyncio.get_running_loop().create_future() if admission else None

    def settle(self, error: BaseException | None = None) -> None:
        """Resolve ``admitted`` (with ``error``: fail it); no-op once resolved."""
        if self.admitted is None or self.admitted.done():
            return
        if error is None:
            self.admitted.set_result(None)
        else:
            self.admitted.set_exception(error)
            self.admitted.exception()  # retrieved: no "never retrieved" warning if unawaited

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        if self.observer is not None:
            self.observer(item)
        return item


async def collect(stream: RequestStream) -> RequestOutput:
    """Drain a stream and merge its deltas into one cumulative, finished RequestOutput.

    Raises:
        EngineDeadError: if the engine dies before the request finishes.
    """
    merged: dict[int, CompletionOutput] = {}
    texts: dict[int, list[str]] = {}
    last, prompt_logprobs = None, None
    async for delta in stream:
        last = delta
        prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
        for c in delta.outputs:
            m = merged.setdefault(c.index, CompletionOutput(
                c.index, logprobs=None if c.logprobs is None else []))
            texts.setdefault(c.index, []).append(c.text)
            m.token_ids.extend(c.token_ids)
            if c.logprobs:
                m.logprobs.extend(c.logprobs)
            m.cumulative_logprob = c.cumulative_logprob
            m.finish_reason, m.stop_reason = c.finish_reason, c.stop_reason
    for index, m in merged.items():
        m.text = "".join(texts[index])
    return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids,
                         [merged[i] for i in sorted(merged)], True, last.metrics,
                         prompt_logprobs)
