"""The /v1/embeddings request and response."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, PrivateAttr, Tag, model_validator

from kvflow.entrypoints.protocol.base import (
    INT32_MAX,
    OpenAIBaseModel,
    RequestBody,
    now,
)
from kvflow.entrypoints.protocol.chat import ChatMessage, check_list_caps, is_batch

Conversation = Annotated[list[ChatMessage], Field(min_length=1)]
# one conversation, or (vLLM 0.32's EmbeddingBatchChatRequest) a list of them; the tags read
# as types in an error's location, which validation_errors leaves out of its param
Conversations = Annotated[
    Annotated[Conversation, Tag("list[ChatMessage]")]
    | Annotated[Annotated[list[Conversation], Field(min_length=1)],
                Tag("list[list[ChatMessage]]")],
    Discriminator(lambda v: "list[list[ChatMessage]]" if is_batch(v) else "list[ChatMessage]")]


def is_chat_input(value: Any) -> bool:
    """Whether an embeddings ``input`` is chat messages, as vLLM 0.32 reads it
    (``EmbeddingChatInputRequest`` / ``EmbeddingBatchChatInputRequest``): a non-empty list of
    objects each with a string ``role``, or a non-empty list of such lists."""
    def conversation(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and \
            all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in v)

    return conversation(value) or (isinstance(value, list) and bool(value)
                                   and all(conversation(v) for v in value))


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings. ``input``: a string, a list of strings, a list of token ids or a
    list of token-id lists; ``dimensions``: Matryoshka truncation (models that support it);
    ``encoding_format``: ``float`` (a JSON list), ``base64`` or ``bytes`` (vLLM's: the raw
    bytes as the body, their layout in the ``metadata`` header; vLLM 0.32's ``bytes_only``:
    the same body without the header), the bytes being the values
    cast to vLLM's ``embed_dtype`` in its ``endianness`` (default float32, this machine's
    order; ``entrypoints/pooling_encoding.py``);
    vLLM's ``request_id`` names the reply (``id``: ``embd-{request_id}``); vLLM's
    ``normalize`` (true / false; unset: as the model's pooling config says) L2-normalizes the
    vector or returns it raw, and ``add_special_tokens`` (default true) false tokenizes text
    inputs without the tokenizer's special tokens (token-id inputs are taken as sent);
    vLLM 0.32's ``use_activation`` is the same switch as ``normalize`` (the two must agree);
    vLLM's ``truncate_prompt_tokens`` cuts each input to that many tokens instead of refusing
    one longer than the context (-1: ``max_model_len``), keeping its first N as vLLM's
    pooling runner does (a text as its tokenizer truncates on the right, special tokens
    kept; token ids their first N), or, with vLLM's ``truncation_side`` ``"left"``, its last
    N (``"right"``: the first N of the whole encoding, special tokens cut too); vLLM's
    ``priority`` orders the waiting queue as a
    generation request's does (needs ``--policy priority`` or ``fair``). Instead of
    ``input``, ``messages``: one conversation, or (vLLM 0.32) a list of conversations, each
    rendered with the chat template and embedded; vLLM 0.32 also reads chat messages sent in
    ``input`` (``is_chat_input``) as ``messages`` (``messages_field`` then ``input``).
    vLLM 0.32's ``padding`` ``"max_length"`` pads each prompt's token ids (after any cut)
    with the tokenizer's pad token to ``max_model_len``, all of them embedded and counted
    (models trained at a fixed length without an attention mask); ``"do_not_pad"`` or unset:
    no padding."""

    CHAT_INPUT: ClassVar[bool] = True  # vLLM 0.32 reads chat messages in input (not /pooling)

    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    input: str | list[int] | list[str] | list[list[int]] | None = None  # ids first: see
    messages: Conversations | None = None  # CompletionRequest
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None  # vLLM 0.32's name of normalize
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None  # None: keep the first tokens
    padding: Literal["max_length", "do_not_pad"] | None = None  # vLLM 0.32's
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    _messages_field: str = PrivateAttr(default="messages")

    @model_validator(mode="wrap")
    @classmethod
    def _cap_lists(cls, data: Any, handler: Any) -> Any:
        moved = cls.CHAT_INPUT and isinstance(data, dict) and "messages" not in data \
            and is_chat_input(data.get("input"))
        if moved:  # vLLM 0.32: chat messages in input are the messages
            data = {**{k: v for k, v in data.items() if k != "input"},
                    "messages": data["input"]}
        check_list_caps(data)  # as chat's: before the body's other checks
        model = handler(data)
        if moved:
            model._messages_field = "input"
        return model

    @property
    def messages_field(self) -> str:
        """The field the client sent its ``messages`` in: ``messages``, or ``input`` (chat
        messages there, vLLM 0.32's reading), for the errors that name it."""
        return self._messages_field


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
    created: int = Field(default_factory=now)
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
