"""vLLM's ``glm45``, ``qwen3_xml``, ``minimax``, ``phi4_mini_json``, ``seed_oss``,
``hunyuan_a13b``, ``step3`` and ``granite-20b-fc`` tool-call parsers: model outputs written by
hand in each family's format (its chat template / vLLM's docs); the expected calls (name,
arguments JSON text) and content are written out by hand. Every stream, split at every point
into two pieces, character by character, and into three pieces (``stream_splits3``'s sample:
every short middle piece, a stride of far cut pairs), joins to exactly the whole reply."""

from __future__ import annotations

import json

import pytest

from kvflow.config import ServerConfig
from kvflow.entrypoints.chat_output import ChatOutputParser
from kvflow.entrypoints.tool_parsers import make_reasoning_parser, make_tool_parser
from tests.tool_parser_streams import (
    HISTORY_READ,
    TOOLS,
    check_calls,
    check_content_only,
    history_read_back,
    read_streamed,
    read_whole,
    served_parser,
    stream_splits,
    stream_splits3,
)

GLM = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> New York "
       "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>"
       '\n<arg_value>{"a": [1, "</tool_call>"]}</arg_value>\n<arg_key>x</arg_key>\n'
       "<arg_value>True</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>")
GLM_WS = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>  Oslo\n</arg_value>\n"
          "<arg_key>days</arg_key>\n<arg_value> 3 </arg_value>\n</tool_call>")
SEED = ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</seed:tool_call>")
S_CALL = "<｜tool_call_begin｜>function<｜tool_sep｜>"
STEP3 = ("Sure.<｜tool_calls_begin｜>" + S_CALL + '<steptml:invoke name="get_weather">'
         '<steptml:parameter name="city"> Paris </steptml:parameter><steptml:parameter '
         'name="days">4</steptml:parameter><steptml:parameter name="ok">TRUE'
         "</steptml:parameter></steptml:invoke><｜tool_call_end｜>" + S_CALL
         + '<steptml:invoke name="get_time"></steptml:invoke><｜tool_call_end｜>'
         "<｜tool_calls_end｜> Done.")

WELL_FORMED = [
    # values: a string-typed or untyped parameter (x is not in the schema) stays text as
    # written, others read as JSON, else as a Python literal; text between and after the
    # blocks is dropped
    ("glm45", GLM, "Let me check.",
     [("get_weather", ('{"city": " New York ", "days": 3, "opts": {"a": [1, "</tool_call>"]}, '
                      '"x": "True"}')), ("get_time", "{}")]),
    # a string value's spaces and newlines are the value's (GLM's template writes it verbatim;
    # they were stripped): vLLM 0.32's glm45 reads exactly these arguments, whole and streamed
    ("glm45", GLM_WS, None, [("get_weather", '{"city": "  Oslo\\n", "days": 3}')]),
    ("qwen3_xml", ("Hi\n<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n</parameter>\n"
     "</function>\n</tool_call>"), "Hi", [("get_weather", '{"days": 5}')]),
    ("seed_oss", "Checking." + SEED, "Checking.",
     [("get_weather", '{"city": "Oslo", "days": 2}')]),
    ("minimax", ('Let me check.\n<tool_calls>\n{"name": "get_weather", "arguments": {"city": '
                 '"</tool_calls>"}}\n{"name": "get_time", "arguments": {}}\n</tool_calls>\nbye'),
     "Let me check.", [("get_weather", '{"city": "</tool_calls>"}'), ("get_time", "{}")]),
    ("phi4_mini_json", ('functools[{"name": "get_weather", "parameters": {"city": "]"}}, '
                        '{"name": "get_time"}]'), None,
     [("get_weather", '{"city": "]"}'), ("get_time", "{}")]),
    ("hunyuan_a13b", ('ok <tool_calls>[{"name": "get_time", "arguments": {"tz": "UTC"}}]'
                      "</tool_calls>"), "ok", [("get_time", '{"tz": "UTC"}')]),
    # step3: values typed by the schema (string stripped); text after the section is content
    ("step3", STEP3, "Sure.\nDone.",
     [("get_weather", '{"city": "Paris", "days": 4, "ok": true}'), ("get_time", "{}")]),
    ("granite-20b-fc", ('Sure. <function_call> {"name": "get_weather", "arguments": {"city": '
                        '"<function_call>"}}\n<function_call> {"name": "get_time", '
                        '"arguments": {}} trailing'), "Sure.",
     [("get_weather", '{"city": "<function_call>"}'), ("get_time", "{}")]),
]

MALFORMED = [
    ("glm45", "x<tool_call>unknown\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
    ("glm45", "<tool_call>get_time"),
    ("glm45", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    ("seed_oss", "<seed:tool_call>\n<function=unknown>\n</function>\n</seed:tool_call>"),
    ("minimax", '<tool_calls>\n{"city": "Paris"}\n</tool_calls>'),
    ("minimax", "Hi <tool_calls>nothing</tool_calls>"),
    ("phi4_mini_json", "functools is a module"),
    ("phi4_mini_json", '[{"name": "get_time", "arguments": {}}]'),
    ("hunyuan_a13b", "<tool_calls>[1]</tool_calls>"),
    ("step3", "<｜tool_calls_begin｜>" + S_CALL + '<steptml:invoke name="unknown">'
     "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>"),
    ("step3", ("<｜tool_calls_begin｜><｜tool_call_begin｜>code<｜tool_sep｜><steptml:invoke "
     'name="get_time"></steptml:invoke><｜tool_call_end｜>')),
    ("granite-20b-fc", "<function_call> not json"),
    ("granite-20b-fc", '<function_call> {"a": 1}'),
]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_calls_whole_and_streamed(name, text, content, calls):
    check_calls(name, text, content, calls, [*stream_splits(text), *stream_splits3(text)])


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_output_is_content(name, text):
    check_content_only(name, text, [*stream_splits(text), *stream_splits3(text)])


def _glm_pair(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n"


@pytest.mark.parametrize("function, key, value, read", [
    ("get_weather", "x", "3", "3"),  # not in the schema
    ("get_weather", "x", "true", "true"),
    ("get_weather", "x", "null", "null"),
    ("get_weather", "x", '{"a": 1}', '{"a": 1}'),
    ("get_weather", "x", "{'a': 1}", "{'a': 1}"),
    ("get_weather", "x", " [1, 2] ", " [1, 2] "),
    ("get_time", "tz", "5", "5"),  # a function without parameters
    ("get_weather", "units", "3", "3"),  # typed ["string", "null"]
    ("get_weather", "units", "null", None),
    ("get_weather", "units", " null ", " null "),
    ("get_weather", "days", " 3 ", 3),  # typed: read as before
])
def test_glm45_untyped_values_stay_text(function, key, value, read):
    """A value the schema gives no type (a parameter not in it, a function without
    parameters) is its text as written, and so is one typed ``["string", "null"]`` except
    ``null``; they were read as JSON or a Python literal (``"3"`` -> 3, ``"{'a': 1}"`` ->
    ``{"a": 1}``, ``"3"`` for an optional string -> 3, against its schema). Oracle: vLLM
    0.32's glm45 (the glm47 engine with its schema coercion), run on these texts with these
    tools: exactly these arguments; whole and streamed every way."""
    text = f"<tool_call>{function}\n{_glm_pair(key, value)}</tool_call>"
    check_calls("glm45", text, None, [(function, json.dumps({key: read}))], stream_splits(text))


def test_glm45_streams_a_pair_at_a_time():
    """get_weather: "{", its 4 pairs, "}"; get_time: "{", "}"."""
    out = ChatOutputParser(make_tool_parser("glm45", TOOLS), None)
    assert read_streamed(out, list(GLM), "stop")[5] == 8


@pytest.mark.parametrize("name, reads", [
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>東京</arg_value>"),
    ("qwen3_xml", "<function=get_weather>"), ("seed_oss", "<seed:tool_call>\n<function="),
    ("minimax", '<tool_calls>\n{"name": "get_weather"'),
    ("phi4_mini_json", 'functools[{"name": "get_weather"'),
    ("hunyuan_a13b", '<tool_calls>[{"name": "get_weather"'),
    ("step3", '<steptml:invoke name="get_weather"><steptml:parameter name="city">東京<'),
    ("granite-20b-fc", '<function_call> {"name": "get_time"')])
def test_history_calls_as_text_parse_back(name, reads):
    calls = history_read_back(name, reads)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == HISTORY_READ


def test_special_token_markers_survive_detokenizing():
    """GLM's, Seed-OSS's and Step3's markers are special tokens (vLLM decodes Step3's with
    them); MiniMax's, Phi-4-mini's, Hunyuan's and granite-20b-fc's are plain text."""
    keeps = {n: make_tool_parser(n).keeps_special_tokens
             for n in ("glm45", "seed_oss", "step3", "minimax", "phi4_mini_json",
                       "hunyuan_a13b", "granite-20b-fc", "qwen3_xml")}
    assert keeps == {"glm45": True, "seed_oss": True, "step3": True, "minimax": False,
                     "phi4_mini_json": False, "hunyuan_a13b": False, "granite-20b-fc": False,
                     "qwen3_xml": False}


REASONING = [
    ("glm45", "<think>Check.</think>\nSunny", "Check.", "Sunny"),
    ("glm45", "Sunny", None, "Sunny"),
    ("mistral", "[THINK]2+2 is 4.[/THINK]\n\n4", "2+2 is 4.", "4"),
    ("mistral", "4, no thinking", None, "4, no thinking"),
    ("mistral", "[THINK]cut by max_tokens", "cut by max_tokens", None),
    ("seed_oss", "<seed:think>Hmm.</seed:think>Yes", "Hmm.", "Yes"),
    ("seed_oss", "opening in the prompt</seed:think>Yes", "opening in the prompt", "Yes"),
    ("step3", "Add them.</think>4", "Add them.", "4"),
    ("step3", "<think>a</think>b", "<think>a", "b"),
    ("step3", "never closed", "never closed", None),
    ("ernie45", "abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "def"),
    ("ernie45", "<think>abc</think>def", "abc", "def"),
    ("hunyuan_a13b", "<think>\nStep 1.\n</think>\n<answer>\nThe answer.\n</answer>", "Step 1.",
     "The answer."),
    ("hunyuan_a13b", "<answer>\nNo thinking.\n</answer>", None, "No thinking."),
    ("hunyuan_a13b", "Plain <answer>", None, "Plain <answer>"),
]


@pytest.mark.parametrize("name, text, reasoning, content", REASONING)
def test_reasoning_whole_and_streamed(name, text, reasoning, content):
    out = ChatOutputParser(None, make_reasoning_parser(name))
    assert read_whole(out, text)[:2] == (content, reasoning)
    for pieces in [*stream_splits(text), *stream_splits3(text)]:
        assert read_streamed(out, pieces, "stop")[:2] == (content, reasoning), pieces


def test_reasoning_switches_follow_the_chat_template_variables():
    """deepseek_v3 splits only under ``thinking: true`` (DeepSeek-V3.1's switch, vLLM 0.11),
    as deepseek_r1 does; glm45 not under ``enable_thinking: false``."""
    assert make_reasoning_parser("deepseek_v3") is None
    assert make_reasoning_parser("deepseek_v3", {"thinking": False}) is None
    v3 = ChatOutputParser(None, make_reasoning_parser("deepseek_v3", {"thinking": True}))
    assert read_whole(v3, "Think.</think>Answer")[:2] == ("Answer", "Think.")
    assert make_reasoning_parser("glm45", {"enable_thinking": False}) is None
    assert make_reasoning_parser("glm45", {}) is not None


def test_seed_oss_reasoning_then_call():
    text = "<seed:think>Need the weather.</seed:think>\n" + SEED
    out = ChatOutputParser(make_tool_parser("seed_oss", TOOLS), make_reasoning_parser("seed_oss"))
    whole = read_whole(out, text)
    assert whole == (None, "Need the weather.", [("get_weather", '{"city": "Oslo", "days": 2}')],
                     "tool_calls")
    for pieces in stream_splits(text):
        assert read_streamed(out, pieces, "stop")[:4] == whole


def test_mistral_reasoning_then_mistral_call():
    text = "[THINK]Use the tool.[/THINK][TOOL_CALLS]get_time[ARGS]{}"
    out = ChatOutputParser(make_tool_parser("mistral", TOOLS), make_reasoning_parser("mistral"))
    whole = read_whole(out, text)
    assert whole == (None, "Use the tool.", [("get_time", "{}")], "tool_calls")
    for pieces in stream_splits(text):
        assert read_streamed(out, pieces, "stop")[:4] == whole


def test_reasoning_markers_that_are_special_tokens_survive_detokenizing():
    keeps = {n: ChatOutputParser(None, make_reasoning_parser(n)).keeps_special_tokens
             for n in ("mistral", "seed_oss", "glm45", "step3", "ernie45", "hunyuan_a13b")}
    assert keeps == {"mistral": True, "seed_oss": True, "glm45": False, "step3": False,
                     "ernie45": False, "hunyuan_a13b": False}


def test_server_builds_them_from_its_flags():
    """The tools reach glm45 (the schema types ``city`` a string: ``007`` stays text); the
    ``thinking`` switch reaches deepseek_v3; Mistral's [THINK] keeps special tokens."""
    glm = served_parser(ServerConfig(tool_call_parser="glm45"))
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>007</arg_value>\n" \
           "<arg_key>days</arg_key>\n<arg_value>007</arg_value>\n</tool_call>"
    assert read_whole(glm, text)[2] == [("get_weather", '{"city": "007", "days": "007"}')]
    assert glm.keeps_special_tokens
    v3 = ServerConfig(reasoning_parser="deepseek_v3")
    assert served_parser(v3).reasoning is None
    on = served_parser(v3, chat_template_kwargs={"thinking": True})
    assert read_whole(on, "Hm.</think>Hi")[:2] == ("Hi", "Hm.")
    assert served_parser(ServerConfig(reasoning_parser="mistral")).keeps_special_tokens
    assert not served_parser(ServerConfig(reasoning_parser="step3")).keeps_special_tokens
