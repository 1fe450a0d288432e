"""Conversations rendered as vLLM 0.32 renders them where it differs from passing the messages
to ``apply_chat_template`` unchanged (kvflow/chat/template.py, kvflow/chat/messages.py):
developer messages for a template without that role, the Responses API's text parts (and an
assistant's ``reasoning``, which transformers aliases as vLLM does). Oracle: the HF tokenizer's own ``apply_chat_template`` on the
messages vLLM hands it, written by hand (vllm/renderers/hf.py, chat_utils.py)."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

from kvflow.chat.template import render_chat

# SmolLM2-135M-Instruct's template (ChatML with a default system message), which names no
# developer role
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
# a template that has a developer role of its own
WITH_DEVELOPER = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% else %}"
                  "<{{ m.role }}>{% endif %}{{ m.content }}\n{% endfor %}")
# Qwen3's way of writing an earlier reply's reasoning
REASONING = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<think>"
             "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)  # the session's tokenizer stays without a template
    tok.chat_template = CHATML
    return tok


def _hf(tok, messages, template=CHATML, **kwargs) -> str:
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=True, **kwargs)


def _sys(text: str) -> dict:
    return {"role": "system", "content": text}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


DEV = {"role": "developer", "content": "Answer in French."}


@pytest.mark.parametrize("messages, as_vllm", [
    ([DEV, _user("hi")], [_sys("Answer in French."), _user("hi")]),
    # a system message that is not first once developers are systems: all merged at the front
    ([_sys("Be brief."), DEV, _user("hi")], [_sys("Be brief.\n\nAnswer in French."), _user("hi")]),
    ([_user("hi"), DEV, _user("ho")], [_sys("Answer in French."), _user("hi"), _user("ho")]),
    ([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                        {"type": "text", "text": "b"}]},
      _sys(""), _user("hi")], [_sys("a\nb"), _user("hi")]),
], ids=["first", "after-system", "later", "parts-and-empty"])
def test_developer_is_system_for_a_template_without_the_role(tok, messages, as_vllm):
    assert render_chat(tok, messages) == _hf(tok, as_vllm)


def test_developer_kept_for_a_template_with_the_role(tok):
    messages = [_sys("s"), DEV, _user("hi")]
    out = render_chat(tok, messages, chat_template=WITH_DEVELOPER)
    assert out == _hf(tok, messages, WITH_DEVELOPER) == "<system>s\n[dev]Answer in French.\n<user>hi\n"


@pytest.mark.parametrize("kind", ["input_text", "output_text"])
def test_responses_text_parts_are_text(tok, kind):
    messages = [{"role": "user", "content": [{"type": kind, "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    assert render_chat(tok, messages) == _hf(tok, [_user("a\nb")])


def test_assistant_reasoning_is_reasoning_content(tok):
    """vLLM copies an assistant's ``reasoning`` to ``reasoning_content`` (the name templates
    read); transformers' apply_chat_template does the same (kvflow relies on it)."""
    messages = [_user("hi"), {"role": "assistant", "content": "yo", "reasoning": "greet"}]
    out = render_chat(tok, messages, chat_template=REASONING, add_generation_prompt=False)
    assert out == "<user>hi\n<assistant><think>greet</think>yo\n"


# a newer template's way: it reads ``reasoning`` (vLLM 0.32's name)
READS_REASONING = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning %}<think>"
                   "{{ m.reasoning }}</think>{% endif %}{{ m.content }}\n{% endfor %}")


@pytest.mark.parametrize("template", [REASONING, READS_REASONING],
                         ids=["reads-reasoning_content", "reads-reasoning"])
@pytest.mark.parametrize("sent", [{"reasoning": "greet"}, {"reasoning_content": "greet"},
                                  {"reasoning": "greet", "reasoning_content": "old"}],
                         ids=["reasoning", "reasoning_content", "both"])
def test_assistant_reasoning_under_either_name_reaches_either_template(tok, template, sent):
    """vLLM 0.32 renames a history message's deprecated ``reasoning_content`` to ``reasoning``
    (an unset one only: ``reasoning`` wins) and hands an assistant's reasoning to the template
    as both ``reasoning`` and ``reasoning_content``. transformers alone filled only
    ``reasoning_content``, from ``reasoning_content`` first: a template reading ``reasoning``
    saw nothing when ``reasoning_content`` was sent, and ``old`` won when both were."""
    messages = [_user("hi"), {"role": "assistant", "content": "yo", **sent}]
    out = render_chat(tok, messages, chat_template=template, add_generation_prompt=False)
    assert out == "<user>hi\n<assistant><think>greet</think>yo\n"


@pytest.fixture(scope="module")
def served_chat(tok):
    """The server's chat handler (rendering only) on ``tok``."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    return OpenAIServingChat(engine, ServerConfig(), "m")


def test_served_chat_renders_as_vllm(served_chat, tok):
    """/v1/chat/completions (and /tokenize, the same ``render``): an ``input_text`` part passes
    the schema, and a developer message is the system message."""
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": [
        DEV, {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
    text, ids = asyncio.run(served_chat.render(req.messages, ChatOptions.of(req)))
    assert text == _hf(tok, [_sys("Answer in French."), _user("hi")])
    assert ids == tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
def test_served_chat_takes_an_earlier_turns_reasoning_under_either_name(served_chat, name):
    """/v1/chat/completions: an assistant turn's ``reasoning`` or (deprecated)
    ``reasoning_content`` renders as vLLM 0.32 renders it, for a template reading either."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat

    served_chat = OpenAIServingChat(served_chat.engine,
                                    ServerConfig(trust_request_chat_template=True), "m")

    for template in (REASONING, READS_REASONING):
        req = ChatCompletionRequest.model_validate({"chat_template": template, "messages": [
            _user("hi"), {"role": "assistant", "content": "yo", name: "greet"}, _user("ok")]})
        text, _ = asyncio.run(served_chat.render(req.messages, ChatOptions.of(req)))
        assert text == "<user>hi\n<assistant><think>greet</think>yo\n<user>ok\n"


# Qwen2-VL's way with content: a string printed as it is, else each part (images as a pad)
QWEN2_VL = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
            "<|vision_pad|>{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}")


def test_openai_format_gives_a_string_content_as_a_text_part(tok):
    """llava-hf's template prints only the parts of type text: a string content (the usual
    text-only turn) was printed as nothing, 'USER: ASSISTANT:'. vLLM's "openai" format (the
    format detected for it) hands it as one text part, null as no part."""
    from tests.multimodal.conftest import LLAVA_CHAT_TEMPLATE

    messages = [_user("What is this?"), {"role": "assistant", "content": None},
                _user("And that?")]
    as_vllm = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]},
               {"role": "assistant", "content": []},
               {"role": "user", "content": [{"type": "text", "text": "And that?"}]}]
    for fmt in ("auto", "openai"):
        out = render_chat(tok, messages, chat_template=LLAVA_CHAT_TEMPLATE, content_format=fmt)
        assert out == _hf(tok, as_vllm, LLAVA_CHAT_TEMPLATE)
        assert out == "USER: What is this? ASSISTANT: USER: And that? ASSISTANT:"


def test_openai_format_gives_a_tool_result_as_one_string(tok):
    """A tool message's text parts reach the template as one ``"\\n"``-joined string in
    vLLM's "openai" format too (they were parts, printed back to back: 'ab')."""
    messages = [_user("add"), {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}]
    template = QWEN2_VL + "{# tool_calls: not printed #}"
    out = render_chat(tok, messages, chat_template=template, add_generation_prompt=False)
    as_vllm = [{"role": "user", "content": [{"type": "text", "text": "add"}]},
               {"role": "assistant", "content": [{"type": "text", "text": ""}]},
               {"role": "tool", "content": "a\nb"}]
    assert out == tok.apply_chat_template(as_vllm, chat_template=template, tokenize=False)
    assert out.endswith("<|im_start|>tool\na\nb<|im_end|>\n")


# named templates (a tokenizer_config.json list): the default reads neither tools nor calls
NAMED_DEFAULT = "D:{% for m in messages %}{{ m['content'] }};{% endfor %}"
NAMED_TOOL_USE = ("T:{% for t in tools or [] %}{{ t['function']['name'] }},{% endfor %}"
                  "{% for m in messages %}{{ m['content'] }}"
                  "{% for c in m.tool_calls or [] %}[{{ c.function.name }}]{% endfor %};"
                  "{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def named_tok(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = {"default": NAMED_DEFAULT, "tool_use": NAMED_TOOL_USE}
    return tok


def test_chat_template_names_one_of_the_models_templates(named_tok):
    """``chat_template="tool_use"`` picks the model's template of that name, as transformers'
    ``get_chat_template`` (and so vLLM, for a request's or LLM.chat's chat_template) does; it
    was refused as text holding no Jinja markup."""
    messages = [_user("hi")]
    for tools in (None, TOOLS):
        out = render_chat(named_tok, messages, chat_template="tool_use", tools=tools,
                          add_generation_prompt=False)
        assert out == named_tok.apply_chat_template(messages, chat_template="tool_use",
                                                    tools=tools, tokenize=False)
    assert out == "T:get_weather,hi;"


def test_named_templates_earlier_calls_without_tools(named_tok, tiny_tokenizer):
    """A conversation with an earlier tool call and no ``tools`` renders with the default
    template, which reads no tool_calls: the calls become the tool parser's text, as for a
    tokenizer holding that template alone (the check looked into every named template, found
    tool_calls in tool_use's, and the default template's render was a 400)."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = NAMED_DEFAULT
    req = ChatCompletionRequest.model_validate({"messages": [
        _user("weather?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    texts = []
    for tok in (named_tok, plain):
        engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                                 max_model_len=4096)
        chat = OpenAIServingChat(engine, ServerConfig(), "m")
        texts.append(asyncio.run(chat.render(req.messages, ChatOptions.of(req)))[0])
    assert texts[0] == texts[1]
    assert texts[0].startswith("D:weather?;<tool_call>")


# Qwen3's thinking switch, and gpt-oss's effort line
THINKING = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
            "enable_thinking is false %}<think></think>{% endif %}{% endif %}")
EFFORT = ("Reasoning: {{ reasoning_effort or 'medium' }}\n"
          "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")


def _served_with(tiny_tokenizer, template: str, body: dict, ignore: bool = False) -> str:
    """The prompt /v1/chat/completions renders for ``body`` on a model whose template is
    ``template`` (an OpenAIError for a request it refuses)."""
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    chat = OpenAIServingChat(engine, ServerConfig(ignore_unknown_fields=ignore), "m")
    req = ChatCompletionRequest.model_validate({"messages": [_user("hi")], **body})
    return asyncio.run(chat.render(req.messages, ChatOptions.of(req)))[0]


@pytest.mark.parametrize("body, hf_kwargs", [
    ({"reasoning_effort": "none"}, {"enable_thinking": False}),
    ({"reasoning_effort": "low"}, {"enable_thinking": True}),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     {"enable_thinking": True}),  # the request's own switch wins
])
def test_reasoning_effort_switches_thinking(tiny_tokenizer, body, hf_kwargs):
    """vLLM's ``reasoning_effort`` sets a template's ``enable_thinking`` (false for "none")
    unless chat_template_kwargs sets it; it was a 400 (unsupported)."""
    out = _served_with(tiny_tokenizer, THINKING, body)
    assert out == _hf(tiny_tokenizer, [_user("hi")], THINKING, **hf_kwargs)


def test_reasoning_effort_is_a_template_variable(tiny_tokenizer):
    out = _served_with(tiny_tokenizer, EFFORT, {"reasoning_effort": "high",
                                                "chat_template_kwargs": {
                                                    "reasoning_effort": "low"}})
    assert out == "Reasoning: high\n<user>hi\n"  # the field wins, as in vLLM


def test_reasoning_effort_a_template_does_not_read(tiny_tokenizer):
    """Refused, naming the field (it would change nothing), unless the server ignores
    unknown fields (then dropped, as vLLM drops it)."""
    from kvflow.entrypoints.openai_errors import OpenAIError

    with pytest.raises(OpenAIError) as info:
        _served_with(tiny_tokenizer, CHATML, {"reasoning_effort": "low"})
    assert (info.value.param, info.value.code) == ("reasoning_effort", "unsupported_value")
    assert _served_with(tiny_tokenizer, CHATML, {"reasoning_effort": "low"}, ignore=True) == \
        _hf(tiny_tokenizer, [_user("hi")])


def test_developer_merge_keeps_the_fields_named_as_sent(tok):
    """Errors name a message by its index as sent, not as merged (the system message moves
    to the front): an unread key, an assistant's tool_calls the template does not render."""
    from kvflow.chat.template import ChatTemplateError

    sent = [_user("hi"), _sys("s"), DEV, {"role": "user", "content": "x", "foo": 1}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, sent)
    assert info.value.param == "messages.3.foo"
    sent = [_user("hi"), _sys("s"), DEV, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(ChatTemplateError) as info:
        render_chat(tok, sent)
    assert info.value.param == "messages.3.tool_calls"


def test_responses_reasoning_effort_is_chats(tiny_tokenizer):
    """/v1/responses' ``reasoning.effort`` reaches the template as chat's reasoning_effort
    (vLLM's Responses API does so; it was a 400), and its errors name reasoning.effort."""
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol.responses_api import ResponsesRequest
    from kvflow.entrypoints.responses_checks import refuse_unhonoured
    from kvflow.entrypoints.responses_errors import renamed_error
    from kvflow.entrypoints.responses_input import chat_messages

    req = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"}})
    refuse_unhonoured(req)  # no longer refused
    conv = chat_messages(req.input, req.instructions, [])
    body = {"messages": conv.messages, "reasoning_effort": req.reasoning.effort}
    assert _served_with(tiny_tokenizer, THINKING, body) == \
        _hf(tiny_tokenizer, [_user("hi")], THINKING, enable_thinking=False)
    with pytest.raises(OpenAIError) as info:
        _served_with(tiny_tokenizer, CHATML, body)
    assert renamed_error(info.value, conv).param == "reasoning.effort"
