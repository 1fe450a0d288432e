"""Calls written as marker-delimited blocks after a section marker, one block per call::

    SECTION  CALL_BEGIN <header> {arguments JSON} CALL_END  CALL_BEGIN ...  SECTION_END

The shared reader of ``deepseek_v3``, ``deepseek_v31`` and ``kimi_k2``, which differ only in
the header (how the function's name, and Kimi's call id, are written before the arguments).
Text before the section marker is content; text after the calls is dropped, as vLLM's parsers
of these names drop it. A call is read from its arguments' ``{`` on, so a block that turns
out malformed before it was never streamed; a call to a function the request did not offer,
or a block that cannot be read, ends the reading (with no call read, the whole reply is
content). The markers are special tokens: the reply is decoded with them.
"""

from __future__ import annotations

import re

from kvflow.entrypoints.json_spans import object_members, skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    calls_or_content,
    is_json,
    read_blocks,
    until_marker,
)

#: a function name as a header may write it (OpenAI's tool names are ``[a-zA-Z0-9_-]``)
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+\Z")


class MarkedBlocksToolParser(ToolParser):
    """Base of the marker-block parsers; subclasses set the markers and ``read_header``."""

    keeps_special_tokens = True
    SECTION = SECTION_END = CALL_BEGIN = CALL_END = ""
    #: text the model may write between the arguments and ``CALL_END`` (DeepSeek-V3's fence)
    CLOSING = ""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.SECTION, final)
        if first < 0:
            return out
        def next_block(end: int) -> int:  # the next block must follow, spaces aside
            pos = skip_ws(text, end)
            return pos if text.startswith(self.CALL_BEGIN, pos) else -1

        read_blocks(out, text, next_block(first + len(self.SECTION)),
                    lambda pos: self._read_call(text, pos + len(self.CALL_BEGIN)), next_block)
        return calls_or_content(out, text, final)

    def read_header(self, text: str, i: int) -> tuple[str, str | None, int] | None:
        """(function name, call id or None, index of the arguments) of the block whose header
        starts at ``text[i]``; None until the header is complete, or if it is not one.

        Raises:
            NotImplementedError: on the base class.
        """
        raise NotImplementedError

    def _read_call(self, text: str, i: int) -> tuple[ParsedCall | None, int | None]:
        """The call of the block whose header starts at ``text[i]`` (None until its arguments
        open, or if the block is not one) and the block's end (None while it is open)."""
        header = self.read_header(text, i)
        if header is None:
            return None, None
        name, call_id, start = header
        if not self.knows(name) or start >= len(text) or text[start] != "{":
            return None, None
        end = object_members(text, start)[1]
        arguments = text[start:end]  # to the text's end while the object is open
        if end is None:
            return ParsedCall(name, arguments, id=call_id), None
        k = skip_ws(text, end)
        if self.CLOSING and text.startswith(self.CLOSING, k):
            k = skip_ws(text, k + len(self.CLOSING))
        close = k + len(self.CALL_END) if text.startswith(self.CALL_END, k) else None
        return ParsedCall(name, arguments, is_json(arguments), call_id), close
