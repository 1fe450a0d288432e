"""The OpenAI error body as an exception (``OpenAIError``), and the errors the handlers share:
a 400 from the engine's validation, a 400 for a body not sent as JSON, a 503 when the engine
is gone or the server is shutting down."""

from __future__ import annotations

import re
from typing import Any

from kvflow.engine.streams import EngineShutdownError, EngineSleepingError
from kvflow.entrypoints.protocol import ErrorInfo, ErrorResponse


class OpenAIError(Exception):
    """An error answered with an OpenAI error body.

    Args:
        message: human-readable explanation.
        status: HTTP status code.
        type: OpenAI error type (``invalid_request_error``, ...).
        param: the request field at fault, if any.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
        headers: extra response headers (``Retry-After`` for 503).
    """

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=str(self), type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


_PARAM_RE = re.compile(r"SamplingParams\.(\w+)")


def invalid_request(error: ValueError) -> OpenAIError:
    """A 400 for a ValueError from the engine's validation. When the message names a
    ``SamplingParams.<field>`` (the request field of that name), the field is the error's
    ``param``, and the message names the field alone. The code is the error's own ``code``
    when it carries one (``stop_limits.LimitError``: ``array_above_max_length``, ...),
    else ``invalid_value``."""
    match = _PARAM_RE.search(str(error))
    code = getattr(error, "code", None) or "invalid_value"
    if match is None:
        return OpenAIError(str(error), code=code)
    return OpenAIError(_PARAM_RE.sub(r"\1", str(error)), param=match.group(1), code=code)


def engine_dead(error: BaseException) -> OpenAIError:
    """A 503 for a request the engine could not finish: code ``server_shutting_down`` when
    the server is stopping (SIGINT / SIGTERM aborted it), ``engine_sleeping`` while sleep
    mode holds new requests back, else ``engine_dead``."""
    if isinstance(error, EngineShutdownError):
        return OpenAIError(str(error), 503, "service_unavailable", code="server_shutting_down")
    if isinstance(error, EngineSleepingError):  # sleep mode: POST /wake_up first
        return OpenAIError(str(error), 503, "service_unavailable", code="engine_sleeping")
    return OpenAIError(f"the engine is not running: {error}", 503, "service_unavailable",
                       code="engine_dead")


def content_type_error(content_type: str | None) -> OpenAIError | None:
    """A 400 (code ``unsupported_media_type``) naming the ``Content-Type`` a request body came
    with unless it is JSON (``application/json`` or ``application/<x>+json``, parameters such
    as ``charset`` allowed); None for JSON.

    A body without that header (``curl -d`` sends ``application/x-www-form-urlencoded``) is
    not read as JSON, as neither OpenAI (it reads no fields from it and answers that ``model``
    is missing) nor vLLM (a 400, "Only 'application/json' is allowed") read it. It also keeps
    a web page from driving a server that has no API key: a browser sends a ``text/plain`` or
    header-less POST cross-origin without asking (no CORS preflight), a JSON one never.
    """
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, sub = media.partition("/")
    if kind == "application" and (sub == "json" or sub.endswith("+json")):
        return None
    got = f"Content-Type {content_type!r}" if content_type else "no Content-Type header"
    return OpenAIError(f"the request body must be JSON sent with 'Content-Type: "
                       f"application/json'; got {got}", code="unsupported_media_type")


def content_encoding_error(encoding: str | None) -> OpenAIError | None:
    """A 415 (code ``unsupported_content_encoding``) naming a ``Content-Encoding`` other than
    ``identity``: kvflow reads request bodies as sent (RFC 9110, section 8.4.1: a server
    answers 415 to a content coding it does not decode), so a gzip body is refused as such
    rather than read as text that is not UTF-8, and a body claiming a coding it does not use
    is not silently read; None when there is no coding."""
    codings = [c.strip().lower() for c in (encoding or "").split(",") if c.strip()]
    if all(c == "identity" for c in codings):
        return None
    return OpenAIError(f"the request body must not be compressed: got Content-Encoding "
                       f"{encoding!r} (kvflow reads only uncompressed JSON bodies)", 415,
                       code="unsupported_content_encoding")


def body_parse_error(cause: BaseException | None) -> OpenAIError:
    """The 400 (code ``invalid_json``) for a JSON body that failed to parse for a reason
    other than its syntax: ``cause`` the exception the parser raised (text that is not UTF-8,
    or nesting deeper than the parser's recursion limit)."""
    if isinstance(cause, RecursionError):
        return OpenAIError("the body's JSON is nested too deeply to parse", code="invalid_json")
    if isinstance(cause, UnicodeDecodeError) or cause is None:
        return OpenAIError("the body is not JSON text: it must be UTF-8 encoded",
                           code="invalid_json")
    return OpenAIError(f"the body could not be parsed as JSON: {type(cause).__name__}",
                       code="invalid_json")
