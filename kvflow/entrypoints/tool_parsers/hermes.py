"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes 2/3,
Qwen2.5, Qwen3, SmolLM2 prompts); text before, between and after the blocks is content, and
so is text inside a block after its call's object (not the closing tag)."""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import HermesToolText
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    call_from_object,
    calls_or_content,
    held_back,
    read_blocks,
    until_marker,
)


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = HermesToolText.START, HermesToolText.END

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.START, final)
        if first < 0:
            return out
        read_blocks(out, text, first, lambda pos: self._read_call(text, pos),
                    lambda end: self._text_after(out, text, end, final))
        return calls_or_content(out, text, final)

    def _read_call(self, text: str, pos: int) -> tuple[ParsedCall | None, int | None]:
        """The call of the ``<tool_call>`` at ``text[pos]`` (None unless a JSON object
        follows) and the object's end."""
        start = skip_ws(text, pos + len(self.START))
        if start >= len(text) or text[start] != "{":
            return None, None
        return call_from_object(text, start, ("arguments", "parameters"))

    def _text_after(self, out: ParsedOutput, text: str, end: int, final: bool) -> int:
        """Add the text after the call object ending at ``end``, up to the next
        ``<tool_call>``, to ``out.content``: text the model wrote inside the block after the
        object (``<tool_call>{...} junk</tool_call>``) and text after the block, each stretch
        stripped, on a line of its own (never the ``</tool_call>`` between them), once a
        named call was read (before one, ``calls_or_content`` may yet make the whole text
        content); returns the next call's start, or -1. While streaming, a possible start of
        a tag and trailing whitespace wait (the content only ever grows); a reply that ended
        inside a tag (``</tool_ca``, ``<tool_ca`` right after the call, cut by ``max_tokens``)
        adds nothing of it: the piece is the calls' markup, which the stream never sent."""
        i = skip_ws(text, end)
        if not text.startswith(self.END, i) and self.END.startswith(text[i:]):
            return -1  # the closing tag may be coming (once final: the reply ended inside it)
        pos = text.find(self.START, i)
        stop = pos if pos >= 0 else len(text)
        close = text.find(self.END, i, stop)
        stretches = [text[i:close], text[close + len(self.END):stop]] if close >= 0 \
            else [text[i:stop]]
        if pos < 0:  # the last stretch may end in the start of a tag: it waits, and a
            # reply that ended inside the block's closing tag adds nothing of it
            tags = (() if final else (self.START,)) + (() if close >= 0 else (self.END,))
            cut = max((held_back(stretches[-1], tag) for tag in tags), default=0)
            stretches[-1] = stretches[-1][:len(stretches[-1]) - cut]
        stretches = [s.strip() for s in stretches]
        if final and pos < 0 and self.START.startswith(stretches[-1]):
            stretches[-1] = ""  # the reply ended inside the next call's opening tag
        if any(c.name for c in out.calls):  # else the text may all be content
            for after in filter(None, stretches):
                out.content = f"{out.content}\n{after}" if out.content else after
        return pos

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return HermesToolText().system_prompt(tools)

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        return HermesToolText().calls_text(calls)
