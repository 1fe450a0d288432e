"""``deepseek_v3``: DeepSeek-V3's (0324) and DeepSeek-R1's (0528) tool-call blocks::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the markers use U+FF5C and U+2581), one ``tool▁call`` block per call. Text before the first
block is content; text after the calls is dropped. A call is read from its arguments' ``{``
on, so a block that turns out malformed before it was never streamed; a call to a function
the request did not offer ends the reading (with no call read, the whole reply is content).
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.entrypoints.json_spans import object_members, skip_ws
from kvflow.entrypoints.tool_parsers.base import (
    ParsedCall,
    ParsedOutput,
    ToolParser,
    calls_or_content,
    is_json,
    until_marker,
)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    keeps_special_tokens = True
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SEP, FENCE = "<｜tool▁sep｜>", "```json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out, first = until_marker(text, self.CALLS_BEGIN, final)
        if first < 0:
            return out
        pos = skip_ws(text, first + len(self.CALLS_BEGIN))
        while text.startswith(self.CALL_BEGIN, pos):
            call, end = self._read_call(text, pos + len(self.CALL_BEGIN))
            if call is None:
                break
            out.calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
        return calls_or_content(out, text, final)

    def _read_call(self, text: str, i: int) -> tuple[ParsedCall | None, int | None]:
        """The call of the block whose body starts at ``text[i]`` (None until its arguments
        open, or if the block is not one) and the block's end (None while it is open)."""
        sep = text.find(self.SEP, i)
        line_end = text.find("\n", sep)
        if sep < 0 or line_end < 0 or text[i:sep].strip() != "function":
            return None, None
        name = text[sep + len(self.SEP):line_end].strip()
        j = skip_ws(text, line_end)
        if not self.knows(name) or not text.startswith(self.FENCE, j):
            return None, None
        start = skip_ws(text, j + len(self.FENCE))
        if start >= len(text) or text[start] != "{":
            return None, None
        end = object_members(text, start)[1]
        arguments = text[start:end]  # to the text's end while the object is open
        if end is None:
            return ParsedCall(name, arguments), None
        k = skip_ws(text, end)
        k = skip_ws(text, k + 3) if text.startswith("```", k) else k
        close = k + len(self.CALL_END) if text.startswith(self.CALL_END, k) else None
        return ParsedCall(name, arguments, is_json(arguments)), close

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You can call the functions below.\n" + listing + "\nTo call one, reply with "
                f"{self.CALLS_BEGIN}{self.CALL_BEGIN}function{self.SEP}name\n{self.FENCE}\n"
                f"{{arguments}}\n```{self.CALL_END}{self.CALLS_END}")

    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        blocks = "".join(
            f"{self.CALL_BEGIN}function{self.SEP}{c['function']['name']}\n{self.FENCE}\n"
            f"{c['function']['arguments'].strip() or '{}'}\n```{self.CALL_END}" for c in calls)
        return f"{self.CALLS_BEGIN}{blocks}{self.CALLS_END}"
