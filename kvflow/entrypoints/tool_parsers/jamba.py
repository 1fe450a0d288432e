"""``jamba``: AI21 Jamba 1.5 / 1.6's JSON list of calls in ``<tool_calls>`` tags::

    Let me check.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_time", "arguments": {}}]</tool_calls>

Text before ``<tool_calls>`` is content; text after the list is dropped (vLLM's parser keeps
only the text before the tag). A list whose first item is an object without a name, or no
list at all, makes the whole reply content. ``<tool_calls>`` and ``</tool_calls>`` are special
tokens in Jamba's tokenizer: the reply is decoded with them, as vLLM does.
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import call_json, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedOutput,
    ToolParser,
    object_calls,
    until_marker,
)


def list_calls(out: ParsedOutput, text: str, start: int, final: bool,
               args_keys: tuple[str, ...] = ("arguments",)) -> ParsedOutput:
    """The calls of the JSON list at ``text[start]`` (after whitespace), ``out.content`` the
    text before it, each call's arguments its first member (in the text) named in
    ``args_keys``. Text that cannot start a list of objects (another character, ``[]``,
    ``[1]``) or a first object without a name (a JSON reply, not a call) makes the reply all
    content at once; a reply
    with no named call is all content once ``final`` (while streaming, ``out`` waits, holding
    no calls). Shared by ``jamba``, ``xlam``, ``hunyuan_a13b`` and ``phi4_mini_json``."""
    start = skip_ws(text, start)
    if start < len(text) and text[start] == "[":
        return object_calls(out, text, start + 1, final, args_keys, ",")
    if start < len(text) or final:
        return ParsedOutput(text)
    return out


class JambaToolParser(ToolParser):
    name = "jamba"
    keeps_special_tokens = True
    START, END = "<tool_calls>", "</tool_calls>"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        return list_calls(out, text, first + len(self.START), final)

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You have access to the following functions. To call them, reply with "
                f'{self.START}[{{"name": function name, "arguments": {{argument: value}}}}, '
                f"...]{self.END}\n" + listing)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return (f"{self.START}[{', '.join(call_json(c, 'arguments') for c in calls)}]"
                f"{self.END}")
