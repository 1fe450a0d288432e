"""``deepseek_v31``: DeepSeek-V3.1's tool-call blocks, the name and the bare arguments JSON::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(no ``function`` type and no code fence, unlike ``deepseek_v3``); read as ``marked_blocks``
describes (text before the first block is content, after the calls dropped).
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import arguments_text, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.marked_blocks import FUNCTION_NAME, MarkedBlocksToolParser


class DeepSeekV31ToolParser(MarkedBlocksToolParser):
    name = "deepseek_v31"
    SECTION, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SEP = "<｜tool▁sep｜>"

    def read_header(self, text: str, i: int) -> tuple[str, str | None, int] | None:
        """``name<｜tool▁sep｜>``."""
        sep = text.find(self.SEP, i)
        name = text[i:sep].strip()
        if sep < 0 or not FUNCTION_NAME.match(name):
            return None
        return name, None, skip_ws(text, sep + len(self.SEP))

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You can call the functions below.\n" + listing + "\nTo call one, reply with "
                f"{self.SECTION}{self.CALL_BEGIN}name{self.SEP}{{arguments}}{self.CALL_END}"
                f"{self.SECTION_END}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        blocks = "".join(
            f"{self.CALL_BEGIN}{c['function']['name']}{self.SEP}"
            f"{arguments_text(c['function']['arguments'])}{self.CALL_END}" for c in calls)
        return f"{self.SECTION}{blocks}{self.SECTION_END}"
