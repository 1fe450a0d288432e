"""Tool-call and reasoning parsers for /v1/chat/completions.

Every parser is a pure function of the text generated so far: ``parse(text, final)`` returns
the content, and the tool calls as raw text spans (name, arguments). Streaming re-parses the
growing text and sends only what is new (``StreamingToolState``); because a call's arguments
are a span of the text that only grows, the streamed argument pieces always join to exactly
the non-streamed ``arguments``. Parsing is span scanning over the model's JSON (strings, nesting,
escapes; ``json_spans``), not a JSON grammar: the grammar backend does the constraining.
Streamed or not, a reply carries the same calls: every call whose name was read.

Parsers: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, Qwen2.5,
Hermes, SmolLM2 prompts), ``llama3_json`` (``{"name": ..., "parameters": {...}}``, several
separated by ``;``, optional ``<|python_tag|>``), plus the two that grammar-forced output uses:
``named`` (the text is the arguments) and ``required`` (a JSON array of calls).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvflow.entrypoints.json_spans import object_members, skip_ws


# ---- parsed output -------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    """One tool call: ``name`` once its string is complete; ``arguments`` the raw JSON text
    so far (complete when ``complete``)."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def _call_from_object(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[ParsedCall,
                                                                                   int | None]:
    """The call in the JSON object at ``text[start]``; returns it and the object's end. An
    ended object without an arguments member has arguments ``{}`` (OpenAI's arguments are
    JSON text; the stream sends that ``{}`` once the object ends)."""
    members, end = object_members(text, start)
    call = ParsedCall()
    name_span = members.get("name")
    if name_span is not None and name_span[1] is not None:
        try:
            name = json.loads(text[name_span[0]:name_span[1]])
        except json.JSONDecodeError:
            name = None
        call.name = name if isinstance(name, str) and name else None
    for key in args_keys:
        if key in members:
            a, b = members[key]
            call.arguments = text[a:b] if b is not None else text[a:]
            break
    else:
        if end is not None:
            call.arguments = "{}"
    call.complete = end is not None and call.name is not None and _is_json(call.arguments)
    return call, end


def _add_call(out: ParsedOutput, call: ParsedCall, end: int | None) -> None:
    """Append ``call`` unless its object ended without a name: such an object is no call,
    and skipping it keeps the later calls' indices the same streamed or not (a nameless
    call is only ever the last, still-growing one)."""
    if end is None or call.name is not None:
        out.calls.append(call)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _calls_or_content(out: ParsedOutput, text: str, final: bool) -> ParsedOutput:
    """``out``, unless generation ended without one named call: then the model wrote no
    usable call (``<tool_call>`` then no JSON, an object without a name, a call cut before
    its name) and the whole text is content, so nothing it wrote is lost. The content the
    stream sent before (the text before the call) is a prefix of it."""
    if final and not any(c.name for c in out.calls):
        return ParsedOutput(text)
    return out


class ToolParser:
    """Base: ``parse(text, final)``; subclasses set ``name`` and ``system_prompt``."""

    name = "base"

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


def _call_json(call: dict[str, Any], args_key: str) -> str:
    """``{"name": ..., "<args_key>": ...}`` with the arguments text as given (``{}`` if
    empty): the model wrote that text; re-encoding it would change what it sees."""
    function = call["function"]
    arguments = function["arguments"].strip() or "{}"
    return (f'{{"name": {json.dumps(function["name"], ensure_ascii=False)}, '
            f'"{args_key}": {arguments}}}')


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(self.START)
        if first < 0:  # trailing whitespace waits: it is dropped if a call follows
            return ParsedOutput(text if final else
                                text[:len(text) - _held_back(text, self.START)].rstrip())
        out = ParsedOutput(text[:first].rstrip())
        pos = first
        while pos >= 0:
            start = skip_ws(text, pos + len(self.START))
            if start >= len(text) or text[start] != "{":
                break
            call, end = _call_from_object(text, start, ("arguments", "parameters"))
            _add_call(out, call, end)
            if end is None:
                break
            pos = self._text_after(out, text, end, final)
        return _calls_or_content(out, text, final)

    def _text_after(self, out: ParsedOutput, text: str, end: int, final: bool) -> int:
        """Add the text after the call object ending at ``end`` (past its ``</tool_call>``,
        up to the next ``<tool_call>``) to ``out.content``, stripped, on a line of its own,
        once a named call was read (before one, ``_calls_or_content`` may yet make the whole
        text content); returns the next call's start, or -1. While streaming, a possible start of a tag and
        trailing whitespace wait (the content only ever grows)."""
        i = skip_ws(text, end)
        if text.startswith(self.END, i):
            i += len(self.END)
        elif not final and self.END.startswith(text[i:]):
            return -1  # the closing tag may be coming
        pos = text.find(self.START, i)
        after = text[i:pos] if pos >= 0 else \
            text[i:len(text) - (0 if final else _held_back(text, self.START))]
        after = after.strip()
        if after and any(c.name for c in out.calls):  # else the text may all be content
            out.content = f"{out.content}\n{after}" if out.content else after
        return pos

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You may call one or more functions to assist with the user query. The "
                f"functions are:\n<tools>\n{listing}\n</tools>\nFor each function call, return "
                "a JSON object with the function name and arguments within <tool_call></tool_call>"
                ' tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
                "\n</tool_call>")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.START}\n{_call_json(c, 'arguments')}\n{self.END}"
                         for c in calls)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, start):
            start = skip_ws(text, start + len(self.PYTHON_TAG))
        elif not final and self.PYTHON_TAG.startswith(text[start:]):
            return ParsedOutput("")  # maybe the tag is coming
        if start >= len(text) or text[start] != "{":
            return ParsedOutput(text if final or start < len(text) else "")
        out = ParsedOutput("")
        while start < len(text) and text[start] == "{":
            call, end = _call_from_object(text, start, ("parameters", "arguments"))
            if end is not None and call.name is None and not out.calls:
                return ParsedOutput(text)  # a JSON reply, not a call: all content
            _add_call(out, call, end)
            if end is None:
                break
            start = skip_ws(text, end)
            if start < len(text) and text[start] == ";":
                start = skip_ws(text, start + 1)
        return _calls_or_content(out, text, final)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You have access to the following functions. To call one, respond with JSON "
                'in the form {"name": function name, "parameters": {argument: value}}.\n'
                + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(_call_json(c, "parameters") for c in calls)


class NamedToolParser(ToolParser):
    """Output forced to the arguments of one function (tool_choice names it)."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        args = text.strip()  # trailing whitespace waits while streaming, then is dropped
        return ParsedOutput("", [ParsedCall(self.function_name, args, _is_json(args))])


class RequiredToolParser(ToolParser):
    """Output forced to a JSON array of ``{"name": ..., "arguments": {...}}`` objects."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput("")
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return out
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            call, end = _call_from_object(text, i, ("arguments", "parameters"))
            _add_call(out, call, end)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser,
                                                                  Llama3JsonToolParser)}


def make_tool_parser(name: str) -> ToolParser:
    """Raises ValueError for an unknown parser name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


# ---- reasoning ---------------------------------------------------------------------------------
class ThinkReasoningParser:
    """Splits ``<think>reasoning</think>content`` (DeepSeek-R1, Qwen3 style). Text before an
    opening tag that never comes is content; an unclosed think block is all reasoning."""

    name = "think"
    START, END = "<think>", "</think>"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning so far, content so far), holding back partial tags unless ``final``."""
        stripped = text.lstrip()
        if not stripped.startswith(self.START):
            if not final and self.START.startswith(stripped):
                return "", ""
            return "", text
        body = stripped[len(self.START):]
        end = body.find(self.END)
        if end < 0:
            hold = 0 if final else _held_back(body, self.END)
            return body[:len(body) - hold], ""
        content = body[end + len(self.END):]
        return body[:end], content.lstrip()  # as it grows too: the stream sends the same


REASONING_PARSERS = {ThinkReasoningParser.name: ThinkReasoningParser}


# ---- streaming -----------------------------------------------------------------------------------
@dataclass
class StreamDelta:
    """What to send for one choice: new reasoning / content text and tool-call pieces
    (index, id or None, name or None, argument text)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class StreamingToolState:
    """One choice's streaming state: the text so far and what has been sent of it.

    Args:
        parser: the tool parser, or None (content only).
        reasoning: the reasoning parser, or None.
        max_calls: the most calls to send (1 for ``parallel_tool_calls: false``; None: all);
            later calls in the text are dropped.
    """

    def __init__(self, parser: ToolParser | None,
                 reasoning: ThinkReasoningParser | None = None,
                 max_calls: int | None = None) -> None:
        self.parser, self.reasoning, self.max_calls = parser, reasoning, max_calls
        self.text = ""
        self._sent_reasoning = self._sent_content = 0
        self._sent_args: list[int] = []  # per call: argument characters sent (-1: no header)
        self.ids: list[str] = []

    def update(self, delta_text: str, final: bool) -> StreamDelta:
        """Fold in new text; returns only what was not sent before."""
        self.text += delta_text
        reasoning, content = (self.reasoning.split(self.text, final) if self.reasoning
                              else ("", self.text))
        out = StreamDelta(reasoning=reasoning[self._sent_reasoning:])
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        parsed = self.parser.parse(content, final) if self.parser else ParsedOutput(content)
        out.content = parsed.content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(parsed.content))
        for index, call in enumerate(parsed.calls[:self.max_calls]):
            if index == len(self._sent_args):
                if call.name is None:
                    break  # arguments wait for the name
                self.ids.append(new_tool_call_id())
                self._sent_args.append(0)
                out.tool_calls.append((index, self.ids[index], call.name, ""))
            piece = call.arguments[self._sent_args[index]:]
            if piece:
                out.tool_calls.append((index, None, None, piece))
                self._sent_args[index] = len(call.arguments)
        return out

    @property
    def num_calls(self) -> int:
        return len(self._sent_args)
