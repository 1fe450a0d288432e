"""The HTTP server's options from vLLM's command line (``ServerConfig``): CORS, ``root_path``
(uvicorn's),
the served docs, the ``X-Request-Id`` response header, and HTTPS (uvicorn's SSL arguments,
checked before the model loads)."""

from __future__ import annotations

import ssl
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvflow.config import ServerConfig
from kvflow.entrypoints.access_log import access_log_options
from kvflow.entrypoints.openai_errors import OpenAIError


def fastapi_options(config: ServerConfig) -> dict[str, Any]:
    """``FastAPI(...)`` keyword arguments: no /openapi.json, /docs or /redoc under
    ``--disable-fastapi-docs``."""
    if config.disable_fastapi_docs:
        return {"openapi_url": None, "docs_url": None, "redoc_url": None}
    return {}


def add_http_middleware(app: FastAPI, config: ServerConfig) -> None:
    """Add the ``X-Request-Id`` header (``--enable-request-id-headers``) and CORS (any CORS
    flag). Call it after every other middleware: CORS is then the outermost, so a browser's
    preflight (OPTIONS) is answered before the API key is asked for, and refusals carry the
    CORS headers a browser needs to read them."""
    if config.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if config.cors_enabled:
        app.add_middleware(OpenAIErrorCORSMiddleware, allow_origins=list(config.allowed_origins or ["*"]),
                           allow_methods=list(config.allowed_methods or ["*"]),
                           allow_headers=list(config.allowed_headers or ["*"]),
                           allow_credentials=bool(config.allow_credentials))


# what a refused preflight names (starlette's failure words) -> the flag that allows it
_CORS_FLAGS = {"origin": "--allowed-origins", "method": "--allowed-methods",
               "headers": "--allowed-headers", "private-network": "no flag"}


class OpenAIErrorCORSMiddleware(CORSMiddleware):
    """starlette's CORS middleware whose refused preflight (an origin, method or header the
    CORS flags do not allow) is a 400 with an OpenAI error body (code
    ``cors_preflight_refused``, naming what was refused and the flag that allows it) and the
    same CORS headers; starlette answers it as plain text ("Disallowed CORS origin"), the one
    4xx of the server that was not an OpenAI error body."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ").split(", ")
        allowed_by = ", ".join(f"{what}: {_CORS_FLAGS.get(what, 'no flag')}"
                               for what in refused)
        verb = "is" if len(refused) == 1 else "are"
        error = OpenAIError(f"the CORS preflight was refused: its {' and '.join(refused)} "
                            f"{verb} not allowed ({allowed_by})", response.status_code,
                            code="cors_preflight_refused")
        headers = {k: v for k, v in response.headers.items()
                   if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(error.body(), response.status_code, headers=headers)


class RequestIdHeaderMiddleware:
    """Set ``X-Request-Id`` on every HTTP response (streams too: the header goes with the
    response's start): the request's own ``X-Request-Id`` header, else a new uuid4 hex."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given if given else uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments: ``root_path`` (``--root-path``: the ASGI scope's,
    which FastAPI names in the OpenAPI schema's ``servers``; the proxy strips the prefix, so
    routes stay where they are) and HTTPS (``--ssl-certfile`` ...; ``--ssl-ca-certs``
    goes to uvicorn as vLLM passes it, with uvicorn's default ``ssl_cert_reqs``, as vLLM's: no
    client certificate is required), ``uds`` (``--uds``: uvicorn then binds that Unix socket,
    not host and port) and the access log's (``access_log.access_log_options``)."""
    options: dict[str, Any] = {"root_path": config.root_path} if config.root_path else {}
    if config.uds is not None:
        options["uds"] = config.uds
    options.update(access_log_options(config.disable_uvicorn_access_log,
                                      config.disable_access_log_for_endpoints))
    if config.ssl_certfile is None:
        return options
    options.update(ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile)
    if config.ssl_ca_certs is not None:
        options["ssl_ca_certs"] = config.ssl_ca_certs
    return options


def check_ssl_files(config: ServerConfig) -> None:
    """Load ``--ssl-certfile`` / ``--ssl-keyfile`` / ``--ssl-ca-certs`` as uvicorn will, before
    the model loads (uvicorn reads them only once the model has loaded).

    Raises:
        ValueError: naming the flag and file that cannot be read or used.
    """
    if config.ssl_certfile is None:
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile "
                         f"{config.ssl_keyfile}: cannot load them ({_reason(e)})") from None
    if config.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(config.ssl_ca_certs)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-ca-certs {config.ssl_ca_certs}: cannot load it "
                             f"({_reason(e)})") from None


def _reason(error: Exception) -> str:
    return getattr(error, "strerror", None) or getattr(error, "reason", None) or str(error)
