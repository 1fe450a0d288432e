"""OpenAI API request/response schemas (pydantic), plus the vLLM extensions kvflow supports.

Requests ignore unknown fields (as vLLM does; the handlers log each unknown name once); a known
field with a value of the wrong type or out of its range fails validation and becomes a 400
with an OpenAI error body. Every field a request model declares is honoured, or rejected with
a 400 naming it when set to a value kvflow does not implement (``best_of`` other than ``n``,
``use_beam_search``, chat ``prompt_logprobs``, ``suffix``, chat ``echo``); tests/e2e/
test_openai_fields.py walks every field. Text anywhere in a body that holds a lone UTF-16
surrogate is a 400 naming the field (``invalid_unicode``).
Extensions beyond OpenAI: ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``return_token_ids`` (adds ``token_ids`` to each choice and ``prompt_token_ids``),
``structured_outputs`` (``json`` / ``regex`` / ``choice`` / ``grammar`` constraints).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvflow.text_checks import find_lone_surrogate

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MAX = 2**31 - 1


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OmitNoneModel(OpenAIBaseModel):
    """A response model whose ``OMIT_IF_NONE`` fields are left out of the JSON when None
    (extensions nobody asked for, a delta's absent role)."""

    OMIT_IF_NONE: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self.OMIT_IF_NONE:
            if data.get(name, 0) is None:
                del data[name]
        return data


# ---- errors --------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared request fields -----------------------------------------------------------------------
class RequestBody(OpenAIBaseModel):
    """A top-level request body: all its text is checked for lone surrogates before
    validation (``invalid_unicode`` error with ``ctx.param``), and the names of fields it does
    not declare are kept in ``unknown_fields`` (for the handler to log)."""

    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _check_body(cls, data: Any, handler: Any) -> Any:
        found = find_lone_surrogate(data) if isinstance(data, dict) else None
        if found is not None:
            raise PydanticCustomError("invalid_unicode", "{param} {why}",
                                      {"param": found[0], "why": found[1]})
        model = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values()
                                             if f.alias}
            model._unknown_fields = tuple(sorted(k for k in data if k not in known))
        return model

    @property
    def unknown_fields(self) -> tuple[str, ...]:
        """Top-level fields of the body that this model does not declare (ignored)."""
        return self._unknown_fields


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema is under ``schema`` (alias of
    ``json_schema``, which pydantic's BaseModel reserves)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIBaseModel):
    """The vLLM-style ``structured_outputs`` extra body field (exactly one of these)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def _not_bool(value: Any) -> Any:
    """A before-validator for numeric fields: JSON true/false is not a number (pydantic would
    take true as 1)."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")  # noqa: TRY004 - pydantic wants it
    return value


class SamplingRequest(RequestBody):
    """Fields shared by completion and chat requests. vLLM's older ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` are ``structured_outputs``
    under other names; ``priority`` orders the waiting queue (needs ``--policy priority`` or
    ``fair``); ``target_ttft_ms`` / ``target_tpot_ms`` override the server's service-level
    targets for this request; ``user`` names the client for ``--policy fair``."""

    model: str | None = None
    n: int = Field(1, ge=1, le=_INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX - 2**20)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = Field(0, ge=-_INT32_MAX, le=_INT32_MAX)
    target_ttft_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    target_tpot_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    best_of: int | None = Field(None, ge=1, le=_INT32_MAX)
    use_beam_search: bool = False
    prompt_logprobs: int | None = Field(None, ge=0)

    _no_bool_numbers = field_validator(
        "n", "top_k", "seed", "min_tokens", "max_tokens", "temperature", "top_p", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "priority", "best_of",
        "prompt_logprobs", "target_ttft_ms", "target_tpot_ms", mode="before",
        check_fields=False)(_not_bool)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    # unset: the model's generation-config max_new_tokens, else 16; null: what the context leaves
    max_tokens: int | None = Field(16, le=_INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    add_special_tokens: bool = True
    suffix: str | None = None

    _no_bool_logprobs = field_validator("logprobs", mode="before")(_not_bool)


class ImageURL(OpenAIBaseModel):
    """An ``image_url`` part's image: a ``data:image/...;base64,`` URL, or an http(s) URL the
    server fetches only from ``--allowed-media-domains``. ``detail``: only ``"auto"`` (the
    model's image processor chooses the resolution); ``"low"`` / ``"high"`` are a 400."""

    url: str
    detail: str | None = None  # checked by the chat handler (a 400 naming the part)


class ContentPart(OpenAIBaseModel):
    """A content part: ``text`` (or an assistant's ``refusal``) is rendered; ``image_url``
    parts are images for a vision-language model (a 400 for a text-only one); other types
    (audio, files) are a 400."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ... reach the template

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. ``tools`` are rendered through the chat template;
    ``tool_choice`` ``required`` and a named function are enforced with a grammar."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, le=_INT32_MAX)
    max_completion_tokens: int | None = Field(None, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    echo: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    _no_bool_chat_counts = field_validator("max_completion_tokens", "top_logprobs",
                                           mode="before")(_not_bool)


# ---- responses -----------------------------------------------------------------------------------
class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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


def _now() -> int:
    return int(time.time())


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
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
    OMIT_IF_NONE = ("reasoning_content",)

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None


class ChatChoice(OmitNoneModel):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OmitNoneModel):
    OMIT_IF_NONE = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None


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
    OMIT_IF_NONE = ("role", "content", "tool_calls", "reasoning_content")

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatStreamChoice(OmitNoneModel):
    OMIT_IF_NONE = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- embeddings ----------------------------------------------------------------------------------
class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings. ``input``: a string, a list of strings, a list of token ids or a
    list of token-id lists; ``dimensions``: Matryoshka truncation (models that support it);
    ``encoding_format``: ``float`` (a JSON list) or ``base64`` (little-endian float32 bytes)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=_INT32_MAX)
    user: str | None = None

    _no_bool_dimensions = field_validator("dimensions", mode="before")(_not_bool)


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# ---- models, tokenizer, version ------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvflow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT folder ``lora_path`` as model
    ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestBody):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving adapter ``lora_name``."""

    lora_name: str = Field(min_length=1)


class TokenizeRequest(RequestBody):
    """POST /tokenize: either ``prompt`` or ``messages`` (rendered with the chat template,
    with the chat options of /v1/chat/completions). ``add_special_tokens`` defaults to true
    for a prompt and false for messages (the template writes the special tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict[str, Any]] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
