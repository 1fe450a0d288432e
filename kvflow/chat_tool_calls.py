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

from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvflow.chat_messages import ChatTemplateError


class _StrictModel(BaseModel):
    """Strict types and declared keys only, as the server's ``RequestModel``."""

    model_config = ConfigDict(extra="forbid", strict=True)


class CalledFunction(_StrictModel):
    """The function an earlier assistant turn called: ``arguments`` is JSON text, as OpenAI
    returns it (parsed into an object for the chat template, see kvflow/chat_messages.py)."""

    name: str
    arguments: str


class MessageToolCall(_StrictModel):
    """One call in an assistant message's ``tool_calls`` (OpenAI's shape, every key needed).
    ``index`` is the position a streamed delta gave the call, which clients that build the
    message from the stream echo back: it must equal the call's position in the list
    (checked with the conversation, kvflow/chat_messages.py) and does not reach the template.
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

# pydantic error type -> the server's OpenAI error code for it (validation_errors._error_code,
# for the types these models can raise)
_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
          "string_too_short": "string_below_min_length", "too_short": "empty_array",
          "greater_than_equal": "integer_below_min_value"}


def check_tool_calls(messages: Sequence[Any]) -> None:
    """Each message's ``tool_calls`` (when set) in the server's schema (``ToolCalls``; a
    call's ``arguments`` may also be an object), for ``LLM.chat``; messages that are no
    dict are left to ``normalize_conversation``.

    Raises:
        ChatTemplateError: naming the first offending key, ``messages.N.tool_calls`` or
            ``messages.N.tool_calls.M.<key>`` (``...M.id`` for an empty id, ``...M.function
            .name`` ...), with the server's code for it (``string_below_min_length``,
            ``missing_required_parameter``, ``unknown_parameter``, ``invalid_type``, ...).
    """
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("tool_calls") is None:
            continue
        try:
            _OFFLINE_TOOL_CALLS.validate_python(message["tool_calls"])
        except ValidationError as e:
            first = e.errors()[0]
            loc = [p for p in first["loc"] if p != "str" and "[" not in str(p)]  # no union tag
            param = ".".join(str(part) for part in (f"messages.{i}.tool_calls", *loc))
            kind = first["type"]
            code = _CODES.get(kind) or ("invalid_type" if kind.endswith("_type")
                                        else "invalid_value")
            why = "a required field, not sent" if kind == "missing" else \
                f"{first['msg']}, got {first['input']!r}"
            raise ChatTemplateError(f"{param}: {why}", param, code) from None


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
