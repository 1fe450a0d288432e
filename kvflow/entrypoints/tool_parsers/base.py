"""Shared pieces of the tool-call parsers: the parsed-output types, the JSON-object call
reader, and the ``ToolParser`` base every parser subclasses (see the package docstring)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.chat.messages import arguments_object
from kvflow.chat.tools_text import tools_listing
from kvflow.entrypoints.json_spans import object_members, skip_ws


# ---- parsed output -------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    """One tool call: ``name`` once its string is complete; ``arguments`` the raw JSON text
    so far (complete when ``complete``); ``id`` the call's id when the model writes one
    (Kimi K2's ``functions.get_weather:0``), else None and the server makes one."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    id: str | None = None


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def call_from_object(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall,
                                                                                   int | None]:
    """The call in the JSON object at ``text[start]``; returns it and the object's end. The
    arguments are the first member (in the text) named one of ``args_keys``, and an ended
    object without one has arguments ``{}`` (OpenAI's arguments are JSON text; the stream
    sends that ``{}`` once the object ends). The name and arguments are the first the object
    gives (duplicates are ignored), so what the text so far gives never changes: a stream
    joins to the whole reply's call."""
    members, end = object_members(text, start)
    call = ParsedCall()
    name_span = members.get("name")
    if name_span is not None and name_span[1] is not None:
        try:
            name = json.loads(text[name_span[0]:name_span[1]])
        except json.JSONDecodeError:
            name = None
        call.name = name if isinstance(name, str) and name else None
    for key, (a, b) in members.items():
        if key in args_keys:
            call.arguments = text[a:b] if b is not None else text[a:]
            break
    else:
        if end is not None:
            call.arguments = "{}"
    call.complete = end is not None and call.name is not None and is_json(call.arguments)
    return call, end


def add_call(out: ParsedOutput, call: ParsedCall, end: int | None) -> None:
    """Append ``call`` unless its object ended without a name: such an object is no call,
    and skipping it keeps the later calls' indices the same streamed or not (a nameless
    call is only ever the last, still-growing one)."""
    if end is None or call.name is not None:
        out.calls.append(call)


def read_blocks(out: ParsedOutput, text: str, pos: int,
                read_call: Callable[[int], tuple[ParsedCall | None, int | None]],
                next_block: Callable[[int], int]) -> None:
    """Append to ``out`` the calls of consecutive blocks, the first at ``text[pos]`` (-1:
    none): ``read_call(i)`` reads the block at ``i`` (the call, None if the block is not one,
    and its end, None while it is open); ``next_block(end)`` gives the next block's start
    (-1: no more). Reading ends at a block that is not a call or is still open. The loop of
    the parsers whose calls come in tagged blocks (``hermes``, ``qwen3_coder``,
    ``marked_blocks``)."""
    while pos >= 0:
        call, end = read_call(pos)
        if call is None:
            break
        add_call(out, call, end)
        if end is None:
            break
        pos = next_block(end)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def until_marker(text: str, marker: str, final: bool) -> tuple[ParsedOutput, int]:
    """The content before the first ``marker`` (where a parser's calls begin) and that
    marker's index; without one (-1), the whole output: all of ``text`` once ``final``,
    while streaming less a suffix that may start the marker and trailing whitespace (both
    wait: the whitespace is dropped if a call follows)."""
    first = text.find(marker)
    if first < 0:
        return ParsedOutput(text if final else
                            text[:len(text) - held_back(text, marker)].rstrip()), -1
    return ParsedOutput(text[:first].rstrip()), first


def calls_or_content(out: ParsedOutput, text: str, final: bool) -> ParsedOutput:
    """``out``, unless generation ended without one named call: then the model wrote no
    usable call (``<tool_call>`` then no JSON, an object without a name, a call cut before
    its name) and the whole text is content, so nothing it wrote is lost. The content the
    stream sent before (the text before the call) is a prefix of it."""
    if final and not any(c.name for c in out.calls):
        return ParsedOutput(text)
    return out


def json_object_calls(text: str, start: int, final: bool, args_keys: tuple[str, ...],
                      separator: str) -> ParsedOutput:
    """The calls of a run of JSON objects ``{"name": ..., <args key>: {...}}`` from ``start``
    (where ``text`` has a ``{``), ``separator`` and whitespace between them (llama3_json's
    ``;``, granite's list ``,``, granite-20b-fc's ``<function_call>``): a first object without
    a name is a JSON reply, all content; reading stops at an object cut off by the end of
    ``text``."""
    out = ParsedOutput("")
    while start < len(text) and text[start] == "{":
        call, end = call_from_object(text, start, args_keys)
        if end is not None and call.name is None and not out.calls:
            return ParsedOutput(text)  # a JSON reply, not a call: all content
        add_call(out, call, end)
        if end is None:
            break
        start = skip_ws(text, end)
        if text.startswith(separator, start):
            start = skip_ws(text, start + len(separator))
    return calls_or_content(out, text, final)


def object_calls(out: ParsedOutput, text: str, start: int, final: bool,
                 args_keys: tuple[str, ...], separator: str) -> ParsedOutput:
    """The calls of the run of JSON objects at ``text[start]`` (after whitespace; see
    ``json_object_calls``), ``out.content`` the text before them. Text that cannot start an
    object, or a first object without a name, makes the reply all content at once; a reply
    with no named call is all content once ``final`` (while streaming, ``out`` waits, holding
    no calls)."""
    start = skip_ws(text, start)
    if start < len(text) and text[start] == "{":
        calls = json_object_calls(text, start, final, args_keys, separator)
        if calls.content == text:
            return calls
        if not calls.calls:
            return out
        calls.content = out.content
        return calls
    if start < len(text) or final:
        return ParsedOutput(text)
    return out


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Base: ``parse(text, final)``; subclasses set ``name`` and ``system_prompt``.

    Args:
        tools: the request's ``tools`` (OpenAI's shape, ``{"type": "function", "function":
            {...}}``), or None when unknown (rendering history, tests). Parsers that type
            values by the tool's schema (``qwen3_coder``) or refuse calls to functions the
            request did not offer (``mistral``, ``pythonic``, ``qwen3_coder``,
            ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``, ``internlm``: such text is
            content) read them.
    """

    name = "base"
    #: the call markers are special tokens (``[TOOL_CALLS]``): the reply must be decoded with
    #: them, whatever the request's ``skip_special_tokens`` (vLLM does the same)
    keeps_special_tokens = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.schemas: dict[str, dict[str, Any]] | None = None if tools is None else {
            t["function"]["name"]: t["function"].get("parameters") or {}
            for t in tools if isinstance(t.get("function"), dict)}

    def knows(self, name: str | None) -> bool:
        """Whether ``name`` is a function the request offered (any name when tools are
        unknown)."""
        return bool(name) and (self.schemas is None or name in self.schemas)

    def parameter_schemas(self, name: str) -> dict[str, Any]:
        """The JSON schemas of function ``name``'s parameters by parameter name (its schema's
        ``properties``; empty when tools are unknown or the schema has none)."""
        return ((self.schemas or {}).get(name) or {}).get("properties") or {}

    def new_call_id(self) -> str:
        """A fresh ``tool_calls[].id`` (OpenAI's ``call_`` + 24 hex digits)."""
        return new_tool_call_id()

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Split the generated ``text`` so far into content and tool calls; ``final`` is set
        once generation has ended (otherwise a possible start of a call is held back).

        Raises:
            NotImplementedError: on the base class; every parser overrides it.
        """
        raise NotImplementedError

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """Instructions for chat templates that do not render ``tools`` themselves.

        Raises:
            NotImplementedError: for a parser without instructions of its own (the base, and
                the ``named`` and ``required`` parsers, whose output a grammar forces).
        """
        raise NotImplementedError

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """An earlier assistant turn's ``tool_calls`` (OpenAI's shape, ``arguments`` JSON text)
        as the text this parser reads calls from, for chat templates that do not render
        ``tool_calls`` themselves: ``parse(calls_text(calls), True)`` gives the calls back.

        Raises:
            NotImplementedError: for a parser without a text format of its own.
        """
        raise NotImplementedError


def arguments_items(function: dict[str, Any]) -> list[tuple[str, str]]:
    """A history call's arguments (``function["arguments"]``, JSON text) as (name, value
    text) pairs, for the formats that write each parameter in tags (``qwen3_coder``,
    ``glm45``, ``step3``): a string value as its text, any other as JSON; none when the text
    is not a JSON object (``chat_messages.arguments_object``: raw newlines in its strings
    are read, as the template path reads them)."""
    arguments = arguments_object(function.get("arguments") or "{}")
    return [(k, v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
            for k, v in arguments.items()]


def schema_types(schema: dict[str, Any] | None) -> list[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, or ``anyOf`` /
    ``oneOf``); none for a schema without a type (``{}``) or no schema."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    return [k for s in schema.get("anyOf") or schema.get("oneOf") or []
            for k in schema_types(s)]


def is_plain_name(name: str) -> bool:
    """Whether a function name read between tags is one word (not empty, no white space, no
    ``<`` or ``>``: text that is no name, or a tag cut short)."""
    return bool(name) and not any(c.isspace() or c in "<>" for c in name)


def json_member(key: str, value: Any) -> str:
    """``"key": value`` as JSON text: one member of the arguments object a streaming parser
    builds up piece by piece."""
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class TaggedBlocksToolParser(ToolParser):
    """A parser whose calls each stand in their own ``START`` ... ``END`` block (``glm45``,
    ``qwen3_coder``): content is the text before the first block; subclasses read a block's
    call in ``_read_call``."""

    START = END = ""
    #: a block's body in ``system_prompt``'s instructions, between ``START`` and ``END``
    CALL_EXAMPLE = ""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        read_blocks(out, text, first, lambda pos: self._read_call(text, pos + len(self.START)),
                    lambda end: text.find(self.START, end))
        return calls_or_content(out, text, final)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (f"You can call the functions below.\n<tools>\n{tools_listing(tools)}\n</tools>\n"
                f"To call one, reply with:\n{self.START}{self.CALL_EXAMPLE}{self.END}")

    def _read_call(self, text: str, i: int) -> tuple[ParsedCall | None, int | None]:
        """The call of the block whose body starts at ``text[i]`` (None until it can be
        read, or if it is no call) and the block's end (None while it is open).

        Raises:
            NotImplementedError: on this class; subclasses read their own blocks.
        """
        raise NotImplementedError
