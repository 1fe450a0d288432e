"""The request body size limit (``--max-request-body-size``): a body over it is refused with
413 before the server parses or tokenizes any of it, so one huge request costs the server
its bytes on the wire, not seconds of CPU."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse

from kvflow.entrypoints.openai_errors import OpenAIError

DRAIN_BYTES = 64 * 2**20  # what a refused body may still send after the 413 (then dropped)
DRAIN_IDLE_S = 5.0  # the longest wait for the next piece of a refused body


def body_too_large(size: int | None, limit: int) -> OpenAIError:
    """The 413 for a body of ``size`` bytes (None: not known, it was sent in chunks) over
    ``limit`` bytes; code ``request_too_large``, the message naming the flag."""
    got = f"{size} bytes" if size is not None else f"over {limit} bytes (sent in chunks)"
    return OpenAIError(f"the request body is {got}; this server reads at most {limit} bytes "
                       f"(--max-request-body-size)", 413, "invalid_request_error",
                       code="request_too_large")


class BodySizeLimitMiddleware:
    """ASGI middleware refusing an HTTP request body longer than ``limit`` bytes with 413 and
    an OpenAI error body (:func:`body_too_large`).

    A body announced by ``Content-Length`` is judged by that header alone (uvicorn ends a
    body that runs past its announced length). A chunked body (no ``Content-Length``) is read
    here, up to ``limit`` bytes, and replayed to the app. The 413 goes out at once (a client
    that sent only the headers gets it without sending the body); the rest of a refused body
    is then read on and discarded (never parsed), up to ``DRAIN_BYTES``, before the
    connection closes, so that a client still sending it reads the answer rather than a
    reset connection; a bigger one, or one whose client waits for ``Expect: 100-continue``
    (it has sent nothing yet), is not drained: the connection closes after the answer.

    Args:
        app: the ASGI app it wraps.
        limit: the most body bytes one request may send (> 0).
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            size = int(length) if length.strip().isdigit() else None
            if size is None or size <= self.limit:
                return await self.app(scope, receive, send)
            drain = size <= DRAIN_BYTES and b"100-continue" not in headers.get(b"expect", b"")
            return await _refuse(body_too_large(size, self.limit), scope, receive, send,
                                 unread=True, drain=drain)
        messages, total, more = [], 0, True
        while more:  # no Content-Length: count the chunks as they come
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            more = message.get("more_body", False)
            if total > self.limit:
                return await _refuse(body_too_large(None, self.limit), scope, receive, send,
                                     unread=more, drain=True)
        return await self.app(scope, _replay(messages, receive), send)


def _replay(messages: list[dict], receive: Any) -> Any:
    """A ``receive`` that gives ``messages`` first, then what ``receive`` gives."""
    pending = list(messages)

    async def replayed() -> dict:
        return pending.pop(0) if pending else await receive()

    return replayed


async def _refuse(error: OpenAIError, scope: dict, receive: Any, send: Any, unread: bool,
                  drain: bool) -> None:
    """Answer ``error`` at once (a client that sent only the headers reads it without sending
    its body). With body bytes ``unread``, the answer says ``Connection: close``, and with
    ``drain`` the rest of the body is then read and dropped (up to ``DRAIN_BYTES``, each
    piece within ``DRAIN_IDLE_S``) before the response ends and the connection closes, so
    that a client still sending it reads the answer rather than a reset connection."""
    headers = {"Connection": "close"} if unread else None
    response = JSONResponse(error.body(), error.status, headers=headers)
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    # the whole body, announced by Content-Length: the client has its answer from here on
    await send({"type": "http.response.body", "body": response.body, "more_body": True})
    if unread and drain:
        await _drain(receive)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Any) -> None:
    """Read and drop the rest of a request body: up to ``DRAIN_BYTES``, until it ends or the
    client disconnects, or until ``DRAIN_IDLE_S`` passes with nothing from it."""
    read, more = 0, True
    while more and read <= DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), DRAIN_IDLE_S)
        except asyncio.TimeoutError:
            return
        read += len(message.get("body", b""))
        more = message["type"] == "http.request" and message.get("more_body", False)
