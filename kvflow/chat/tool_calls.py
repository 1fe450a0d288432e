"""An assistant message's ``tool_calls`` and the tool messages answering them, checked the same
way for the server and ``LLM.chat``:

* the shape of a call (OpenAI's, every key needed, ``id`` non-empty): the models below are
  the server's request schema for ``messages.N.tool_calls`` (``protocol/chat.py`` uses them),
  and ``LLM.chat``, which has no schema, validates with them (:func:`check_tool_calls`);
* a tool message's ``tool_call_id`` is the ``id`` of a call of an earlier assistant message,
  as OpenAI requires (:func:`check_tool_call_ids`): a result answering no call would reach
  the template, and the model, attached to nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvflow.chat.messages import ChatTemplateError
from kvflow.utils.validation_words import error_code, field_message


class _StrictModel(BaseModel):
    """Strict types and declared keys only, as the server's ``RequestModel``."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CalledFunction(_StrictModel):
    """The function an earlier assistant turn called: ``arguments`` is text, as OpenAI returns
    it, and any text is taken, as vLLM 0.32 takes it: a reply's call may be cut or malformed
    (OpenAI warns its arguments are not always valid JSON), and the client sends that turn
    back. The chat template gets the object the text reads as, ``{}`` for text that is no
    JSON object (``chat_messages.arguments_object``). ``parsed_arguments`` is the official
    ``openai`` client's own reading of ``arguments`` (``chat.completions.parse`` and
    ``.stream`` set it, and the client sends it back with the message): any value is taken,
    and dropped before the template (``arguments`` is the call)."""

    name: str
    arguments: str
    parsed_arguments: Any = None


def is_object_text(text: str) -> bool:
    """Whether ``text`` is a JSON object's text (strict JSON, as clients parse it): a reply's
    call whose arguments are not is no call a client can run (a Responses function_call is
    ``incomplete``)."""
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class MessageToolCall(_StrictModel):
    """One call in an assistant message's ``tool_calls`` (OpenAI's shape, every key needed).
    ``index`` is the position a streamed delta gave the call, which clients that build the
    message from the stream echo back: it must equal the call's position in the list
    (checked with the conversation, kvflow/chat/messages.py) and does not reach the template.
    ``id`` is a non-empty string, as a tool message's ``tool_call_id`` must be."""

    id: str = Field(min_length=1)  # what a tool message's tool_call_id answers
    type: Literal["function"]
    function: CalledFunction
    index: int | None = Field(default=None, ge=0)


# A message's tool_calls: one call at least (OpenAI's minItems).
ToolCalls = Annotated[list[MessageToolCall], Field(min_length=1)]


class _OfflineFunction(CalledFunction):
    """``LLM.chat`` also takes ``arguments`` as an object (transformers' tool-use
    convention, which vLLM's offline chat takes too); the server takes OpenAI's JSON text."""

    arguments: str | dict[str, Any]


class _OfflineToolCall(MessageToolCall):
    function: _OfflineFunction


_OFFLINE_TOOL_CALLS: TypeAdapter[list[_OfflineToolCall]] = TypeAdapter(
    Annotated[list[_OfflineToolCall], Field(min_length=1)])


def check_tool_calls(messages: Sequence[Any]) -> None:
    """Each message's ``tool_calls`` (when set) in the server's schema (``ToolCalls``; a
    call's ``arguments`` may also be an object), for ``LLM.chat``; messages that are no
    dict are left to ``normalize_conversation``.

    Raises:
        ChatTemplateError: naming the first offending key, ``messages.N.tool_calls`` or
            ``messages.N.tool_calls.M.<key>`` (``...M.id`` for an empty id, ``...M.function
            .name`` ...), with the server's message and code for it
            (``kvflow.utils.validation_words``: ``...M.id: at least 1 character, got 0``, code
            ``string_below_min_length``).
    """
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("tool_calls") is None:
            continue
        try:
            _OFFLINE_TOOL_CALLS.validate_python(message["tool_calls"])
        except ValidationError as e:
            first = e.errors()[0]
            loc = [f"messages.{i}.tool_calls",  # without union tags (str of str | dict)
                   *(str(p) for p in first["loc"] if p != "str" and "[" not in str(p))]
            raise ChatTemplateError(field_message(loc, first), ".".join(loc),
                                    error_code(first)) from None


def check_tool_call_ids(turns: Iterable[tuple[str, Sequence[str], Any]]) -> None:
    """Each tool message's ``tool_call_id`` is the ``id`` of a call of an earlier assistant
    message (OpenAI refuses a tool message answering no call with a 400).

    Args:
        turns: per message in order, ``(role, its tool_calls' ids, its tool_call_id)``; a
            tool_call_id that is not a non-empty string is left to
            ``chat_messages.check_message_fields`` (which names it).

    Raises:
        ChatTemplateError: naming ``messages.N.tool_call_id`` (code ``invalid_value``) and
            the id, with the ids of the calls made before it.
    """
    known: list[str] = []
    for i, (role, call_ids, call_id) in enumerate(turns):
        if role == "assistant":
            known += call_ids
        elif role == "tool" and isinstance(call_id, str) and call_id and call_id not in known:
            shown = ", ".join(repr(c) for c in known[:8]) + (", ..." if len(known) > 8 else "")
            made = f"the calls made before it: {shown}" if known else \
                "no earlier assistant message has tool_calls"
            raise ChatTemplateError(f"messages.{i}.tool_call_id {call_id!r} answers no tool "
                                    f"call of an earlier assistant message ({made})",
                                    f"messages.{i}.tool_call_id")


def message_turns(messages: Sequence[Any]) -> list[tuple[str, list[str], Any]]:
    """:func:`check_tool_call_ids`'s ``turns`` of message dicts (``LLM.chat``'s, after
    :func:`check_tool_calls`); a message that is no dict counts as no turn of either kind."""
    turns = []
    for message in messages:
        if not isinstance(message, Mapping):
            turns.append(("", [], None))
            continue
        calls = message.get("tool_calls") or []
        turns.append((message.get("role"), [c["id"] for c in calls],
                      message.get("tool_call_id")))
    return turns
