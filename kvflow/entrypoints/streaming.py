"""Streaming plumbing of the OpenAI handlers: merging the streams of several prompts,
racing a response against the client's disconnect, and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvflow.engine.streams import RequestStream
from kvflow.outputs import RequestOutput

T = TypeVar("T")


async def merge_streams(streams: Sequence[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(stream index, delta output)`` from several streams as outputs arrive.

    Raises:
        EngineDeadError: if the engine dies meanwhile.
    """
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


async def run_unless_disconnected(raw: Request, work: Awaitable[T],
                                  on_disconnect: Callable[[], None]) -> T | None:
    """Await ``work`` but cancel it (and call ``on_disconnect``) if the client goes away
    first; returns None then."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    on_disconnect()
    return None


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events whose body iterator is always closed when the response ends or the
    client disconnects, so its ``finally`` (which aborts the requests) runs at once."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(data: str) -> str:
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
