"""vLLM's other --tool-call-parser / --reasoning-parser names: ``mistral``, ``pythonic``,
``qwen3_coder``; ``deepseek_r1``, ``qwen3``, ``granite``. Model outputs written by hand in each
family's documented format; the expected calls (name, arguments JSON text) and content are
computed by hand. Every stream (split at every point, and character by character) must join
to exactly the whole reply; malformed output is plain content, never an error."""

from __future__ import annotations

import json

import pytest

from kvflow.config import ServerConfig
from kvflow.entrypoints.chat_output import ChatOutputParser
from kvflow.entrypoints.cli import build_parser
from kvflow.entrypoints.tool_parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    make_reasoning_parser,
    make_tool_parser,
)
from kvflow.entrypoints.tool_parsers.qwen3_coder import schema_value
from tests.tool_parser_streams import (
    HISTORY,
    TOOLS,
    check_calls,
    check_content_only,
    history_read_back,
    read_streamed,
    read_whole,
    served_parser,
    stream_splits,
)

MISTRAL_LIST = ('Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
                '"Paris", "note": "a ] [ \\"q\\""}}, {"name": "get_time", "arguments": {}}]')
MISTRAL_NAMED = ('Sure [TOOL_CALLS]get_weather[ARGS]{"city": "東京", "days": 2}'
                 '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}')
PYTHONIC = ('[get_weather(city="San Francisco", days=3, opts={"units": \'metric\', '
            '"hours": (6, 18)}, ok=True, units=None), get_time()]')
LLAMA4 = '<|python_start|>[get_time(tz="UTC")]<|python_end|>'
QWEN3_CODER = ('I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n'
               'New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=units>\n'
               'null\n</parameter>\n<parameter=opts>\n{"a": [1, 2]}\n</parameter>\n'
               '<parameter=ok>\nFalse\n</parameter>\n<parameter=t>\n-2.5e1\n</parameter>\n'
               '<parameter=tags>\n[\'x\', "y"]\n</parameter>\n<parameter=code>\ndef f():\n'
               '    return 1\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
               '<function=get_time>\n</function>\n</tool_call>')
B, E = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```<｜tool▁call▁end｜>"
DEEPSEEK_V3 = ('Checking.\n<｜tool▁calls▁begin｜>' + B + 'get_weather\n```json\n{"city": "Paris", '
               '"note": "```"}' + E + B + "get_time\n```json\n{}" + E + "<｜tool▁calls▁end｜>")

WELL_FORMED = [
    ("mistral", MISTRAL_LIST, "Let me look.",
     [("get_weather", '{"city": "Paris", "note": "a ] [ \\"q\\""}'), ("get_time", "{}")]),
    ("mistral", MISTRAL_NAMED, "Sure",
     [("get_weather", '{"city": "東京", "days": 2}'), ("get_time", "{}")]),
    ("pythonic", PYTHONIC, None,
     [("get_weather", ('{"city": "San Francisco", "days": 3, "opts": {"units": "metric", '
                      '"hours": [6, 18]}, "ok": true, "units": null}')), ("get_time", "{}")]),
    ("llama4_pythonic", LLAMA4, None, [("get_time", '{"tz": "UTC"}')]),
    ("qwen3_coder", QWEN3_CODER, "I will check.",
     [("get_weather", ('{"city": "New York", "days": 3, "units": null, "opts": {"a": [1, 2]}, '
                      '"ok": false, "t": -25.0, "tags": ["x", "y"], '
                      '"code": "def f():\\n    return 1"}')), ("get_time", "{}")]),
    ("deepseek_v3", DEEPSEEK_V3, "Checking.",
     [("get_weather", '{"city": "Paris", "note": "```"}'), ("get_time", "{}")]),
]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED,
                         ids=["mistral-list", "mistral-args", "pythonic", "llama4", "qwen3_coder",
                              "deepseek_v3"])
def test_calls_whole_and_streamed(name, text, content, calls):
    out = check_calls(name, text, content, calls, stream_splits(text))
    if name == "qwen3_coder":  # arguments stream a parameter at a time, not at the end
        # get_weather: "{", its 8 parameters, "}"; get_time: "{", "}"
        assert read_streamed(out, list(text), "stop")[5] == 12
    if name == "deepseek_v3":  # arguments stream as the model writes them
        assert read_streamed(out, list(text), "stop")[5] > 10
    if name == "mistral":  # Mistral's templates accept only 9-character ids back
        ids = read_streamed(out, [text], "stop")[4]
        assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
        message, _ = out.message(text, "stop")
        assert all(len(c.id) == 9 for c in message.tool_calls)


MALFORMED = [
    ("mistral", '[TOOL_CALLS]unknown_fn[ARGS]{"a": 1}'),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS] not a call"),
    ("mistral", "Hi [TOOL_CALLS]get_weather"),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}"),
    ("mistral", "[TOOL_CALLS]get_time[ARGS] nope"),
    ("pythonic", '[get_weather(city=os.system("x"))]'),
    ("pythonic", '[get_weather(city=__import__("os"))]'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", "[unknown(a=1)]"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[]"),
    ("pythonic", '[get_weather(**{"city": "a"})]'),
    ("pythonic", "[get_weather(tags={1, 2})]"),
    ("pythonic", "[get_weather(t=1e999)]"),
    ("pythonic", "[get_weather(t=b'x')]"),
    ("pythonic", "[x.get_weather(t=1)]"),
    ("qwen3_coder", "x <tool_call>\n<function=unknown>\n</function>\n</tool_call>"),
    ("qwen3_coder", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather"),
    ("qwen3_coder", "<tool_call>\n<function=get weather>\n</function>\n</tool_call>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + B + "unknown\n```json\n{}" + E),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>" + B + "get_time\n{}" + E),
    ("deepseek_v3", "So <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"),
]


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_output_is_content(name, text):
    """Unbalanced brackets, non-literal Python, unknown functions, no call at all: the whole
    reply is content (finish_reason stop), streamed or not."""
    check_content_only(name, text, stream_splits(text))


@pytest.mark.parametrize("text", ["The answer is [1].", "[1, 2] are numbers", "[see above]"])
def test_pythonic_plain_text_streams_at_once(text):
    """A reply that cannot be a call list is sent as it comes, not held to the end."""
    out = ChatOutputParser(make_tool_parser("pythonic", TOOLS), None)
    state = out.stream_state()
    sent = ""
    for ch in text[:-1]:
        delta, _ = out.delta(state, ch, None)
        sent += (delta.content or "") if delta else ""
    assert sent == text[:-1]


def test_a_cut_qwen3_coder_call_keeps_the_parameters_read():
    """max_tokens cut the call: the message has what the stream sent (the closed
    parameters, no closing brace), finish_reason length."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n4")
    out = ChatOutputParser(make_tool_parser("qwen3_coder", TOOLS), None)
    expected = (None, None, [("get_weather", '{"city": "Oslo"')], "length")
    assert read_whole(out, text, "length") == expected
    for pieces in stream_splits(text):
        assert read_streamed(out, pieces, "length")[:4] == expected


@pytest.mark.parametrize("raw, schema, expected", [
    ("42", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),  # not an integer: the text stays a string
    ("1e3", {"type": "number"}, 1000.0),
    ("7", {"type": "number"}, 7),
    ("nan", {"type": "number"}, "nan"),
    (" TRUE ", {"type": "boolean"}, True),
    ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": ["integer", "null"]}, None),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 5),
    ("null", {"type": "string"}, "null"),
    ("{'a': True}", {"type": "object"}, {"a": True}),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),
    ("(1, 2)", {"type": "array"}, [1, 2]),
    ("  spaced \n", {"type": "string"}, "  spaced \n"),
    ("3", None, "3"),  # a parameter the schema does not list: a string
])
def test_qwen3_coder_values_typed_by_the_schema(raw, schema, expected):
    assert schema_value(raw, schema) == expected
    assert type(schema_value(raw, schema)) is type(expected)


@pytest.mark.parametrize("name, reads", [("mistral", "[TOOL_CALLS]"), ("pythonic", "[get_"),
                                         ("qwen3_coder", "<function=get_weather>"),
                                         ("deepseek_v3", "<｜tool▁sep｜>get_weather\n")])
def test_history_calls_as_text_parse_back(name, reads):
    """An earlier turn's tool_calls, for a template that renders none, in the parser's own
    format: the parser reads the same calls back."""
    history = [{**HISTORY[0], "function": {
                   "name": "get_weather", "arguments": '{"city": "東京", "days": 2, "ok": true}'}},
               HISTORY[1]]
    calls = history_read_back(name, reads, history)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in calls] == \
        [("get_weather", {"city": "東京", "days": 2, "ok": True}, True), ("get_time", {}, True)]


REASONING = [
    ("deepseek_r1", "Let me think.\nStep 2.</think>\n\nAnswer: 4", "Let me think.\nStep 2.",
     "Answer: 4"),
    ("deepseek_r1", "<think>\nA</think>B", "\nA", "B"),
    ("deepseek_r1", "cut before the end", "cut before the end", None),
    ("qwen3", "<think>\nA\n</think>\n\nB", "\nA\n", "B"),
    ("qwen3", "Plain answer", None, "Plain answer"),
    ("qwen3", "A</think>B", None, "A</think>B"),
    ("granite", "Here is my thought process:\nI add.\nHere is my response:\n4", "\nI add.\n",
     "4"),
    ("granite", "Here's my thought process: x Here's my response: y", " x ", "y"),
    ("granite", "Just 4", None, "Just 4"),
    ("think", "<think>a</think>b", "a", "b"),
]


@pytest.mark.parametrize("name, text, reasoning, content", REASONING)
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    out = ChatOutputParser(None, make_reasoning_parser(name))
    assert read_whole(out, text)[:2] == (content, reasoning)
    for pieces in stream_splits(text):
        assert read_streamed(out, pieces, "stop")[:2] == (content, reasoning), pieces


def test_qwen3_reasoning_then_qwen3_coder_call():
    text = "<think>\nNeed the time.\n</think>\n\n" + QWEN3_CODER[QWEN3_CODER.index("<tool_call>"):]
    out = ChatOutputParser(make_tool_parser("qwen3_coder", TOOLS), make_reasoning_parser("qwen3"))
    whole = read_whole(out, text)
    assert whole[1] == "\nNeed the time.\n" and whole[0] is None
    assert [c[0] for c in whole[2]] == ["get_weather", "get_time"]
    for pieces in stream_splits(text):
        assert read_streamed(out, pieces, "stop")[:4] == whole


def test_server_passes_the_tools_and_the_thinking_switch():
    config = ServerConfig(tool_call_parser="qwen3_coder", reasoning_parser="qwen3")
    parser = served_parser(config)
    text = "<think>r</think>" + QWEN3_CODER
    assert read_whole(parser, text)[1:3] == ("r", WELL_FORMED[4][3])  # typed: the tools arrived
    assert not parser.keeps_special_tokens
    off = served_parser(config, chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning is None
    assert read_whole(off, "<think>r</think>Hi") == ("<think>r</think>Hi", None, None, "stop")
    default_off = ServerConfig(reasoning_parser="qwen3",
                               default_chat_template_kwargs='{"enable_thinking": false}')
    assert served_parser(default_off).reasoning is None
    assert served_parser(default_off, chat_template_kwargs={"enable_thinking": True}) \
        .reasoning is not None
    mistral = served_parser(ServerConfig(tool_call_parser="mistral"))
    assert mistral.keeps_special_tokens  # [TOOL_CALLS] must survive detokenizing
    forced = served_parser(ServerConfig(tool_call_parser="mistral"), tool_choice="required")
    assert not forced.keeps_special_tokens  # forced JSON: as before


def test_flags_accept_vllm_names_and_refuse_others():
    def config(*argv: str) -> ServerConfig:
        return ServerConfig.from_cli_args(build_parser().parse_args(["serve", *argv]), env={})

    for name in TOOL_PARSERS:
        assert config("--model", "M", "--tool-call-parser", name).tool_call_parser == name
    for name in REASONING_PARSERS:
        assert config("--model", "M", "--reasoning-parser", name).reasoning_parser == name
    assert sorted(TOOL_PARSERS) == ["deepseek_v3", "deepseek_v31", "glm45", "granite",
                                    "granite-20b-fc", "hermes", "hunyuan_a13b", "internlm",
                                    "internlm2", "jamba", "kimi_k2", "llama3_json",
                                    "llama4_json", "llama4_pythonic", "minimax", "mistral",
                                    "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml",
                                    "seed_oss", "step3", "xlam"]
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "deepseek_v3", "ernie45", "glm45",
                                         "granite", "hunyuan_a13b", "mistral", "qwen3",
                                         "seed_oss", "step3", "think"]
    with pytest.raises(ValueError, match="tool_call_parser='bogus'.*qwen3_coder"):
        ServerConfig(tool_call_parser="bogus")
    with pytest.raises(ValueError, match="reasoning_parser='r1'.*deepseek_r1"):
        ServerConfig(reasoning_parser="r1")
    with pytest.raises(ValueError, match="choose one of.*pythonic"):
        make_tool_parser("bogus")
    with pytest.raises(ValueError, match="choose one of.*granite"):
        make_reasoning_parser("bogus")


# Qwen3-Coder often leaves out the opening <tool_call> (and keeps the closing one)
BARE_CALLS = [
    ("I'll check.\n\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     + "</function>\n</tool_call>", "I'll check.", [("get_weather", '{"city": "Paris"}')]),
    ("<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     + "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", None,
     [("get_time", "{}"), ("get_weather", '{"days": 2}')]),
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<function=get_weather>\n"
     + "<parameter=city>\nP\n</parameter>\n</function>", None,
     [("get_time", "{}"), ("get_weather", '{"city": "P"}')]),
]


@pytest.mark.parametrize("name", ["qwen3_coder", "qwen3_xml", "seed_oss"])
@pytest.mark.parametrize("text, content, calls", BARE_CALLS, ids=["orphan-close", "then-wrapped",
                                                                  "after-wrapped"])
def test_a_call_without_its_opening_tag(name, text, content, calls):
    """A bare <function=NAME> block (no <tool_call> before it) is a call, as vLLM reads it:
    it was content, the raw XML shown to the user and the call lost (and a wrapped call
    after it read, so the reply mixed both). Whole and in every 2-piece and 1-char split."""
    if name == "seed_oss":
        text = text.replace("tool_call>", "seed:tool_call>")
    check_calls(name, text, content, calls, stream_splits(text))


@pytest.mark.parametrize("name", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("text", ["Write <function=foo> in your code.",
                                  "Call <function=get_time> later, or now.",
                                  "Use <function=get_time>x</function> there",
                                  "It is <function=get weather>\n</function>"])
def test_function_tag_in_prose_stays_content(name, text):
    """``<function=`` in prose (a function not offered, or not followed by a parameter or
    ``</function>``) is not read as a bare call: the reply is content, streamed or not."""
    check_content_only(name, text, stream_splits(text))
