"""``--enable-server-load-tracking`` (vLLM's): the number of generation and pooling requests
being served now, for GET /load (``{"server_load": N}``). A request counts from the moment
it passes the API-key and body-size checks until its response is complete (a stream's last
chunk sent, or its client gone), whatever its outcome."""

from __future__ import annotations

from typing import Any

# POST routes whose requests run on the engine (vLLM counts the same kinds of endpoint)
TRACKED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/pooling",
    "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify", "/v1/classify",
    "/invocations"})


class ServerLoad:
    """The counter: ``value`` requests in flight (>= 0). Used on the event loop only."""

    def __init__(self) -> None:
        self.value = 0


class ServerLoadMiddleware:
    """ASGI middleware counting the POSTs to ``TRACKED_PATHS`` in ``load`` while each runs.

    Args:
        app: the ASGI app it wraps.
        load: the counter GET /load reads.
    """

    def __init__(self, app: Any, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                route_path(scope) not in TRACKED_PATHS:
            return await self.app(scope, receive, send)
        self.load.value += 1
        try:
            await self.app(scope, receive, send)  # returns once the response is complete
        finally:
            self.load.value -= 1


def route_path(scope: dict) -> str:
    """The request's path without the ``--root-path`` prefix, if it carries one (uvicorn
    puts ``root_path`` in front of the path it received; the routes match what follows, as
    starlette's router does)."""
    path, root = scope["path"], scope.get("root_path") or ""
    return path[len(root):] if root and path.startswith(root + "/") else path
