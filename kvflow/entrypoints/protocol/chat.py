"""The /v1/chat/completions request: messages and their content parts, tools, tool choice."""

from __future__ import annotations

from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvflow.chat.tool_calls import ToolCalls
from kvflow.entrypoints.protocol.base import INT32_MAX, RequestModel, request_limit
from kvflow.entrypoints.protocol.sampling import SamplingRequest

# Content parts one request may hold, all messages together, a string (or null) content
# counting as one: the schema validates them on the event loop, where 200,000 text parts held
# the server 1.3 s (parsing and validating the body in-process); at this limit about 0.06 s.
# Documented in docs/openai-server.md (the chat fields).
MAX_CONTENT_PARTS = 10_000
# Tools and earlier turns' tool calls one request may hold (OpenAI's API takes 128 tools; vLLM
# sets no limit): validated on the event loop too, 100,000 tools (each with a JSON schema
# then checked, ~0.5 ms a tool) or tool calls held it for seconds. Documented in docs/openai-server.md.
MAX_TOOLS = 2048
MAX_TOOL_CALLS = 2048


def check_list_caps(data: Any) -> None:
    """Refuse a body whose ``messages`` hold more than :data:`MAX_CONTENT_PARTS` content
    parts in all (a message whose content is not a list counts as one), more than
    :data:`MAX_TOOL_CALLS` ``tool_calls`` in all, or whose ``tools`` are more than
    :data:`MAX_TOOLS`, before anything else of it is read: one pass over the messages, not
    over the parts or calls. ``messages`` may be a list of conversations (/v1/embeddings'
    batch, vLLM 0.32's): their messages count together.

    Raises:
        PydanticCustomError: ``request_limit`` (``base.request_limit``), its context naming
            the field (``messages.<i>.content`` / ``messages.<i>.tool_calls`` of the message
            that passes the limit, ``messages.<b>.<i>...`` in a batch, or ``tools``), the
            limit and the count (the server's 400, code ``array_above_max_length``).
    """
    if not isinstance(data, dict):
        return
    tools = data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise request_limit("tools", f"a request holds at most {MAX_TOOLS} tools; this one "
                                     f"holds {len(tools)}")
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    named = [(f"messages.{b}.{i}", m) for b, conversation in enumerate(messages)
             for i, m in enumerate(conversation)] if is_batch(messages) else \
        [(f"messages.{i}", m) for i, m in enumerate(messages)]
    for key, limit, what in (("content", MAX_CONTENT_PARTS, "content parts"),
                             ("tool_calls", MAX_TOOL_CALLS, "tool calls")):
        values = [m.get(key) if isinstance(m, dict) else None for _, m in named]
        one = 1 if key == "content" else 0  # a content that is no list is one part
        totals = list(accumulate(len(v) if isinstance(v, list) else one for v in values))
        if not totals or totals[-1] <= limit:
            continue
        i = next(i for i, total in enumerate(totals) if total > limit)
        note = " (a string content counts as one)" if key == "content" else ""
        raise request_limit(f"{named[i][0]}.{key}", f"a request holds at most {limit} {what}, "
                            f"all messages together{note}; this one holds {totals[-1]}")


def is_batch(messages: Any) -> bool:
    """Whether a body's ``messages`` is a list of conversations (each a list), as
    /v1/embeddings takes a batch (vLLM 0.32's ``EmbeddingBatchChatRequest``), rather than
    one conversation."""
    return isinstance(messages, list) and bool(messages) and \
        all(isinstance(m, list) for m in messages)


class ImageURL(RequestModel):
    """An ``image_url`` part's image: a ``data:image/...;base64,`` URL, an http(s) URL the
    server fetches only from ``--allowed-media-domains``, or a ``file://`` URL read only from
    inside ``--allowed-local-media-path``. ``detail``: only ``"auto"`` (the
    model's image processor chooses the resolution); ``"low"`` / ``"high"`` are a 400."""

    url: str
    detail: str | None = None  # checked by the chat handler (a 400 naming the part)


class VideoURL(RequestModel):
    """A ``video_url`` part's video (vLLM's extension): ``data:video/jpeg;base64,<frame>,...``
    (base64 JPEG frames), ``data:video/<mp4|webm|...>;base64,`` (a video file; the server
    needs PyAV), an http(s) URL from ``--allowed-media-domains``, or a ``file://`` URL from
    inside ``--allowed-local-media-path``."""

    url: str


# Part types whose payload key is not their type: the Responses API's text parts, which chat
# takes as text parts (their ``text``), as vLLM does
_TEXT_KEYS = {"input_text": "text", "output_text": "text"}


class ContentPart(RequestModel):
    """A content part: ``text`` (or an assistant's ``refusal``, or the Responses API's
    ``input_text`` / ``output_text`` parts' ``text``, as vLLM takes them) is rendered; ``image_url``
    and ``video_url`` parts are images and videos for a vision-language model (a 400 for a
    text-only one); other types
    (audio, files) are a 400 naming the part (kvflow/chat/messages.py). A key other than
    ``type`` and the declared ones is a 400 naming it (``messages.0.content.0.foo``), except
    the payload of an undeclared type (``input_audio`` of an ``input_audio`` part), which is
    dropped so that the part is refused for its type. A part carries only its own type's
    payload: ``image_url`` on a ``text`` part (or ``text`` on an ``image_url`` one) is a 400
    naming that key (code ``unknown_parameter``), not left unread."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: ImageURL | None = None
    video_url: VideoURL | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_payload(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if not isinstance(kind, str):
            return data
        if kind in data and kind not in cls.model_fields:
            data = {k: v for k, v in data.items() if k != kind}
        payloads = set(cls.model_fields) - {"type"}
        own = _TEXT_KEYS.get(kind, kind)
        other = next((k for k in data if k in payloads and k != own
                      and data[k] is not None), None)
        if other is not None:
            raise PydanticCustomError(
                "part_key", "Unrecognized request argument supplied: {key} (a {kind!r} part "
                "carries {own} only)", {"key": other, "kind": kind, "own": own})
        return data


# An earlier assistant turn's calls (ToolCalls: CalledFunction, MessageToolCall) are defined with
# the conversation's other tool-call checks in kvflow/chat/tool_calls.py, which LLM.chat runs too.


class ChatMessage(RequestModel):
    """A conversation turn. ``content`` must be sent (null renders as empty text) except on
    an assistant turn with ``tool_calls``, as OpenAI requires (checked with the conversation,
    ``chat_messages.check_message_fields``). ``tool_calls`` (assistant turns only) and a tool
    turn's ``tool_call_id`` (required on tool turns, as OpenAI requires it) reach the
    template; OpenAI's and vLLM's other keys (``name``, ...) reach it unchecked, any other key
    only when the template reads it (kvflow/chat/template.py). ``parsed`` (assistant turns
    only) is the official ``openai`` client's reading of a reply's ``content``
    (``chat.completions.parse``), which it sends back with the message: any value is taken,
    and left out of the template's conversation (``content`` is the turn)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: ToolCalls | None = None
    tool_call_id: str | None = None
    parsed: Any = None  # the openai client's own; never rendered (chat_render)

    @field_validator("content")
    @classmethod
    def _parts_not_empty(cls, content: Any) -> Any:
        """A list of content parts holds at least one part (OpenAI's ``minItems: 1``)."""
        if isinstance(content, list) and not content:
            raise PydanticCustomError("empty_content", "a list of content parts must hold at "
                                      "least one part (for no content send a string or null)")
        return content


class FunctionDefinition(RequestModel):
    """A tool's function: ``name`` by OpenAI's rule (``^[a-zA-Z0-9_-]{1,64}$``; unique among
    the tools, checked with the ``parameters`` schema in structured_requests.check_tools)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. ``tools`` are rendered through the chat template;
    ``tool_choice`` ``required`` and a named function are enforced with a grammar.

    OpenAI's fields about the platform rather than the reply are accepted: ``metadata`` (up
    to 16 string pairs, as OpenAI limits them; not kept), ``prompt_cache_key`` (every request
    shares the prefix cache anyway), ``safety_identifier`` (logged like ``user``),
    ``store: false`` and ``service_tier`` ``auto`` / ``default``; ``store: true`` and another
    tier ask for what kvflow does not do and are a 400 naming the field (``platform_fields``)."""

    messages: list[ChatMessage] = Field(min_length=1)  # MAX_CONTENT_PARTS parts in all
    max_tokens: int | None = Field(None, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=INT32_MAX)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: template variables (chat_options.effort_kwargs), not a sampling setting
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    # vLLM's: false drops the parsed reasoning (and logprobs, token ids) from the reply
    include_reasoning: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    echo: bool = False
    return_prompt_text: bool = False  # vLLM 0.32's: the rendered prompt as prompt_text
    tools: list[ChatTool] | None = Field(None, min_length=1)  # [] too short; MAX_TOOLS
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[Annotated[str, Field(max_length=64)],
                   Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _cap_lists(cls, data: Any, handler: Any) -> Any:
        check_list_caps(data)  # before the body's other checks and its validation
        return handler(data)
