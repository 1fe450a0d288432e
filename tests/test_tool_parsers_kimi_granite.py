"""vLLM's ``kimi_k2``, ``deepseek_v31``, ``granite``, ``internlm`` and ``llama4_json`` tool-call
parsers, and ``pythonic`` streaming a call as soon as its closing parenthesis arrives. Model
outputs written by hand in each family's documented format (vLLM's docs and parser tests);
the expected calls (name, arguments JSON text), content and ids are written out by hand. Every
stream, split at every point into two pieces, character by character, and into three pieces
(``stream_splits3``'s sample: every short middle piece, a stride of far cut pairs), joins to
exactly the whole reply."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.chat_output import ChatOutputParser
from kvflow.entrypoints.tool_parsers import make_tool_parser
from tests.tool_parser_streams import (
    HISTORY_READ,
    TOOLS,
    check_calls,
    check_content_only,
    history_read_back,
    read_streamed,
    stream_splits,
    stream_splits3,
)

KIMI = ('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris", "note": "}<|tool_call_end|>"}'
        '<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
        '<|tool_call_end|><|tool_calls_section_end|>')
KIMI_IDS = ["functions.get_weather:0", "functions.get_time:1"]
CB, CS, CE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_V31 = ("Sure.\n<｜tool▁calls▁begin｜>" + CB + "get_weather" + CS
                + '{"city": "東京", "days": 2}' + CE + CB + "get_time" + CS + "{}" + CE
                + "<｜tool▁calls▁end｜>")
GRANITE = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Boston", "tags": '
           '["a", "]"]}}, {"name": "get_time", "arguments": {}}]')
INTERNLM = ('I will look it up.<|action_start|><|plugin|>\n{"name": "get_weather", '
            '"parameters": {"city": "Paris"}}<|action_end|>')

WELL_FORMED = [
    ("kimi_k2", KIMI, "Let me check.",
     [("get_weather", '{"city": "Paris", "note": "}<|tool_call_end|>"}'), ("get_time", "{}")]),
    # text after the section is dropped, as vLLM drops it
    ("kimi_k2", KIMI + "\nDone.", "Let me check.",
     [("get_weather", '{"city": "Paris", "note": "}<|tool_call_end|>"}'), ("get_time", "{}")]),
    ("kimi_k2", ("<|tool_calls_section_begin|><|tool_call_begin|> get_time:0 "
     "<|tool_call_argument_begin|> {}<|tool_call_end|>"), None, [("get_time", "{}")]),
    ("deepseek_v31", DEEPSEEK_V31, "Sure.",
     [("get_weather", '{"city": "東京", "days": 2}'), ("get_time", "{}")]),
    ("granite", GRANITE, None,
     [("get_weather", '{"city": "Boston", "tags": ["a", "]"]}'), ("get_time", "{}")]),
    ("granite", ' <tool_call>[{"name": "get_time", "arguments": {"tz": "UTC"}}]', None,
     [("get_time", '{"tz": "UTC"}')]),
    ("granite", '[{"name": "get_time", "arguments": {}}] trailing', None, [("get_time", "{}")]),
    ("internlm", INTERNLM, "I will look it up.", [("get_weather", '{"city": "Paris"}')]),
    ("internlm2", INTERNLM, "I will look it up.", [("get_weather", '{"city": "Paris"}')]),
    ("internlm", ('<|action_start|><|plugin|>{"name": "get_time", "arguments": {"tz": "UTC"}}'
     '<|action_end|>\nmore<|action_start|><|plugin|>{"name": "get_time"}<|action_end|>'), None,
     [("get_time", '{"tz": "UTC"}')]),
    ("llama4_json", '{"name": "get_time", "parameters": {"tz": "UTC"}}', None,
     [("get_time", '{"tz": "UTC"}')]),
    # pythonic: calls read up to the first item that is not one; text after the list's "]"
    ("pythonic", '[get_weather(city="a)(]", days=3), get_time()]', None,
     [("get_weather", '{"city": "a)(]", "days": 3}'), ("get_time", "{}")]),
    ("pythonic", '[get_weather(city="""x")\'"""), get_time(tz=\'U"\\\'\')]', None,
     [("get_weather", '{"city": "x\\")\'"}'), ("get_time", '{"tz": "U\\"\'"}')]),
    ("pythonic", '[get_weather(city="a")', None, [("get_weather", '{"city": "a"}')]),
    ("pythonic", '[get_weather(city="a"))]', None, [("get_weather", '{"city": "a"}')]),
    ("pythonic", '[get_weather(city="a"), 3, get_time()]', None, [("get_weather", '{"city": "a"}')]),
    ("pythonic", '[get_time(), unknown(a=1)]', None, [("get_time", "{}")]),
    ("pythonic", '[get_weather(city="a")] and more', "and more", [("get_weather", '{"city": "a"}')]),
    ("llama4_pythonic", '<|python_start|>[get_time(tz="UTC")]<|python_end|> ok', "ok",
     [("get_time", '{"tz": "UTC"}')]),
]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_calls_whole_and_streamed(name, text, content, calls):
    check_calls(name, text, content, calls, [*stream_splits(text), *stream_splits3(text)])


def test_kimi_ids_are_the_models_own():
    """vLLM returns Kimi K2's functions.NAME:INDEX as the call's id, streamed or not."""
    out = ChatOutputParser(make_tool_parser("kimi_k2", TOOLS), None)
    message, _ = out.message(KIMI, "stop")
    assert [c.id for c in message.tool_calls] == KIMI_IDS
    for pieces in stream_splits(KIMI):
        assert read_streamed(out, pieces, "stop")[4] == KIMI_IDS


def test_pythonic_streams_each_call_at_its_closing_parenthesis():
    text = '[get_weather(city="a)", days=3), get_time()]'
    out = ChatOutputParser(make_tool_parser("pythonic", TOOLS), None)
    state, sent = out.stream_state(), []
    for i, ch in enumerate(text):
        delta, _ = out.delta(state, ch, None)
        for call in (delta.tool_calls or []) if delta else []:
            if call.function.name:
                sent.append((i, call.function.name))
    assert sent == [(text.index("3)") + 1, "get_weather"), (len(text) - 2, "get_time")]


MALFORMED = [
    ("kimi_k2", ("<|tool_calls_section_begin|><|tool_call_begin|>functions.unknown:0"
     "<|tool_call_argument_begin|>{}<|tool_call_end|>")),
    ("kimi_k2", ("x<|tool_calls_section_begin|><|tool_call_begin|>get_time"
     "<|tool_call_argument_begin|>{}<|tool_call_end|>")),  # no :INDEX
    ("kimi_k2", ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
     "<|tool_call_argument_begin|>nope<|tool_call_end|>")),
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + CB + "unknown" + CS + "{}" + CE),
    # DeepSeek-V3's form: "function" is no offered function's name
    ("deepseek_v31", "<｜tool▁calls▁begin｜>" + CB + "function" + CS + "get_time\n```json\n{}"
     "\n```" + CE),
    ("granite", "[1, 2]"),
    ("granite", '{"name": "get_time", "arguments": {}}'),
    ("granite", '<|tool_call|>[{"a": 1}]'),
    ("granite", 'Text [{"name": "get_time", "arguments": {}}]'),
    ("internlm", '<|action_start|><|plugin|>{"name": "unknown", "parameters": {}}<|action_end|>'),
    ("internlm", "Hi<|action_start|><|plugin|>not json<|action_end|>"),
    ("internlm", "<|action_start|><|interpreter|>print(1)<|action_end|>"),
    ("pythonic", '[get_weather("Paris"), get_time()]'),
    ("pythonic", "[x.get_weather(t=1)]"),
]


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_output_is_content(name, text):
    check_content_only(name, text, [*stream_splits(text), *stream_splits3(text)])


@pytest.mark.parametrize("name, reads, first_only", [
    ("kimi_k2", "functions.get_weather:0<|tool_call_argument_begin|>", False),
    ("deepseek_v31", "get_weather<｜tool▁sep｜>", False),
    ("granite", '<|tool_call|>[{"name": "get_weather"', False),
    ("internlm", '<|plugin|>\n{"name": "get_weather"', True),
    ("llama4_json", '{"name": "get_weather", "parameters"', False)])
def test_history_calls_as_text_parse_back(name, reads, first_only):
    calls = history_read_back(name, reads)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        HISTORY_READ[:1 if first_only else 2]


def test_special_token_markers_survive_detokenizing():
    keeps = {n: make_tool_parser(n).keeps_special_tokens
             for n in ("kimi_k2", "deepseek_v31", "internlm", "granite", "llama4_json",
                       "internlm2")}
    assert keeps == {"kimi_k2": True, "deepseek_v31": True, "internlm": True, "internlm2": True,
                     "granite": False, "llama4_json": False}
