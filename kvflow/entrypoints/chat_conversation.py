"""A chat request's conversation before the template renders it: the fields of its
messages checked, earlier turns' tool calls written as text for a template that cannot read
them, and the tools' instructions added to the system message (a template that fails on
that message gets an error saying kvflow added it); and the 400 for a model without a
template."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvflow.chat_messages import ChatTemplateError, check_call_index, check_message_fields
from kvflow.chat_template import NoChatTemplateError
from kvflow.chat_tool_calls import check_tool_call_ids
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatMessage
from kvflow.entrypoints.tool_parsers import ToolParser


def check_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's per-role rules (``content`` sent unless an assistant turn calls tools,
    ``tool_call_id`` on every tool turn and only there, ``tool_calls`` only on assistant
    turns: ``chat_messages.check_message_fields``, the check ``LLM.chat`` runs, here on the
    fields the client sent) and each call's ``index`` its position (checked here too, before
    calls a template cannot read become text), and each tool turn's ``tool_call_id`` the id
    of an earlier assistant turn's call (``chat_tool_calls.check_tool_call_ids``, as
    ``LLM.chat``). Raises OpenAIError 400 naming the field otherwise."""
    try:
        for i, message in enumerate(messages):
            check_message_fields({k: getattr(message, k) for k in message.model_fields_set}, i)
            for j, call in enumerate(message.tool_calls or []):
                check_call_index(call.index, i, j)
        check_tool_call_ids((m.role, [c.id for c in m.tool_calls or ()], m.tool_call_id)
                            for m in messages)
    except ChatTemplateError as e:
        raise OpenAIError(str(e), param=e.param, code=e.code) from None


def with_calls_as_text(conversation: list[dict[str, Any]], parser: ToolParser
                        ) -> list[dict[str, Any]]:
    """Each assistant turn's ``tool_calls`` appended to its content as ``parser``'s text
    (on a line of its own after any text; a new text part for content given as parts)."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        text, content = parser.calls_text(calls), message.get("content")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": text}]
        else:
            content = f"{content}\n{text}" if content else text
        out.append({k: v for k, v in message.items() if k != "tool_calls"} |
                   {"content": content})
    return out


def with_system_prompt(conversation: list[dict[str, Any]], prompt: str
                        ) -> list[dict[str, Any]]:
    """``prompt`` as the system message, after the conversation's own system text if any
    (a blank line between; content given as parts gets it as one more text part, which the
    parts' newline join renders the same)."""
    if conversation and conversation[0].get("role") == "system":
        content = conversation[0].get("content")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": f"\n{prompt}"}]
        else:
            content = f"{content or ''}\n\n{prompt}".strip()
        return [{**conversation[0], "content": content}, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]


_RENDER_FAILED = "the chat template cannot render these messages: "  # chat_template.py's words


def tools_prompt_error(error: ChatTemplateError, before: list[dict[str, Any]]
                       ) -> ChatTemplateError:
    """The error for a template that fails on the tools' instructions
    ``with_system_prompt`` wrote into ``before`` (the conversation as the client sent it,
    which the template renders): a system message kvflow added, or the end of the client's
    own. ``error`` is the template's failure, kept in the text; param ``tools`` (the field
    that brought the message in), code ``invalid_value``."""
    which = "the end of message 0 (the system message)" \
        if before and before[0].get("role") == "system" else "message 0 (a system message)"
    failure = str(error).removeprefix(_RENDER_FAILED)
    return ChatTemplateError(
        f"the chat template cannot render {which} that kvflow added for tools: this template "
        "does not read tools, so kvflow writes their instructions into the system message, "
        f"and the template fails on it ({failure}); send the request without tools, or use a "
        "chat template that reads tools", "tools")


def apply_with_tools_prompt(apply: Callable[[list[dict[str, Any]], Any], str],
                            conversation: list[dict[str, Any]], tools: Any,
                            before_tools: list[dict[str, Any]] | None) -> str:
    """``apply(conversation, tools)``, the template's prompt text. ``before_tools``: the
    conversation before ``with_system_prompt`` wrote the tools' instructions into it (None:
    it did not); when the template fails, it is rendered too (``apply(before_tools,
    None)``), to tell whether that text is what the template fails on.

    Raises:
        NoChatTemplateError: from ``apply``.
        ChatTemplateError: from ``apply``; :func:`tools_prompt_error` (param ``tools``) when
            the template fails on the conversation but renders ``before_tools``.
    """
    try:
        return apply(conversation, tools)
    except NoChatTemplateError:
        raise
    except ChatTemplateError as e:
        if before_tools is None or e.param not in ("messages", "chat_template"):
            raise
        try:
            apply(before_tools, None)
        except ChatTemplateError:
            raise e from None  # the client's messages fail too: their error
        raise tools_prompt_error(e, before_tools) from None


def no_template_error(task: str, request_templates: bool) -> OpenAIError:
    """The 400 (param ``messages``, code ``no_chat_template``) for a conversation on a model
    without a chat template, saying what this server takes instead: a request's
    ``chat_template`` when it trusts them (``request_templates``), else ``--chat-template``,
    or the plain-text routes of the server's ``task`` (a pooling server's inputs, else
    /v1/completions)."""
    plain = {"generate": "use /v1/completions with a plain prompt",
             "embed": "send the text as /tokenize's prompt or /v1/embeddings' (/pooling's) "
                      "input"}.get(task, "send the text as /tokenize's prompt or /pooling's "
                                         "input")
    how = "send one in the request's chat_template field" if request_templates else \
        "the server needs one (kvflow serve --chat-template FILE)"
    return OpenAIError(f"this model has no chat template: {how}, or {plain}",
                       param="messages", code="no_chat_template")
