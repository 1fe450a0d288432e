"""A reply's tool calls sent back in the next request (the agent loop's history). A call whose
``arguments`` are no JSON object's text (a call ``max_tokens`` cut, malformed JSON, JSON that
is no object, empty text) or whose strings hold raw newlines (models write them) is returned
by /v1/chat/completions as the model wrote it, and sending that assistant turn back was a 400
at ``messages.N.tool_calls.M.function.arguments`` (``LLM.chat``: a ValueError). vLLM 0.32's
schema takes any string there and its renderer (renderers/chat_utils.py,
``_postprocess_messages``) gives the template ``json.loads``' object, ``{}`` where that fails
or reads no object, so the conversation can go on. kvflow does the same, except that raw
newlines inside strings are read (json's ``strict=False``) where vLLM's strict ``json.loads``
falls back to ``{}`` and the template would show a call without its arguments. A string
that is still refused: a non-string ``arguments`` (tests/test_tool_call_ids.py).

Oracle: transformers' ``apply_chat_template`` on the same tokenizer and template with the
arguments given as the object (hand-written: ``{}``, or what the model wrote); a template that
reads no ``tool_calls`` gets hermes' text with hand-written arguments."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from kvflow import LLM, SamplingParams
from kvflow.entrypoints.tool_parsers import HermesToolParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# reads tool_calls two ways: Qwen2.5's `arguments | tojson` and GLM's `arguments.items()`
READS_CALLS = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }} "
    "{{ tc.function.arguments | tojson }}"
    "{% for k, v in tc.function.arguments.items() %}<{{ k }}={{ v }}>{% endfor %}"
    "</tool_call>{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
READS_NO_CALLS = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
HI = {"role": "user", "content": "Run it"}

# (the model's reply, the arguments text the parsed reply's call carries, the object the
# template gets for it); the first two hand-checked against HermesToolParser's reading
REPLIES = [
    ('<tool_call>{"name": "f", "arguments": {"city": "Par', '{"city": "Par', {}),  # max_tokens
    ('<tool_call>{"name": "f", "arguments": ', "", {}),  # cut before the arguments
    ('<tool_call>{"name": "f", "arguments": {city: Paris}}</tool_call>', "{city: Paris}", {}),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "[1, 2]", {}),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '"x"', {}),
    ('<tool_call>{"name": "f", "arguments": {"code": "a = 1\nb = 2"}}</tool_call>',
     '{"code": "a = 1\nb = 2"}', {"code": "a = 1\nb = 2"}),  # a raw newline in a string
]
IDS = ["cut_in_arguments", "cut_before_arguments", "malformed", "array", "string",
       "raw_newline"]


def _tokenizer(tiny_tokenizer, template: str):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    return tok


def _history(reply: str, arguments: str) -> list[dict]:
    """The conversation a client sends next: the assistant turn built from the reply's
    call (its arguments as the reply gave them), then the tool's answer."""
    parsed = HermesToolParser(TOOLS).parse(reply, True)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("f", arguments)]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": parsed.calls[0].arguments}}
    return [HI, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def _served(tokenizer, messages: list[dict]) -> str:
    """The prompt /v1/chat/completions renders (its schema first)."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(tokenizer=tokenizer,
                             processor=InputProcessor(tokenizer, 4096, len(tokenizer), 0),
                             max_model_len=4096)
    chat = OpenAIServingChat(engine, ServerConfig(), "m")
    req = ChatCompletionRequest.model_validate({"messages": messages})
    return asyncio.run(chat.render(req.messages, ChatOptions.of(req)))[0]


def _offline(tokenizer, messages: list[dict]) -> str:
    """The prompt ``LLM.chat`` renders (its engine stubbed: generation is not run)."""
    from kvflow.inputs.processor import InputProcessor

    llm = LLM.__new__(LLM)
    llm.engine = SimpleNamespace(processor=InputProcessor(tokenizer, 4096, len(tokenizer), 0),
                                 tokenizer=tokenizer)
    llm.generate = lambda prompts, *a, **k: [SimpleNamespace() for _ in prompts]
    return llm.chat(messages, SamplingParams(max_tokens=4))[0].prompt


@pytest.mark.parametrize("reply, arguments, as_object", REPLIES, ids=IDS)
def test_a_replys_call_comes_back_as_vllm_renders_it(tiny_tokenizer, reply, arguments,
                                                     as_object):
    tok = _tokenizer(tiny_tokenizer, READS_CALLS)
    messages = _history(reply, arguments)
    oracle = copy.deepcopy(messages)
    oracle[1]["tool_calls"][0]["function"]["arguments"] = as_object
    expected = tok.apply_chat_template(oracle, tokenize=False, add_generation_prompt=True)
    assert _served(tok, messages) == expected
    assert _offline(tok, messages) == expected


@pytest.mark.parametrize("arguments", ["", "null", '"{}"', "{", '{"a": 1}}'],
                         ids=["empty", "null", "json_string", "open", "extra_brace"])
def test_a_clients_arguments_text_that_is_no_object_renders_as_empty(tiny_tokenizer,
                                                                      arguments):
    """Text a client wrote (no reply of kvflow's): the same rule, as vLLM 0.32 applies it."""
    tok = _tokenizer(tiny_tokenizer, READS_CALLS)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    expected = "<|user|>Run it<|assistant|><tool_call>f {}</tool_call><|assistant|>"
    assert _served(tok, messages) == expected
    assert _offline(tok, messages) == expected


@pytest.mark.parametrize("reply, arguments, as_object", REPLIES, ids=IDS)
def test_a_replys_call_comes_back_as_hermes_text(tiny_tokenizer, reply, arguments, as_object):
    """A template that reads no ``tool_calls`` gets the call as hermes' text in the assistant
    turn: the arguments as the model wrote them when they read as an object, else ``{}``,
    the object the template path gets (the text was pasted as written)."""
    tok = _tokenizer(tiny_tokenizer, READS_NO_CALLS)
    messages = _history(reply, arguments)
    written = arguments if as_object else "{}"
    call_text = f'<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>'
    served, offline = _served(tok, messages), _offline(tok, messages)
    assert f"<assistant>{call_text}\n<tool>done\n" in served
    assert offline == served
