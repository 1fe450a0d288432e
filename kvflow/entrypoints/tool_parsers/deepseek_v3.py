"""``deepseek_v3``: DeepSeek-V3's (0324) and DeepSeek-R1's (0528) tool-call blocks::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the markers use U+FF5C and U+2581), one ``tool▁call`` block per call; read as
``marked_blocks`` describes (text before the first block is content, after the calls dropped).
"""

from __future__ import annotations

from typing import Any

from kvflow.chat.tools_text import arguments_text, tools_listing
from kvflow.entrypoints.json_spans import skip_ws
from kvflow.entrypoints.tool_parsers.marked_blocks import MarkedBlocksToolParser


class DeepSeekV3ToolParser(MarkedBlocksToolParser):
    name = "deepseek_v3"
    SECTION, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SEP, FENCE, CLOSING = "<｜tool▁sep｜>", "```json", "```"

    def read_header(self, text: str, i: int) -> tuple[str, str | None, int] | None:
        """``function<｜tool▁sep｜>name``, a newline and the opening ```` ```json ```` fence."""
        sep = text.find(self.SEP, i)
        line_end = text.find("\n", sep)
        if sep < 0 or line_end < 0 or text[i:sep].strip() != "function":
            return None
        j = skip_ws(text, line_end)
        if not text.startswith(self.FENCE, j):
            return None
        return text[sep + len(self.SEP):line_end].strip(), None, skip_ws(text, j + len(self.FENCE))

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = tools_listing(tools)
        return ("You can call the functions below.\n" + listing + "\nTo call one, reply with "
                f"{self.SECTION}{self.CALL_BEGIN}function{self.SEP}name\n{self.FENCE}\n"
                f"{{arguments}}\n```{self.CALL_END}{self.SECTION_END}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        blocks = "".join(
            f"{self.CALL_BEGIN}function{self.SEP}{c['function']['name']}\n{self.FENCE}\n"
            f"{arguments_text(c['function']['arguments'])}\n```{self.CALL_END}" for c in calls)
        return f"{self.SECTION}{blocks}{self.SECTION_END}"
