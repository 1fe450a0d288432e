"""vLLM's ``jamba`` and ``xlam`` tool-call parsers: model outputs written by hand in each
family's documented format (vLLM's docs and parser tests); the expected calls (name,
arguments JSON text) and content are written out by hand. Every stream, split at every point
into two pieces, character by character, and into three pieces (``stream_splits3``'s sample:
every short middle piece, a stride of far cut pairs), joins to exactly the whole reply."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.tool_parsers import make_tool_parser
from tests.tool_parser_streams import (
    HISTORY_READ,
    check_calls,
    check_content_only,
    history_read_back,
    stream_splits,
    stream_splits3,
)

JAMBA = ('Let me check.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", '
         '"note": "]</tool_calls>"}}, {"name": "get_time", "arguments": {}}]</tool_calls>')

WELL_FORMED = [
    ("jamba", JAMBA, "Let me check.",
     [("get_weather", '{"city": "Paris", "note": "]</tool_calls>"}'), ("get_time", "{}")]),
    # text after the list is dropped, as vLLM drops it; a missing arguments member is {}
    ("jamba", '<tool_calls> [ {"name": "get_time"} ] </tool_calls> Done.', None,
     [("get_time", "{}")]),
    ("xlam", ('[{"name": "get_weather", "arguments": {"city": "[TOOL_CALLS]```"}}, '
              '{"name": "get_time", "arguments": {"tz": "UTC"}}]'), None,
     [("get_weather", '{"city": "[TOOL_CALLS]```"}'), ("get_time", '{"tz": "UTC"}')]),
    ("xlam", 'Let me check.\n```json\n[{"name": "get_time", "arguments": {}}]\n```',
     "Let me check.", [("get_time", "{}")]),
    ("xlam", '```\n[{"name": "get_time", "arguments": {"tz": "UTC"}}]\n```\nDone.', None,
     [("get_time", '{"tz": "UTC"}')]),
    ("xlam", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     "Sure.", [("get_weather", '{"city": "Paris"}')]),
]

MALFORMED = [
    ("jamba", "Hi <tool_calls>not json</tool_calls>"),
    ("jamba", '<tool_calls>[{"a": 1}]</tool_calls>'),
    ("jamba", "<tool_calls>[]</tool_calls>"),
    ("jamba", '<tool_calls>{"name": "get_time", "arguments": {}}</tool_calls>'),
    ("jamba", "Just text, no calls."),
    ("xlam", "Here is code:\n```python\nprint([1])\n```"),
    ("xlam", "[1, 2, 3]"),
    ("xlam", '[{"city": "Paris"}]'),
    ("xlam", '{"name": "get_time", "arguments": {}}'),
    ("xlam", 'Text [{"name": "get_time", "arguments": {}}]'),
    ("xlam", "[TOOL_CALLS] nothing"),
    ("xlam", "No calls at all."),
]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_calls_whole_and_streamed(name, text, content, calls):
    check_calls(name, text, content, calls,
                [*stream_splits(text), *stream_splits3(text), list(text)])


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_output_is_content(name, text):
    check_content_only(name, text, [*stream_splits(text), *stream_splits3(text), list(text)])


@pytest.mark.parametrize("name, reads", [
    ("jamba", '<tool_calls>[{"name": "get_weather", "arguments": {"city"'),
    ("xlam", '[{"name": "get_weather", "arguments": {"city"')])
def test_history_calls_as_text_parse_back(name, reads):
    calls = history_read_back(name, reads)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == HISTORY_READ


def test_only_jamba_keeps_special_tokens():
    """<tool_calls> is a special token of Jamba's tokenizer (vLLM decodes with it); xLAM's
    output is plain text."""
    assert make_tool_parser("jamba").keeps_special_tokens is True
    assert make_tool_parser("xlam").keeps_special_tokens is False
