"""The /v1/embeddings request and response."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvflow.entrypoints.protocol.base import (
    INT32_MAX,
    OpenAIBaseModel,
    RequestBody,
    now,
    unsupported_field,
)


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings. ``input``: a string, a list of strings, a list of token ids or a
    list of token-id lists; ``dimensions``: Matryoshka truncation (models that support it);
    ``encoding_format``: ``float`` (a JSON list), ``base64`` or ``bytes`` (vLLM's: the raw
    bytes as the body, their layout in the ``metadata`` header), the bytes being the values
    cast to vLLM's ``embed_dtype`` in its ``endianness`` (default float32, this machine's
    order; ``entrypoints/pooling_encoding.py``);
    vLLM's ``request_id`` names the reply (``id``: ``embd-{request_id}``); vLLM's
    ``normalize`` (true / false; unset: as the model's pooling config says) L2-normalizes the
    vector or returns it raw, and ``add_special_tokens`` (default true) false tokenizes text
    inputs without the tokenizer's special tokens (token-id inputs are taken as sent);
    vLLM's ``truncate_prompt_tokens`` cuts each input to that many tokens instead of refusing
    one longer than the context (-1: ``max_model_len``; a text as its tokenizer truncates,
    token ids keep their last N); vLLM's ``priority`` orders the waiting queue as a
    generation request's does (needs ``--policy priority`` or ``fair``)."""

    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    input: str | list[int] | list[str] | list[list[int]]  # ids first: see CompletionRequest
    encoding_format: Literal["float", "base64", "bytes"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    dimensions: int | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)

    @model_validator(mode="wrap")
    @classmethod
    def _messages_instead_of_input(cls, data: Any, handler: Any) -> Any:
        """vLLM's chat-style body (``messages``, no ``input``) is a 400 naming ``messages``
        (pointing to /pooling, which renders them), not "input: a required field". A
        subclass declaring ``messages`` (/pooling's PoolingRequest) reads them itself."""
        if "messages" not in cls.model_fields and isinstance(data, dict) \
                and data.get("input") is None and data.get("messages") is not None:
            raise unsupported_field("messages", "/v1/embeddings takes input only (vLLM's "
                                    "chat-style embedding request is not served here): send "
                                    "the text as input, or POST the messages to /pooling, "
                                    "which renders them with the chat template")
        return handler(data)


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
