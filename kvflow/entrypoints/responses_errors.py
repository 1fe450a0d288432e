"""A chat-side error of a /v1/responses request, named as the Responses request names its
field: the chat path (``OpenAIServingChat.start``) checks the ``ChatCompletionRequest`` that
``responses_input`` built, so its ``param`` is a chat field (``max_completion_tokens``,
``messages.3.tool_call_id``, ``tools.0.function.parameters``); ``renamed_error`` gives the
same error at the Responses field (``max_output_tokens``, ``input.2.call_id``,
``tools.0.parameters``), in its ``param`` and in its message."""

from __future__ import annotations

import re

from kvflow.entrypoints.openai_errors import OpenAIError
from kvflow.entrypoints.responses_input import Conversation

# chat request fields -> the Responses fields they came from (for errors found by chat)
_RENAMED = {"logprobs": "include", "max_completion_tokens": "max_output_tokens",
            "max_tokens": "max_output_tokens",
            "response_format.json_schema": "text.format", "response_format": "text.format",
            "tool_choice.function": "tool_choice", "messages": "input",
            "reasoning_effort": "reasoning.effort", "truncate_prompt_tokens": "truncation"}
# the chat fields a Responses request cannot have: wherever a message names one, it means
# the Responses field it came from (longest first)
_CHAT_ONLY = ("max_completion_tokens", "max_tokens", "response_format.json_schema",
              "response_format")
# a chat tool call's fields -> the function_call item's
_CALL_KEYS = {"id": "call_id", "function.name": "name", "function.arguments": "arguments"}


def renamed_error(error: OpenAIError, conv: Conversation) -> OpenAIError:
    """``error`` (found by the chat path) naming the Responses request's field, in its
    ``param`` and where its message names the chat field."""
    param = renamed(error.param, conv)
    message = str(error).replace(error.param, param) if error.param else str(error)
    for chat_name in _CHAT_ONLY:  # named in the message beside another param
        message = re.sub(rf"\b{re.escape(chat_name)}\b", _RENAMED[chat_name], message)
    if param == error.param and message == str(error):
        return error
    return OpenAIError(message, error.status, error.type, param, error.code, error.headers)


def renamed(param: str | None, conv: Conversation) -> str | None:
    """A chat request field's name as the Responses request's (``max_completion_tokens`` ->
    ``max_output_tokens``, ``tools.0.function.parameters`` -> ``tools.0.parameters``,
    ``messages.3.tool_call_id`` -> ``input.2.call_id``)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages" and rest:
        return _message_path(rest, conv)
    for chat_name, name in _RENAMED.items():
        if param == chat_name or param.startswith(chat_name + "."):
            return name + param[len(chat_name):]
    parts = param.split(".")
    if head == "tools" and parts[2:3] == ["function"]:
        return ".".join(parts[:2] + parts[3:])
    return param


def _message_path(rest: str, conv: Conversation) -> str:
    """``messages.<rest>`` as the path of the input item the message came from (the item
    itself for a message of several items' calls, ``instructions``, or an earlier reply)."""
    index, _, key = rest.partition(".")
    if not index.isdigit() or int(index) >= len(conv.paths):
        return "input"
    path = conv.paths[int(index)]
    first, _, deeper = key.partition(".")
    if first == "tool_calls":
        return _call_path(conv.call_paths.get(int(index), []), deeper) or path
    if not first or not path.startswith("input."):
        return path
    return ".".join(p for p in (path, {"tool_call_id": "call_id"}.get(first, first), deeper)
                    if p)


def _call_path(call_paths: list[str], key: str) -> str | None:
    """``tool_calls.<key>`` of a message as its function_call item's path (``0.function.
    arguments`` -> ``input.3.arguments``; a call of a stored turn: ``previous_response_id``);
    None when the call came from no input item."""
    index, _, rest = key.partition(".")
    if not index.isdigit() or int(index) >= len(call_paths):
        return None
    path = call_paths[int(index)]
    if not path.startswith("input."):
        return path
    return ".".join(p for p in (path, _CALL_KEYS.get(rest, "")) if p)
