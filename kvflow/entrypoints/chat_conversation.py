"""A chat request's conversation before the template renders it: the fields of its
messages checked, earlier turns' tool calls written as text for a template that cannot read
them, and the tools' instructions added to the system message."""

from __future__ import annotations

from typing import Any

from kvflow.chat_template import ChatTemplateError, check_call_index, check_message_fields
from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.protocol import ChatMessage
from kvflow.entrypoints.tool_parsers import ToolParser


def check_messages(messages: list[ChatMessage]) -> None:
    """``content`` sent unless an assistant turn calls tools (``check_message_fields``, as
    ``LLM.chat`` checks it, on the fields the client sent), ``tool_calls`` only on assistant
    turns, ``tool_call_id`` only on tool turns (a template reads them nowhere else) and on
    every tool turn (OpenAI requires it: the call the result answers), each call's ``index``
    its position (checked here too, before calls a template cannot read become text).
    Raises OpenAIError 400 naming the field otherwise."""
    for i, message in enumerate(messages):
        try:
            check_message_fields({k: getattr(message, k) for k in message.model_fields_set}, i)
        except ChatTemplateError as e:
            raise OpenAIError(str(e), param=e.param, code=e.code) from None
        if message.role == "tool" and message.tool_call_id is None:
            raise OpenAIError(f"messages.{i}.tool_call_id: a required field for tool messages "
                              "(the id of the call this result answers), not sent",
                              param=f"messages.{i}.tool_call_id",
                              code="missing_required_parameter")
        for name, role in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
            if getattr(message, name) is not None and message.role != role:
                raise OpenAIError(f"messages.{i}.{name} is for {role} messages only (this is "
                                  f"a {message.role} message)", param=f"messages.{i}.{name}",
                                  code="invalid_value")
        for j, call in enumerate(message.tool_calls or []):
            try:
                check_call_index(call.index, i, j)
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
