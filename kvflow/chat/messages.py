"""A conversation's messages checked and normalized as a chat template sees them.

Messages are normalized as OpenAI clients send them and as vLLM renders them ("string" content
format); rendering them is ``template.py``'s job:

* ``content`` must be sent, except on an assistant turn that calls tools, and a tool turn
  needs ``tool_call_id``, a non-empty string (OpenAI's rules, ``check_message_fields``);
  null (an assistant turn that only calls tools, or any empty turn) becomes ``""``;
* a list of content parts becomes the ``"\\n"``-joined text of its ``text`` parts (``refusal``
  parts of assistant turns count as text, and so do the Responses API's ``input_text`` /
  ``output_text`` parts, their ``text``, as vLLM takes them); ``image_url`` parts, for a
  model that takes images (the caller passes its ``image_placeholder``), become that
  placeholder text, one line per image before the text (``detail`` other than ``"auto"``
  is refused), and ``video_url`` parts likewise (``video_placeholder``); any other part is
  refused. A template that loops over a message's content itself (Qwen2-VL's, llava-hf's;
  found by ``chat_template.loops_over_content``) gets the parts instead (``content_parts``,
  vLLM's "openai" content format), images as ``{"type": "image"}`` and videos as
  ``{"type": "video"}``, so it places them as the model was trained; a string content is
  then one text part and null none (llava-hf's templates print only the text parts), and a
  tool message's text parts stay one ``"\\n"``-joined string (as vLLM gives them: most
  templates print a tool result as it is); ``image_urls`` / ``video_urls`` list the images /
  videos in prompt order either way;
* an assistant's ``tool_calls[].function.arguments`` given as JSON text (OpenAI's form) is
  parsed into an object, as templates that write ``arguments | tojson`` expect; text that
  is no JSON object (a cut or malformed call) becomes ``{}`` (``arguments_object``);
* an assistant's reasoning, sent as ``reasoning`` (vLLM 0.32's name) or ``reasoning_content``
  (its deprecated one; ``reasoning`` wins when both are set, as vLLM renames only an unset
  one), reaches the template under both names, as vLLM gives it: Qwen3's and
  DeepSeek-R1's templates read ``reasoning_content``, newer ones ``reasoning``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.utils.text_checks import find_lone_surrogate

__all__ = ["ROLES", "ChatTemplateError", "arguments_object", "check_call_index",
           "check_message_fields", "developer_as_system", "image_urls", "normalize_conversation",
           "object_from_text", "video_urls"]

# The roles a message may have: OpenAI's chat roles and the older "function" (the server's
# ChatMessage schema lists the same ones; LLM.chat checks them here)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Text part types -> the key holding their text: OpenAI's chat parts, and the Responses API's
# input_text / output_text, which vLLM's chat takes as text parts too (clients reuse them)
_TEXT_PARTS = {"text": "text", "refusal": "refusal", "input_text": "text",
               "output_text": "text"}
_IMAGE_PARTS = {"image_url", "video_url"}  # media parts: a URL and a placeholder
_TEMPLATE_TYPES = {"image_url": "image", "video_url": "video"}


class ChatTemplateError(ValueError):
    """A conversation or option that cannot be rendered; ``param`` names the field at fault
    (``messages.2.content``, ``continue_final_message``, ...), ``code`` the OpenAI error code
    the server answers with."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def normalize_conversation(messages: Sequence[Any], image_placeholder: str | None = None,
                           content_parts: bool = False, video_placeholder: str | None = None
                           ) -> list[dict[str, Any]]:
    """Messages as the template sees them (see the module docstring); inputs are not changed.

    Args:
        messages: OpenAI-style message dicts.
        image_placeholder: the text standing for one image (None: images are refused).
        content_parts: give content as a list of parts (for templates that loop over them;
            a tool message's text as one string), as vLLM's "openai" content format.
        video_placeholder: the text standing for one video (None: videos are refused).

    Raises:
        ChatTemplateError: for an empty list, a message that is not a dict with a string
            ``role`` or whose role is not one of ``ROLES``, an unsupported content part (any image when ``image_placeholder`` is
            None), or text with a lone surrogate.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("a conversation must be a non-empty list of messages",
                                "messages")
    found = find_lone_surrogate(list(messages), "messages")
    if found is not None:
        raise ChatTemplateError(f"{found[0]} {found[1]}", found[0])
    placeholders = {kind: text for kind, text in (("image_url", image_placeholder),
                                                  ("video_url", video_placeholder))
                    if text is not None}
    return [_normalize_message(m, i, placeholders, content_parts)
            for i, m in enumerate(messages)]


def developer_as_system(conversation: list[dict[str, Any]],
                        template: Any) -> list[dict[str, Any]]:
    """The conversation as vLLM renders it for a template that has no ``developer`` role
    (its text never names ``"developer"`` or ``'developer'``, vLLM's test): every developer
    message becomes a system message, and when that leaves a system message anywhere but
    first (or several), all system messages are merged into one at the front, their texts
    (a list content's text parts joined with ``"\\n"``; empty ones left out) joined with
    ``"\\n\\n"`` (vLLM's ``_convert_developer_to_system`` and
    ``_consolidate_system_messages``). Unchanged without a developer message, or for a
    template that names the role. Inputs are not changed."""
    if not any(m["role"] == "developer" for m in conversation) or \
            any(f"{q}developer{q}" in str(template) for q in "\"'"):
        return conversation
    converted = [{**m, "role": "system"} if m["role"] == "developer" else m
                 for m in conversation]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0]:
        return converted
    texts = [_text_of(converted[i]["content"]) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(t for t in texts if t)}
    return [merged, *(m for m in converted if m["role"] != "system")]


def _text_of(content: Any) -> str:
    """A normalized message content as text: a list of parts' text parts joined with
    ``"\\n"`` (media parts carry none)."""
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
    return content or ""


def image_urls(messages: Sequence[Any], kind: str = "image_url") -> list[tuple[str, Any]]:
    """``(field path, url)`` of every ``image_url`` part (``kind`` parts), in prompt order
    (messages in order, parts in order). Call after ``normalize_conversation`` accepted the
    messages."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") == kind:
                media = part.get(kind)
                url = media.get("url") if isinstance(media, dict) else media
                out.append((f"messages.{i}.content.{j}.{kind}", url))
    return out


def video_urls(messages: Sequence[Any]) -> list[tuple[str, Any]]:
    """``(field path, url)`` of every ``video_url`` part, in prompt order."""
    return image_urls(messages, "video_url")


def _normalize_message(message: Any, i: int, placeholders: dict[str, str],
                       content_parts: bool) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"message {i} must be a dict with a string 'role'",
                                f"messages.{i}")
    if message["role"] not in ROLES:
        raise ChatTemplateError(f"messages.{i}.role={message['role']!r} is not a chat role: "
                                f"one of {', '.join(ROLES)}", f"messages.{i}.role")
    check_message_fields(message, i)
    out = dict(message)
    content = message.get("content")
    out["content"] = _content_as_parts(message["role"], content, i, placeholders) \
        if content_parts else _content_text(content, i, placeholders)
    if isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_parsed_arguments(_without_index(c, i, j))
                             for j, c in enumerate(message["tool_calls"])]
    if message["role"] == "assistant":
        out.update(_reasoning_keys(message))
    return out


def _reasoning_keys(message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant message's reasoning under both its names (``reasoning``, else the
    deprecated ``reasoning_content``; vLLM 0.32's renaming), or {} when it sent none."""
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    return {} if reasoning is None else {"reasoning": reasoning, "reasoning_content": reasoning}


def check_message_fields(message: Mapping[str, Any], i: int) -> None:
    """OpenAI's per-role rules for message ``i``'s fields, the same for ``LLM.chat`` and the
    server (which passes the fields its client sent): ``content`` is sent on every message
    (null counts: it renders as empty text) except an assistant message calling tools
    (``tool_calls``, or the older ``function_call``); a tool message has ``tool_call_id``, a
    non-empty string (the call its result answers); ``tool_calls`` is on assistant messages only and
    ``tool_call_id`` on tool messages only (a template reads them nowhere else).

    Args:
        message: the message's keys as sent (a None value counts as sent for ``content``,
            as unset for the others), ``role`` a string.
        i: the message's position in the conversation.

    Raises:
        ChatTemplateError: naming ``messages.<i>.content`` or ``messages.<i>.tool_call_id``
            when missing (code ``missing_required_parameter``), a tool message's
            ``messages.<i>.tool_call_id`` that is ``""`` (code ``empty_string``) or no string
            (``invalid_type``), or ``messages.<i>.tool_calls`` / ``messages.<i>.tool_call_id``
            on another role (code ``invalid_value``).
    """
    role = message.get("role")
    calls = bool(message.get("tool_calls")) or message.get("function_call") is not None
    if "content" not in message and not (role == "assistant" and calls):
        need = "assistant messages without tool_calls" if role == "assistant" else \
            f"{role} messages"
        raise ChatTemplateError(f"messages.{i}.content: a required field for {need} (null "
                                "for no text), not sent", f"messages.{i}.content",
                                "missing_required_parameter")
    if role == "tool":
        _check_tool_call_id(message, i)
    for name, owner in (("tool_calls", "assistant"), ("tool_call_id", "tool")):
        if message.get(name) is not None and role != owner:
            raise ChatTemplateError(f"messages.{i}.{name} is for {owner} messages only (this "
                                    f"is a {role} message)", f"messages.{i}.{name}")


def _check_tool_call_id(message: Mapping[str, Any], i: int) -> None:
    """A tool message's ``tool_call_id`` is a non-empty string: the id of the call its result
    answers (an empty one answers no call; the server's schema has made it a string already).

    Raises:
        ChatTemplateError: naming ``messages.<i>.tool_call_id``: code
            ``missing_required_parameter`` when not sent or null, ``empty_string`` for ``""``,
            ``invalid_type`` for a value that is no string.
    """
    call_id = message.get("tool_call_id")
    param = f"messages.{i}.tool_call_id"
    if call_id is None:
        how = "sent as null" if "tool_call_id" in message else "not sent"
        raise ChatTemplateError(f"{param}: a required field for tool messages (the id of the "
                                f"call this result answers), {how}", param,
                                "missing_required_parameter")
    if not isinstance(call_id, str) or not call_id:
        raise ChatTemplateError(f"{param} must be a non-empty string (the id of the call this "
                                f"result answers), got {call_id!r}", param,
                                "empty_string" if call_id == "" else "invalid_type")


def _without_index(call: Any, i: int, j: int) -> Any:
    """Tool call ``j`` of message ``i`` without its ``index`` key (see
    :func:`check_call_index`).

    Raises:
        ChatTemplateError: if ``index`` is given and is not ``j``.
    """
    if not isinstance(call, dict) or "index" not in call:
        return call
    check_call_index(call["index"], i, j)
    return {k: v for k, v in call.items() if k != "index"}


def check_call_index(index: Any, i: int, j: int) -> None:
    """A tool call's ``index``, the position a streamed delta gave the call (clients echo it
    back), must be ``j``, its position in message ``i``'s ``tool_calls`` (or absent: None).

    Raises:
        ChatTemplateError: naming ``messages.i.tool_calls.j.index`` otherwise.
    """
    if index is not None and index != j:
        raise ChatTemplateError(f"message {i}: tool call {j} has index {index}; a call's "
                                "index is its position in tool_calls",
                                f"messages.{i}.tool_calls.{j}.index")


def _content_text(content: Any, i: int, placeholders: dict[str, str]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatTemplateError(f"message {i}: content must be a string, a list of content "
                                "parts or null", f"messages.{i}.content")
    images, texts = [], []
    for j, part in enumerate(content):
        kind, text = _part(part, i, j, placeholders)
        (images if kind in _IMAGE_PARTS else texts).append(text)
    return "\n".join(images + texts)


def _content_as_parts(role: str, content: Any, i: int,
                      placeholders: dict[str, str]) -> str | list[dict]:
    """Message ``i``'s content in vLLM's "openai" format: a list of parts (a string is one
    text part, null none), except a tool message's text, which stays one string (its text
    parts ``"\\n"``-joined). Raises ChatTemplateError for a bad content or part."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif content is None:
        content = []
    elif not isinstance(content, list):
        return _content_text(content, i, placeholders)  # raises: no content of any form
    parts = _content_parts(content, i, placeholders)
    if role == "tool" and all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _content_parts(content: list, i: int, placeholders: dict[str, str]) -> list[dict]:
    parts = []
    for j, part in enumerate(content):
        kind, text = _part(part, i, j, placeholders)
        parts.append({"type": _TEMPLATE_TYPES[kind]} if kind in _IMAGE_PARTS else
                     {"type": "text", "text": text})
    return parts


def _part(part: Any, i: int, j: int, placeholders: dict[str, str]) -> tuple[str, str]:
    """(type, text) of one content part; an image's (video's) text is its placeholder
    (``placeholders``: part type -> text, for the media parts the model takes). A part holds
    ``type`` and its type's payload only (another non-null key would go unread: a
    ChatTemplateError naming it, as the HTTP schema refuses it). A plain string is a text
    part (vLLM's chat parser takes it so)."""
    if isinstance(part, str):
        return "text", part
    kind = part.get("type") if isinstance(part, dict) else None
    key = _TEXT_PARTS.get(kind, kind) if isinstance(kind, str) else None
    other = next((k for k, v in part.items() if k not in ("type", key) and v is not None),
                 None) if isinstance(kind, str) else None
    if other is not None and (kind in _TEXT_PARTS or kind in _IMAGE_PARTS):
        raise ChatTemplateError(f"message {i}: content part {j} of type {kind!r} carries "
                                f"{key} only, not {other!r}",
                                f"messages.{i}.content.{j}.{other}", "unknown_parameter")
    if kind in placeholders:
        image = part.get(kind)
        if not isinstance(image.get("url") if isinstance(image, dict) else image, str):
            raise ChatTemplateError(f"message {i}: content part {j} needs {kind}.url",
                                    f"messages.{i}.content.{j}.{kind}")
        detail = image.get("detail") if isinstance(image, dict) else None
        if detail not in (None, "auto"):  # honoured or refused, never ignored
            raise ChatTemplateError(f"{kind}.detail={detail!r} is not supported: the "
                                    "model's image processor chooses the resolution (use "
                                    "'auto' or leave it out)",
                                    f"messages.{i}.content.{j}.{kind}.detail",
                                    "unsupported_value")
        return kind, placeholders[kind]
    text = part.get(key) if kind in _TEXT_PARTS else None
    if kind in _TEXT_PARTS and not isinstance(text, str):
        raise ChatTemplateError(f"message {i}: content part {j} of type {kind!r} needs "
                                f"{key} (a string)", f"messages.{i}.content.{j}.{key}")
    if not isinstance(text, str):
        what = " and ".join(["text", *placeholders]) if placeholders else \
            "text only: this model does not take images or videos"
        raise ChatTemplateError(f"message {i}: content part {j} of type {kind!r} is not "
                                f"supported ({what})", f"messages.{i}.content.{j}")
    return kind, text


def object_from_text(text: str) -> dict[str, Any] | None:
    """The JSON object ``text`` reads as, control characters such as raw newlines allowed
    inside its strings (models write them; ``json.loads(strict=False)``); None for text that
    is no JSON object's (empty, malformed, a cut call's, JSON that is no object)."""
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def arguments_object(arguments: Any) -> Any:
    """An earlier call's ``function.arguments`` as the object a chat template gets: an object
    as it is; text as the object it reads as (:func:`object_from_text`), else ``{}`` (a cut
    or malformed call a reply returned, as vLLM 0.32 coerces it, so the conversation can go
    on); any other type as it is (the schema refuses it before)."""
    if not isinstance(arguments, str):
        return arguments
    value = object_from_text(arguments)
    return {} if value is None else value


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose ``function.arguments`` text is the template's object
    (:func:`arguments_object`; left alone otherwise), without the ``openai`` client's
    ``parsed_arguments`` (its own reading of the same text: ``chat_tool_calls
    .CalledFunction``)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    function = {k: v for k, v in function.items() if k != "parsed_arguments"}
    if isinstance(function.get("arguments"), str):
        function["arguments"] = arguments_object(function["arguments"])
    return {**call, "function": function}
