"""Streaming: one choice's text so far re-parsed at every delta, sending only what is new.
A parser's content, reasoning and each call's arguments only grow as the text does, so the
streamed pieces join to exactly what the whole-text parse gives."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.entrypoints.tool_parsers.base import ParsedOutput, ToolParser
from kvflow.entrypoints.tool_parsers.reasoning import ReasoningParser


@dataclass
class StreamDelta:
    """What to send for one choice: new reasoning / content text and tool-call pieces
    (index, id or None, name or None, argument text)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)



class StreamingToolState:
    """One choice's streaming state: the text so far and what has been sent of it.

    Args:
        parser: the tool parser, or None (content only).
        reasoning: the reasoning parser, or None.
        max_calls: the most calls to send (1 for ``parallel_tool_calls: false``; None: all);
            later calls in the text are dropped.
    """

    def __init__(self, parser: ToolParser | None,
                 reasoning: ReasoningParser | None = None,
                 max_calls: int | None = None) -> None:
        self.parser, self.reasoning, self.max_calls = parser, reasoning, max_calls
        self.text = ""
        self._sent_reasoning = self._sent_content = 0
        self._sent_args: list[int] = []  # per call: argument characters sent (-1: no header)
        self.ids: list[str] = []

    def update(self, delta_text: str, final: bool) -> StreamDelta:
        """Fold in new text; returns only what was not sent before."""
        self.text += delta_text
        reasoning, content = (self.reasoning.split(self.text, final) if self.reasoning
                              else ("", self.text))
        out = StreamDelta(reasoning=reasoning[self._sent_reasoning:])
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        parsed = self.parser.parse(content, final) if self.parser else ParsedOutput(content)
        out.content = parsed.content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(parsed.content))
        for index, call in enumerate(parsed.calls[:self.max_calls]):
            if index == len(self._sent_args):
                if call.name is None:
                    break  # arguments wait for the name
                self.ids.append(call.id or self.parser.new_call_id())
                self._sent_args.append(0)
                out.tool_calls.append((index, self.ids[index], call.name, ""))
            piece = call.arguments[self._sent_args[index]:]
            if piece:
                out.tool_calls.append((index, None, None, piece))
                self._sent_args[index] = len(call.arguments)
        return out

    @property
    def num_calls(self) -> int:
        return len(self._sent_args)
