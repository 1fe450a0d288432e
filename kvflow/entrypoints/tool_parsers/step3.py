"""``step3``: Step3's tool-call section, each call a ``steptml`` invocation::

    Sure.<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather"><steptml:parameter name="city">Paris</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>

A value is its text stripped, read as the tool's JSON schema types the parameter (integer,
number, boolean, null; anything else, or text that does not read so, stays a string), as
vLLM's parser reads it. Text before the section is content, and so is text after its end (on
a line of its own), as vLLM keeps both. A call's name is sent as soon as it is read and its
arguments whole when its invocation closes. A call to a function the request did not offer,
or a block that cannot be read, ends the reading (with no call read, the whole reply is
content). The markers are special tokens: the reply is decoded with them, as vLLM does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from kvflow.chat.tools_text import tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    arguments_items,
    calls_or_content,
    read_blocks,
    until_marker,
)

_INVOKE = re.compile(r'<steptml:invoke name="([^"<>]+)">')
_PARAMETER = re.compile(r'<steptml:parameter name="([^"<>]+)">([^<]*)</steptml:parameter>')


class Step3ToolParser(ToolParser):
    name = "step3"
    keeps_special_tokens = True
    SECTION, SECTION_END = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"
    INVOKE_END = "</steptml:invoke>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.SECTION, final)
        if first < 0:
            return out
        last = [first + len(self.SECTION)]  # where the text after the calls starts

        def next_block(end: int) -> int:
            last[0] = pos = skip_ws(text, end)
            return pos if text.startswith(self.CALL_BEGIN, pos) else -1

        read_blocks(out, text, next_block(last[0]),
                    lambda pos: self._read_call(text, pos + len(self.CALL_BEGIN)), next_block)
        out = calls_or_content(out, text, final)
        if out.calls and out.calls[-1].complete and text.startswith(self.SECTION_END, last[0]):
            after = text[last[0] + len(self.SECTION_END):]
            if after.strip():
                out.content = "\n".join(s for s in (out.content, after.strip()) if s)
        return out

    def _read_call(self, text: str, i: int) -> tuple[ParsedCall | None, int | None]:
        """The call of the block whose ``function<｜tool_sep｜>`` starts at ``text[i]`` (None
        until its name is read, or if it is no call) and the block's end (None while open)."""
        sep = text.find(self.SEP, i)
        invoke = _INVOKE.match(text, skip_ws(text, sep + len(self.SEP))) if sep >= 0 else None
        if invoke is None or text[i:sep].strip() != "function" or not self.knows(invoke[1]):
            return None, None
        name = invoke[1]
        close = text.find(self.INVOKE_END, invoke.end())
        if close < 0:
            return ParsedCall(name), None
        properties = self.parameter_schemas(name)
        arguments = {k: step3_value(v, properties.get(k))
                     for k, v in _PARAMETER.findall(text, invoke.end(), close)}
        call = ParsedCall(name, json.dumps(arguments, ensure_ascii=False), True)
        k = skip_ws(text, close + len(self.INVOKE_END))
        return call, k + len(self.CALL_END) if text.startswith(self.CALL_END, k) else None

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You can call the functions below.\n" + listing + "\nTo call one, reply with "
                f"{self.SECTION}{self.CALL_BEGIN}function{self.SEP}"
                '<steptml:invoke name="NAME"><steptml:parameter name="ARG">VALUE'
                f"</steptml:parameter></steptml:invoke>{self.CALL_END}{self.SECTION_END}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Each call's invocation; a string value as its text, others as JSON."""
        blocks = []
        for c in calls:
            params = "".join(f'<steptml:parameter name="{k}">{v}</steptml:parameter>'
                             for k, v in arguments_items(c["function"]))
            blocks.append(f'{self.CALL_BEGIN}function{self.SEP}<steptml:invoke name='
                          f'"{c["function"]["name"]}">{params}{self.INVOKE_END}{self.CALL_END}')
        return f"{self.SECTION}{''.join(blocks)}{self.SECTION_END}"


def step3_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A Step3 parameter's value: ``raw`` stripped, read as ``schema``'s ``type`` says
    (integer, number, boolean, null), else the text."""
    text = raw.strip()
    kind = schema.get("type") if isinstance(schema, dict) else None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            value = float(text)
            return value if math.isfinite(value) else text
    except ValueError:
        return text
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind == "null" and text.lower() == "null":
        return None
    return text
