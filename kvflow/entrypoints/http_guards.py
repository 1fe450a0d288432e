"""The HTTP server's guards: the API key (``ApiKeyMiddleware``), the JSON-body rule, and the
exception handlers that turn every error into an OpenAI error body (a 4xx for bad input;
a 500 only for a fault of kvflow's own)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.entrypoints.openai_errors import (
    OpenAIError,
    body_parse_error,
    content_encoding_error,
    content_type_error,
)
from kvflow.entrypoints.server_load import route_path
from kvflow.entrypoints.validation_errors import validation_error

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version"})
# POST routes that take no body (OpenAI's client sends none; sleep mode's take query
# parameters): the JSON-body rule skips them
BODYLESS_POSTS = re.compile(
    r"/v1/responses/[^/]+/cancel|/ping|/reset_prefix_cache|/sleep|/wake_up|/start_profile"
    r"|/stop_profile")


class ApiKeyMiddleware:
    """ASGI middleware: every path but ``OPEN_PATHS`` needs ``Authorization: Bearer KEY``,
    KEY any of ``api_keys`` (vLLM's ``--api-key`` takes a list; each compared in constant time,
    as SHA-256 digests, so neither a key's length nor which key matched shows in the timing);
    otherwise 401 with an OpenAI error body. The path is the route's, without the
    ``--root-path`` prefix uvicorn puts in front of it (``route_path``), as vLLM strips it:
    /health stays open behind a proxy."""

    def __init__(self, app: Any, api_keys: Sequence[str]) -> None:
        self.app = app
        self._expected = [hashlib.sha256(key.encode()).digest() for key in api_keys]

    def _accepts(self, given: bytes) -> bool:
        digest = hashlib.sha256(given).digest()
        matched = False
        for expected in self._expected:  # every key, whichever matches
            matched |= hmac.compare_digest(digest, expected)
        return matched

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        # the scheme name is case-insensitive (RFC 7235, section 2.1)
        if scheme.lower() == b"bearer" and self._accepts(given.strip()):
            return await self.app(scope, receive, send)
        error = OpenAIError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                            401, "authentication_error", code="invalid_api_key")
        response = JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})
        return await response(scope, receive, send)


async def require_json_body(raw: Request) -> None:
    """Every POST body is JSON: a 400 naming the Content-Type otherwise (see
    :func:`content_type_error`), but on the routes that take none (``BODYLESS_POSTS``). A coroutine, so FastAPI runs it on the event loop: a plain
    ``def`` dependency is handed to a worker thread (and back) on every request.

    Raises:
        OpenAIError: 400 (``unsupported_media_type``) for a POST body not sent as JSON.
    """
    takes_body = raw.method == "POST" and not BODYLESS_POSTS.fullmatch(route_path(raw.scope))
    error = body_header_error(raw) if takes_body else None
    if error is not None:
        raise error


def body_header_error(raw: Request) -> OpenAIError | None:
    """The error for a body's headers: a ``Content-Encoding`` (415, see
    :func:`content_encoding_error`), else a ``Content-Type`` other than JSON (400, see
    :func:`content_type_error`); None for an uncompressed JSON body."""
    return content_encoding_error(raw.headers.get("content-encoding")) or \
        content_type_error(raw.headers.get("content-type"))


def error_response(error: OpenAIError) -> JSONResponse:
    """``error`` as its HTTP response (status, OpenAI body, extra headers)."""
    return JSONResponse(error.body(), error.status, headers=error.headers)


# FastAPI's detail for a body it could not decode (not UTF-8, nested past the recursion limit;
# the parser's exception is its __cause__); a JSON syntax error is a RequestValidationError
FASTAPI_BODY_ERROR = "There was an error parsing the body"


def add_error_handlers(app: FastAPI) -> None:
    """Answer every exception ``app`` raises with an OpenAI error body."""
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def schema_error(raw: Request, exc: RequestValidationError) -> JSONResponse:
        # a body not sent as JSON: say so, not what failed to parse in it
        unknown = getattr(raw.app.state, "unknown_fields", None)
        return error_response(body_header_error(raw)
                              or validation_error(exc, unknown, route_path(raw.scope)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(raw: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == FASTAPI_BODY_ERROR:  # not UTF-8, too deep
            return error_response(body_header_error(raw) or body_parse_error(exc.__cause__))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # its headers too: a 405's Allow (RFC 9110 says it must carry it)
        return error_response(OpenAIError(_routing_message(raw, exc), exc.status_code, kind,
                                          headers=exc.headers))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", exc)
        return error_response(OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500,
                                           "internal_server_error"))


def _routing_message(raw: Request, exc: StarletteHTTPException) -> str:
    """The message of an HTTP error: for the router's own 404 / 405 (starlette's bare "Not
    Found" / "Method Not Allowed") one naming the method and path (and the methods the path
    takes); any other error's detail as it is."""
    path = route_path(raw.scope)
    if exc.status_code == 404 and exc.detail == "Not Found":
        return f"{raw.method} {path}: no such route"
    if exc.status_code == 405 and exc.detail == "Method Not Allowed":
        allowed = (exc.headers or {}).get("Allow", "")
        return f"{raw.method} is not allowed on {path} (it takes {allowed})"
    return str(exc.detail)
