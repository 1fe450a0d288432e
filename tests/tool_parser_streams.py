"""Shared checks of the tool-call parser tests (``tests/test_tool_parsers_*.py``): the tools the
hand-written replies call, the ways a reply is split into stream pieces, a client's joining of
the streamed deltas, and the whole-reply / streamed / history round-trip assertions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from kvflow.config import ServerConfig
from kvflow.entrypoints.chat_output import ChatOutputParser
from kvflow.entrypoints.protocol import ChatCompletionRequest
from kvflow.entrypoints.tool_parsers import make_tool_parser

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"},
    "units": {"type": ["string", "null"]}, "opts": {"type": "object"},
    "ok": {"type": "boolean"}, "t": {"type": "number"}, "tags": {"type": "array"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
# An earlier assistant turn's two calls (the second with empty arguments), and what reads back
HISTORY = [{"id": "c1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "東京", "days": 2}'}},
           {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": ""}}]
HISTORY_READ = [("get_weather", {"city": "東京", "days": 2}), ("get_time", {})]


def stream_splits(text: str):
    """Every way the tests split a stream: at each single point, and character by character."""
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


# A middle piece of up to SPLIT3_NEAR characters: longer than every marker of the parsers'
# formats (the longest, kimi_k2's "<|tool_calls_section_begin|>", is 28), so each marker is cut
# twice in every way, and each pair of nearby tokens is cut in every way.
SPLIT3_NEAR = 32
# Farther cut pairs: every SPLIT3_STRIDE-th second cut for each first cut (i + j fixed modulo
# the stride, so the kept second cuts shift with the first).
SPLIT3_STRIDE = 13


def stream_splits3(text: str):
    """Splits into three non-empty pieces at cuts i < j: every pair with a middle piece of at
    most ``SPLIT3_NEAR`` characters, and every pair with ``(i + j) % SPLIT3_STRIDE == 0``.
    Every first cut is so paired with a second cut inside every later token (marker, name,
    value, content) of at least ``SPLIT3_STRIDE`` characters and every second cut with a first
    cut inside every such earlier token, at about a quarter of all ``len(text)**2 / 2`` pairs
    on the longer replies (each pair is a whole stream to parse: all of them took ~5 s per
    long reply on 2 cores)."""
    for i in range(1, len(text) - 1):
        for j in range(i + 1, len(text)):
            if j - i <= SPLIT3_NEAR or (i + j) % SPLIT3_STRIDE == 0:
                yield [text[:i], text[i:j], text[j:]]


def read_streamed(out: ChatOutputParser, parts: list[str], finish: str):
    """(content or None, reasoning or None, [(name, arguments)] or None, finish_reason, ids,
    argument pieces sent) as a client joins the stream's deltas."""
    state, content, reasoning, calls, reason, n_args = out.stream_state(), "", "", {}, None, 0
    for i, piece in enumerate(parts):
        delta, reason = out.delta(state, piece, finish if i == len(parts) - 1 else None)
        if delta is None:
            continue
        content += delta.content or ""
        reasoning += delta.reasoning or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, [None, "", None])
            entry[0] = call.function.name or entry[0]
            entry[2] = call.id or entry[2]
            entry[1] += call.function.arguments or ""
            n_args += bool(call.function.arguments)
    listed = [(calls[i][0], calls[i][1]) for i in sorted(calls)]
    return (content or None, reasoning or None, listed or None, reason,
            [calls[i][2] for i in sorted(calls)], n_args)


def read_whole(out: ChatOutputParser, text: str, finish: str = "stop"):
    """(content, reasoning or None, [(name, arguments)] or None, finish_reason) of the reply
    read whole (not streamed)."""
    message, reason = out.message(text, finish)
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content, message.reasoning or None, calls or None, reason


def check_calls(name: str, text: str, content: str | None, calls: list[tuple[str, str]],
                streams: Iterable[list[str]]) -> ChatOutputParser:
    """Parser ``name`` reads ``calls`` (valid JSON arguments) and ``content`` from ``text``
    whole, and so does every stream of it split as ``streams``; returns the output parser."""
    out = ChatOutputParser(make_tool_parser(name, TOOLS), None)
    assert read_whole(out, text) == (content, None, calls, "tool_calls")
    for c in calls:
        json.loads(c[1])
    for parts in streams:
        assert read_streamed(out, parts, "stop")[:4] == (content, None, calls, "tool_calls"), parts
    return out


def check_content_only(name: str, text: str, streams: Iterable[list[str]]) -> None:
    """Parser ``name`` reads no call from ``text``: the whole reply is content (finish_reason
    stop), whole and in every stream of it split as ``streams``."""
    out = ChatOutputParser(make_tool_parser(name, TOOLS), None)
    assert read_whole(out, text) == (text, None, None, "stop")
    for parts in streams:
        assert read_streamed(out, parts, "stop")[:4] == (text, None, None, "stop"), parts


def history_read_back(name: str, reads: str, history: list[dict[str, Any]] = HISTORY) -> list:
    """The calls parser ``name`` reads back from its own ``calls_text(history)`` (which must
    contain ``reads``, with no content around the calls)."""
    parser = make_tool_parser(name, TOOLS)
    text = parser.calls_text(history)
    assert reads in text
    parsed = parser.parse(text, True)
    assert parsed.content == ""
    return parsed.calls


def served_parser(config: ServerConfig, **fields: Any) -> ChatOutputParser:
    """The output parser the server builds for a chat request with ``TOOLS`` (auto) and the
    request ``fields``."""
    from kvflow.entrypoints.serving_chat import OpenAIServingChat

    chat = OpenAIServingChat(SimpleNamespace(tokenizer=None), config, "m")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                **fields)
    return asyncio.run(chat._tools(req))[1]
