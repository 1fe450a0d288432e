"""The OpenAI Responses API (POST /v1/responses): the request body and the response object.

Not to be confused with ``protocol/responses.py`` (the completion and chat replies). The
request's ``input`` items and ``tools`` are kept as JSON here and read item by item by
``entrypoints/responses_input.py``, so that a bad item is a 400 whose ``param`` is its exact
path (``input.2.content.0.type``, ``tools.1.type``). The OpenAI fields kvflow does not honour
are declared (``Any``) so that ``serving_responses`` can refuse a set value with a 400 naming
it; a field neither declared nor OpenAI's is refused like on every endpoint
(``unknown_fields.py``). The stream events are plain dicts built by ``responses_events.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from kvflow.entrypoints.protocol.base import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    OpenAIBaseModel,
    RequestBody,
    RequestModel,
)
from kvflow.entrypoints.protocol.sampling import (
    MAX_SESSION_ID_CHARS,
    StructuredOutputsField,
    XargValue,
    cap_logit_bias,
)

# vLLM 0.32's ResponsesRequest fields that its to_sampling_params / build_chat_params read,
# and that kvflow's chat request declares under the same name and honours: each goes to the
# chat request as it came (serving_responses._chat_request), so it means what it means there
CHAT_FIELDS = ("top_k", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
               "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
               "structured_outputs", "chat_template_kwargs", "priority",
               "kv_transfer_params")


class TextFormat(RequestModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
    ``strict``, ``description``: the same as chat's ``response_format.json_schema``, flat)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    """``text``: the output's ``format``; ``verbosity`` is refused unless null (the reply's
    length follows the model and ``max_output_tokens``)."""

    format: TextFormat | None = None
    verbosity: Any = None


class ReasoningConfig(RequestModel):
    """``reasoning``: ``effort`` is chat's ``reasoning_effort`` (template variables, as
    vLLM's); ``summary`` / ``generate_summary`` set are a 400 naming them. Reasoning text is
    returned when the server runs with ``--reasoning-parser``."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Any = None
    generate_summary: Any = None


@dataclass(frozen=True)
class Unhonoured:
    """Marks an OpenAI field of ``ResponsesRequest`` that kvflow declares but does not
    honour (``Annotated[Any, Unhonoured(...)]``): ``harmless`` is the value that asks for
    nothing (None: only null passes), ``instead`` says what kvflow does instead (in the 400's
    message for any other value)."""

    harmless: Any
    instead: str


class ResponsesRequest(RequestBody):
    """POST /v1/responses. ``input``: a string (one user message) or a list of items (each
    checked by ``responses_input.chat_messages``); ``tools``: function tools (JSON, checked by
    ``responses_input.chat_tools``); the other honoured fields map onto the chat request
    (``max_output_tokens`` -> ``max_completion_tokens``, ``text.format`` ->
    ``response_format``). ``store`` (OpenAI's default true) keeps the response in the
    server's bounded in-memory store for GET /v1/responses/{id} and ``previous_response_id``;
    ``background`` (needs ``store``) answers at once with the response ``queued`` and runs it
    as a server task (``responses_background``), polled with GET, stopped with POST
    /v1/responses/{id}/cancel.
    ``include`` may hold ``message.output_text.logprobs`` (output text logprobs, with
    ``top_logprobs`` alternatives, 0-20); other values are refused by ``serving_responses``.
    ``vllm_xargs`` (vLLM's, as on chat/completions) goes to the chat request: the arguments
    of the server's custom logits processors (``SamplingParams.extra_args``).
    ``truncation`` ``auto`` (vLLM 0.32's reading) keeps the rendered conversation's last
    ``max_model_len - 1`` tokens (chat's ``truncate_prompt_tokens: -1``); ``disabled`` (the
    default) refuses one longer than the context.
    ``request_id`` (vLLM 0.32's) is the response's ``id``, as sent (vLLM's default, and
    kvflow's without it, is ``resp_`` and a random hex): GET, DELETE, cancel and
    ``previous_response_id`` name the reply by it; a stored reply of that id that has ended
    is replaced, as vLLM's store replaces it, and one still running in the background makes
    it a 400 (``serving_responses``).
    ``include_reasoning`` (vLLM 0.32's, as on chat): ``false`` on a server with a reasoning
    parser leaves the reasoning items out, streamed or not, and the output text's logprobs
    (which would show the reasoning's tokens); ``usage`` still counts its tokens.
    vLLM 0.32's sampling and template fields (``CHAT_FIELDS``: ``top_k``, ``min_p``, the
    penalties, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logit_bias``,
    ``skip_special_tokens``, ``include_stop_str_in_output``, ``structured_outputs``,
    ``chat_template_kwargs``, ``priority``, ``kv_transfer_params``) go to the chat request
    unchanged and are honoured (or refused) there. vLLM 0.32's chat and completion fields
    that its Responses request does not declare (``thinking_token_budget``, ``n``, ...) are
    unknown fields here, refused with a 400 naming them.
    The fields after ``user`` are OpenAI's that kvflow does not honour, each marked
    ``Unhonoured`` (its harmless value and what kvflow does instead): declared so that a set
    value is a 400 naming it (``responses_checks.refuse_unhonoured`` reads
    ``unhonoured_fields()``)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    parallel_tool_calls: bool = True
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: salts the prefix cache
    # vLLM 0.32's: the session written into the KV cache events (as on chat/completions)
    session_id: str | None = Field(None, max_length=MAX_SESSION_ID_CHARS)
    # vLLM 0.32's: the response's id as sent (default resp_<uuid>); at most 256 characters,
    # the cap of chat's request_id
    request_id: str | None = Field(None, min_length=1, max_length=256)
    background: bool = False
    # vLLM's: arguments of the server's custom logits processors (as on chat/completions)
    vllm_xargs: dict[str, XargValue | list[XargValue]] | None = None
    # vLLM 0.32's: false leaves the reasoning items (and output logprobs) out
    include_reasoning: bool = True
    # vLLM 0.32's sampling and template fields (CHAT_FIELDS): as on chat/completions
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsField | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    kv_transfer_params: dict[str, Any] | None = None
    # OpenAI's, not honoured: a value other than null (or the harmless one) is a 400
    conversation: Annotated[Any, Unhonoured(
        None, "use previous_response_id to continue a stored reply")] = None
    max_tool_calls: Annotated[Any, Unhonoured(
        None, "send parallel_tool_calls false for at most one call")] = None
    prompt: Annotated[Any, Unhonoured(
        None, "there are no stored prompt templates: send input and instructions")] = None
    context_management: Annotated[Any, Unhonoured(
        None, "a conversation longer than the context is a 400")] = None
    prompt_cache_retention: Annotated[Any, Unhonoured(
        None, "the prefix cache keeps blocks while memory allows")] = None
    prompt_cache_options: Annotated[Any, Unhonoured(
        None, "every request shares the prefix cache")] = None
    moderation: Annotated[Any, Unhonoured(None, "kvflow runs no moderation")] = None
    image: Annotated[Any, Unhonoured(None, "the reply is text only")] = None
    access_programs: Annotated[Any, Unhonoured(None, "kvflow has no access programs")] = None
    background_options: Annotated[Any, Unhonoured(
        None, "a background response runs until it ends or is cancelled")] = None


    @model_validator(mode="wrap")
    @classmethod
    def _cap_logit_bias(cls, data: Any, handler: Any) -> Any:
        """Refuse more ``logit_bias`` entries than any vocabulary has before the body is
        validated (``sampling.cap_logit_bias``: a 400 at ``logit_bias``)."""
        cap_logit_bias(data)
        return handler(data)


def unhonoured_fields() -> dict[str, Unhonoured]:
    """``ResponsesRequest``'s fields marked ``Unhonoured``, by name (in declaration order):
    the one table ``responses_checks.refuse_unhonoured`` reads."""
    return {name: meta for name, info in ResponsesRequest.model_fields.items()
            for meta in info.metadata if isinstance(meta, Unhonoured)}


# ---- the response ----------------------------------------------------------------------------
class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    """Token counts: ``input_tokens`` the prompt's (instructions, earlier turns and tools as
    the chat template rendered them), ``output_tokens`` every generated token (reasoning
    included); ``cached_tokens`` the prompt tokens found in the prefix cache (whole KV
    blocks, at most ``input_tokens - 1``), ``reasoning_tokens`` the reasoning text
    re-tokenized; ``cache_write_tokens`` is 0."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(OpenAIBaseModel):
    """The ``response`` object (OpenAI's ``Response``): ``output`` holds the items as plain
    dicts (``responses_events.OutputItems`` builds them); the request's settings are echoed.
    ``status``: ``queued`` / ``in_progress`` while a background response runs, then
    ``completed``, ``incomplete`` (cut by ``max_output_tokens``), ``failed`` (``error``:
    ``code`` and ``message``) or ``cancelled``."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: str | None = None
    store: bool = True
    truncation: str = "disabled"
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    background: bool = False


class ResponseItemList(OpenAIBaseModel):
    """GET /v1/responses/{id}/input_items: a page of a stored reply's input items (OpenAI's
    ``ResponseItemList``; ``first_id`` / ``last_id`` null for an empty page)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(OpenAIBaseModel):
    """DELETE /v1/responses/{id}: the reply is no longer stored."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
