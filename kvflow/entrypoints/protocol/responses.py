"""The /v1/completions and /v1/chat/completions responses, whole and streamed."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kvflow.entrypoints.protocol.base import OmitNoneModel, OpenAIBaseModel, now


class PromptTokenUsageInfo(OpenAIBaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens found in the
    prefix cache (OpenAI's ``CompletionUsage.prompt_tokens_details``)."""

    cached_tokens: int = 0


class UsageInfo(OmitNoneModel):
    """Token counts of a request; ``prompt_tokens_details`` only on a server started with
    ``--enable-prompt-tokens-details`` (left out of the JSON otherwise)."""

    OMIT_IF_NONE = ("prompt_tokens_details",)

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in ``prompt_logprobs`` (vLLM's form)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


class CompletionChoice(OmitNoneModel):
    """``prompt_logprobs`` (when asked for): per prompt token, token id (as a string) ->
    its entry, with the prompt token and the top-k; None for the first token."""

    OMIT_IF_NONE = ("token_ids", "prompt_token_ids", "prompt_logprobs")

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OmitNoneModel):
    """The reply's message. ``tool_calls`` is left out when the reply made no call, as
    OpenAI and vLLM 0.32 leave it out: the official client sends the message back as it
    parsed it (``messages.append(reply.choices[0].message)``), and an empty ``tool_calls``
    is a 400 there, as OpenAI refuses one. ``reasoning`` (``--reasoning-parser``) is vLLM
    0.32's name for the reply's reasoning (vLLM 0.10's ``reasoning_content`` is no longer
    written, as vLLM 0.32 writes only ``reasoning``)."""

    OMIT_IF_NONE = ("tool_calls", "reasoning")

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None


class ChatChoice(OmitNoneModel):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OmitNoneModel):
    """``service_tier``: the tier that served the request, when it sent one (as OpenAI's);
    ``prompt_logprobs`` (vLLM's field, when asked for): as ``CompletionChoice``'s, for the
    rendered conversation's tokens; ``prompt_text`` (vLLM 0.32's, ``return_prompt_text``):
    the rendered conversation the model was given."""

    OMIT_IF_NONE = ("prompt_token_ids", "service_tier", "prompt_logprobs", "prompt_text")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    service_tier: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_text: str | None = None


class DeltaFunctionCall(OmitNoneModel):
    OMIT_IF_NONE = ("name", "arguments")

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNoneModel):
    """A streamed piece of tool call ``index``: the first carries id, type and name."""

    OMIT_IF_NONE = ("id", "type")

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OmitNoneModel):
    """A stream chunk's piece of the message; ``reasoning`` as ``ChatResponseMessage``'s."""

    OMIT_IF_NONE = ("role", "content", "tool_calls", "reasoning")

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None


class ChatStreamChoice(OmitNoneModel):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OmitNoneModel):
    """A chat stream chunk; ``prompt_token_ids`` (``return_token_ids``) and ``prompt_text``
    (``return_prompt_text``) on each choice's first (its role chunk) only; ``service_tier``
    on every chunk when the request sent one (as OpenAI's)."""

    OMIT_IF_NONE = ("prompt_token_ids", "service_tier", "prompt_text")

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    service_tier: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
