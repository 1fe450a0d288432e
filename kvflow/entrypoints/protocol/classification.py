"""The /classify request and response (vLLM's shape) of a sequence-classification server
(``--task classify``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvflow.entrypoints.protocol.base import (
    INT32_MAX,
    OpenAIBaseModel,
    RequestBody,
    now,
)
from kvflow.entrypoints.protocol.chat import ChatMessage, check_list_caps
from kvflow.entrypoints.protocol.responses import UsageInfo


class ClassificationRequest(RequestBody):
    """POST /classify (and /v1/classify). ``input``: a string, a list of strings, a list of
    token ids or a list of token-id lists, one classification each;
    ``truncate_prompt_tokens`` cuts each input to that many tokens instead of refusing one
    longer than the context (-1: ``max_model_len``), keeping its first N (a text as its
    tokenizer truncates on the right, special tokens kept; token ids their first N, as vLLM
    does), or its last N with vLLM's ``truncation_side`` ``"left"`` (as /v1/embeddings);
    vLLM's ``request_id`` names the reply (``id``:
    ``classify-{request_id}``); vLLM's ``priority`` orders the waiting queue (needs
    ``--policy priority`` or ``fair``). As vLLM 0.32's classification requests (and
    /v1/embeddings): ``add_special_tokens`` (default true; false tokenizes text inputs
    without the tokenizer's special tokens) and, instead of ``input``, ``messages``: one
    conversation rendered with the chat template, with the chat fields /v1/embeddings takes
    (``add_special_tokens`` then defaults to false), and ``padding`` as /v1/embeddings
    reads it."""

    model: str | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    input: str | list[int] | list[str] | list[list[int]] | None = None  # ids first: see
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # CompletionRequest
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    truncation_side: Literal["left", "right"] | None = None  # None: keep the first tokens
    padding: Literal["max_length", "do_not_pad"] | None = None  # vLLM 0.32's
    user: str | None = None
    priority: int = Field(0, ge=-INT32_MAX, le=INT32_MAX)
    activation: bool | None = None  # vLLM 0.10's name of use_activation
    use_activation: bool | None = None  # False: raw head logits, no softmax / sigmoid

    @model_validator(mode="wrap")
    @classmethod
    def _cap_lists(cls, data: Any, handler: Any) -> Any:
        check_list_caps(data)  # as chat's: before the body's other checks
        return handler(data)


class ClassificationData(OpenAIBaseModel):
    """One input's classes: ``probs`` (softmax of the head's logits, class-index order),
    ``label`` the most probable class's name (``config.id2label``), ``num_classes``."""

    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo  # prompt tokens; completion_tokens 0 (vLLM's shape)
