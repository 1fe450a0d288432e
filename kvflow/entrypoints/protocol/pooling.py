"""The /pooling request and response (vLLM's generic pooling endpoint) of a pooling server:
an embedding model's vectors, a sequence classifier's class probabilities."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from kvflow.entrypoints.protocol.base import OpenAIBaseModel, now
from kvflow.entrypoints.protocol.chat import ChatMessage
from kvflow.entrypoints.protocol.embeddings import EmbeddingRequest
from kvflow.entrypoints.protocol.responses import UsageInfo


class PoolingRequest(EmbeddingRequest):
    """POST /pooling: /v1/embeddings' fields (their meaning and checks: ``input`` or
    ``messages``) and vLLM's ``task``: ``embed`` or ``classify``, where the server's model
    runs it (None: ``embed`` on an embedding server, else ``classify``); ``dimensions`` and
    ``normalize`` apply to ``embed`` only; ``activation`` / ``use_activation`` to every task
    (the head's activation, or on the embedding tasks vLLM 0.32's name of ``normalize``),
    and vLLM 0.10's reward-model ``softmax`` (the same switch) to ``token_classify``
    only. Unlike /v1/embeddings (vLLM 0.32's /pooling as well), ``messages`` is one
    conversation and ``input`` never holds chat messages."""

    CHAT_INPUT: ClassVar[bool] = False

    messages: list[ChatMessage] | None = Field(None, min_length=1)
    task: str | None = None
    activation: bool | None = None  # vLLM 0.10's name of use_activation
    use_activation: bool | None = None  # False: raw head logits / an unnormalized embedding
    softmax: bool | None = None  # vLLM 0.10's reward-model name of it: token_classify only


class PoolingData(OpenAIBaseModel):
    """One input's pooled output: an embedding (``task`` embed) or the class probabilities
    (classify), a JSON list of floats or its bytes in base64 (``encoding_format``); for the
    per-token tasks (token_embed, token_classify) one list per prompt token, [tokens][D]
    (base64: the rows' bytes, row-major)."""

    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | list[list[float]] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[PoolingData]
    usage: UsageInfo  # prompt tokens; completion_tokens 0 (vLLM's shape)
