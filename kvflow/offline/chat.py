"""``LLM.chat`` (vLLM's): conversations rendered with the chat template, then generated,
mixed into :class:`kvflow.offline.llm.LLM`, whose ``engine`` and ``generate`` it uses; ``enqueue_chat``
renders with it too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvflow.chat.template import template_text
from kvflow.chat.tool_calls import check_tool_call_ids, check_tool_calls, message_turns
from kvflow.chat.tools_text import (
    HermesToolText,
    apply_with_tools_prompt,
    check_calls_before_text,
    tools_as_text,
)
from kvflow.engine.llm_engine import LLMEngine
from kvflow.inputs.tokenization import TokenizationOptions, parse_tokenization_kwargs
from kvflow.lora.request import LoRARequest
from kvflow.offline.arguments import with_images
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams

# vLLM's chat_template_content_format values (kvflow.chat.template.render_chat's content_format)
CONTENT_FORMATS = ("auto", "string", "openai")


class LLMChat:
    """The chat methods of :class:`kvflow.offline.llm.LLM` (a mixin: ``LLM`` sets ``engine`` and
    defines ``generate``)."""

    engine: LLMEngine
    generate: Callable[..., list[RequestOutput]]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             priority: int | Sequence[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, documents: list[dict] | None = None,
             on_output: Callable[[int, RequestOutput], None] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             tokenization_kwargs: dict[str, Any] | None = None
             ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them and generate.

        The positional arguments are vLLM's first four (``messages``, ``sampling_params``,
        ``use_tqdm``, ``lora_request``); the rest are keyword-only (vLLM's order after those
        differs between its versions, so a positional one would bind to another argument).

        Message ``content`` may be a string, a list of text parts (a plain string in the
        list is one, as vLLM takes it) and, for a vision-language model, ``image_url`` and
        ``video_url`` parts, or None (see ``kvflow.chat.messages``;
        image URLs are ``data:`` URLs, http(s) from ``allowed_media_domains`` or ``file://``
        inside ``allowed_local_media_path``; video URLs
        likewise, see ``kvflow.multimodal.video``);
        ``continue_final_message`` continues the last message (whatever its role, as
        transformers and vLLM do) instead of starting a new turn; ``chat_template`` replaces the model's;
        ``tools`` / ``documents`` / ``chat_template_kwargs`` become template variables
        (a template that reads no ``tools`` gets hermes' instructions for them at the end of
        the system message instead, and one that reads neither ``tools`` nor ``tool_calls``
        gets an assistant's calls as hermes' ``<tool_call>`` text: what ``kvflow serve``
        renders under its default ``--tool-call-parser``);
        ``on_output`` is ``generate``'s (the outputs it sees have no ``prompt`` text: ``chat``
        sets it on the ones it returns); ``mm_processor_kwargs``, ``lora_request`` and
        ``priority`` are ``generate``'s
        too (one adapter or priority for every conversation, or one per conversation);
        ``chat_template_content_format`` is vLLM's: ``auto`` (content as a
        list of parts for a template that loops over a message's content, else one string),
        ``string`` (always one string) or ``openai`` (always a list of ``{type, ...}``
        parts), as ``kvflow serve --chat-template-content-format``. ``tokenization_kwargs``
        are ``generate``'s, for the rendered text (``add_special_tokens`` False unless they
        say otherwise: the template writes the special tokens).

        Raises:
            ValueError: for a ``chat_template_content_format`` other than the three,
                ``tools`` that are not a list of dicts, if the
                model has no chat template, or for a message or option the
                template cannot honour (``ChatTemplateError`` names the field): an
                assistant's ``tool_calls`` not in the server's shape
                (``messages.N.tool_calls.M.id`` for an empty id, ...), or a tool message's
                ``tool_call_id`` that no earlier assistant message's call has
                (``kvflow.chat.tool_calls``).
        """
        prompts, token_prompts = self._render_chat(
            messages, chat_template=chat_template,
            chat_template_content_format=chat_template_content_format,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools,
            chat_template_kwargs=chat_template_kwargs, documents=documents,
            tokenization_kwargs=tokenization_kwargs)
        outputs = self.generate(token_prompts, sampling_params, use_tqdm, priority=priority,
                                lora_request=lora_request, on_output=on_output,
                                mm_processor_kwargs=mm_processor_kwargs)
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def _render_chat(self, messages: list[dict] | list[list[dict]], *,
                     chat_template: str | None = None,
                     chat_template_content_format: str = "auto",
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                     documents: list[dict] | None = None,
                     tokenization_kwargs: dict[str, Any] | None = None
                     ) -> tuple[list[str], list[Any]]:
        """One conversation or a list of them rendered as :meth:`chat` renders them (its
        arguments): (the rendered texts, the prompts for ``generate``).

        Raises:
            ValueError: see :meth:`chat`.
        """
        messages = chat_conversations(messages)
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} "
                             f"must be one of {', '.join(CONTENT_FORMATS)}")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of tool dicts ({'type': 'function', "
                             f"'function': {{...}}}}), got {tools!r:.60}")
        conversations = messages
        options = {"continue_final_message": continue_final_message,
                   "chat_template": chat_template, "tools": tools, "documents": documents,
                   "template_kwargs": chat_template_kwargs,
                   "content_format": chat_template_content_format}
        tokenization = parse_tokenization_kwargs(tokenization_kwargs,
                                                 self.engine.processor.max_model_len,
                                                 add_special_tokens=False, generation=True)
        return self._chat_prompts(conversations, add_generation_prompt, options, tokenization)

    def _chat_prompts(self, conversations: list, add_generation_prompt: bool,
                      options: dict[str, Any],
                      tokenization: TokenizationOptions | None = None
                      ) -> tuple[list[str], list[Any]]:
        """Each conversation checked as the server's schema checks it (tool calls and their
        ids), rendered with the chat template (``options``: ``apply_chat_template``'s) and
        tokenized without special tokens (the template writes them; ``tokenization``: the
        call's ``tokenization_kwargs``), its images attached: (the rendered texts, the
        prompts for ``generate``).

        Raises:
            ValueError: see :meth:`chat`; ``tokenization_kwargs`` that cut or pad a
                conversation with images or videos.
        """
        for conversation in conversations:
            if isinstance(conversation, list):
                check_tool_calls(conversation)
                check_tool_call_ids(message_turns(conversation))
        processor, tokenizer = self.engine.processor, self.engine.tokenizer
        texts = [_render_conversation(processor, tokenizer, c, add_generation_prompt, options)
                 for c in conversations]
        prompts = []
        for text, c in zip(texts, conversations):
            images, videos = processor.load_chat_media(c)
            if tokenization is None:
                ids = tokenizer.encode(text, add_special_tokens=False)
            elif tokenization.reshapes and (images or videos):
                raise ValueError("tokenization_kwargs cannot cut or pad a conversation with "
                                 "images or videos (their placeholders are expanded after "
                                 "tokenization)")
            else:
                ids = tokenization.encode(tokenizer, text)
            prompts.append(with_images(ids, images, videos))
        return texts, prompts


def chat_conversations(messages: Any) -> list[Any]:
    """``chat``'s ``messages`` as a list of conversations: one conversation (a non-empty
    list or tuple of message dicts) or a list or tuple of them, tuples as lists (a
    conversation's messages are checked as the template renders them).

    Raises:
        ValueError: naming what ``messages`` is for anything else: a string (a prompt
            text: ``generate`` takes it, or wrap it as ``[{"role": "user", "content":
            ...}]``), a single message dict, an empty list, another type, or a list of
            conversations with an item that is not one (naming its index).
    """
    accepted = ("a conversation (a list of message dicts such as [{'role': 'user', "
                "'content': 'Hi'}]) or a list of conversations")
    if isinstance(messages, str):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"chat() messages must be {accepted}; got a string ({messages!r:.40}): pass "
            "[{'role': 'user', 'content': <the text>}], or the text to generate()")
    if isinstance(messages, dict):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
            f"chat() messages must be {accepted}; got one message dict: wrap it in a list")
    if not isinstance(messages, (list, tuple)) or not messages:
        what = "an empty list" if isinstance(messages, (list, tuple)) else \
            type(messages).__name__
        raise ValueError(f"chat() messages must be {accepted}; got {what}")
    if isinstance(messages[0], dict):
        return [list(messages)]
    conversations = [list(c) if isinstance(c, tuple) else c for c in messages]
    bad = next((i for i, c in enumerate(conversations) if not isinstance(c, list)), None)
    if bad is not None:
        raise ValueError(f"chat() messages[{bad}] must be a conversation (a list of message "
                         f"dicts) or a message dict, got {type(conversations[bad]).__name__}")
    return conversations


def _render_conversation(processor: Any, tokenizer: Any, conversation: Any,
                         add_generation_prompt: bool, options: dict[str, Any]) -> str:
    """One conversation's prompt text, rendered as ``/v1/chat/completions`` renders it under
    the server's default ``--tool-call-parser`` (hermes): a template that reads no
    ``tools`` gets their instructions in the system message, one that reads neither them
    nor ``tool_calls`` gets earlier calls as text (``kvflow.chat.tools_text``). ``options``:
    ``apply_chat_template``'s. Raises ValueError (``ChatTemplateError``) as
    :meth:`LLMChat.chat`."""
    def apply(messages: Any, tools: Any) -> str:
        return processor.apply_chat_template(messages, add_generation_prompt,
                                             **{**options, "tools": tools})

    if not isinstance(conversation, list):
        return apply(conversation, options.get("tools"))  # refused there, naming it
    check_calls_before_text(conversation)
    template = template_text(tokenizer, options.get("chat_template"),
                             tools=options.get("tools"))
    return apply_with_tools_prompt(apply, tools_as_text(
        conversation, template, options.get("tools"), HermesToolText()))
