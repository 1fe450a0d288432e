"""The endpoints around generation: /v1/models, LoRA adapter loading and unloading,
/tokenize and /detokenize, /version."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from kvflow.entrypoints.protocol.base import OmitNoneModel, OpenAIBaseModel, RequestBody, now
from kvflow.entrypoints.protocol.chat import (
    ChatMessage,
    ChatTool,
    NamedToolChoice,
    check_list_caps,
)


class ModelPermission(OpenAIBaseModel):
    """A model card's ``permission`` entry, as vLLM 0.32 writes it (the legacy OpenAI
    schema's: every model may be sampled, with logprobs, and viewed, by any organization)."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    """One served name of /v1/models (vLLM's fields; ``permission`` one entry, as vLLM's)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvflow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestBody):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT folder ``lora_path`` as model
    ``lora_name``; with ``load_inplace`` (vLLM's field) it replaces an adapter already served
    under that name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


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
    tools: list[ChatTool] | None = Field(None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = None  # vLLM's: each token's string as well

    @model_validator(mode="wrap")
    @classmethod
    def _cap_lists(cls, data: Any, handler: Any) -> Any:
        check_list_caps(data)  # as chat's: before the body's other checks
        return handler(data)


class TokenizeResponse(OmitNoneModel):
    OMIT_IF_NONE = ("token_strs",)

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the vocabulary's strings


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
