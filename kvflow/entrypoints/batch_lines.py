"""The lines of an OpenAI Batch file (``kvflow run-batch``): each input line read into a
``BatchRequest`` or refused as a ``LineError``, and each output line built.

Input line (OpenAI's batch request format)::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output line, one per input line, in input order::

    {"id": "batch_req_<hex>", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "chatcmpl-<hex>", "body": {...}},
     "error": null}

``response`` holds what the endpoint answered, a 4xx with its OpenAI error body included (as
OpenAI's batch output does). ``error`` (``response`` null) holds a line the batch refused
before any endpoint saw it: its envelope is not a JSON object, lacks or mistypes
``custom_id`` / ``method`` / ``url`` / ``body`` or holds another key (unless
``--ignore-unknown-fields``), has a method other than POST, a url other
than the batch endpoints (``BATCH_URLS``, or their aliases ``URL_ALIASES``), a ``custom_id``
an earlier line used, a body asking to stream, or a /v1/responses body naming a
``previous_response_id``. The error object is ``{"code", "message", "param", "line"}``
(OpenAI's batch validation errors' fields; ``line`` counts from 1).

/v1/responses lines and the reply store: ``store`` is sent on as written (absent means true,
OpenAI's default, so refusing it would refuse nearly every line) and echoed in the body as the
server echoes it, but nothing outlives the batch: the server's store is in-process memory, and
no batch line can read it (POST only; no GET /v1/responses/{id}). ``previous_response_id`` is
refused: the lines run concurrently, so whether another line's reply is stored when a line
names it would depend on timing, and a reply stored by an earlier ``kvflow serve`` is gone.
A batch line sends the whole conversation in ``input`` instead.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

# the keys of an input line (OpenAI's batch request format)
ENVELOPE_KEYS = ("custom_id", "method", "url", "body")
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
              "/v1/score", "/v1/rerank", "/v1/classify")
# the server's other paths of /v1/score and /v1/rerank, taken too: vLLM's run-batch takes
# them (it matches a url ending in /score or /rerank, and names /score and /rerank)
URL_ALIASES = ("/score", "/rerank", "/v2/rerank")


@dataclass(frozen=True)
class BatchRequest:
    """One input line the batch accepted: ``body`` is sent to ``url`` as it was written."""

    line: int  # 1-based line number in the input
    custom_id: str
    url: str
    body: dict[str, Any]
    ignored: tuple[str, ...] = ()  # keys beyond the four, under --ignore-unknown-fields


@dataclass(frozen=True)
class LineError:
    """One input line the batch refused (see the module docstring); ``custom_id`` is the
    line's own when it had a string one, else None."""

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None

    def output(self) -> dict[str, Any]:
        """The output line: ``response`` null, this error in ``error``."""
        return {"id": batch_line_id(), "custom_id": self.custom_id, "response": None,
                "error": {"code": self.code, "message": self.message, "param": self.param,
                          "line": self.line}}


def batch_line_id() -> str:
    """A fresh output-line id, ``batch_req_`` + 32 hex digits (OpenAI's prefix)."""
    return f"batch_req_{uuid.uuid4().hex}"


def response_line(custom_id: str, status_code: int, body: Any) -> dict[str, Any]:
    """The output line of a request an endpoint answered: ``body`` (parsed JSON) exactly as
    the endpoint returned it with ``status_code``; ``request_id`` is the body's ``id`` when it
    has one (the id the server logs the request under), else a fresh ``req_<hex>``."""
    reply_id = body.get("id") if isinstance(body, dict) else None
    request_id = reply_id if isinstance(reply_id, str) else f"req_{uuid.uuid4().hex}"
    return {"id": batch_line_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def parse_line(raw: bytes, line: int, seen_ids: set[str],
               ignore_unknown: bool = False) -> BatchRequest | LineError:
    """Read input line number ``line`` (1-based; ``raw`` its bytes, line ending included or
    not). A string ``custom_id`` is added to ``seen_ids`` at its first line, whether or not
    that line is accepted, so a later line reusing it is refused (``duplicate_custom_id``) and
    each accepted custom_id names one response. A key other than ``ENVELOPE_KEYS`` is refused
    (``unknown_parameter``, before a missing key: ``bdy`` is named, not ``body``), as the
    server refuses a body's unknown fields; with ``ignore_unknown``
    (``--ignore-unknown-fields``) the request carries their names in ``ignored``.

    Returns:
        The accepted request, or the ``LineError`` saying why the line was refused; never
        raises for bad input.
    """
    try:
        value = json.loads(raw.decode("utf-8").rstrip("\r\n"))  # an error's column: on this line
    except UnicodeDecodeError:
        return LineError(line, None, "invalid_json_line", f"line {line} is not UTF-8 text")
    except json.JSONDecodeError as e:
        what = "is empty" if not raw.strip() else \
            f"is not valid JSON: {e.msg} (column {e.colno})"
        return LineError(line, None, "invalid_json_line", f"line {line} {what}")
    if not isinstance(value, dict):
        return LineError(line, None, "invalid_json_line",
                         f"line {line} is a JSON {type(value).__name__}, not an object")
    custom_id = value.get("custom_id")
    named = isinstance(custom_id, str) and bool(custom_id)
    if named and custom_id in seen_ids:
        return LineError(line, custom_id, "duplicate_custom_id",
                         f"line {line}: custom_id {custom_id!r} was used by an earlier line; "
                         "each line needs its own", "custom_id")
    if named:
        seen_ids.add(custom_id)
    unknown = tuple(sorted(str(k) for k in value if k not in ENVELOPE_KEYS))
    if unknown and not ignore_unknown:
        return LineError(line, custom_id if named else None, "unknown_parameter",
                         f"line {line}: unrecognized key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}: a batch line holds custom_id, method, url "
                         "and body only (the request's fields go in body; run-batch "
                         "--ignore-unknown-fields ignores such keys)", unknown[0])
    if not named:
        return _field_error(line, None, value, "custom_id", "a non-empty string")
    return _envelope_error(line, custom_id, value) or \
        BatchRequest(line, custom_id, value["url"], value["body"], unknown)


def _envelope_error(line: int, custom_id: str, value: dict[str, Any]) -> LineError | None:
    """What is wrong with a line's ``method``, ``url`` and ``body``; None if nothing."""
    for name, kind in (("method", "the string 'POST'"), ("url", "a string"),
                       ("body", "a JSON object")):
        wanted = dict if name == "body" else str
        if not isinstance(value.get(name), wanted):
            return _field_error(line, custom_id, value, name, kind)
    if value["method"] != "POST":
        return LineError(line, custom_id, "invalid_method",
                         f"line {line}: method {value['method']!r} is not supported; batch "
                         "requests are POST", "method")
    if value["url"] not in BATCH_URLS + URL_ALIASES:
        return LineError(line, custom_id, "invalid_url",
                         f"line {line}: url {value['url']!r} is not supported; use one of "
                         f"{', '.join(BATCH_URLS)}", "url")
    return _body_error(line, custom_id, value["url"], value["body"])


def _body_error(line: int, custom_id: str, url: str, body: dict[str, Any]) -> LineError | None:
    """What a batch cannot do that ``body`` asks for (a stream; on /v1/responses, a
    ``previous_response_id`` or ``background`` true; on /v1/embeddings, ``encoding_format``
    bytes or bytes_only); None if nothing."""
    stream = body.get("stream")
    if stream is not None and stream is not False:
        return LineError(line, custom_id, "stream_unsupported",
                         f"line {line}: batch requests cannot stream; leave body.stream out "
                         f"or false (got {_shown(stream)})", "body.stream")
    if url == "/v1/embeddings" and body.get("encoding_format") in ("bytes", "bytes_only"):
        return LineError(line, custom_id, "unsupported_value",
                         f"line {line}: body.encoding_format {_shown(body['encoding_format'])} "
                         "answers with a binary "
                         "body, which an output line (JSON) cannot hold; send base64 (with "
                         "embed_dtype and endianness as needed)", "body.encoding_format")
    previous = body.get("previous_response_id")
    if url == "/v1/responses" and previous is not None:
        return LineError(line, custom_id, "unsupported_parameter",
                         f"line {line}: body.previous_response_id is not supported in a batch "
                         "(lines run concurrently and no reply outlives the batch); send the "
                         f"earlier turns in input instead (got {_shown(previous)})",
                         "body.previous_response_id")
    background = body.get("background")
    if url == "/v1/responses" and background is not None and background is not False:
        return LineError(line, custom_id, "unsupported_parameter",
                         f"line {line}: body.background is not supported in a batch (a line's "
                         "output is its finished reply; the batch already runs apart from its "
                         f"caller); leave it out or false (got {_shown(background)})",
                         "body.background")
    return None


def _field_error(line: int, custom_id: str | None, value: dict[str, Any], name: str,
                 kind: str) -> LineError:
    """``missing_required_parameter`` for an absent field, ``invalid_value`` for one of the
    wrong type."""
    if name not in value:
        return LineError(line, custom_id, "missing_required_parameter",
                         f"line {line} has no {name!r}: it must be {kind}", name)
    return LineError(line, custom_id, "invalid_value",
                     f"line {line}: {name} must be {kind}, got {_shown(value[name])}",
                     name)


def _shown(value: Any, limit: int = 60) -> str:
    """``value`` as JSON, cut to ``limit`` characters (an error message quotes it)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
