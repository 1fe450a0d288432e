"""``internlm``: InternLM2 / 2.5's plugin action, one call per reply::

    I will look it up.<|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

(``arguments`` is read too). Text before the action is content; text after it, and any later
action, is dropped (vLLM's parser reads one call and drops the rest). A call to a function the
request did not offer is not read (the whole reply is content). ``<|action_start|>`` and
``<|plugin|>`` are special tokens: the reply is decoded with them, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    add_call,
    call_from_object,
    calls_or_content,
    until_marker,
)


class InternLMToolParser(ToolParser):
    name = "internlm"
    keeps_special_tokens = True
    START, END = "<|action_start|><|plugin|>", "<|action_end|>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        start = skip_ws(text, first + len(self.START))
        if start < len(text) and text[start] == "{":
            call, end = call_from_object(text, start, ("parameters", "arguments"))
            if call.name is None or self.knows(call.name):
                add_call(out, call, end)
        return calls_or_content(out, text, final)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You can call the functions below.\n" + listing + "\nTo call one, reply with "
                f'{self.START}\n{{"name": function name, "parameters": {{argument: value}}}}'
                f"{self.END}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """The first call (InternLM2 makes one per turn)."""
        return "".join(f"{self.START}\n{call_json(c, 'parameters')}{self.END}" for c in calls[:1])


class InternLM2ToolParser(InternLMToolParser):
    """vLLM's other name for the same format (``internlm2``)."""

    name = "internlm2"
