"""``llama3_json``: ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, after an
optional ``<|python_tag|>`` (Llama 3.1 / 3.2 JSON tool calling); a reply that starts with
anything else is content."""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    json_object_calls,
)


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
        return json_object_calls(text, start, final, ("parameters", "arguments"), ";")

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You have access to the following functions. To call one, respond with JSON "
                'in the form {"name": function name, "parameters": {argument: value}}.\n'
                + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(call_json(c, "parameters") for c in calls)


class Llama4JsonToolParser(Llama3JsonToolParser):
    """vLLM's name for the same format on Llama 4 (``llama4_json``)."""

    name = "llama4_json"
