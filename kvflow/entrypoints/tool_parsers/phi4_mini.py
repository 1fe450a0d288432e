"""``phi4_mini_json``: Phi-4-mini's JSON list of calls after ``functools``::

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]

(``parameters`` is read too.) Text before ``functools`` is content (vLLM's parser drops it;
kvflow keeps it, as its other parsers do); text after the list is dropped. No list after the
marker, or a first object without a name, makes the whole reply content.
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    until_marker,
)
from kvflow.entrypoints.tool_parsers.jamba import list_calls


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"
    START = "functools"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        return list_calls(out, text, first + len(self.START), final,
                          ("arguments", "parameters"))

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You have access to the following functions. To call them, reply with "
                f'{self.START}[{{"name": function name, "arguments": {{argument: value}}}}, '
                "...]\n" + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.START}[{', '.join(call_json(c, 'arguments') for c in calls)}]"
