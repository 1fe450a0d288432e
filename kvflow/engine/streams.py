"""What a caller of ``AsyncLLM`` holds per request: its output stream, and the error that
ends it when its engine core dies."""

from __future__ import annotations

import asyncio

from kvflow.outputs import CompletionOutput, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine-core process died or reported a fatal error; no request can proceed."""


class RequestStream:
    """Async iterator over one request's delta RequestOutputs; ends after the finished one.

    Raises:
        EngineDeadError: from iteration if the engine dies meanwhile.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

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
