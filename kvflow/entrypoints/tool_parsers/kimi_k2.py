"""``kimi_k2``: Kimi K2's tool-call section, each call headed by its id::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The id is ``functions.NAME:INDEX`` (``NAME:INDEX`` also read); the function's name is the part
between the last ``.`` and the ``:``, and the id is the call's ``tool_calls[].id`` as written,
as vLLM returns it (Kimi's chat template writes it back in the next turn). Read as
``marked_blocks`` describes (text before the section is content, after the calls dropped).
"""

from __future__ import annotations

import re
from typing import Any

from kvflow.chat.tools_text import arguments_text, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.marked_blocks import MarkedBlocksToolParser

_CALL_ID = re.compile(r"(?:[A-Za-z0-9_\-]+\.)*([A-Za-z0-9_\-]+):\d+\Z")


class KimiK2ToolParser(MarkedBlocksToolParser):
    name = "kimi_k2"
    SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
    ARGUMENTS = "<|tool_call_argument_begin|>"

    def read_header(self, text: str, i: int) -> tuple[str, str | None, int] | None:
        """``functions.NAME:INDEX<|tool_call_argument_begin|>``."""
        arguments = text.find(self.ARGUMENTS, i)
        call_id = text[i:arguments].strip()
        match = _CALL_ID.match(call_id) if arguments >= 0 else None
        if match is None:
            return None
        return match.group(1), call_id, skip_ws(text, arguments + len(self.ARGUMENTS))

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You can call the functions below.\n" + listing + "\nTo call one, reply with "
                f"{self.SECTION}{self.CALL_BEGIN}functions.name:0{self.ARGUMENTS}{{arguments}}"
                f"{self.CALL_END}{self.SECTION_END}, numbering the calls 0, 1, ...")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """Each call with the id Kimi's format gives it, ``functions.NAME:INDEX`` (an id in
        that form is kept)."""
        blocks = []
        for index, c in enumerate(calls):
            name = c["function"]["name"]
            call_id = c.get("id") or ""
            if not (_CALL_ID.match(call_id) and _CALL_ID.match(call_id).group(1) == name):
                call_id = f"functions.{name}:{index}"
            blocks.append(f"{self.CALL_BEGIN}{call_id}{self.ARGUMENTS}"
                          f"{arguments_text(c['function']['arguments'])}{self.CALL_END}")
        return f"{self.SECTION}{''.join(blocks)}{self.SECTION_END}"
