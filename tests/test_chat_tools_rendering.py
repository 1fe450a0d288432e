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
    from kvflow.input_processor import InputProcessor

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TEMPLATE  # reads neither tools nor tool_calls
    engine = SimpleNamespace(tokenizer=tok, processor=InputProcessor(tok, 64, 320, 0),
                             max_model_len=4096)
    return OpenAIServingChat(engine, ServerConfig(), "m")


def _render(chat, system_content) -> str:
    from kvflow.entrypoints.protocol import ChatCompletionRequest
    from kvflow.entrypoints.serving_chat import ChatOptions

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
