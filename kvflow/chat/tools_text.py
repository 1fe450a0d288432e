"""Tools and tool calls written as text for a chat template that does not read them, the same
for ``LLM.chat``, ``/v1/chat/completions`` and ``/tokenize``: the tools' instructions at the
end of the system message, earlier assistant turns' ``tool_calls`` as the text the tool parser
reads calls from (a template that fails on the added instructions gets an error saying kvflow
added them); and ``hermes``'s text (the server's default ``--tool-call-parser``, ``LLM.chat``'s
only one).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from kvflow.chat.messages import (
    ChatTemplateError,
    check_call_index,
    check_message_fields,
    object_from_text,
)
from kvflow.chat.template import NoChatTemplateError


class ToolTextFormat(Protocol):
    """What a tool parser writes for a template that reads no tools (``ToolParser``'s
    ``system_prompt`` and ``calls_text``)."""

    def system_prompt(self, tools: list[dict[str, Any]]) -> str: ...

    def calls_text(self, calls: list[dict[str, Any]]) -> str: ...


def tools_listing(tools: list[dict[str, Any]]) -> str:
    """The request's ``tools`` one JSON object a line, for a parser's ``system_prompt``."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def arguments_text(arguments: Any) -> str:
    """An earlier call's ``function.arguments`` as the text written for a template that
    reads no ``tool_calls``: text that reads as a JSON object as given, stripped (the model
    wrote it; re-encoding it would change what it sees), an object (``LLM.chat`` takes them
    so) as JSON, other text (empty, a cut or malformed call's) as ``{}``, the object the
    template path gets for it (``chat_messages.arguments_object``)."""
    if not isinstance(arguments, str):
        return json.dumps(arguments, ensure_ascii=False)
    return arguments.strip() if object_from_text(arguments) is not None else "{}"


def call_json(call: dict[str, Any], args_key: str) -> str:
    """``{"name": ..., "<args_key>": ...}`` with the arguments as :func:`arguments_text`."""
    function = call["function"]
    return (f'{{"name": {json.dumps(function["name"], ensure_ascii=False)}, '
            f'"{args_key}": {arguments_text(function["arguments"])}}}')


class HermesToolText:
    """``hermes``'s text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (Hermes 2/3, Qwen2.5, Qwen3, SmolLM2 prompts)."""

    START, END = "<tool_call>", "</tool_call>"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return ("You may call one or more functions to assist with the user query. The "
                f"functions are:\n<tools>\n{tools_listing(tools)}\n</tools>\nFor each function "
                "call, return a JSON object with the function name and arguments within "
                '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
                '"arguments": <args-json-object>}\n</tool_call>')

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.START}\n{call_json(c, 'arguments')}\n{self.END}"
                         for c in calls)


class ToolsAsText(NamedTuple):
    """A conversation ready for its template (:func:`tools_as_text`): ``conversation`` to
    render, ``tools`` for the template's ``tools`` variable (None once written as text), and
    ``before_tools``, the conversation before the tools' instructions were written into it
    (None: they were not), for :func:`apply_with_tools_prompt`."""

    conversation: list[Any]
    tools: list[dict[str, Any]] | None
    before_tools: list[Any] | None


def tools_as_text(conversation: list[Any], template: str, tools: list[dict[str, Any]] | None,
                  fmt: ToolTextFormat, instructions: bool = True) -> ToolsAsText:
    """``conversation`` and ``tools`` for ``template`` (the Jinja text that renders them): a
    template that mentions neither ``tools`` nor ``tool_calls`` gets the assistant turns'
    calls as ``fmt``'s text; one that does not mention ``tools`` gets ``fmt``'s instructions
    for them as (the end of) the system message instead of the variable, unless
    ``instructions`` is False (tool_choice none: they would ask for calls the request forbids),
    where it sees no tools at all. Messages that are no dict are left as they are (the
    renderer refuses them)."""
    if "tools" not in template and "tool_calls" not in template:
        conversation = with_calls_as_text(conversation, fmt)
    if not tools or "tools" in template:
        return ToolsAsText(conversation, tools, None)
    if not instructions:
        return ToolsAsText(conversation, None, None)
    return ToolsAsText(with_system_prompt(conversation, fmt.system_prompt(tools)), None,
                       conversation)


def check_calls_before_text(conversation: list[Any]) -> None:
    """The renderer's checks of the messages that :func:`with_calls_as_text` changes (those
    with ``tool_calls``: their fields by role, each call's ``index``), run before it drops
    their calls (``LLM.chat``; the server checks every message first, ``check_messages``):
    a user message with ``tool_calls`` is refused, not rendered with the calls as text.
    Raises ChatTemplateError naming the field."""
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not message.get("tool_calls"):
            continue
        check_message_fields(message, i)
        calls = message["tool_calls"]
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            if isinstance(call, Mapping):
                check_call_index(call.get("index"), i, j)


def with_calls_as_text(conversation: list[Any], fmt: ToolTextFormat) -> list[Any]:
    """Each assistant turn's ``tool_calls`` appended to its content as ``fmt``'s text
    (on a line of its own after any text; a new text part for content given as parts)."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if not calls:
            out.append(message)
            continue
        text, content = fmt.calls_text(calls), message.get("content")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": text}]
        else:
            content = f"{content}\n{text}" if content else text
        out.append({k: v for k, v in message.items() if k != "tool_calls"} |
                   {"content": content})
    return out


def with_system_prompt(conversation: list[Any], prompt: str) -> list[Any]:
    """``prompt`` as the system message, after the conversation's own system text if any
    (a blank line between; content given as parts gets it as one more text part, which the
    parts' newline join renders the same)."""
    first = conversation[0] if conversation else None
    if isinstance(first, Mapping) and first.get("role") == "system":
        content = first.get("content")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": f"\n{prompt}"}]
        else:
            content = f"{content or ''}\n\n{prompt}".strip()
        return [{**first, "content": content}, *conversation[1:]]
    return [{"role": "system", "content": prompt}, *conversation]


_RENDER_FAILED = "the chat template cannot render these messages: "  # chat_template.py's words


def tools_prompt_error(error: ChatTemplateError, before: list[Any]) -> ChatTemplateError:
    """The error for a template that fails on the tools' instructions
    ``with_system_prompt`` wrote into ``before`` (the conversation as the client sent it,
    which the template renders): a system message kvflow added, or the end of the client's
    own. ``error`` is the template's failure, kept in the text; param ``tools`` (the field
    that brought the message in), code ``invalid_value``."""
    first = before[0] if before else None
    which = "the end of message 0 (the system message)" \
        if isinstance(first, Mapping) and first.get("role") == "system" \
        else "message 0 (a system message)"
    failure = str(error).removeprefix(_RENDER_FAILED)
    return ChatTemplateError(
        f"the chat template cannot render {which} that kvflow added for tools: this template "
        "does not read tools, so kvflow writes their instructions into the system message, "
        f"and the template fails on it ({failure}); send the request without tools, or use a "
        "chat template that reads tools", "tools")


def apply_with_tools_prompt(apply: Callable[[list[Any], Any], str], prepared: ToolsAsText
                            ) -> str:
    """``apply(conversation, tools)`` of ``prepared`` (:func:`tools_as_text`), the template's
    prompt text. When the template fails and kvflow wrote the tools' instructions into the
    conversation, the conversation before that is rendered too (``apply(before_tools,
    None)``), to tell whether that text is what the template fails on.

    Raises:
        NoChatTemplateError: from ``apply``.
        ChatTemplateError: from ``apply``; :func:`tools_prompt_error` (param ``tools``) when
            the template fails on the conversation but renders ``before_tools``.
    """
    try:
        return apply(prepared.conversation, prepared.tools)
    except NoChatTemplateError:
        raise
    except ChatTemplateError as e:
        if prepared.before_tools is None or e.param not in ("messages", "chat_template"):
            raise
        try:
            apply(prepared.before_tools, None)
        except ChatTemplateError:
            raise e from None  # the client's messages fail too: their error
        raise tools_prompt_error(e, prepared.before_tools) from None
