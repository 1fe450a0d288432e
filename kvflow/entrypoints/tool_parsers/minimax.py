"""``minimax``: MiniMax-M1's calls, one JSON object per line in ``<tool_calls>`` tags::

    Let me check.
    <tool_calls>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    {"name": "get_time", "arguments": {}}
    </tool_calls>

Text before ``<tool_calls>`` is content; text after the calls is dropped (vLLM's parser keeps
only the text before the tag). A first object without a name, or no object at all, makes the
whole reply content. (Calls inside a ``<think>`` block are the ``--reasoning-parser``'s to
split off first.)
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


class MiniMaxToolParser(ToolParser):
    name = "minimax"
    START, END = "<tool_calls>", "</tool_calls>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        return object_calls(out, text, first + len(self.START), final, ("arguments",), ",")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You can call the functions below.\n<tools>\n" + listing + "\n</tools>\n"
                f"To call them, reply with {self.START}, then one line per call, "
                '{"name": function name, "arguments": {argument: value}}, then '
                f"{self.END}.")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        lines = "\n".join(call_json(c, "arguments") for c in calls)
        return f"{self.START}\n{lines}\n{self.END}"
