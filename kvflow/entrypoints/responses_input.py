"""A Responses API request's ``input``, ``tools``, ``tool_choice`` and ``text.format`` in the
chat endpoint's terms, so that /v1/responses renders, samples, constrains and parses exactly
as /v1/chat/completions does. Every item is checked here: a bad one is a
``RequestFieldError`` whose ``param`` is its path in the Responses request
(``input.2.content.0.type``).

Input items -> chat messages:
- a message (``type`` ``message`` or absent; ``role`` user / system / developer / assistant;
  ``content`` a string or ``input_text`` / ``output_text`` parts) -> that message, its parts
  as text parts;
- ``function_call`` (``call_id``, ``name``, ``arguments``) -> a tool call of an assistant turn
  (consecutive calls, and calls right after an assistant message, share one turn);
- ``function_call_output`` (``call_id``, ``output``: a string or text parts) -> a ``tool``
  message;
- ``reasoning`` -> not rendered (chat templates drop earlier turns' reasoning too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.entrypoints.protocol.chat import MAX_CONTENT_PARTS, MAX_TOOLS
from kvflow.entrypoints.responses_events import new_id
from kvflow.entrypoints.structured_requests import RequestFieldError

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# keys an item may carry besides the ones read (OpenAI's ids and statuses of earlier output)
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"},
              "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"}}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


@dataclass
class Conversation:
    """Chat messages (dicts as ``ChatMessage`` takes them) and, per message, the request path
    it came from (``input.3``, ``instructions``) and the paths of its tool calls' items (by
    message index; one per call, ``previous_response_id`` for a stored turn's own), for
    naming a chat-side error's field. Messages may be a stored reply's own dicts: replace,
    never change them."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    call_paths: dict[int, list[str]] = field(default_factory=dict)

    def add(self, message: dict[str, Any], path: str) -> None:
        self.messages.append(message)
        self.paths.append(path)


def chat_messages(input_: str | list[dict[str, Any]], instructions: str | None,
                  earlier: list[dict[str, Any]] = ()) -> Conversation:
    """The conversation: ``instructions`` as a system message first, the ``earlier`` turns
    (a stored response's, for ``previous_response_id``), then the ``input`` items.

    Raises:
        RequestFieldError: naming the item's field (``input.1.role``, ``input.0.content.2.type``,
            ``input.4.call_id``) for an item kvflow cannot read; ``input`` for an empty
            string (``empty_string``) or list (``empty_array``), or more than chat's
            ``MAX_CONTENT_PARTS`` items (``array_above_max_length``).
    """
    conv = Conversation()
    if instructions is not None:
        conv.add({"role": "system", "content": instructions}, "instructions")
    for message in earlier:
        conv.add(message, "previous_response_id")
    if input_ == "":  # OpenAI's answer (and code) for an empty string or list
        raise RequestFieldError("Invalid 'input': empty string. Expected a string with "
                                "minimum length 1, but got an empty string instead.", "input",
                                "empty_string")
    if isinstance(input_, str):
        conv.add({"role": "user", "content": input_}, "input")
        return conv
    if not input_:
        raise RequestFieldError("Invalid 'input': empty array. Expected an array with "
                                "minimum length 1, but got an empty array instead.", "input",
                                "empty_array")
    if len(input_) > MAX_CONTENT_PARTS:  # chat's cap, before any item is read on the loop
        raise RequestFieldError(f"input holds at most {MAX_CONTENT_PARTS} items; this one "
                                f"holds {len(input_)}", "input", "array_above_max_length")
    for i, item in enumerate(input_):
        _add_item(conv, item, f"input.{i}")
    return conv


def _add_item(conv: Conversation, item: Any, path: str) -> None:
    if not isinstance(item, dict):
        raise RequestFieldError(f"{path} must be an object", path, "invalid_type")
    kind = item.get("type", "message")
    if kind not in _ITEM_KEYS:
        raise RequestFieldError(f"input items of type {kind!r} are not supported by kvflow "
                                f"(it reads {', '.join(_ITEM_KEYS)})", f"{path}.type",
                                "unsupported_value")
    _check_keys(item, _ITEM_KEYS[kind], path)
    if kind == "message":
        conv.add({"role": _role(item, path), "content": _content(item, "content", path)},
                 path)
    elif kind == "function_call":
        _add_call(conv, item, path)
    elif kind == "function_call_output":
        output = _content(item, "output", path)
        conv.add({"role": "tool", "tool_call_id": _string(item, "call_id", path),
                  "content": output}, path)


def _add_call(conv: Conversation, item: dict[str, Any], path: str) -> None:
    """The call joins the assistant turn before it (a new one if there is none). That turn
    is replaced by a copy, never changed in place: it may be a stored reply's turn
    (``previous_response_id``), which other requests continue too. ``call_paths`` keeps one
    path per tool call of the turn: the turn's own for the calls it had already."""
    call = {"id": _string(item, "call_id", path), "type": "function",
            "function": {"name": _string(item, "name", path),
                         "arguments": _string(item, "arguments", path)}}
    last = conv.messages[-1] if conv.messages else None
    if last is None or last["role"] != "assistant" or conv.paths[-1] == "instructions":
        conv.add({"role": "assistant", "content": None, "tool_calls": []}, path)
        last = conv.messages[-1]
    index, had = len(conv.messages) - 1, last.get("tool_calls") or []
    conv.messages[index] = {**last, "tool_calls": [*had, call]}
    conv.call_paths.setdefault(index, [conv.paths[index]] * len(had)).append(path)


def _role(item: dict[str, Any], path: str) -> str:
    role = item.get("role")
    if role not in _ROLES:
        raise RequestFieldError(f"{path}.role must be one of {', '.join(_ROLES)}; got "
                                f"{role!r}", f"{path}.role")
    return role


def _content(item: dict[str, Any], key: str, path: str) -> str | list[dict[str, str]]:
    """A message's ``content`` or a function_call_output's ``output`` (``key``): a string,
    or text parts as chat's ``text`` parts."""
    content = item.get(key)
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RequestFieldError(f"{path}.{key} must be a string or a non-empty list of "
                                "input_text / output_text parts", f"{path}.{key}",
                                "invalid_type")
    parts = []
    for j, part in enumerate(content):
        where = f"{path}.{key}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise RequestFieldError(f"content parts of type {kind!r} are not supported by "
                                    "kvflow (send input_text or output_text parts)",
                                    f"{where}.type", "unsupported_value")
        _check_keys(part, _PART_KEYS, where)
        parts.append({"type": "text", "text": _string(part, "text", where)})
    return parts


def _string(item: dict[str, Any], key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}"
        raise RequestFieldError(f"{path}.{key} must be a string; it is {what}",
                                f"{path}.{key}", "invalid_type")
    return value


def _check_keys(obj: dict[str, Any], allowed: set[str], path: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise RequestFieldError(f"Unrecognized request argument supplied: {path}.{extra[0]}",
                                f"{path}.{extra[0]}", "unknown_parameter")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's form (``{"type": "function", "function": {...}}``).

    Raises:
        RequestFieldError: ``tools.N.type`` for a tool other than ``function`` (built-in
            tools: web_search, file_search, code_interpreter, ... are not supported),
            ``tools.N.<key>`` for a key a function tool does not take, or ``tools`` for more
            than chat's ``MAX_TOOLS``.
    """
    if tools is None:
        return None
    if len(tools) > MAX_TOOLS:
        raise RequestFieldError(f"a request holds at most {MAX_TOOLS} tools; this one holds "
                                f"{len(tools)}", "tools", "array_above_max_length")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise RequestFieldError(f"tools of type {kind!r} are not supported by kvflow "
                                    "(only function tools: it runs no built-in tools)",
                                    f"tools.{i}.type", "unsupported_value")
        _check_keys(tool, _TOOL_KEYS, f"tools.{i}")
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat's form: ``{"type": "function", "name": N}`` ->
    ``{"type": "function", "function": {"name": N}}``; the strings as they are.

    Raises:
        RequestFieldError: ``tool_choice`` for another object (hosted tools, allowed_tools).
    """
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or set(choice) != {"type", "name"}:
        raise RequestFieldError("tool_choice must be none, auto, required or "
                                '{"type": "function", "name": ...}', "tool_choice",
                                "unsupported_value")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(fmt: Any) -> dict[str, Any] | None:
    """``text.format`` (a ``TextFormat`` or None) as chat's ``response_format``.

    Raises:
        RequestFieldError: ``text.format.name`` / ``text.format.schema`` missing for
            ``json_schema``, or set for another type.
    """
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        extra = next((k for k in ("name", "json_schema", "strict", "description")
                      if getattr(fmt, k) is not None), None)
        if extra is not None:
            key = "schema" if extra == "json_schema" else extra
            raise RequestFieldError(f"text.format.{key} applies to type json_schema only",
                                    f"text.format.{key}")
        return {"type": fmt.type}
    for key, value in (("name", fmt.name), ("schema", fmt.json_schema)):
        if value is None:
            raise RequestFieldError(f"text.format of type json_schema needs {key}",
                                    f"text.format.{key}", "missing_required_parameter")
    spec = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict,
            "description": fmt.description}
    return {"type": "json_schema",
            "json_schema": {k: v for k, v in spec.items() if v is not None}}


def input_items(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` (already read by ``kvflow.chat.messages``) as OpenAI lists it back (GET
    /v1/responses/{id}/input_items): each item with an ``id`` (its own, else a new
    ``msg_`` / ``fc_`` / ``fco_`` / ``rs_`` one) and ``status`` ``completed``; a string is
    one user message; message content as parts (``input_text`` for user / system /
    developer, ``output_text`` for assistant, OpenAI's item types for each role)."""
    if isinstance(input_, str):
        input_ = [{"role": "user", "content": input_}]
    return [_listed(item) for item in input_]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
              "reasoning": "rs"}


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    out = {**item, "type": kind, "id": item.get("id") or new_id(_ID_PREFIX[kind])}
    if kind == "reasoning":
        out.setdefault("summary", [])
        return out
    out["status"] = item.get("status") or "completed"
    if kind == "message":
        part = "output_text" if item["role"] == "assistant" else "input_text"
        content = item["content"]
        texts = [content] if isinstance(content, str) else [p["text"] for p in content]
        out["content"] = [{"type": part, "text": t, **({"annotations": []}
                                                     if part == "output_text" else {})}
                          for t in texts]
    return out
