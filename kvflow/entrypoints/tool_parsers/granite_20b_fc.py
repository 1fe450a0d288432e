"""``granite-20b-fc``: granite-20b-functioncalling's calls, each a JSON object after its own
``<function_call>``::

    Sure.<function_call> {"name": "get_weather", "arguments": {"city": "Paris"}}
    <function_call> {"name": "get_time", "arguments": {}}

Text before the first ``<function_call>`` is content; text after the last object is dropped
(as vLLM's parser drops it). No object after the marker, or a first object without a name,
makes the whole reply content.
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    object_calls,
    until_marker,
)


class Granite20bFCToolParser(ToolParser):
    name = "granite-20b-fc"
    START = "<function_call>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        return object_calls(out, text, first + len(self.START), final, ("arguments",),
                            self.START)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You have access to the following functions:\n" + listing + "\nTo call one, "
                f'reply with {self.START} {{"name": function name, "arguments": '
                "{argument: value}}, one per call.")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{self.START} {call_json(c, 'arguments')}" for c in calls)
