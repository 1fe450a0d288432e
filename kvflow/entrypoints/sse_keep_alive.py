"""vLLM's ``--sse-keep-alive-interval``: an SSE comment line (``: keep-alive``) sent whenever
a streamed /v1/chat/completions or /v1/completions reply has sent nothing for that many
seconds (queued, in prefill, between tokens), so a proxy's read timeout does not cut it.
SSE clients skip comment lines."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

KEEP_ALIVE_COMMENT = ": keep-alive\n\n"


def with_keep_alive(body: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """``body`` with :data:`KEEP_ALIVE_COMMENT` inserted each time ``interval_s`` seconds
    pass without a chunk from it; ``body`` itself for an interval of 0 (off)."""
    if not 0 < interval_s < math.inf:
        return body
    return _keep_alive(body, interval_s)


async def _keep_alive(body: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    # one pending __anext__ task at a time: a timeout only stops waiting for it (asyncio.wait
    # does not cancel it), so no chunk is lost and the body is never advanced twice at once
    pending = asyncio.ensure_future(anext(body))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE_COMMENT
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(anext(body))
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        aclose = getattr(body, "aclose", None)
        if aclose is not None:  # the body's own cleanup (aborting its requests) runs now
            await aclose()
