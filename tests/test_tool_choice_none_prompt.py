"""tool_choice "none": the model still sees the tools (OpenAI's and vLLM's default: it knows
the functions and calls none), unless --exclude-tools-when-tool-choice-none (vLLM's flag).
kvflow left them out of the prompt always (newcomer check, session 29: 34 prompt tokens
instead of ~268). A template that never reads tools gets no tool instructions under "none"
(they would ask for calls the request forbids). Oracle: the prompt text /tokenize renders,
against hand-written expected text. Runs /tokenize's handler on a stand-in engine."""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import pytest

READS_TOOLS = ("{% if tools %}<tools>{{ tools | map(attribute='function') | map(attribute='name')"
               " | join(',') }}</tools>\n{% endif %}"
               "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
IGNORES_TOOLS = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time"}}]


def _prompt(tiny_tokenizer, template: str, tool_choice: str | None, exclude: bool) -> str:
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.protocol import TokenizeRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.entrypoints.token_routes import _tokenize_ids
    from kvflow.inputs.processor import InputProcessor

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    chat = OpenAIServingChat(engine, ServerConfig(exclude_tools_when_tool_choice_none=exclude),
                             "m")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "add_generation_prompt": False}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    raw = SimpleNamespace(headers={"content-length": str(len(json.dumps(body)))})
    ids = asyncio.run(_tokenize_ids(chat, TokenizeRequest(**body), raw))
    return tok.decode(ids)


@pytest.mark.parametrize("tool_choice, exclude, expected", [
    ("none", False, "<tools>get_weather,get_time</tools>\n<user>hi\n"),
    ("auto", False, "<tools>get_weather,get_time</tools>\n<user>hi\n"),
    (None, False, "<tools>get_weather,get_time</tools>\n<user>hi\n"),
    ("none", True, "<user>hi\n"),
    ("auto", True, "<tools>get_weather,get_time</tools>\n<user>hi\n"),  # the flag is none's
])
def test_a_template_reading_tools(tiny_tokenizer, tool_choice, exclude, expected):
    assert _prompt(tiny_tokenizer, READS_TOOLS, tool_choice, exclude) == expected


def test_a_template_ignoring_tools_gets_no_instructions_under_none(tiny_tokenizer):
    """Under auto kvflow writes the tool parser's instructions into a system message; under
    none the conversation renders as if no tools were sent."""
    assert _prompt(tiny_tokenizer, IGNORES_TOOLS, "none", False) == "<user>hi\n"
    auto = _prompt(tiny_tokenizer, IGNORES_TOOLS, "auto", False)
    assert auto.startswith("<system>") and "get_weather" in auto and auto.endswith("<user>hi\n")
