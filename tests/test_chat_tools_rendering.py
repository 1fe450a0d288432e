"""Tools on a chat template that never reads them (served chat): the tool parser's
instructions become (the end of) the system message. Oracle: the same conversation with its
system text given as a plain string, which the template renders as written."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def chat(tiny_tokenizer):
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TEMPLATE  # reads neither tools nor tool_calls
    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    return OpenAIServingChat(engine, ServerConfig(), "m")


def _render(chat, system_content) -> str:
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "system", "content": system_content},
                                          {"role": "user", "content": "hi"}], tools=TOOLS)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    text, _ = asyncio.run(chat.render(req.messages, ChatOptions.of(req), tools))
    return text


def test_system_text_parts_keep_their_text_when_tools_are_injected(chat):
    """A system message sent as text parts (what OpenAI clients may send) rendered as the
    Python repr of the parts list ("<system>[{'type': 'text', ...}]") once the tools'
    instructions were added to it; it must render as its text, like the string form."""
    as_string = _render(chat, "Be brief")
    assert as_string.startswith("<system>Be brief\n\n") and '"name": "f"' in as_string
    assert _render(chat, [{"type": "text", "text": "Be brief"}]) == as_string
    two_parts = _render(chat, [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief"}])
    assert two_parts == _render(chat, "Be\nbrief")  # parts join with newlines


# Mistral-style: no system role (reads neither tools nor tool_calls, so tools' instructions
# would become a system message it refuses).
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}"
             "{{ raise_exception('System role not supported') }}{% endif %}"
             "<{{ m.role }}>{{ m.content }}\n{% endfor %}")
# Renders a system message of at most 20 characters: the user's fits, with the tools' text not.
SHORT_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' and m.content | length > 20 %}"
                "{{ raise_exception('system message too long') }}{% endif %}"
                "<{{ m.role }}>{{ m.content }}\n{% endfor %}")


def _served(tiny_tokenizer, template: str):
    from kvflow.config import ServerConfig
    from kvflow.entrypoints.serving_chat import OpenAIServingChat
    from kvflow.inputs.processor import InputProcessor

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    return OpenAIServingChat(engine, ServerConfig(), "m")


def _render_error(chat, messages: list[dict], tools: list[dict] | None = TOOLS):
    from kvflow.entrypoints.chat_options import ChatOptions
    from kvflow.entrypoints.openai_errors import OpenAIError
    from kvflow.entrypoints.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=messages, tools=tools)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(chat.render(req.messages, ChatOptions.of(req), tools))
    return info.value


@pytest.mark.parametrize("template, messages, which", [
    (NO_SYSTEM, [{"role": "user", "content": "hi"}], "message 0 (a system message)"),
    (SHORT_SYSTEM, [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi"}],
     "the end of message 0 (the system message)"),
], ids=["added", "extended"])
def test_template_failing_on_the_tools_system_text_says_kvflow_added_it(
        tiny_tokenizer, template, messages, which):
    """Tools on a template that does not read them go into a system message kvflow writes;
    a template that cannot render it gave a 400 at ``messages`` about a system message the
    client never sent. Now the 400 names ``tools``, says kvflow added the text for them, and
    keeps the template's own failure (oracle: HF transformers' apply_chat_template raises
    that failure on the conversation with the tools' system text and renders the one
    without it)."""
    import jinja2

    from kvflow.entrypoints.tool_parsers import make_tool_parser

    chat = _served(tiny_tokenizer, template)
    prompt = make_tool_parser(chat.config.tool_call_parser).system_prompt(TOOLS)
    hf = chat.engine.tokenizer
    sent = messages[0]["content"] + "\n\n" if messages[0]["role"] == "system" else None
    with_tools = [{"role": "system", "content": (sent or "") + prompt},
                  *messages[1 if sent else 0:]]
    with pytest.raises(jinja2.TemplateError) as hf_error:
        hf.apply_chat_template(with_tools, tokenize=False)
    assert hf.apply_chat_template(messages, tokenize=False)  # the client's messages render
    error = _render_error(chat, messages)
    assert (error.status, error.param, error.code) == (400, "tools", "invalid_value")
    assert str(error) == (
        f"the chat template cannot render {which} that kvflow added for tools: this template "
        "does not read tools, so kvflow writes their instructions into the system message, "
        f"and the template fails on it (TemplateError: {hf_error.value}); send the request "
        "without tools, or use a chat template that reads tools")


def test_template_failing_on_the_clients_messages_keeps_its_error(tiny_tokenizer):
    """When the client's own messages fail too, the fault is theirs: the 400 stays at
    ``messages`` with the template's failure, tools or not (oracle: the same request without
    tools gives the same error)."""
    chat = _served(tiny_tokenizer, NO_SYSTEM)
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi"}]
    with_tools, without = _render_error(chat, messages), _render_error(chat, messages, None)
    assert (with_tools.status, with_tools.param, str(with_tools)) == \
        (400, "messages", str(without))
    assert str(without) == ("the chat template cannot render these messages: TemplateError: "
                            "System role not supported")
