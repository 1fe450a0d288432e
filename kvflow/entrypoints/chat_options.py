"""The chat-template fields of a chat or /tokenize request, as the chat handler renders
them (``OpenAIServingChat.render``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvflow.chat.template import ChatTemplateError, template_variables
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
    reasoning_effort: str | None = None  # chat's (vLLM's); /tokenize has none

    @classmethod
    def of(cls, req: ChatCompletionRequest | TokenizeRequest) -> ChatOptions:
        """The options of a chat or /tokenize request."""
        special = req.add_special_tokens
        return cls(req.add_generation_prompt, req.continue_final_message, bool(special),
                   req.chat_template, req.documents, req.chat_template_kwargs,
                   getattr(req, "reasoning_effort", None))

    def with_effort(self, template: str, drop: bool = False) -> ChatOptions:
        """These options with ``reasoning_effort`` made template variables, as vLLM makes
        them: ``reasoning_effort`` itself for a template that reads it, and
        ``enable_thinking`` (false for ``"none"``, else true) for one that reads that, unless
        ``chat_template_kwargs`` sets it; ``reasoning_effort`` overrides a
        ``chat_template_kwargs`` key of that name. ``template``: the Jinja text that renders.

        Raises:
            ChatTemplateError: (param ``reasoning_effort``) for a template that reads
                neither (the effort would change nothing), unless ``drop`` (a server started
                with ``--ignore-unknown-fields``, which ignores it as vLLM does).
        """
        if self.reasoning_effort is None:
            return self
        read = template_variables(template) if template else frozenset()
        if read is None:  # does not parse: rendering reports it
            return replace(self, reasoning_effort=None)
        user = self.template_kwargs if isinstance(self.template_kwargs, dict) else {}
        effort = {}
        if "reasoning_effort" in read:
            effort["reasoning_effort"] = self.reasoning_effort
        if "enable_thinking" in read and "enable_thinking" not in user:
            effort["enable_thinking"] = self.reasoning_effort != "none"
        if not read & {"reasoning_effort", "enable_thinking"} and not drop:
            raise ChatTemplateError(
                f"reasoning_effort={self.reasoning_effort!r} changes nothing for this model: "
                "its chat template reads neither reasoning_effort nor enable_thinking (leave "
                "it out, or pass the model's own switch in chat_template_kwargs)",
                "reasoning_effort", "unsupported_value")
        if not effort:
            return replace(self, reasoning_effort=None)
        kwargs = {**self.template_kwargs, **effort} if isinstance(self.template_kwargs, dict) \
            else effort if self.template_kwargs is None else self.template_kwargs
        return replace(self, template_kwargs=kwargs, reasoning_effort=None)
