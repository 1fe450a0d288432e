"""``llama3_json``: ``{"name": ..., "parameters": {...}}`` objects separated by ``;``, after an
optional ``<|python_tag|>`` (Llama 3.1 / 3.2 JSON tool calling); a reply that starts with
anything else is content."""

from __future__ import annotations

import json
from typing import Any

from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    add_call,
    call_from_object,
    call_json,
    calls_or_content,
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
        out = ParsedOutput("")
        while start < len(text) and text[start] == "{":
            call, end = call_from_object(text, start, ("parameters", "arguments"))
            if end is not None and call.name is None and not out.calls:
                return ParsedOutput(text)  # a JSON reply, not a call: all content
            add_call(out, call, end)
            if end is None:
                break
            start = skip_ws(text, end)
            if start < len(text) and text[start] == ";":
                start = skip_ws(text, start + 1)
        return calls_or_content(out, text, final)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You have access to the following functions. To call one, respond with JSON "
                'in the form {"name": function name, "parameters": {argument: value}}.\n'
                + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(call_json(c, "parameters") for c in calls)


class Llama4JsonToolParser(Llama3JsonToolParser):
    """vLLM's name for the same format on Llama 4 (``llama4_json``)."""

    name = "llama4_json"
