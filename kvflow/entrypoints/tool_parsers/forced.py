"""The parsers of grammar-forced output (``tool_choice`` required or named): the grammar
backend constrains the text, so these only read it."""

from __future__ import annotations

from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    add_call,
    call_from_object,
    is_json,
)


class NamedToolParser(ToolParser):
    """Output forced to the arguments of one function (tool_choice names it)."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        args = text.strip()  # trailing whitespace waits while streaming, then is dropped
        return ParsedOutput("", [ParsedCall(self.function_name, args, is_json(args))])

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
            call, end = call_from_object(text, i, ("arguments", "parameters"))
            add_call(out, call, end)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return out
