"""``granite``: Granite 3.x's JSON list of calls at the start of the reply, after Granite 3.0's
``<|tool_call|>`` token or Granite 3.1's ``<tool_call>`` text (either optional)::

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

A reply that does not start so is content. The calls are the list's objects; text after the
list is dropped (vLLM's parser returns no content beside the calls). An object without a name
as the first item makes the reply content (a JSON reply, not a call).
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    json_object_calls,
)


class GraniteToolParser(ToolParser):
    name = "granite"
    TAGS = ("<|tool_call|>", "<tool_call>")

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        for tag in self.TAGS:
            if text.startswith(tag, start):
                start = skip_ws(text, start + len(tag))
            elif not final and tag.startswith(text[start:]):
                return ParsedOutput("")  # maybe the tag is coming
        if start < len(text) and text[start] == "[":
            start = skip_ws(text, start + 1)
        elif start < len(text) or final:
            return ParsedOutput(text)
        if start >= len(text):
            return ParsedOutput(text if final else "")
        if text[start] != "{":
            return ParsedOutput(text)
        return json_object_calls(text, start, final, ("arguments",), ",")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You have access to the following functions. To call them, reply with "
                f'{self.TAGS[0]} and a JSON list of calls: [{{"name": function name, '
                f'"arguments": {{argument: value}}}}].\n' + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.TAGS[0]}[{', '.join(call_json(c, 'arguments') for c in calls)}]"
