"""Reading a chat reply back: reasoning and tool calls out of the generated text,
for whole responses and for streams (see ``tool_parsers`` for the parsers)."""

from __future__ import annotations

from kvflow.entrypoints.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from kvflow.entrypoints.tool_parsers import (
    ReasoningParser,
    StreamingToolState,
    ToolParser,
    make_reasoning_parser,
)

__all__ = ["ChatOutputParser", "make_reasoning_parser"]


class ChatOutputParser:
    """Turns a choice's text into an assistant message (content, reasoning, tool calls).

    Args:
        tool_parser: reads tool calls (None: the text is all content).
        reasoning: splits off the reasoning (``--reasoning-parser``; None: no split).
        max_calls: the most tool calls a reply carries (1 for ``parallel_tool_calls: false``,
            which OpenAI honours under ``tool_choice: "auto"`` too; None: all). Later calls
            the model wrote are dropped, streamed or not.
        calls_finish: the finish reason of a reply that stopped with tool calls:
            ``tool_calls``, or ``stop`` under a named ``tool_choice`` (OpenAI's answers,
            streamed or not; vLLM aligned with them in its PR 25054).
        include_reasoning: False (vLLM's request field): the reasoning is still split off
            the text, then dropped from messages and deltas (a delta holding only reasoning
            is not sent), as vLLM 0.32 drops it.
    """

    def __init__(self, tool_parser: ToolParser | None,
                 reasoning: ReasoningParser | None, max_calls: int | None = None,
                 calls_finish: str = "tool_calls", include_reasoning: bool = True) -> None:
        self.tool_parser, self.reasoning, self.max_calls = tool_parser, reasoning, max_calls
        self.calls_finish, self.include_reasoning = calls_finish, include_reasoning

    @property
    def hides_reasoning(self) -> bool:
        """Whether reasoning is split off and dropped (``include_reasoning: false`` with a
        reasoning parser): then the reply's per-token data (logprobs, token ids), which
        would show the reasoning, is left out too, as vLLM 0.32 leaves it out."""
        return self.reasoning is not None and not self.include_reasoning

    @property
    def is_plain(self) -> bool:
        return self.tool_parser is None and self.reasoning is None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the reply must be decoded with special tokens (the tool parser's or the
        reasoning parser's markers are special tokens, as Mistral's ``[TOOL_CALLS]`` and
        ``[THINK]``)."""
        return (self.tool_parser is not None and self.tool_parser.keeps_special_tokens) or \
            (self.reasoning is not None and self.reasoning.keeps_special_tokens)

    def note_prompt(self, prompt: str, grammar: bool = False) -> None:
        """Read the rendered prompt's end (see ``ReasoningParser.note_prompt``): one that
        opens the reasoning block starts the reply inside it, unless a ``grammar`` constrains
        the reply."""
        if self.reasoning is not None:
            self.reasoning.note_prompt(prompt, grammar)

    def message(self, text: str, finish_reason: str | None
                ) -> tuple[ChatResponseMessage, str | None]:
        """The whole message and its finish reason (``tool_calls`` when the reply stopped
        with tool calls; ``length`` stays ``length``). It carries exactly what the streamed
        deltas carry: every call whose name the parser read, with its arguments text as
        written (partial when ``max_tokens`` cut it, and possibly not valid JSON: OpenAI
        documents that clients must check), and text the parser treats as a call is never
        repeated as content."""
        reasoning, content = self.reasoning.split(text, True) if self.reasoning else (None, text)
        shown = reasoning if reasoning and self.include_reasoning else None  # none: null
        if self.tool_parser is None:  # all reasoning: no content (null), as streamed
            return ChatResponseMessage(content=content or None if reasoning else content,
                                       reasoning=shown), finish_reason
        parsed = self.tool_parser.parse(content, True)
        calls = [ToolCall(id=c.id or self.tool_parser.new_call_id(),
                          function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parsed.calls if c.name][:self.max_calls]
        if not calls:
            return ChatResponseMessage(content=parsed.content or None,
                                       reasoning=shown), finish_reason
        message = ChatResponseMessage(content=parsed.content or None, tool_calls=calls,
                                      reasoning=shown)
        return message, self.calls_finish if finish_reason == "stop" else finish_reason

    def stream_state(self) -> StreamingToolState:
        return StreamingToolState(self.tool_parser, self.reasoning, self.max_calls)

    def delta(self, state: StreamingToolState, text: str, finish_reason: str | None
              ) -> tuple[DeltaMessage | None, str | None]:
        """The delta message for new ``text`` (None if nothing to send yet) and the finish
        reason to report (``calls_finish`` once a call was streamed and the reply stopped)."""
        out = state.update(text, finish_reason is not None)
        calls: dict[int, DeltaToolCall] = {}
        for index, call_id, name, arguments in out.tool_calls:
            if index not in calls:
                calls[index] = DeltaToolCall(
                    index=index, id=call_id, type="function" if call_id else None,
                    function=DeltaFunctionCall(name=name, arguments=arguments))
            else:
                fn = calls[index].function
                fn.arguments = (fn.arguments or "") + arguments
        if finish_reason == "stop" and state.num_calls:
            finish_reason = self.calls_finish
        reasoning = out.reasoning if self.include_reasoning else None
        if not (out.content or reasoning or calls):
            return None, finish_reason
        return DeltaMessage(content=out.content or None, reasoning=reasoning or None,
                            tool_calls=list(calls.values()) or None), finish_reason
