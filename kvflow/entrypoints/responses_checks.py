"""A /v1/responses request's own checks before it becomes a chat request: the OpenAI fields
kvflow does not honour (``Unhonoured`` marks), ``include``, ``stream_options``, and whether
it asks for logprobs."""

from __future__ import annotations

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol.responses_api import (
    ResponsesRequest,
    unhonoured_fields,
)

# OpenAI fields kvflow does not honour (marked so in the protocol: one table) -> their
# harmless value and what kvflow does instead
_UNHONOURED = unhonoured_fields()
# the one ``include`` value kvflow honours: output_text parts carry their tokens' logprobs
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def refuse_unhonoured(req: ResponsesRequest) -> None:
    """Raises OpenAIError 400 naming the first OpenAI field set to something kvflow does
    not do: an ``include`` value other than
    ``message.output_text.logprobs`` (``include.N``), ``top_logprobs`` above 0 without that
    value, a ``reasoning`` key, ``text.verbosity``,
    a ``service_tier`` other than auto / default, ``stream_options`` other than
    ``include_obfuscation: false`` or without ``stream``, and the ``_UNHONOURED`` fields
    (``conversation``, ``prompt``, ``max_tool_calls``, ...)."""
    for name, mark in _UNHONOURED.items():
        value = getattr(req, name)
        if value is not None and value != mark.harmless:
            raise _unsupported(name, f"{name} is not supported by kvflow: {mark.instead}")
    _check_include(req)
    if req.reasoning is not None:
        for key in ("summary", "generate_summary"):  # effort: chat's reasoning_effort
            if getattr(req.reasoning, key) is not None:
                raise _unsupported(f"reasoning.{key}", f"reasoning.{key} is not supported: "
                                   "kvflow writes no reasoning summary (pass none; "
                                   "reasoning text is returned when the server runs with "
                                   "--reasoning-parser)")
    if req.text is not None and req.text.verbosity is not None:
        raise _unsupported("text.verbosity", "text.verbosity is not supported: the reply's "
                           "length follows the model and max_output_tokens")
    if req.service_tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", f"service_tier={req.service_tier!r} is not "
                           "supported: kvflow serves every request on one tier")
    _check_stream_options(req)


def _check_include(req: ResponsesRequest) -> None:
    for i, value in enumerate(req.include or []):
        if value != OUTPUT_LOGPROBS:
            raise _unsupported(f"include.{i}", f"include value {value!r} is not supported: "
                               f"kvflow returns no extra output data but {OUTPUT_LOGPROBS}")
    if req.top_logprobs and OUTPUT_LOGPROBS not in (req.include or []):
        raise OpenAIError(f"top_logprobs needs include [{OUTPUT_LOGPROBS!r}] (the logprobs "
                          "are returned on the output_text parts)", param="top_logprobs",
                          code="invalid_value")


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the reply's output_text parts carry logprobs (``include`` holds
    ``message.output_text.logprobs``)."""
    return OUTPUT_LOGPROBS in (req.include or [])


def _check_stream_options(req: ResponsesRequest) -> None:
    options = req.stream_options
    if options is None:
        return
    if not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true",
                          param="stream_options", code="invalid_value")
    extra = sorted(set(options) - {"include_obfuscation"})
    if extra or options.get("include_obfuscation"):
        param = f"stream_options.{extra[0] if extra else 'include_obfuscation'}"
        raise _unsupported(param, f"{param} is not supported (kvflow adds no obfuscation "
                           "to stream events; send include_obfuscation false)")


def _unsupported(param: str, message: str) -> OpenAIError:
    return OpenAIError(message, param=param, code="unsupported_parameter")
