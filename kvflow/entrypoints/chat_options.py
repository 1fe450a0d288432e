"""The chat-template fields of a chat or /tokenize request, as the chat handler renders
them (``OpenAIServingChat.render``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvflow.entrypoints.protocol import ChatCompletionRequest, TokenizeRequest


@dataclass(frozen=True)
class ChatOptions:
    """How to render a conversation (the chat-template fields of a request)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None

    @classmethod
    def of(cls, req: ChatCompletionRequest | TokenizeRequest) -> ChatOptions:
        """The options of a chat or /tokenize request."""
        special = req.add_special_tokens
        return cls(req.add_generation_prompt, req.continue_final_message, bool(special),
                   req.chat_template, req.documents, req.chat_template_kwargs)
