"""``xlam``: Salesforce xLAM's JSON list of calls, bare at the reply's start, in a
``json`` (or plain) code fence, or after ``[TOOL_CALLS]``::

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", ...}]
    Let me check.
    ```json
    [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    ```

Text before the fence or ``[TOOL_CALLS]`` is content; text after the list is dropped (vLLM's
parser keeps only the text before the calls). The first fence or ``[TOOL_CALLS]`` decides: a
fence that does not hold a list of objects (a code block), or a first object without a name,
makes the whole reply content. (A ``</think>`` block before the calls is the
``--reasoning-parser``'s to split off.)
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    held_back,
)
from kvflow.entrypoints.tool_parsers.jamba import list_calls


class XLAMToolParser(ToolParser):
    name = "xlam"
    MARKERS = ("[TOOL_CALLS]", "```")

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        head = text[start:start + len(self.MARKERS[0])]
        if head.startswith("[") and not self.MARKERS[0].startswith(head):
            return list_calls(ParsedOutput(""), text, start, final)  # a bare list
        found = [(i, m) for m in self.MARKERS if (i := text.find(m)) >= 0]
        if not found:
            hold = max(held_back(text, m) for m in self.MARKERS)
            return ParsedOutput(text if final else text[:len(text) - hold].rstrip())
        first, marker = min(found)
        out = ParsedOutput(text[:first].rstrip())
        pos = first + len(marker)
        if marker == "```":
            rest = text[pos:pos + 4]
            if not final and len(rest) < 4 and "json".startswith(rest):
                return out  # maybe the fence's language is coming
            if rest == "json":
                pos += 4
        return list_calls(out, text, pos, final)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You have access to the following functions. To call them, reply with a JSON "
                'list of calls: [{"name": function name, "arguments": {argument: value}}, '
                "...].\n" + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return f"[{', '.join(call_json(c, 'arguments') for c in calls)}]"
