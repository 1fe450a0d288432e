"""Tools and tool calls for a chat template that reads neither (kvflow/chat/tools_text.py):
``LLM.chat`` renders them as ``/v1/chat/completions`` (and ``/tokenize``) does. Oracle: the
prompt token ids the server's own render builds for the same request (``ChatRendering.render``,
what /v1/chat/completions and /tokenize call), on the packaged SmolLM2-135M-Instruct's
tokenizer and template (which ignores tools) and on a tiny engine end to end."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from kvflow import LLM, SamplingParams
from kvflow.chat.template import ChatTemplateError

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
HI = {"role": "user", "content": "What is 2+2?"}
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")  # no tools, no tool_calls


def _served(tokenizer, body: dict) -> tuple[str, list[int]]:
    """(text, token ids) the server renders for a chat request ``body``, as
    /v1/chat/completions does (its tools for the template under its tool_choice mode)."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.entrypoints.structured_requests import tool_choice_mode
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(tokenizer=tokenizer,
                             processor=InputProcessor(tokenizer, 4096, len(tokenizer), 0),
                             max_model_len=4096)
    chat = OpenAIServingChat(engine, ServerConfig(), "m")
    req = ChatCompletionRequest.model_validate(body)
    mode = tool_choice_mode(req)
    return asyncio.run(chat.render(req.messages, ChatOptions.of(req),
                                   chat.template_tools(req, mode),
                                   tool_instructions=mode is not None))


def _offline(tokenizer, messages: list[dict], **kwargs) -> tuple[str, list[int]]:
    """(text, token ids) ``LLM.chat`` queues for ``messages`` (its engine stubbed: the
    rendering is the real one, generation is not run)."""
    from kvflow.inputs.processor import InputProcessor

    queued = []
    llm = LLM.__new__(LLM)  # no engine loaded: chat's own rendering over a stub engine
    llm.engine = SimpleNamespace(processor=InputProcessor(tokenizer, 4096, len(tokenizer), 0),
                                 tokenizer=tokenizer)
    llm.generate = lambda prompts, *a, **k: queued.extend(prompts) or \
        [SimpleNamespace() for _ in prompts]
    out = llm.chat(messages, SamplingParams(max_tokens=4), **kwargs)
    return out[0].prompt, queued[0]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The packaged SmolLM2-135M-Instruct's tokenizer (its chat template ignores tools)."""
    from kvflow.models.loader import load_tokenizer
    from kvflow.models.model_resolver import resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), None)
    assert "tools" not in tokenizer.chat_template
    return tokenizer


@pytest.mark.parametrize("messages", [
    [HI],
    [{"role": "system", "content": "Be brief."}, HI],
    [HI, {"role": "assistant", "content": None, "tool_calls": [CALL]},
     {"role": "tool", "content": "4", "tool_call_id": "c1"}],
], ids=["user", "system", "history_call"])
def test_llm_chat_tools_on_smollm2_render_as_the_server(smollm2_tokenizer, messages):
    """``LLM.chat(..., tools=...)`` on SmolLM2 raised ``ChatTemplateError: this chat template
    does not use tools`` while the server answered 200, writing hermes' instructions into the
    system message (and an earlier call as ``<tool_call>`` text). Now the offline prompt is
    the server's, token for token."""
    text, ids = _offline(smollm2_tokenizer, messages, tools=TOOLS)
    served_text, served_ids = _served(smollm2_tokenizer, {"messages": messages,
                                                          "tools": TOOLS})
    assert ids == served_ids and text == served_text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in text
    assert '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}' \
        in text
    if messages[0]["role"] == "system":
        assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call one or more")
    if len(messages) > 1 and messages[1].get("tool_calls"):
        assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in text


def test_llm_chat_with_tools_generates_from_the_servers_prompt(smollm2_llm, assert_no_leaks):
    """End to end on the packaged SmolLM2 engine: the request's ``prompt_token_ids`` are the
    server's for the same messages and tools (an earlier call given with object arguments,
    which LLM.chat takes, renders as the server's JSON text of it)."""
    history = [HI, {"role": "assistant", "content": "Let me see.", "tool_calls": [CALL]},
               {"role": "tool", "content": "4", "tool_call_id": "c1"}]
    as_object = copy.deepcopy(history)
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"x": 1}
    _, served_ids = _served(smollm2_llm.engine.tokenizer, {"messages": history,
                                                           "tools": TOOLS})
    for messages in (history, as_object):
        out = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=2),
                               use_tqdm=False, tools=TOOLS)
        assert out[0].prompt_token_ids == served_ids
        assert out[0].prompt.startswith("<|im_start|>system\nYou may call one or more")
        assert ('<|im_start|>assistant\nLet me see.\n<tool_call>\n{"name": "f", '
                '"arguments": {"x": 1}}\n</tool_call><|im_end|>') in out[0].prompt
        assert len(out[0].outputs[0].token_ids) == 2
    assert_no_leaks(smollm2_llm)


def test_llm_chat_refuses_what_the_server_refuses_before_calls_become_text(tiny_tokenizer):
    """Calls on a user message, or a call whose echoed ``index`` is not its position, are
    refused (naming the field, in the server's words) before calls become text, where the
    check could no longer see them."""
    from kvflow.entrypoints.openai_errors import OpenAIError

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TEMPLATE
    for messages, param in (
            ([{**HI, "tool_calls": [CALL]}], "messages.0.tool_calls"),
            ([HI, {"role": "assistant", "tool_calls": [{**CALL, "index": 1}]}],
             "messages.1.tool_calls.0.index")):
        with pytest.raises(OpenAIError) as served:
            _served(tok, {"messages": messages})
        with pytest.raises(ChatTemplateError) as offline:
            _offline(tok, messages)
        assert offline.value.param == served.value.param == param
        assert str(offline.value) == str(served.value)


def test_template_failing_on_the_tools_text_names_tools(tiny_tokenizer):
    """A template that fails on a system message (which only kvflow's tools text brings in)
    is an error at ``tools`` saying so, offline as on the server."""
    from kvflow.entrypoints.openai_errors import OpenAIError

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('no system messages') }}{% endif %}"
                         "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    with pytest.raises(OpenAIError) as served:
        _served(tok, {"messages": [HI], "tools": TOOLS})
    with pytest.raises(ChatTemplateError) as offline:
        _offline(tok, [HI], tools=TOOLS)
    assert offline.value.param == served.value.param == "tools"
    assert str(offline.value) == str(served.value)
    assert "kvflow writes their instructions into the system message" in str(offline.value)
    with pytest.raises(ValueError, match="tools must be a list of tool dicts"):
        _offline(tok, [HI], tools="f")
