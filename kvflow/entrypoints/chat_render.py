"""Rendering a chat conversation into the prompt, shared by /v1/chat/completions and
/tokenize: the server's chat template (``--chat-template``, read once), the request's own
(under ``--trust-request-chat-template``), the tools given to the template or written into the
system message as the tool parser's instructions, long conversations rendered off the event
loop, a vision-language model's images attached after rendering, and (chat only) the rendered
prompt cut to ``truncate_prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from kvflow.chat.messages import image_urls, video_urls
from kvflow.chat.template import ChatTemplateError, NoChatTemplateError, template_text
from kvflow.chat.tools_text import ToolsAsText, apply_with_tools_prompt, tools_as_text
from kvflow.chat_template_source import load_chat_template, template_name
from kvflow.entrypoints.chat_conversation import check_messages, no_template_error
from kvflow.entrypoints.chat_options import ChatOptions
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.preprocess import INLINE_CHARS, PromptTooLong, encode_checked, off_loop
from kvflow.entrypoints.protocol import ChatCompletionRequest, ChatMessage
from kvflow.entrypoints.sampling_requests import prompt_truncation
from kvflow.entrypoints.serving_base import body_size
from kvflow.entrypoints.structured_requests import tools_for_template
from kvflow.entrypoints.tool_parsers import make_tool_parser
from kvflow.inputs.processor import InputProcessor
from kvflow.inputs.prompts import ProcessedPrompt
from kvflow.inputs.tokenization import cut_generation_prompt
from kvflow.multimodal import MediaError
from kvflow.multimodal.video import VideoError

logger = logging.getLogger(__name__)

# A message's keys the official openai client sends back but no template gets: ``parsed``
# (ChatMessage's docstring)
CLIENT_ONLY_KEYS = frozenset({"parsed"})


class ChatRendering:
    """The conversation-rendering half of ``OpenAIServingChat`` (mixed into it): reads
    ``self.config`` (ServerConfig), ``self.engine`` (its ``processor``, ``max_model_len``,
    ``task``), ``self.tokenizer``, ``self.unknown_fields`` and ``self.chat_template`` (the
    server's template text, or None for the model's: ``_init_chat_template``), as
    ``OpenAIServing`` provides them. ``cli_command``: the command whose ``--chat-template``
    the no-template error names (``kvflow run-batch`` sets its own on its instance).
    """

    cli_command = "kvflow serve"

    def _init_chat_template(self, text: str | None) -> str | None:
        """The server's template, ``text`` if read already (None: the model's)."""
        value = self.config.chat_template
        if value is None:
            if text is not None:
                raise ValueError("a chat template text was given without "
                                 "config.chat_template, the --chat-template it is read from")
            return None
        template = load_chat_template(value) if text is None else text
        logger.info("conversations render with --chat-template %s, not the model's template",
                    template_name(value))
        return template

    def template_tools(self, req: Any, mode: str | None) -> list[dict[str, Any]] | None:
        """The request's tools for the chat template (``tools_for_template`` under this
        server's ``--exclude-tools-when-tool-choice-none``)."""
        return tools_for_template(req, mode, self.config.exclude_tools_when_tool_choice_none)

    async def render(self, messages: list[ChatMessage], options: ChatOptions,
                     tools: list[dict[str, Any]] | None = None, check_length: bool = True,
                     size: int | None = None, tool_instructions: bool = True
                     ) -> tuple[str, list[int]]:
        """Apply the chat template; returns (prompt text, token ids). ``tools`` go to the
        template's ``tools`` argument; a template that ignores them gets the tool parser's
        instructions as (the end of) the system message instead, added by kvflow (not under
        tool_choice none, ``tool_instructions`` False: they would ask for calls the request
        forbids, so such a template sees no tools then): a template
        that fails on that message but renders the client's messages is a 400 at ``tools``
        saying so (``chat_tools_text``, which ``LLM.chat`` shares). Assistant turns'
        ``tool_calls`` go to the template too; one that mentions neither ``tools`` nor
        ``tool_calls`` gets them as the tool parser's text at the end of the turn (the format
        those instructions ask for), one that reads tools but not tool_calls is a 400. A long
        conversation (``size``: its request body's bytes, ``body_size``; None: long) is
        rendered and tokenized in a worker thread (``preprocess.off_loop``); with
        ``check_length``, a prompt whose prefix alone is longer than the context is refused
        without tokenizing the rest.

        Raises:
            OpenAIError: 400 naming the field for non-text content, a model without a chat
                template, an option the template cannot honour, or a conversation it rejects
                (``tools`` when it rejects only the system text kvflow added for them);
                400 (code ``context_length_exceeded``) for a prompt certainly too long.
        """
        self._check_chat_template(options.chat_template)
        if options.chat_template is not None:
            size = None  # a client's template may run long: never on the event loop
        check_messages(messages)
        tokenizer = self.tokenizer
        options, prepared = self._prepare(tokenizer, messages, options, tools,
                                          tool_instructions)
        limit = self.engine.max_model_len - 1 if check_length else None
        try:
            return await off_loop(INLINE_CHARS + 1 if size is None else size,
                                  self._render_now, tokenizer, prepared, options, limit)
        except NoChatTemplateError:
            raise no_template_error(getattr(self.engine, "task", "generate"),
                                    self.config.trust_request_chat_template,
                                    self.cli_command) from None
        except ChatTemplateError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None
        except PromptTooLong as e:
            raise OpenAIError(str(e), param="messages", code="context_length_exceeded") \
                from None

    def _prepare(self, tokenizer: Any, messages: list[ChatMessage], options: ChatOptions,
                 tools: list[dict[str, Any]] | None, tool_instructions: bool
                 ) -> tuple[ChatOptions, ToolsAsText]:
        """The checked messages as the template's conversation, with the tools and earlier
        tool calls as text where the template that renders reads neither
        (``chat_tools_text.tools_as_text``), and ``options`` with ``reasoning_effort`` as
        template variables (``ChatOptions.with_effort``).

        Raises:
            OpenAIError: 400 naming the field, for a ``reasoning_effort`` the template cannot
                honour.
        """
        conversation = [m.model_dump(exclude_none=True, exclude=CLIENT_ONLY_KEYS) |
                        {"content": m.model_dump()["content"]} for m in messages]
        template = template_text(tokenizer, options.chat_template, self.chat_template, tools)
        try:
            options = options.with_effort(template, drop=self.unknown_fields.ignore)
        except ChatTemplateError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None
        prepared = tools_as_text(conversation, template, tools,
                                 make_tool_parser(self.config.tool_call_parser),
                                 tool_instructions)
        return options, prepared

    def _check_chat_template(self, template: str | None) -> None:
        """Raises OpenAIError 400 (``chat_template``) for a request's own template unless the
        server trusts them (``--trust-request-chat-template``: a Jinja template is code run on
        the server, and one that loops for minutes would hold a worker thread), or an empty
        one."""
        if template is None:
            return
        if not self.config.trust_request_chat_template:
            raise OpenAIError("chat_template in a request is refused: this server was not "
                              "started with --trust-request-chat-template",
                              param="chat_template", code="unsupported_parameter")
        if not template.strip():
            raise OpenAIError("chat_template is empty", param="chat_template",
                              code="invalid_value")

    def _render_now(self, tokenizer: Any, prepared: ToolsAsText, options: ChatOptions,
                    limit: int | None) -> tuple[str, list[int]]:
        """``render``'s work (run in a worker thread for a long conversation): the template
        on ``prepared`` (``chat_tools_text.tools_as_text``), then the tokenizer (refusing a
        text certainly over ``limit`` tokens unless None).

        Raises:
            NoChatTemplateError, ChatTemplateError: from the template (param ``tools`` when it
                fails only on the tools' instructions kvflow added:
                ``chat_tools_text.apply_with_tools_prompt``); PromptTooLong.
        """
        text = apply_with_tools_prompt(
            lambda messages, tools: self._apply_template(messages, options, tools), prepared)
        special = options.add_special_tokens
        if limit is None:
            return text, tokenizer.encode(text, add_special_tokens=special)
        return text, encode_checked(tokenizer, text, limit, special)

    def _apply_template(self, conversation: list[dict[str, Any]], options: ChatOptions,
                        tools: list[dict[str, Any]] | None) -> str:
        """The prompt text. Raises NoChatTemplateError, ChatTemplateError (``render_chat``);
        under ``--ignore-unknown-fields`` a ``chat_template_kwargs`` key the template never
        reads is dropped and logged once (``_log_unread_kwargs``) instead of refused."""
        return self.engine.processor.apply_chat_template(
            conversation, options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            chat_template=options.chat_template, tools=tools, documents=options.documents,
            template_kwargs=options.template_kwargs, default_template=self.chat_template,
            on_unread_kwargs=self._log_unread_kwargs if self.unknown_fields.ignore else None,
            default_kwargs=self.config.default_chat_template_kwargs,
            content_format=self.config.chat_template_content_format)

    def _log_unread_kwargs(self, names: list[str]) -> None:
        self.unknown_fields.log.note_names(
            [f"chat_template_kwargs.{name}" for name in names], "a chat or /tokenize request",
            "chat_template_kwargs keys the chat template does not read")

    async def attach_images(self, messages: list[ChatMessage], text: str, ids: list[int],
                            mm_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        """The rendered prompt with the conversation's images (a vision-language model):
        each ``image_url`` part's image fetched or decoded, checked and preprocessed (with
        the request's ``mm_processor_kwargs``, ``mm_kwargs``) in a worker thread (the event
        loop keeps serving), and its placeholder expanded.

        Raises:
            OpenAIError: 400 naming ``mm_processor_kwargs`` for keys the image processor does
                not take (or any, for a text-only model), the ``image_url`` part for an image
                that cannot be used (see ``kvflow/multimodal/media.py``), or ``messages`` for
                a placeholder count that differs from the image count.
        """
        processor = self.engine.processor
        try:
            mm_kwargs = processor.check_mm_kwargs(mm_kwargs)
        except ValueError as e:
            raise OpenAIError(str(e), param="mm_processor_kwargs",
                              code="invalid_value") from None
        if processor.mm_processor is None:  # rendering refused image parts already
            return ProcessedPrompt(text, ids)
        conversation = [m.model_dump(exclude=CLIENT_ONLY_KEYS) for m in messages]
        try:
            return await asyncio.to_thread(_with_images, processor, conversation, text, ids,
                                           mm_kwargs)
        except ValueError as e:
            param = getattr(e, "param", None) or "messages"
            raise OpenAIError(str(e), param=param,
                              code=getattr(e, "code", None) or "invalid_value") from None

    async def render_prompt(self, req: ChatCompletionRequest, raw: Request, mode: str | None
                            ) -> tuple[str, ProcessedPrompt, str | None, list[int]]:
        """The request's conversation rendered (off the event loop when large), its images
        attached and the prompt cut to ``truncate_prompt_tokens``: (the rendered text, the
        processed prompt with its images, the prompt's text (None once cut) and token ids after
        the cut). ``mode``: the request's tool-choice mode (None: no tools).

        Raises:
            OpenAIError: 400 for a conversation, image or truncation that cannot be used,
                or a prompt longer than the context (when not truncated).
        """
        limit = prompt_truncation(self.engine, req)
        text, ids = await self.render(req.messages, ChatOptions.of(req), self.template_tools(
            req, mode), check_length=limit is None, size=body_size(raw),
            tool_instructions=mode is not None)
        rendered = text
        prompt = await self.attach_images(req.messages, text, ids, req.mm_processor_kwargs)
        special = req.add_special_tokens and "truncation_side" not in req.unknown_values
        text, ids = await off_loop(len(text), _truncated, self.tokenizer, text,
                                   prompt.token_ids, limit, prompt.mm_features, special)
        return rendered, prompt, text, ids


def _with_images(processor: InputProcessor, conversation: list[dict[str, Any]], text: str,
                 ids: list[int], mm_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
    """Load the conversation's images and videos, preprocess them (the image processor
    called with ``mm_kwargs`` too) and expand their placeholders in ``ids``; a refused
    item's error names its ``image_url`` / ``video_url`` part. Raises ValueError
    (``MediaError``)."""
    images, videos = processor.load_chat_media(conversation)
    try:
        return processor.attach_images(text, ids, images, videos, mm_kwargs)
    except MediaError as e:
        urls = video_urls(conversation) if isinstance(e, VideoError) else \
            image_urls(conversation)
        if e.image_index is not None and e.image_index < len(urls):
            e.param = urls[e.image_index][0]
        raise


def _truncated(tokenizer: Any, text: str, ids: list[int], limit: int | None,
               images: list | None, special: bool) -> tuple[str | None, list[int]]:
    """The rendered prompt cut to its last ``limit`` tokens (``truncate_prompt_tokens``; its
    text is then None: no longer the prompt); as it is when it fits or ``limit`` is None.
    ``special``: ``ids`` hold the special tokens the tokenizer adds (``add_special_tokens``,
    no ``truncation_side``): they stay, as vLLM 0.32 cuts the text
    (``tokenization_options.cut_generation_prompt``).

    Raises:
        OpenAIError: 400 naming ``truncate_prompt_tokens`` for a cut through a prompt with
            images (their placeholder tokens would be cut from their features).
    """
    if limit is None or len(ids) <= limit:
        return text, ids
    if images:
        raise OpenAIError(f"truncate_prompt_tokens={limit} would cut the rendered prompt of "
                          f"{len(ids)} tokens, which holds images: send a larger value or "
                          "leave it out", param="truncate_prompt_tokens", code="invalid_value")
    return None, cut_generation_prompt(tokenizer, text, ids, limit, special)
